"""Engine phases from observations, and the fleet status with its conditions."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from tests.unit.controller.fleet_fixtures import HASH, NO_WEIGHTS, NOW, draining, engine, obs, state

from rollfleet.api.fleet import PauseStatus, RolloutFleetSpec, RolloutFleetStatus
from rollfleet.contract import ANNOTATION_CRASHES, ANNOTATION_DRAINING_SINCE, ANNOTATION_PHASE, ANNOTATION_TEMPLATE_HASH
from rollfleet.controller.status import (
    ENGINES_PAUSED_ALONE,
    Engine,
    GatewayObs,
    Observations,
    PauseView,
    WeightView,
    classify,
    fleet_status,
    listed,
    observe_pod,
)
from rollfleet_engine.protocol import EngineState

NOT_PAUSED = PauseView(None)
SPEC = RolloutFleetSpec.model_validate({"replicas": 2, "model": {"servedName": "tiny", "hostPath": "/m"}})


def pod(name: str = "f-engine-1", phase: str = "Running", ready: str = "True", **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "annotations": {
                ANNOTATION_PHASE: "Draining",
                ANNOTATION_TEMPLATE_HASH: "h1",
                ANNOTATION_DRAINING_SINCE: "2026-01-01T11:59:00Z",
            },
            **extra,
        },
        "spec": {"nodeName": "gpu-1"},
        "status": {"phase": phase, "podIP": "127.10.0.9", "conditions": [{"type": "Ready", "status": ready}]},
    }


def test_observe_pod_reads_the_facts_the_operator_decides_on() -> None:
    o = observe_pod(pod(), "f", node_lost=False, state=None)
    assert o is not None
    assert (o.index, o.template_hash, o.ready, o.draining, o.node, o.pod_ip) == (
        1,
        "h1",
        True,
        True,
        "gpu-1",
        "127.10.0.9",
    )
    assert o.draining_since == NOW - timedelta(minutes=1)
    assert observe_pod(pod(name="f-gateway-x"), "f", False, None) is None


def test_observations_are_made_again_only_when_the_pod_its_node_or_its_engine_s_state_changed() -> None:
    memo, lost = Observations("f"), {"gpu-1": False}
    pods = [pod("f-engine-1", resourceVersion="10"), pod("f-engine-2", resourceVersion="20")]
    first = memo.observe(pods, lambda p: lost[p["spec"]["nodeName"]])
    assert first == [observe_pod(p, "f", False, None) for p in pods]
    moved = [pods[0], pod("f-engine-2", phase="Failed", resourceVersion="21")]
    again = memo.observe(moved, lambda p: lost[p["spec"]["nodeName"]])
    assert again[0] is first[0] and again[1].failed and again[1] is not first[1]
    lost["gpu-1"] = True
    assert all(o.node_lost for o in memo.observe(moved, lambda p: lost[p["spec"]["nodeName"]]))
    # A pod without a resourceVersion (never from the API server) is observed anew every time.
    unversioned = [pod("f-engine-3")]
    assert memo.observe(unversioned, lambda _: False)[0] is not memo.observe(unversioned, lambda _: False)[0]

    read, reread = state(), state(running=2)
    observed = memo.observe(pods, lambda _: False)
    stated = memo.with_states(observed, {"f-engine-1": read})
    assert (stated[0].state, stated[1].state) == (read, None)
    kept = memo.with_states(observed, {"f-engine-1": read})
    assert kept[0] is stated[0] and kept[1] is stated[1]
    assert memo.with_states(observed, {"f-engine-1": reread})[0].in_flight == 2


def test_observe_pod_explains_why_an_engine_is_not_running() -> None:
    p = pod(phase="Failed", ready="False")
    p["status"]["containerStatuses"] = [{"state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]
    o = observe_pod(p, "f", False, None)
    assert o is not None and o.reason == "engine exited with code 137 (Error)"
    pending = pod(phase="Pending", ready="False")
    pending["status"]["conditions"].append(
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes have free nvidia.com/gpu",
        }
    )
    o = observe_pod(pending, "f", False, None)
    assert o is not None and o.reason == "Unschedulable: 0/3 nodes have free nvidia.com/gpu"


def test_phases() -> None:
    assert engine(0).phase == "Ready"
    assert engine(0, phase="Pending", ready=False).phase == "Starting"
    assert engine(0, ready=False, annotated="Starting").message == "loading the model"
    assert engine(0, ready=False, annotated="Ready").message == "loading the model"  # born Ready, never read
    assert engine(0, ready=False, engine=state()).message == "readiness probe failing"
    assert engine(0, engine=state(paused=True)).phase == "Paused"
    assert engine(0, phase="Failed", ready=False).phase == "Failed"
    assert engine(0, node_lost=True).phase == "Failed"
    assert engine(0, terminating=True).phase == "Draining"
    assert draining(0, 1, 2).message == "draining, 2 in flight"
    # Ready for the kubelet, but its state has not been read yet.
    assert engine(0, engine=None, state=None).phase == "Starting"


def test_weights_behind_the_fleet_mean_pending_sync_unless_sync_is_not_required() -> None:
    weights = WeightView(version="step-3", pending_sync=frozenset({"f-engine-0"}), syncing=False)
    assert engine(0, weights=weights).phase == "PendingSync"
    assert classify(obs(0), weights, False, require_sync=False).phase == "Ready"
    syncing = WeightView(version="step-3", pending_sync=frozenset(), syncing=True)
    assert engine(0, weights=syncing, engine=state(paused=True)).phase == "Syncing"
    # Paused engines are routable (they hold requests): one on stale weights must not look Paused.
    assert engine(0, weights=weights, engine=state(paused=True)).phase == "PendingSync"
    assert engine(0, weights=weights, engine=state(paused=True), fleet_paused=True).phase == "PendingSync"


def test_an_engine_with_the_fleets_label_but_not_its_bytes_says_so_and_the_status_shows_its_proof() -> None:
    weights = WeightView(version="step-3", pending_sync=frozenset({"f-engine-0"}), syncing=False)
    relabelled = EngineState(model="tiny", weight_version="step-3", paused=False, running=0, waiting=0)
    e = engine(0, weights=weights, engine=relabelled.model_copy(update={"weights_manifest_sha256": "0ther"}))
    assert e.phase == "PendingSync" and e.message is not None
    assert "labelled step-3 but were not verified against step-3's manifest" in e.message and "0ther" in e.message
    behind = engine(0, weights=weights, engine=state(version="step-2"))
    assert behind.message == "weights step-2 are not the fleet's step-3"
    proven = engine(1, engine=relabelled.model_copy(update={"weights_manifest_sha256": "ab12"}))
    assert [x.weights_manifest for x in status([proven, e]).engines] == ["0ther", "ab12"]


def test_a_new_engine_in_a_paused_fleet_gets_no_traffic_until_paused() -> None:
    assert engine(0, annotated="Starting", fleet_paused=True).phase == "Starting"
    assert engine(0, annotated="Ready", fleet_paused=True).phase == "Ready"  # a running one being paused


def status(
    engines: list[Engine],
    previous: RolloutFleetStatus | None = None,
    spec: RolloutFleetSpec = SPEC,
    pause: PauseView = NOT_PAUSED,
    generation: int = 1,
) -> RolloutFleetStatus:
    return fleet_status(
        spec=spec,
        generation=generation,
        current_hash=HASH,
        selector="sel",
        engines=engines,
        weights=NO_WEIGHTS,
        pause=pause,
        gateway=GatewayObs(1, 1),
        gateway_endpoint="http://f-gateway.ns.svc:8080",
        gateway_enabled=True,
        previous=previous,
        now=NOW,
    )


def conditions(s: RolloutFleetStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in s.conditions}


def test_converged_fleet() -> None:
    s = status([engine(0), engine(1)])
    assert (s.replicas, s.ready_replicas, s.updated_replicas, s.ready) == (2, 2, 2, "2/2")
    assert conditions(s) == {
        "Ready": ("True", "AllEnginesReady"),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected"),
        "Paused": ("False", "Running"),
    }
    assert [e.name for e in s.engines] == ["f-engine-0", "f-engine-1"]
    assert s.gateway is not None and s.gateway.ready_replicas == 1


def test_a_large_fleets_status_lists_only_the_engines_that_need_a_look_and_counts_every_phase() -> None:
    """2,000 engines listed whole were 300 KB of one object (bench_scale); past 256 the status names only the odd
    ones. The operator's own view keeps them all."""
    spec = SPEC.model_copy(update={"replicas": 2000})
    engines = [engine(i, engine=state(version="v2")) for i in range(2000)]
    engines[7] = engine(7, ready=False, annotated="Starting")
    engines[9] = engine(9, template_hash="old", engine=state(version="v2"))
    engines[11] = engine(11, engine=state(version="v1"))  # another version than the fleet's
    full = status(engines, spec=spec).model_copy(update={"weight_version": "v2"})
    written = listed(full)
    assert [e.name for e in written.engines] == ["f-engine-7", "f-engine-9", "f-engine-11"]
    assert written.engines_unlisted == 1997 and written.engine_phases == {"Ready": 1999, "Starting": 1}
    assert len(json.dumps(written.wire())) < 8 * 1024
    assert len(full.engines) == 2000  # what the operator's metrics read
    # A fleet the list holds whole is listed whole, and counted too.
    small = status([engine(0), engine(1)])
    assert listed(small).engines == small.engines and listed(small).engine_phases == {"Ready": 2}
    assert listed(small).engines_unlisted is None


