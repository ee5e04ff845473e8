#!/usr/bin/env bash
# Build the product's images: `hack/images.sh [control-plane] [engine-cpu] [engine-cuda]`
# (default: control-plane and engine-cpu; engine-cuda is ~10 GB and only checked for imports here).
#
# Names and tags come from the one source of truth, rollfleet.api.common (the CRD
# defaults read the same constants). Where no registry is reachable (this machine),
# hack/base-images.sh builds the base images from Debian's packages and they are passed
# as BASE_IMAGE; ROLLFLEET_PUBLIC_BASES=1 builds on the Dockerfiles' public defaults.
# Each build logs to a file; a failure names the image, the step and the log.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
PY="${PYTHON:-.venv/bin/python}"
say() { echo "[images] $*"; }
die() { echo "[images] error: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "no Docker daemon answers: run 'make docker' (hack/docker.sh) first"
read -r control_plane engine_cpu engine_cuda < <("$PY" -c \
  'from rollfleet.api.common import SHIPPED_IMAGES; print(*SHIPPED_IMAGES)')
base_args=()
[ "${ROLLFLEET_PUBLIC_BASES:-0}" = 1 ] || read -r -a base_args < <(hack/base-images.sh)

build() {  # build NAME DOCKERFILE CHECK...: build the image, then run CHECK in it
  local name=$1 dockerfile=$2; shift 2
  local log="$CACHE/logs/image-${name//[\/:]/_}.log" start=$SECONDS
  mkdir -p "$(dirname "$log")"
  say "building $name from $dockerfile (log: $log)"
  if ! docker build "${base_args[@]}" -f "$dockerfile" -t "$name" . >"$log" 2>&1; then
    grep -E '^Step [0-9]+/[0-9]+' "$log" | tail -n 1 | sed 's/^/[images] failed at /' >&2 || true
    tail -n 15 "$log" >&2
    die "$name did not build; the whole log is $log"
  fi
  docker run --rm --entrypoint "$1" "$name" "${@:2}" >>"$log" 2>&1 \
    || die "$name built but its check ($*) failed; see $log"
  say "$name ready in $((SECONDS - start)) s, $(docker image inspect -f '{{.Size}}' "$name" | numfmt --to=iec)"
}

# vLLM loads the engine package's plugin, and every weight-transfer backend it registers imports.
engine_check=(python -c "from rollfleet_engine.plugin import check; check()")
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(control-plane engine-cpu)
for t in "${targets[@]}"; do
  case "$t" in
    control-plane) build "$control_plane" Dockerfile rollfleet --help ;;
    engine-cpu) build "$engine_cpu" engine_image/Dockerfile.cpu "${engine_check[@]}" ;;
    engine-cuda) build "$engine_cuda" engine_image/Dockerfile.gpu "${engine_check[@]}" ;;
    *) die "unknown image '$t': want control-plane, engine-cpu or engine-cuda" ;;
  esac
done
