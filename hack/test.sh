#!/usr/bin/env bash
# `make test`: every tier (docs/testing.md): unit, engine and control plane (the local cluster),
# then acceptance on kind; at the end, each tier's time against its budget.
#
# Bringing kind up (Docker, the images, the node image, the cluster) is mostly waiting on Docker
# and on cached builds; cold, it is Go builds. It runs beside the engine and control-plane tiers at
# low CPU priority instead of after them, and its output goes to a log. A cluster kept from an earlier run loses
# what that run left in it (`--clean`: a fleet of engines, an operator), or it would run beside
# this one; and the cluster is stopped once up, since an idle cluster costs a share of a core that
# the local tiers need. It is started again for the acceptance tier, once both are done.
# Without Docker (and no root to install it) use `make test-local`.
set -uo pipefail
cd "$(dirname "$0")/.."

CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
LOGS="$CACHE/logs"
KIND_LOG="$LOGS/kind-up.log"
SLOWEST=15  # each tier's slowest tests, repeated at the end
say() { echo "[test] $*"; }

hack/docker.sh || { say "kind needs Docker; without it, run 'make test-local' (every tier on the local cluster)"; exit 1; }
mkdir -p "$LOGS"
rm -f "$KIND_LOG.status"
start=$SECONDS

summary=()
failed=0
# tier NAME BUDGET_S COMMAND...: run it, its output also in $LOGS/NAME.log; a line of the summary.
tier() {
  local name=$1 budget=$2 t0=$SECONDS status
  shift 2
  say "== tier $name (budget ${budget} s)"
  "$@" 2>&1 | tee "$LOGS/$name.log"
  status=${PIPESTATUS[0]}
  # pytest exits 5 when a tier selects no test (-k, -m from PYTEST_ARGS): nothing failed.
  [ "$status" = 5 ] && status=0
  local took=$((SECONDS - t0)) verdict=ok
  [ "$took" -gt "$budget" ] && verdict="OVER BUDGET"
  [ "$status" != 0 ] && { verdict="FAILED (exit $status)"; failed=1; }
  summary+=("$(printf '%-22s %6s s  budget %5s s  %s' "$name" "$took" "$budget" "$verdict")")
}

run_tier() {
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
  tier "$1" "$(python -m tests.tiers budget "$1")" python -m tests.tiers run "$1" --durations=$SLOWEST $PYTEST_ARGS
}
run_tier unit
# After the unit tier, which is short and whose budget is for it alone.
say "bringing the kind cluster up beside the next tiers, at low priority, stopped until they are done (log: $KIND_LOG)"
(
  nice -n 10 bash -c 'make --no-print-directory kind-up KIND_UP_ARGS=--clean && rollfleet kind stop' >"$KIND_LOG" 2>&1
  echo $? >"$KIND_LOG.status"
) &
kind_pid=$!
run_tier engine
# The local cluster serves the control-plane tier (its start is a line of its own); one that was up
# before stays up after. Not earlier: idle, it still costs the first two tiers CPU.
was_up=$(python -c 'from rollfleet_dev.localcluster import controlplane as c; print(int(c.is_up()))')
tier "local cluster up" 180 rollfleet cluster up
run_tier controlplane
# Its CPU goes to the kind cluster from here on.
[ "$was_up" = 1 ] || rollfleet cluster down >"$LOGS/cluster-down.log" 2>&1
local_s=$((SECONDS - start))

wait "$kind_pid"
kind_status=$(cat "$KIND_LOG.status" 2>/dev/null || echo 1)
if [ "$kind_status" != 0 ]; then
  tail -n 30 "$KIND_LOG" | sed 's/^/[kind-up] /'
  say "make kind-up failed (exit $kind_status); the whole log is $KIND_LOG"
  exit 1
fi
kind_s=$((SECONDS - start))
say "kind cluster ready after $kind_s s (log: $KIND_LOG); starting it"
# The cluster and its images are ready; `kind up` only starts the stopped nodes.
tier "kind start" 120 rollfleet kind up
run_tier acceptance

# The end of a run is what a CI page shows: where each tier's time went, what failed, the tiers' times.
for t in unit engine controlplane acceptance; do
  { sed -n "/slowest $SLOWEST durations/,/^=/p" "$LOGS/$t.log"; grep -E '^(FAILED|ERROR) ' "$LOGS/$t.log"; } | sed "s/^/[$t] /"
done
say "local tiers done at $local_s s; kind ready at $kind_s s (beside them); the whole run took $((SECONDS - start)) s"
say "tier times against their budgets (docs/testing.md):"
for line in "${summary[@]}"; do say "  $line"; done
exit "$failed"
