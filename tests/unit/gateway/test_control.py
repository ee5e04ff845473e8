"""The gateway's fleet-control decisions: the state it answers, and when a pause or resume is done."""

from __future__ import annotations

from typing import Any

from rollfleet.gateway.control import field_manager, fleet_state, pause_done
from rollfleet.sync.protocol import FleetRecord, PushPhase, PushRecord, WeightsRef, encode_record

FLEET: dict[str, Any] = {
    "metadata": {"name": "tiny"},
    "spec": {"replicas": 2},
    "status": {
        "readyReplicas": 2,
        "weightVersion": "b",
        "pause": {
            "mode": "keep",
            "since": "2026-11-24T10:00:00Z",
            "pausedEngines": 1,
            "requestedBy": "kubectl-annotate",
        },
        "engines": [
            {"name": "tiny-engine-0", "phase": "Paused", "weightVersion": "b", "inFlight": 3},
            {"name": "tiny-engine-1", "phase": "Ready", "weightVersion": "b"},
            {"name": "tiny-engine-2", "phase": "Draining"},
        ],
    },
}


def record(push: bool) -> dict[str, str]:
    b = WeightsRef("b", 2)
    running = PushRecord(PushPhase.IN_PROGRESS, WeightsRef("c", 3), b, 0.0) if push else None
    data = encode_record(FleetRecord(committed=b, push=running, history=(("a", 1), ("b", 2))))
    return {k: v for k, v in data.items() if v is not None}


def test_the_state_joins_the_status_and_the_weights_record() -> None:
    state = fleet_state("team", FLEET, record(push=True))
    assert (state.fleet, state.namespace, state.replicas, state.ready_replicas) == ("tiny", "team", 2, 2)
    assert (state.weight_version, state.weight_generation, state.push) == ("b", 2, "c")
    assert state.generations == {"a": 1, "b": 2}
    assert state.pause is not None and state.pause.requested_by == "kubectl-annotate"
    assert [e.phase for e in state.engines] == ["Paused", "Ready", "Draining"] and state.engines[0].in_flight == 3
    assert fleet_state("team", FLEET, record(push=False)).push is None
    fresh = fleet_state("team", {"metadata": {"name": "new"}, "spec": {"replicas": 1}}, None)
    assert (fresh.pause, fresh.engines, fresh.weight_generation) == (None, [], None)
    unpushed = fleet_state("team", FLEET, None)  # the engines' initial weights are generation 0
    assert (unpushed.weight_generation, unpushed.generations) == (0, {"b": 0})


def test_a_pause_is_done_when_recorded_and_every_serving_engine_is_paused() -> None:
    half = fleet_state("team", FLEET, None)
    assert not pause_done(half, "keep")  # engine 1 still Ready (a Draining engine does not count)
    every_paused = {**FLEET, "status": {**FLEET["status"], "engines": FLEET["status"]["engines"][:1]}}
    assert pause_done(fleet_state("team", every_paused, None), "keep")
    assert not pause_done(fleet_state("team", every_paused, None), "abort")  # another mode asked: not yet
    assert not pause_done(half, None)
    running = {**FLEET, "status": {"engines": [{"name": "e", "phase": "Ready"}]}}
    assert pause_done(fleet_state("team", running, None), None)
    empty = {**FLEET, "status": {"pause": FLEET["status"]["pause"], "engines": []}}
    assert pause_done(fleet_state("team", empty, None), "keep")  # no engine to pause: recorded is done


def test_the_field_manager_names_the_caller() -> None:
    assert field_manager("trainer-0") == "rollfleet-client/trainer-0"
