#!/usr/bin/env bash
# `make test`: the local control plane's build and lint, then every tier (docs/testing.md): unit,
# then engine, then the control-plane tier (the local cluster) and the acceptance tier (kind) side by
# side; at the end, each phase's time against its budget.
#
# Why side by side: the control-plane tier mostly waits (on simulated engines' pace, backoffs,
# watches: two thirds of the machine idle), and the acceptance tier mostly decodes on real engines.
# Bringing kind up (Docker, the images, the node image, the cluster) runs in the background at low
# CPU priority, its output in a log: on a machine without a kind cluster it starts first, since its
# image builds (mostly I/O) overlap the CPU-bound build of the local control plane and its Go builds
# take long; warm, it is mostly image loads and starts after the unit tier, beside the engine tier. A cluster kept from an earlier run loses what that run left
# in it (`--clean`: a fleet of engines, an operator), or it would run beside this one; and the
# cluster is stopped once up, since an idle cluster costs a share of a core that the tiers need. It
# is started again for the acceptance tier, which begins as soon as both the engine tier and kind
# are done. Without Docker (and no root to install it) use `make test-local`.
set -uo pipefail
cd "$(dirname "$0")/.."

CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
LOGS="$CACHE/logs"
KIND_LOG="$LOGS/kind-up.log"
SUMMARY="$LOGS/tiers.summary"  # one line per tier; tiers in the background add theirs too
SLOWEST=15  # each tier's slowest tests, repeated at the end
say() { echo "[test] $*"; }

hack/docker.sh || { say "kind needs Docker; without it, run 'make test-local' (every tier on the local cluster)"; exit 1; }
mkdir -p "$LOGS"
rm -f "$KIND_LOG.status" "$SUMMARY" "$LOGS/acceptance.status"
start=$SECONDS

# tier NAME BUDGET_S COMMAND...: run it, its output in $LOGS/NAME.log (and here, unless QUIET=1); its
# line of the summary; exits with the command's status.
tier() {
  local name=$1 budget=$2 t0=$SECONDS status
  shift 2
  say "== tier $name (budget ${budget} s)"
  if [ "${QUIET:-0}" = 1 ]; then "$@" >"$LOGS/$name.log" 2>&1; else "$@" 2>&1 | tee "$LOGS/$name.log"; fi
  status=${PIPESTATUS[0]}
  # pytest exits 5 when a tier selects no test (-k, -m from PYTEST_ARGS): nothing failed.
  [ "$status" = 5 ] && status=0
  local took=$((SECONDS - t0)) verdict=ok
  [ "$took" -gt "$budget" ] && verdict="OVER BUDGET"
  [ "$status" != 0 ] && verdict="FAILED (exit $status)"
  printf '%-22s %6s s  budget %5s s  %s\n' "$name" "$took" "$budget" "$verdict" >>"$SUMMARY"
  say "== tier $name: $verdict after $took s"
  return "$status"
}

run_tier() {
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
  tier "$1" "$(python -m tests.tiers budget "$1")" python -m tests.tiers run "$1" --durations=$SLOWEST $PYTEST_ARGS
}

failed=0
kind_pid=""
start_kind() {
  say "bringing the kind cluster up beside the $1, at low priority, stopped until the acceptance tier (log: $KIND_LOG)"
  # A process group of its own (setsid), so that a failed build or lint can stop it whole.
  # shellcheck disable=SC2016  # expanded by the inner shell
  setsid nice -n 10 bash -c 'make --no-print-directory kind-up KIND_UP_ARGS=--clean && rollfleet kind stop
    echo $? >"$1.status"' _ "$KIND_LOG" >"$KIND_LOG" 2>&1 &
  kind_pid=$!
}
stop_kind() { [ -n "$kind_pid" ] && kill -- -"$kind_pid" 2>/dev/null; say "stopped (and kind's bring-up)"; exit 1; }
# Cold (no kind node on this machine yet), bringing kind up takes half an hour of image and Go builds:
# it starts first. Warm it is a few minutes of image loads, which would push the unit tier past its
# 2 minutes: it starts after that tier.
if [ -z "$(docker ps -aq --filter 'name=^rollfleet-control-plane$')" ]; then
  start_kind "build, lint, unit and engine tiers"
fi
# The local control plane from Go modules (seconds once cached), and lint: phases of their own, before any tier.
tier build 900 make --no-print-directory build || stop_kind
tier lint 180 make --no-print-directory lint || stop_kind
run_tier unit || failed=1
[ -n "$kind_pid" ] || start_kind "engine tier"
run_tier engine || failed=1

# The acceptance tier, in the background once kind is ready: its output goes to its log, printed
# whole once the control-plane tier is done.
(
  while [ ! -s "$KIND_LOG.status" ]; do sleep 2; done  # kind-up's status file: not a child of this shell
  kind_status=$(cat "$KIND_LOG.status")
  if [ "$kind_status" != 0 ]; then
    tail -n 30 "$KIND_LOG" | sed 's/^/[kind-up] /' >"$LOGS/acceptance.log"
    echo "[test] make kind-up failed (exit $kind_status); the whole log is $KIND_LOG" >>"$LOGS/acceptance.log"
    echo 1 >"$LOGS/acceptance.status"
    exit 1
  fi
  say "kind cluster ready after $((SECONDS - start)) s; starting it, then the acceptance tier (log: $LOGS/acceptance.log)"
  # The cluster and its images are ready; `kind up` only starts the stopped nodes.
  QUIET=1 tier "kind start" 120 rollfleet kind up && QUIET=1 run_tier acceptance
  echo $? >"$LOGS/acceptance.status"
) &
acceptance_pid=$!

# The local cluster serves the control-plane tier (its start is a line of its own); one that was up
# before stays up after.
was_up=$(python -c 'from rollfleet_dev.localcluster import controlplane as c; print(int(c.is_up()))')
tier "local cluster up" 180 rollfleet cluster up || failed=1
run_tier controlplane || failed=1
[ "$was_up" = 1 ] || rollfleet cluster down >"$LOGS/cluster-down.log" 2>&1
# Engines across processes: seven vLLM processes per engine at their start, too many beside kind's image
# loads; the control-plane lane ends minutes before the acceptance tier and has the room.
run_tier multipod || failed=1
local_s=$((SECONDS - start))

say "control-plane tier done at $local_s s; waiting for the acceptance tier"
wait "$kind_pid" "$acceptance_pid"
[ "$(cat "$LOGS/acceptance.status" 2>/dev/null || echo 1)" = 0 ] || failed=1
for name in "kind start" acceptance; do
  [ -f "$LOGS/$name.log" ] && sed "s/^/[$name] /" "$LOGS/$name.log"
done

# The end of a run is what a CI page shows: where each tier's time went, what failed, the tiers' times.
for t in unit engine controlplane multipod acceptance; do
  { sed -n "/slowest $SLOWEST durations/,/^=/p" "$LOGS/$t.log"; grep -E '^(FAILED|ERROR) ' "$LOGS/$t.log"; } | sed "s/^/[$t] /"
done
say "control-plane tier done at $local_s s; the whole run took $((SECONDS - start)) s"
say "tier times against their budgets (docs/testing.md; control plane and acceptance side by side):"
sed 's/^/[test]   /' "$SUMMARY"
exit "$failed"
