#!/usr/bin/env bash
# `make test`: the local control plane's build and lint, then every tier (docs/testing.md): unit, then
# two lanes side by side: the local lane (engine, then control-plane, then multipod tiers) and the kind
# lane (kind up, then the acceptance tier); at the end, each phase's time against its budget.
#
# Why side by side: the control-plane tier mostly waits (on simulated engines' pace, backoffs,
# watches), and the acceptance tier, the longest, is the run's critical path: it starts as soon as kind
# is up. Bringing kind up (Docker, the images, the node image, the cluster) runs in the background at
# low CPU priority, its output in a log: on a machine without a kind cluster it starts first, since its
# image builds (mostly I/O) overlap the CPU-bound build of the local control plane and its Go builds
# take long; warm, it is image builds and the loads of their new layers (`imageload`), after the unit
# tier. A cluster kept from an earlier run loses what that run left in it (`--clean`: a fleet of
# engines, an operator), or it would run beside this one. Without Docker (and no root to install it)
# use `make test-local`. Each tier's line says how busy the machine's CPUs were meanwhile (both lanes),
# and vmstat's log ($LOGS/vmstat.log) what memory was left, for a run that ran out of either.
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
rm -f "$KIND_LOG.status" "$SUMMARY" "$LOGS/acceptance.status" "$LOGS/lint.status"
start=$SECONDS