def test_scale_down_in_progress_counts_draining_engines_apart() -> None:
    s = status([engine(0), draining(1, 3, 1), draining(2, 3, 0)], spec=SPEC.model_copy(update={"replicas": 1}))
    assert (s.replicas, s.ready_replicas, s.ready) == (3, 1, "1/1")
    assert conditions(s)["Progressing"] == ("True", "Draining")
    assert conditions(s)["Ready"] == ("True", "AllEnginesReady")


def test_scale_up_is_progress_not_degradation() -> None:
    converged = status([engine(0), engine(1)])
    bigger = SPEC.model_copy(update={"replicas": 3})
    s = status([engine(0), engine(1), engine(2, ready=False, annotated="Starting")], converged, bigger, generation=2)
    assert conditions(s)["Ready"] == ("False", "EnginesNotReady")
    assert conditions(s)["Degraded"] == ("False", "AsExpected")
    assert conditions(s)["Progressing"] == ("True", "EnginesStarting")


def test_losing_an_engine_degrades_until_its_replacement_serves() -> None:
    converged = status([engine(0), engine(1)])
    failed = status(
        [engine(0), engine(1, phase="Failed", ready=False, reason="engine exited with code 137")], converged
    )
    assert conditions(failed)["Degraded"] == ("True", "EngineFailed")
    assert "137" in next(c.message for c in failed.conditions if c.type == "Degraded")
    # The failed pod is gone and its replacement is starting: still degraded (the status remembers).
    replacing = status([engine(0), engine(1, ready=False, annotated="Starting")], failed)
    assert conditions(replacing)["Degraded"] == ("True", "EnginesLost")
    # A deleted pod (no failure seen) after convergence is also degradation.
    assert conditions(status([engine(0)], converged))["Degraded"] == ("True", "EnginesLost")
    healed = status([engine(0), engine(1)], replacing)
    assert conditions(healed)["Degraded"] == ("False", "AsExpected")
    assert conditions(healed)["Ready"] == ("True", "AllEnginesReady")


