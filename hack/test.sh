#!/usr/bin/env bash
# `make test`: the whole suite on the local cluster, then the acceptance subset on kind.
#
# Bringing kind up (Docker, the images, the node image, the cluster) is mostly waiting on Docker
# and on cached builds; cold, it is Go builds. It runs beside the local-cluster suite at low CPU
# priority instead of after it, and its output goes to a log. The kind subset runs once both are
# done. Without Docker (and no root to install it) use `make test-local`.
set -uo pipefail
cd "$(dirname "$0")/.."

CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
KIND_LOG="$CACHE/logs/kind-up.log"
say() { echo "[test] $*"; }

hack/docker.sh || { say "kind needs Docker; without it, run 'make test-local' (the suite on the local cluster)"; exit 1; }
mkdir -p "$(dirname "$KIND_LOG")"
say "bringing the kind cluster up beside the local suite, at low priority (log: $KIND_LOG)"
start=$SECONDS
(nice -n 10 make --no-print-directory kind-up >"$KIND_LOG" 2>&1; echo $? >"$KIND_LOG.status") &
kind_pid=$!

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
pytest $PYTEST_ARGS
local_status=$?
say "local-cluster suite: exit $local_status after $((SECONDS - start)) s"

wait "$kind_pid"
kind_status=$(cat "$KIND_LOG.status" 2>/dev/null || echo 1)
if [ "$kind_status" != 0 ]; then
  tail -n 30 "$KIND_LOG" | sed 's/^/[kind-up] /'
  say "make kind-up failed (exit $kind_status); the whole log is $KIND_LOG"
  exit 1
fi
say "kind cluster up after $((SECONDS - start)) s (log: $KIND_LOG)"

make --no-print-directory kind-e2e
kind_e2e_status=$?
say "kind subset: exit $kind_e2e_status; the whole run took $((SECONDS - start)) s"
[ "$local_status" = 0 ] && [ "$kind_e2e_status" = 0 ]
