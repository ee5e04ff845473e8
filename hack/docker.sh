#!/usr/bin/env bash
# Make a Docker daemon answer on this machine: install Debian's docker.io if dockerd is
# missing, register the capability-trimming runc wrapper, start dockerd, wait for it.
# Idempotent: a daemon that already answers is left alone.
#
# Why the wrapper: this VM's capability bounding set lacks CAP_SYS_RESOURCE, so runc
# fails every `--privileged` container ("unable to apply caps"), and kind's nodes are
# privileged. The wrapper removes that one capability from the OCI spec runc is handed
# (create/run: the bundle's config.json; exec: the --process file), then runs the real runc.
# On a machine whose bounding set has it (GitHub's runners), the wrapper is not installed.
set -euo pipefail

CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
LOG="$CACHE/dockerd.log"
WRAPPER=/usr/local/libexec/rollfleet/runc-drop-sys-resource
say() { echo "[docker] $*"; }
die() { echo "[docker] error: $*" >&2; exit 1; }

if docker info >/dev/null 2>&1; then
  say "daemon answers"
  exit 0
fi
[ "$(id -u)" = 0 ] || die "the Docker daemon does not answer and starting one needs root: run 'sudo $0', or start Docker yourself"

if ! command -v dockerd >/dev/null; then
  say "installing Debian's docker.io (dockerd, containerd, runc)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io iptables >/dev/null \
    || die "apt-get install docker.io failed: check that Debian's package mirrors are reachable"
fi

# CAP_SYS_RESOURCE is bit 24 of the bounding set.
if (( (0x$(awk '/^CapBnd/ {print $2}' /proc/self/status) >> 24 & 1) == 0 )); then
  real_runc=$(command -v runc) || die "runc is missing: apt-get install runc"
  say "this machine cannot grant CAP_SYS_RESOURCE: registering $WRAPPER as the default runtime"
  mkdir -p "$(dirname "$WRAPPER")" /etc/docker
  cat >"$WRAPPER" <<EOF
#!/usr/bin/env python3
"""runc, minus CAP_SYS_RESOURCE (absent from this machine's bounding set). Written by hack/docker.sh."""
import json, os, sys

CAP = "CAP_SYS_RESOURCE"
args = sys.argv[1:]

def strip(path):
    with open(path) as f:
        spec = json.load(f)
    process = spec.get("process", spec)  # config.json has "process"; an exec --process file is one
    for caps in (process.get("capabilities") or {}).values():
        while CAP in caps:
            caps.remove(CAP)
    with open(path, "w") as f:
        json.dump(spec, f)

def value(flag):
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None

command = next((a for a in args if a in ("create", "run", "exec")), None)
if command in ("create", "run"):
    strip(os.path.join(value("--bundle") or value("-b") or ".", "config.json"))
elif command == "exec" and value("--process"):
    strip(value("--process"))
os.execv("$real_runc", ["$real_runc", *args])
EOF
  chmod 755 "$WRAPPER"
  python3 - "$WRAPPER" <<'EOF'
import json, pathlib, sys
path = pathlib.Path("/etc/docker/daemon.json")
config = json.loads(path.read_text()) if path.exists() else {}
config.setdefault("runtimes", {})["rollfleet-runc"] = {"path": sys.argv[1]}
config["default-runtime"] = "rollfleet-runc"
path.write_text(json.dumps(config, indent=2) + "\n")
EOF
fi

mkdir -p "$CACHE"
say "starting dockerd (log: $LOG)"
# setsid: the daemon outlives this script and the make target that ran it.
setsid dockerd >>"$LOG" 2>&1 </dev/null &
for _ in $(seq 1 60); do
  docker info >/dev/null 2>&1 && { say "daemon answers"; exit 0; }
  kill -0 $! 2>/dev/null || break
  sleep 1  # polling a condition: dockerd is starting
done
tail -n 20 "$LOG" >&2 || true
die "dockerd did not come up; its log is $LOG (the last lines are above)"