def test_condition_transition_time_changes_only_with_status() -> None:
    first = status([engine(0), engine(1)])
    later = fleet_status(
        spec=SPEC,
        generation=1,
        current_hash=HASH,
        selector="sel",
        engines=[engine(0), engine(1)],
        weights=NO_WEIGHTS,
        pause=PauseView(None),
        gateway=GatewayObs(2, 1),
        gateway_endpoint="e",
        gateway_enabled=True,
        previous=first,
        now=NOW + timedelta(hours=1),
    )
    assert [c.last_transition_time for c in later.conditions] == [c.last_transition_time for c in first.conditions]
    assert first.conditions[0].message != later.conditions[0].message  # the gateway count changed


def test_ready_needs_a_ready_gateway_when_one_is_enabled() -> None:
    engines = [engine(0), engine(1)]
    no_gateway = fleet_status(
        spec=SPEC,
        generation=1,
        current_hash=HASH,
        selector="sel",
        engines=engines,
        weights=NO_WEIGHTS,
        pause=NOT_PAUSED,
        gateway=GatewayObs(1, 0),
        gateway_endpoint="e",
        gateway_enabled=True,
        previous=None,
        now=NOW,
    )
    assert conditions(no_gateway)["Ready"] == ("False", "GatewayNotReady")
    disabled = fleet_status(
        spec=SPEC,
        generation=1,
        current_hash=HASH,
        selector="sel",
        engines=engines,
        weights=NO_WEIGHTS,
        pause=NOT_PAUSED,
        gateway=None,
        gateway_endpoint="e",
        gateway_enabled=False,
        previous=None,
        now=NOW,
    )
    assert conditions(disabled)["Ready"] == ("True", "AllEnginesReady") and disabled.gateway is None


