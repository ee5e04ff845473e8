"""The operator's fleet metrics (rollfleet.controller.metrics): what a scrape shows of each fleet's last pass."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import CollectorRegistry, generate_latest

from rollfleet.api.common import Condition
from rollfleet.api.fleet import EngineStatus, PauseStatus, RolloutFleetStatus
from rollfleet.contract import EnginePhase
from rollfleet.controller.metrics import FleetMetrics, FleetSnapshot, RequestMetrics, skewed

NOW = datetime.now(UTC)  # a scrape measures a pause against the clock
KEY = ("rl", "fleet-a")


def engine(i: int, phase: EnginePhase, version: str | None, in_flight: int | None = None) -> EngineStatus:
    return EngineStatus(name=f"fleet-a-engine-{i}", index=i, phase=phase, weight_version=version, in_flight=in_flight)


def snapshot(paused_for: float | None = None) -> FleetSnapshot:
    status = RolloutFleetStatus(
        weight_version="b-2",
        engines=[
            engine(0, EnginePhase.READY, "b-2", in_flight=3),
            engine(1, EnginePhase.PENDING_SYNC, "b-2"),  # the label, not the bytes
            engine(2, EnginePhase.STARTING, None),
        ],
        conditions=[
            Condition(type="Ready", status="False", reason="EnginesLost"),
            Condition(type="Degraded", status="True", reason="EngineFailed"),
        ],
        pause=None
        if paused_for is None
        else PauseStatus(mode="keep", since=NOW - timedelta(seconds=paused_for), paused_engines=1),
    )
    return FleetSnapshot(
        status, wanted=4, generation=2, engine_generations={"fleet-a-engine-0": 2, "fleet-a-engine-1": None}
    )


def scrape(metrics: FleetMetrics) -> set[str]:
    return set(generate_latest(metrics.registry).decode().splitlines())


def test_a_scrape_shows_each_fleets_engines_conditions_pause_and_versions() -> None:
    metrics = FleetMetrics(CollectorRegistry())
    metrics.observed(KEY, snapshot(paused_for=7.5))
    lines = scrape(metrics)
    fleet = 'fleet="fleet-a",namespace="rl"'
    for line in (
        f'rollfleet_operator_engines{{{fleet},phase="Ready"}} 1.0',
        f'rollfleet_operator_engines{{{fleet},phase="PendingSync"}} 1.0',
        f'rollfleet_operator_engines{{{fleet},phase="Failed"}} 0.0',  # every phase, 0 included
        f"rollfleet_operator_engines_wanted{{{fleet}}} 4.0",
        f'rollfleet_operator_fleet_condition{{condition="Degraded",{fleet}}} 1.0',
        f'rollfleet_operator_fleet_condition{{condition="Ready",{fleet}}} 0.0',
        f"rollfleet_operator_fleet_paused{{{fleet}}} 1.0",
        f"rollfleet_operator_fleet_paused_engines{{{fleet}}} 1.0",
        f"rollfleet_operator_fleet_weight_generation{{{fleet}}} 2.0",
        f'rollfleet_operator_engine_weight_generation{{engine="fleet-a-engine-0",{fleet}}} 2.0',
        f"rollfleet_operator_fleet_version_skew_engines{{{fleet}}} 1.0",
        f'rollfleet_operator_engine_in_flight{{engine="fleet-a-engine-0",{fleet}}} 3.0',
        f'rollfleet_operator_engine_phase{{engine="fleet-a-engine-1",{fleet},phase="PendingSync"}} 1.0',
        f'rollfleet_operator_engine_phase{{engine="fleet-a-engine-2",{fleet},phase="Starting"}} 1.0',
    ):
        assert line in lines, line
    # One series per engine, on its current phase.
    assert len([ln for ln in lines if ln.startswith("rollfleet_operator_engine_phase{")]) == 3
    # An engine whose generation is unknown has no sample, rather than a made-up one.
    assert not any('engine="fleet-a-engine-1"' in ln and "weight_generation" in ln for ln in lines)
    pause = next(ln for ln in lines if ln.startswith("rollfleet_operator_fleet_pause_seconds{"))
    assert float(pause.split()[1]) >= 7.5


def test_a_fleet_not_paused_shows_0_and_a_deleted_fleet_leaves_no_series() -> None:
    metrics = FleetMetrics(CollectorRegistry())
    metrics.observed(KEY, snapshot())
    # At 0 before any failure: an alert's increase() sees the first one.
    assert 'rollfleet_operator_reconcile_errors_total{fleet="fleet-a",namespace="rl"} 0.0' in scrape(metrics)
    metrics.failed(KEY)
    lines = scrape(metrics)
    assert 'rollfleet_operator_fleet_pause_seconds{fleet="fleet-a",namespace="rl"} 0.0' in lines
    assert 'rollfleet_operator_reconcile_errors_total{fleet="fleet-a",namespace="rl"} 1.0' in lines
    metrics.forget(KEY)
    metrics.forget(KEY)  # twice: a loop closed after the fleet went
    assert not [ln for ln in scrape(metrics) if "fleet-a" in ln]


def test_skew_counts_pending_sync_and_other_versions_not_unknown_ones() -> None:
    st = RolloutFleetStatus(
        weight_version="b-2",
        engines=[
            engine(0, EnginePhase.READY, "b-2"),
            engine(1, EnginePhase.DRAINING, "b-1"),
            engine(2, EnginePhase.PENDING_SYNC, None),
            engine(3, EnginePhase.STARTING, None),
        ],
    )
    assert skewed(st) == 2
    assert skewed(RolloutFleetStatus(weight_version=None, engines=[engine(0, EnginePhase.READY, "a")])) == 0


def request(uid: str, namespace: str, phase: str | None, **counts: int) -> dict[str, object]:
    status = {"phase": phase, "counts": counts} if phase else {}
    return {"metadata": {"uid": uid, "namespace": namespace, "name": f"r-{uid}"}, "status": status}


def test_requests_are_counted_by_phase_and_their_samples_by_outcome_per_namespace() -> None:
    metrics = RequestMetrics(CollectorRegistry())
    metrics.seen("ADDED", request("1", "rl", None))  # not yet seen by its runner: Pending
    metrics.seen("MODIFIED", request("2", "rl", "Running", total=64, completed=10, inFlight=8))
    metrics.seen("MODIFIED", request("3", "rl", "Succeeded", total=16, completed=15, failed=1))
    metrics.seen("MODIFIED", request("4", "other", "Running", total=4, inFlight=4))
    metrics.seen("MODIFIED", {"metadata": {}})  # nothing to count it by: ignored
    lines = set(generate_latest(metrics.registry).decode().splitlines())
    for line in (
        'rollfleet_operator_requests{namespace="rl",phase="Pending"} 1.0',
        'rollfleet_operator_requests{namespace="rl",phase="Running"} 1.0',
        'rollfleet_operator_requests{namespace="rl",phase="Succeeded"} 1.0',
        'rollfleet_operator_request_samples{namespace="rl",outcome="total"} 80.0',
        'rollfleet_operator_request_samples{namespace="rl",outcome="completed"} 25.0',
        'rollfleet_operator_request_samples{namespace="rl",outcome="in_flight"} 8.0',
        'rollfleet_operator_request_samples{namespace="rl",outcome="failed"} 1.0',
        'rollfleet_operator_request_samples{namespace="other",outcome="in_flight"} 4.0',
    ):
        assert line in lines, line
    metrics.seen("DELETED", request("2", "rl", "Running"))
    lines = set(generate_latest(metrics.registry).decode().splitlines())
    assert 'rollfleet_operator_requests{namespace="rl",phase="Running"} 1.0' not in lines
    assert 'rollfleet_operator_request_samples{namespace="rl",outcome="in_flight"} 0.0' in lines


def test_finished_samples_and_results_bytes_count_what_changed_while_watched() -> None:
    metrics = RequestMetrics(CollectorRegistry())

    def seen(event: str | None, uid: str, stored: int, **counts: int) -> None:
        obj = request(uid, "rl", "Running", **counts)
        obj["status"]["results"] = {"bytes": stored}  # type: ignore[index]
        metrics.seen(event, obj)

    seen(None, "old", 4000, total=8, completed=8)  # found at the operator's start: its baseline, not counted
    seen("ADDED", "new", 0, total=8)
    seen("MODIFIED", "new", 900, total=8, completed=3, failed=1)
    seen("MODIFIED", "new", 2100, total=8, completed=6, aborted=1, failed=1)
    seen("MODIFIED", "old", 4000, total=8, completed=8)  # unchanged
    metrics.seen("DELETED", request("new", "rl", "Running"))  # counters keep what was counted
    lines = set(generate_latest(metrics.registry).decode().splitlines())
    for line in (
        'rollfleet_operator_request_samples_finished_total{namespace="rl",outcome="completed"} 6.0',
        'rollfleet_operator_request_samples_finished_total{namespace="rl",outcome="aborted"} 1.0',
        'rollfleet_operator_request_samples_finished_total{namespace="rl",outcome="failed"} 1.0',
        'rollfleet_operator_request_results_bytes_total{namespace="rl"} 2100.0',
    ):
        assert line in lines, line
