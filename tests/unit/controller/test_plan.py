"""Pod actions: scale up and down with drains, replacement, rolling updates, pause decisions."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from tests.unit.controller.fleet_fixtures import HASH, NOW, draining, engine, obs, state

from rollfleet.api.fleet import PauseStatus, UpdateStrategy
from rollfleet.contract import ANNOTATION_PAUSE, ANNOTATION_RESUME
from rollfleet.controller import plan
from rollfleet.controller.plan import Create, Delete, Drain, PauseCall, ResumeCall
from rollfleet.controller.status import Engine, Exited, WeightView

OLD = "h-old"


def run(
    engines: Sequence[Engine], replicas: int, max_unavailable: int = 1, max_surge: int = 0, drain_timeout: float = 60
) -> list[plan.PodAction]:
    return plan.plan_pods(
        engines,
        replicas=replicas,
        current_hash=HASH,
        max_unavailable=max_unavailable,
        max_surge=max_surge,
        drain_timeout=drain_timeout,
        now=NOW,
    )


def test_new_fleet_creates_every_engine_by_index() -> None:
    up = "3 engines wanted, 0 exist"
    assert run([], 3) == [Create(0, up), Create(1, up), Create(2, up)]


def test_converged_fleet_does_nothing() -> None:
    assert run([engine(0), engine(1)], 2) == []


def test_scale_up_fills_the_lowest_free_index() -> None:
    assert run([engine(0), engine(2)], 3) == [Create(1, "3 engines wanted, 2 exist")]


def test_scale_down_drains_highest_indices_and_deletes_unready_ones_at_once() -> None:
    assert run([engine(0), engine(1), engine(2)], 1) == [
        Drain("f-engine-2", "scale-down"),
        Drain("f-engine-1", "scale-down"),
    ]
    starting = engine(1, ready=False, annotated="Starting")
    assert run([engine(0), starting, engine(2)], 2) == [Delete("f-engine-1", "scale-down of a Starting engine")]


def test_draining_engine_is_deleted_once_idle_or_timed_out_and_never_replaced_meanwhile() -> None:
    assert run([engine(0), draining(1, seconds_ago=5, in_flight=1)], 1) == []
    assert run([engine(0), draining(1, seconds_ago=5, in_flight=0)], 1) == [Delete("f-engine-1", "drained after 5s")]
    # Within the settle time, an idle engine may still receive a request a gateway already routed.
    assert run([engine(0), draining(1, seconds_ago=0.5, in_flight=0)], 1) == []
    [timeout] = run([engine(0), draining(1, seconds_ago=61, in_flight=3)], 1)
    assert isinstance(timeout, Delete) and "timeout" in timeout.reason


def test_failed_engine_is_deleted_then_recreated_under_the_same_name() -> None:
    failed = engine(1, phase="Failed", ready=False, reason="engine exited with code 137 (Error)")
    [delete] = run([engine(0), failed], 2)
    assert isinstance(delete, Delete) and delete.name == "f-engine-1" and "137" in delete.reason
    # While the failed pod still exists its name is taken: no engine-2 is created instead.
    assert not any(isinstance(a, Create) for a in run([engine(0), failed], 2))
    assert run([engine(0)], 2) == [Create(1, "2 engines wanted, 1 exist")]


def crashed(index: int, exited_s_ago: float, ran_s: float, crashes: int = 0, **over: Any) -> Engine:
    exited = Exited(NOW - timedelta(seconds=exited_s_ago), ran_s)
    reason = "engine exited with code 1 (Error): ValueError: max_model_len too large"
    return engine(index, phase="Failed", ready=False, reason=reason, exited=exited, crashes=crashes, **over)


def test_an_engine_that_crashes_at_start_is_replaced_after_a_doubling_backoff() -> None:
    # Its third crash in a row: 10 s * 2**2 = 40 s after it exited.
    assert run([engine(0), crashed(1, exited_s_ago=39, ran_s=20, crashes=2)], 2) == []
    [delete] = run([engine(0), crashed(1, exited_s_ago=41, ran_s=20, crashes=2)], 2)
    assert isinstance(delete, Delete) and delete.crashes == 3 and "max_model_len" in delete.reason
    assert crashed(1, exited_s_ago=0, ran_s=1, crashes=9).obs.replace_at() == NOW + timedelta(seconds=300)  # the cap


def test_a_long_run_or_a_fixed_spec_ends_the_backoff() -> None:
    [after_long_run] = run([engine(0), crashed(1, exited_s_ago=0, ran_s=3600, crashes=4)], 2)
    assert isinstance(after_long_run, Delete) and after_long_run.crashes is None
    [outdated] = run([engine(0), crashed(1, exited_s_ago=0, ran_s=20, crashes=4, template_hash=OLD)], 2)
    assert isinstance(outdated, Delete) and outdated.crashes is None


def test_engine_on_a_lost_node_is_force_deleted() -> None:
    lost = engine(1, node_lost=True, node="gpu-1")
    assert run([engine(0), lost], 2) == [Delete("f-engine-1", "node gpu-1 is lost", force=True)]


def test_terminating_pod_keeps_its_slot_until_gone() -> None:
    assert run([engine(0), engine(1, terminating=True)], 2) == []
    # An engine that exits on SIGTERM while its pod is deleted is not a failure to replace.
    exited = engine(1, terminating=True, phase="Succeeded", ready=False)
    assert exited.phase == "Draining"
    assert run([engine(0), exited], 2) == []


def test_rolling_update_with_max_surge_0_goes_one_engine_at_a_time() -> None:
    # Both old and serving: drain one (the highest index).
    assert run([engine(0, template_hash=OLD), engine(1, template_hash=OLD)], 2) == [Drain("f-engine-1", "update")]
    # One draining: no new pod (no spare GPU), no second drain.
    assert run([engine(0, template_hash=OLD), draining(1, 5, 2, template_hash=OLD)], 2) == []
    # The drained pod is gone: recreate it with the new template.
    assert run([engine(0, template_hash=OLD)], 2) == [Create(1, "update")]
    # The new one is still starting: maxUnavailable 1 is used up.
    assert run([engine(0, template_hash=OLD), engine(1, ready=False, annotated="Starting")], 2) == []
    # It serves: the last old one goes.
    assert run([engine(0, template_hash=OLD), engine(1)], 2) == [Drain("f-engine-0", "update")]


def test_rolling_update_with_surge_creates_first() -> None:
    olds = [engine(0, template_hash=OLD), engine(1, template_hash=OLD)]
    assert run(olds, 2, max_unavailable=0, max_surge=1) == [Create(2, "update")]
    assert run([*olds, engine(2)], 2, max_unavailable=0, max_surge=1) == [Drain("f-engine-1", "update")]


def test_outdated_engines_that_do_not_serve_are_replaced_without_budget() -> None:
    old_starting = engine(1, template_hash="h-old", ready=False, annotated="Starting")
    assert run([engine(0), old_starting], 2) == [Delete("f-engine-1", "update of a Starting engine")]


@pytest.mark.parametrize(
    ("strategy", "replicas", "expected"),
    [
        ({}, 4, (1, 0)),
        ({"maxUnavailable": "25%", "maxSurge": "25%"}, 10, (2, 3)),
        ({"maxUnavailable": "10%", "maxSurge": 0}, 4, (1, 0)),  # both would be 0: one may be unavailable
        ({"maxUnavailable": 0, "maxSurge": 2}, 4, (0, 2)),
    ],
)
def test_rollout_budget(strategy: dict[str, Any], replicas: int, expected: tuple[int, int]) -> None:
    assert plan.rollout_budget(UpdateStrategy.model_validate(strategy), replicas) == expected


def meta(annotations: dict[str, str], managed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"annotations": annotations, "managedFields": managed or []}


def test_pause_request_from_annotations() -> None:
    assert plan.pause_request(meta({ANNOTATION_PAUSE: "keep"}), None) == plan.PauseRequest("keep")
    assert plan.pause_request(meta({}), None) == plan.PauseRequest(None)
    recorded = PauseStatus(mode="wait", since=NOW)
    invalid = plan.pause_request(meta({ANNOTATION_PAUSE: "sometimes"}), recorded)
    assert invalid == plan.PauseRequest("wait", invalid_value="sometimes")  # nothing changes
    assert plan.pause_request(meta({ANNOTATION_PAUSE: "soon"}), None).mode is None
    resume = plan.pause_request(meta({ANNOTATION_PAUSE: "keep", ANNOTATION_RESUME: ""}), recorded)
    assert resume == plan.PauseRequest(None, remove_annotations=(ANNOTATION_RESUME, ANNOTATION_PAUSE))


def owns(manager: str, *annotations: str) -> dict[str, Any]:
    fields = {"f:metadata": {"f:annotations": {f"f:{a}": {} for a in annotations}}}
    return {"manager": manager, "operation": "Update", "fieldsV1": fields}


def test_the_pause_records_who_set_the_annotation_from_its_field_manager() -> None:
    managed = [owns("kubectl-client-side-apply", "other"), owns("rollfleet-client/trainer-0", ANNOTATION_PAUSE)]
    request = plan.pause_request(meta({ANNOTATION_PAUSE: "keep"}, managed), None)
    assert request.requested_by == "rollfleet-client/trainer-0"
    record = plan.pause_record(request, None, [], NOW)
    assert record is not None and record.requested_by == "rollfleet-client/trainer-0"
    # Ownership moves to whoever wrote it last: a later `kubectl annotate --overwrite`.
    later = [owns("kubectl-annotate", ANNOTATION_PAUSE), owns("rollfleet-client/trainer-0")]
    assert plan.pause_request(meta({ANNOTATION_PAUSE: "abort"}, later), record).requested_by == "kubectl-annotate"
    assert plan.annotation_manager(meta({ANNOTATION_PAUSE: "keep"}), ANNOTATION_PAUSE) is None


def test_pause_record_keeps_since_and_lasts_until_engines_resumed() -> None:
    recorded = PauseStatus(mode="keep", since=NOW.replace(hour=1))
    assert plan.pause_record(plan.PauseRequest("keep"), None, [], NOW) == PauseStatus(mode="keep", since=NOW)
    assert plan.pause_record(plan.PauseRequest("abort"), recorded, [], NOW).since == recorded.since  # type: ignore[union-attr]
    paused = engine(0, engine=state(paused=True, mode="keep"), fleet_paused=True)
    assert plan.pause_record(plan.PauseRequest(None), recorded, [paused], NOW) == recorded
    assert plan.pause_record(plan.PauseRequest(None), recorded, [engine(0)], NOW) is None


def test_pause_calls_are_idempotent_and_resume_only_what_the_fleet_paused() -> None:
    running, paused = engine(0), engine(1, engine=state(paused=True, mode="keep"), fleet_paused=True)
    record = PauseStatus(mode="keep", since=NOW)
    assert plan.engine_pause_calls("keep", record, [running, paused]) == [PauseCall("f-engine-0", "keep")]
    assert plan.engine_pause_calls("abort", record, [paused]) == [PauseCall("f-engine-1", "abort")]
    assert plan.engine_pause_calls(None, record, [running, paused]) == [ResumeCall("f-engine-1")]
    # An engine the sync sidecar paused while the fleet runs is not the operator's to resume.
    assert plan.engine_pause_calls(None, None, [paused]) == []
    # Nor one behind the fleet's weights: the sidecar resumes it after catching it up.
    behind = WeightView(version="step-3", pending_sync=frozenset({"f-engine-1"}), syncing=False)
    stale = engine(1, engine=state(paused=True, mode="keep"), weights=behind)
    assert plan.engine_pause_calls(None, record, [stale]) == []
    # Engines without a known state or on their way out are left alone.
    starting = engine(2, ready=False, annotated="Starting")
    assert plan.engine_pause_calls("keep", record, [starting, draining(3, 1, 0)]) == []


def test_phase_updates_skip_engines_that_are_leaving() -> None:
    new = engine(0, annotated="Starting")
    gone = engine(1, annotated="Starting")
    assert plan.phase_updates([new, gone], [Drain("f-engine-1", "scale-down")], born=False) == {"f-engine-0": "Ready"}


def test_a_new_engine_is_born_ready_only_where_nothing_could_hold_it_back() -> None:
    assert plan.born_ready(pristine=True, pause_mode=None)
    assert not plan.born_ready(pristine=False, pause_mode=None)  # pushed weights: it loads them first
    assert not plan.born_ready(pristine=True, pause_mode="keep")  # a paused fleet: it is paused first


def test_an_engine_born_ready_keeps_its_phase_until_its_pod_is_ready_and_no_longer_once_it_could_be_held_back() -> None:
    loading = engine(0, ready=False)  # annotated Ready at its creation, its model loading
    assert (loading.phase, loading.message) == ("Starting", "loading the model")
    assert plan.phase_updates([loading], [], born=True) == {}  # the gateway routes no pod that is not Ready
    # A push began or a pause was asked for meanwhile: held back until its state says where it is.
    assert plan.phase_updates([loading], [], born=False) == {"f-engine-0": "Starting"}
    # Ready for the kubelet, its state not read yet: nothing it could say would hold it back, unless born=False.
    unread = engine(1, engine=None, state=None)
    assert plan.phase_updates([unread], [], born=True) == {}
    assert plan.phase_updates([unread], [], born=False) == {"f-engine-1": "Starting"}
    # What its state says is written whatever its birth: here, paused at the engine.
    paused = engine(2, engine=state(paused=True, mode="keep"))
    assert plan.phase_updates([paused], [], born=True) == {"f-engine-2": "Paused"}


def test_the_weight_generation_annotation_follows_what_each_engine_reports() -> None:
    moved = engine(0, annotated_generation="1")
    same = engine(1, annotated_generation="2")
    unknown = engine(2, annotated_generation="1")  # reports weights the record does not know
    unread = engine(3, annotated_generation="1")  # its state was not read this time: left as it is
    going = engine(4, annotated_generation="1", terminating=True)
    generations = {"f-engine-0": 2, "f-engine-1": 2, "f-engine-2": None, "f-engine-4": 2}
    updates = plan.generation_updates([moved, same, unknown, unread, going], generations)
    assert updates == {"f-engine-0": "2", "f-engine-2": None}


def test_a_created_engine_is_awaited_until_the_watch_shows_it_or_patience_runs_out() -> None:
    """A pass that runs before the watch delivers the pods the last one created must not create them again; one
    the watch never shows (deleted meanwhile) is created again after `patience_s`."""
    created = {0: 100.0, 1: 100.0, 2: 40.0}
    assert plan.awaited_creations(created, seen={1}, now=110.0, patience_s=60.0) == {0: 100.0}
    assert plan.awaited_creations(created, seen=set(), now=170.0, patience_s=60.0) == {}


def test_an_annotation_write_is_not_made_again_until_the_watch_shows_its_pod_changed() -> None:
    """A pass that runs before the watch delivers the last pass's patches must not make them again; a new value is
    written at once, and once the watch shows the pod changed, it is believed, whoever changed it."""
    ready = {"rollfleet.dev/phase": "Ready", "rollfleet.dev/weight-generation": "0"}
    written = {"e-0": ("10", ready), "e-1": ("11", ready), "e-2": ("12", ready), "gone": ("13", ready)}
    versions = {"e-0": "10", "e-1": "11", "e-2": "20"}  # e-2: the watch has shown it since
    changes = {"e-0": ready, "e-1": {"rollfleet.dev/phase": "Paused"}, "e-2": ready, "e-3": ready}
    todo, awaited = plan.awaited_annotations(changes, written, versions)
    assert todo == {"e-1": {"rollfleet.dev/phase": "Paused"}, "e-2": ready, "e-3": ready}
    assert awaited == {"e-0": ("10", ready), "e-1": ("11", ready)}  # e-2 shown, "gone" gone: forgotten


def test_a_busy_fleet_re_reads_every_second_only_the_engines_whose_state_may_change_on_its_own() -> None:
    """A converging fleet of 2,000 re-read every Ready engine each second; only those loading or syncing need it."""
    ages = {
        phase: plan.state_max_age(obs(0, annotated=phase), busy=True, busy_s=1.0, idle_s=40.0)
        for phase in (None, "Starting", "PendingSync", "Syncing", "Draining", "Ready", "Paused")
    }
    assert ages == {
        None: 1.0,
        "Starting": 1.0,
        "PendingSync": 1.0,
        "Syncing": 1.0,
        "Draining": 1.0,
        "Ready": 40.0,
        "Paused": 40.0,
    }
    assert plan.state_max_age(obs(0, annotated="Starting"), busy=False, busy_s=1.0, idle_s=40.0) == 40.0
