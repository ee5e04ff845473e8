#!/usr/bin/env bash
# `make test`: the whole suite on the local cluster, then the acceptance subset on kind.
#
# Bringing kind up (Docker, the images, the node image, the cluster) is mostly waiting on Docker
# and on cached builds; cold, it is Go builds. It runs beside the local-cluster suite at low CPU
# priority instead of after it, and its output goes to a log. A cluster kept from an earlier run
# loses what that run left in it (`--clean`: a fleet of engines, an operator), or it would run
# beside this one; and the cluster is stopped once up, since an idle cluster costs a share of a
# core that the local suite needs. It is started again for the kind subset, once both are done.
# Without Docker (and no root to install it) use `make test-local`.
set -uo pipefail
cd "$(dirname "$0")/.."

CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
KIND_LOG="$CACHE/logs/kind-up.log"
LOCAL_LOG="$CACHE/logs/local-suite.log"
SLOWEST=15  # the local suite's slowest tests, repeated at the end
say() { echo "[test] $*"; }

hack/docker.sh || { say "kind needs Docker; without it, run 'make test-local' (the suite on the local cluster)"; exit 1; }
mkdir -p "$(dirname "$KIND_LOG")"
rm -f "$KIND_LOG.status"
say "bringing the kind cluster up beside the local suite, at low priority, stopped until the suite is done (log: $KIND_LOG)"
start=$SECONDS
(
  nice -n 10 bash -c 'make --no-print-directory kind-up KIND_UP_ARGS=--clean && rollfleet kind stop' >"$KIND_LOG" 2>&1
  echo $? >"$KIND_LOG.status"
) &
kind_pid=$!

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
pytest --durations=$SLOWEST $PYTEST_ARGS 2>&1 | tee "$LOCAL_LOG"
local_status=${PIPESTATUS[0]}
local_s=$((SECONDS - start))
say "local-cluster suite: exit $local_status after $local_s s"

wait "$kind_pid"
kind_status=$(cat "$KIND_LOG.status" 2>/dev/null || echo 1)
if [ "$kind_status" != 0 ]; then
  tail -n 30 "$KIND_LOG" | sed 's/^/[kind-up] /'
  say "make kind-up failed (exit $kind_status); the whole log is $KIND_LOG"
  exit 1
fi
kind_s=$((SECONDS - start))
say "kind cluster ready after $kind_s s (log: $KIND_LOG); starting it"

# -o kind-up: the cluster and its images are ready; `kind up` only starts the stopped nodes.
rollfleet kind up && make --no-print-directory -o kind-up kind-e2e
kind_e2e_status=$?
# The end of a run is what a CI page shows: repeat where the local suite's time went.
{ sed -n "/slowest $SLOWEST durations/,/^=/p" "$LOCAL_LOG"; grep -E '^(FAILED|ERROR) ' "$LOCAL_LOG"; } | sed 's/^/[local] /'
say "local suite: $(tail -n 1 "$LOCAL_LOG" | tr -d '=') (exit $local_status, done at $local_s s); kind ready at $kind_s s"
say "kind subset: exit $kind_e2e_status; the whole run took $((SECONDS - start)) s"
[ "$local_status" = 0 ] && [ "$kind_e2e_status" = 0 ]