def test_pause_shows_mode_count_and_invalid_values() -> None:
    record = PauseStatus(mode="keep", since=NOW)
    paused = engine(0, engine=state(paused=True, mode="keep"), fleet_paused=True)
    half = status([paused, engine(1)], pause=PauseView(record))
    assert half.pause is not None and half.pause.paused_engines == 1
    assert conditions(half)["Paused"] == ("True", "Pausing")
    both = status(
        [paused, engine(1, engine=state(paused=True, mode="keep"), fleet_paused=True)], pause=PauseView(record)
    )
    assert conditions(both)["Paused"] == ("True", "Paused")
    assert conditions(both)["Ready"] == ("True", "AllEnginesReady")  # paused engines hold requests: they serve
    # Lifted, while an engine still reports paused: the fleet is resuming, not paused again.
    lifted = status([paused, engine(1)], pause=PauseView(record, resuming=True))
    assert conditions(lifted)["Paused"] == ("True", "Resuming") and lifted.pause is not None
    invalid = status([engine(0), engine(1)], pause=PauseView(None, invalid_value="soon"))
    assert conditions(invalid)["Paused"] == ("False", "InvalidPauseAnnotation")
    assert invalid.pause is None


def test_an_engine_paused_alone_is_named_while_the_fleet_runs() -> None:
    """Paused at its own control route while the fleet is not: the fleet is not Paused, and the
    condition names the engine and who may resume it (the operator leaves it)."""
    alone = status([engine(0), engine(1, engine=state(paused=True, mode="keep"))])
    cond = next(c for c in alone.conditions if c.type == "Paused")
    assert (cond.status, cond.reason) == ("False", ENGINES_PAUSED_ALONE)
    assert "f-engine-1 (keep)" in cond.message and "f-engine-0" not in cond.message
    assert "POST /resume" in cond.message
    assert alone.pause is None and alone.ready_replicas == 2  # it holds requests: it still serves
    assert conditions(status([engine(0), engine(1)], previous=alone))["Paused"] == ("False", "Running")


def test_a_crashed_engine_says_why_with_its_last_log_lines_and_when_it_is_replaced() -> None:
    log = "\n".join(f"line {i}" for i in range(20)) + "\nValueError: max_model_len 99999 > 2048"
    terminated = {
        "exitCode": 1,
        "reason": "Error",
        "startedAt": "2026-01-01T11:59:30Z",
        "finishedAt": "2026-01-01T11:59:50Z",
        "message": log,
    }
    raw = pod(name="f-engine-1", phase="Failed", ready="False")
    raw["metadata"]["annotations"] = {ANNOTATION_CRASHES: "1", ANNOTATION_TEMPLATE_HASH: HASH}
    raw["status"]["containerStatuses"] = [{"name": "engine", "state": {"terminated": terminated}}]
    o = observe_pod(raw, "f", False, None)
    assert o is not None and o.crashes == 1 and o.exited is not None and o.exited.ran_s == 20
    assert o.reason is not None and o.reason.endswith("line 19 | ValueError: max_model_len 99999 > 2048")
    assert "line 14" not in o.reason  # the last lines only
    e = classify(o, NO_WEIGHTS, False, True)
    assert e.phase == "Failed" and e.message is not None
    # Its second crash in a row: replaced 20 s after it exited.
    assert e.message.startswith("crashed 2 time(s) in a row, replaced from 12:00:10Z on: engine exited with code 1")
