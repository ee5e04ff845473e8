#!/usr/bin/env bash
# Build the base images locally from Debian's packages, for machines that reach no image
# registry (this one): Debian bookworm (debootstrap + docker import), and on it a Python
# 3.11 base that behaves like the public `python:3.11-slim` (`python` and `pip` on PATH).
# Each is tagged with a hash of this script, so it is built once per recipe: seconds after.
#
# Prints the build arguments that point the Dockerfiles at these bases, e.g.
#   docker build $(hack/base-images.sh) -f Dockerfile .
# With --debian, builds only the Debian base and prints its name (the kind node image's base).
# Users with a registry need none of this: the Dockerfiles default to the public images.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=bookworm
# debootstrap's default mirror unless DEBIAN_MIRROR names another.
MIRROR=(${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"})
CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
recipe=$(sha256sum "$0" | cut -c1-8)
DEBIAN_IMAGE="rollfleet-base/debian:$SUITE-$recipe"
PYTHON_IMAGE="rollfleet-base/python:3.11-$SUITE-$recipe"
say() { echo "[base-images] $*" >&2; }
die() { echo "[base-images] error: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "no Docker daemon answers: run hack/docker.sh (or 'make docker') first"
have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have "$DEBIAN_IMAGE"; then
  command -v debootstrap >/dev/null || {
    say "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  root=$(mktemp -d)
  log="$CACHE/logs/debootstrap-$SUITE.log"
  mkdir -p "$(dirname "$log")"
  say "debootstrap $SUITE (minbase) (log: $log)"
  debootstrap --variant=minbase "$SUITE" "$root" "${MIRROR[@]}" >"$log" 2>&1 \
    || { rm -rf "$root"; die "debootstrap failed; see $log"; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import -c 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$root"
  say "built $DEBIAN_IMAGE"
fi
if [ "${1:-}" = --debian ]; then
  echo "$DEBIAN_IMAGE"
  exit 0
fi

if ! have "$PYTHON_IMAGE"; then
  log="$CACHE/logs/base-python.log"
  say "building $PYTHON_IMAGE (log: $log)"
  context=$(mktemp -d)
  # The CA certificates this machine added to its trust store (a TLS-inspecting egress proxy,
  # a company CA): without them pip inside the builds cannot reach PyPI here.
  mkdir -p "$context/ca"
  cp /usr/local/share/ca-certificates/*.crt "$context/ca/" 2>/dev/null || true
  # A venv first on PATH: `pip install` works as in python:3.11-slim (Debian's own python3
  # refuses system-wide pip installs, PEP 668).
  cat >"$context/Dockerfile" <<'EOF'
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
COPY ca/ /usr/local/share/ca-certificates/
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && update-ca-certificates >/dev/null \
 && python3 -m venv /usr/local/python \
 && /usr/local/python/bin/pip install --no-cache-dir -q --upgrade pip
ENV PATH=/usr/local/python/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
CMD ["python"]
EOF
  docker build -t "$PYTHON_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" "$context" >"$log" 2>&1 \
    || { rm -rf "$context"; die "the Python base image failed to build; see $log"; }
  rm -rf "$context"
  say "built $PYTHON_IMAGE"
fi

echo "--build-arg BASE_IMAGE=$PYTHON_IMAGE"