# The machine's CPU time so far, busy and all (jiffies of /proc/stat's first line: idle and iowait are not busy).
cpu_ticks() { awk '/^cpu / {print $2+$3+$4+$7+$8+$9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }

# tier NAME BUDGET_S COMMAND...: run it, its output in $LOGS/NAME.log (and here, unless QUIET=1); its
# line of the summary; exits with the command's status.
tier() {
  local name=$1 budget=$2 t0=$SECONDS status busy0 all0 busy1 all1
  shift 2
  read -r busy0 all0 < <(cpu_ticks)
  say "== tier $name (budget ${budget} s)"
  if [ "${QUIET:-0}" = 1 ]; then "$@" >"$LOGS/$name.log" 2>&1; else "$@" 2>&1 | tee "$LOGS/$name.log"; fi
  status=${PIPESTATUS[0]}
  # pytest exits 5 when a tier selects no test (-k, -m from PYTEST_ARGS): nothing failed.
  [ "$status" = 5 ] && status=0
  read -r busy1 all1 < <(cpu_ticks)
  local took=$((SECONDS - t0)) verdict=ok cpu=$(( 100 * (busy1 - busy0) / (all1 - all0 > 0 ? all1 - all0 : 1) ))
  [ "$took" -gt "$budget" ] && verdict="OVER BUDGET"
  [ "$status" != 0 ] && verdict="FAILED (exit $status)"
  printf '%-22s %6s s  budget %5s s  cpu %3s%%  %s\n' "$name" "$took" "$budget" "$cpu" "$verdict" >>"$SUMMARY"
  say "== tier $name: $verdict after $took s"
  return "$status"
}

# Every test's time is kept in $LOGS/TIER.xml (JUnit), for finding where a tier's time goes.
run_tier() {
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
  tier "$1" "$(python -m tests.tiers budget "$1")" python -m tests.tiers run "$1" --durations=$SLOWEST \
    --junitxml="$LOGS/$1.xml" $PYTEST_ARGS
}

failed=0
kind_pid=""
vmstat -t 10 >"$LOGS/vmstat.log" 2>&1 &
vmstat_pid=$!
trap 'kill "$vmstat_pid" 2>/dev/null' EXIT
start_kind() {  # start_kind BESIDE NICENESS
  say "bringing the kind cluster up beside the $1, at niceness $2 (log: $KIND_LOG)"
  # A process group of its own (setsid), so that a failed build or lint can stop it whole.
  # shellcheck disable=SC2016  # expanded by the inner shell
  setsid nice -n "$2" bash -c 'make --no-print-directory kind-up KIND_UP_ARGS=--clean
    echo $? >"$1.status"' _ "$KIND_LOG" >"$KIND_LOG" 2>&1 &
  kind_pid=$! kind_t0=$SECONDS
}
stop_kind() { [ -n "$kind_pid" ] && kill -- -"$kind_pid" 2>/dev/null; say "stopped (and kind's bring-up)"; exit 1; }
# Cold (no kind node on this machine yet), bringing kind up takes half an hour of image and Go builds:
# it starts first, beside the build. Warm it is image builds, the loads of their new layers and the nodes'
# start: it starts after the build, beside the lint and the unit tier. Either way at low priority, so that
# it takes the CPU they leave (the lint is one process, the unit tier's workers wait on the processes
# they start: together they left a third of the two cores idle), then at normal priority once the unit
# tier is done, since the kind lane is the run's longer one (at niceness 10 beside the engine tier it
# took 288 s, where alone it takes 40).
if [ -z "$(docker ps -aq --filter 'name=^rollfleet-control-plane$')" ]; then
  start_kind "build, lint and unit tiers" 10
fi
# The local control plane from Go modules (seconds once cached): a phase of its own, before any tier.
tier build 900 make --no-print-directory build || stop_kind
[ -n "$kind_pid" ] || start_kind "lint and unit tiers" 10
# The lint beside the unit tier: its output is printed once that tier is done; its failure stops the run.
(QUIET=1 tier lint 180 make --no-print-directory lint; echo $? >"$LOGS/lint.status") &
lint_pid=$!
run_tier unit || failed=1
renice -n 0 -g "$kind_pid" >/dev/null 2>&1 || true  # kind's bring-up, if still going, is now the longer path
wait "$lint_pid"
sed 's/^/[lint] /' "$LOGS/lint.log"
[ "$(cat "$LOGS/lint.status" 2>/dev/null)" = 0 ] || { say "lint failed (log: $LOGS/lint.log)"; stop_kind; }

# The kind lane, in the background: its output goes to its log, printed whole once the local lane is done.
(
  while [ ! -s "$KIND_LOG.status" ]; do sleep 2; done  # kind-up's status file: not a child of this shell
  kind_status=$(cat "$KIND_LOG.status")
  if [ "$kind_status" != 0 ]; then
    tail -n 30 "$KIND_LOG" | sed 's/^/[kind-up] /' >"$LOGS/acceptance.log"
    echo "[test] make kind-up failed (exit $kind_status); the whole log is $KIND_LOG" >>"$LOGS/acceptance.log"
    echo 1 >"$LOGS/acceptance.status"
    exit 1
  fi
  say "kind cluster up after $((SECONDS - start)) s; the acceptance tier starts (log: $LOGS/acceptance.log)"
  printf '%-22s %6s s  (beside the tiers before it)\n' "kind up" "$((SECONDS - kind_t0))" >>"$SUMMARY"
  QUIET=1 run_tier acceptance
  echo $? >"$LOGS/acceptance.status"
) &
acceptance_pid=$!

run_tier engine || failed=1
# The local cluster serves the control-plane tier (its start is a line of its own); one that was up
# before stays up after.
was_up=$(python -c 'from rollfleet_dev.localcluster import controlplane as c; print(int(c.is_up()))')
tier "local cluster up" 180 rollfleet cluster up || failed=1
run_tier controlplane || failed=1
[ "$was_up" = 1 ] || rollfleet cluster down >"$LOGS/cluster-down.log" 2>&1
# Engines across processes: seven vLLM processes per engine at their start, last in the local lane, once
# the engine and control-plane tiers' processes are gone.
run_tier multipod || failed=1
local_s=$((SECONDS - start))

say "local lane done at $local_s s; waiting for the acceptance tier"
wait "$kind_pid" "$acceptance_pid"
[ "$(cat "$LOGS/acceptance.status" 2>/dev/null || echo 1)" = 0 ] || failed=1
[ -f "$LOGS/acceptance.log" ] && sed "s/^/[acceptance] /" "$LOGS/acceptance.log"

# The end of a run is what a CI page shows: where each tier's time went, what failed, the tiers' times.
for t in unit engine controlplane multipod acceptance; do
  { sed -n "/slowest $SLOWEST durations/,/^=/p" "$LOGS/$t.log"; grep -E '^(FAILED|ERROR) ' "$LOGS/$t.log"; } | sed "s/^/[$t] /"
done
say "local lane done at $local_s s; the whole run took $((SECONDS - start)) s"
say "tier times against their budgets (docs/testing.md; the local and kind lanes side by side):"
sed 's/^/[test]   /' "$SUMMARY"
exit "$failed"
