"""The weight sync protocol's decisions: record round trip, transitions, recovery, staleness."""

from __future__ import annotations

import pytest

from rollfleet.contract import (
    ANNOTATION_MAX_STALENESS,
    RECORD_ENGINE_TEMPLATE,
    RECORD_MODEL,
    RECORD_SYNC_STATE,
    RECORD_WEIGHT_GENERATION,
    RECORD_WEIGHT_VERSION,
    RECORD_WEIGHTS_URL,
)
from rollfleet.sync.protocol import (
    HISTORY_LENGTH,
    EngineObservation,
    FleetRecord,
    InFlight,
    PushPhase,
    PushRefused,
    RecoveryAction,
    WeightsRef,
    adopt_initial,
    begin_push,
    commit,
    complete,
    decode_record,
    encode_record,
    layout_change,
    max_staleness,
    needs_catch_up,
    operator_fields,
    plan_recovery,
    proven,
    roll_back,
    routable,
    should_commit,
    stale_requests,
    vouched,
)

A = WeightsRef("A", 0)
B = WeightsRef("B", 1, url="http://10.0.0.5:8472", manifest_sha256="abc", source="/spool/B")


def on_a() -> FleetRecord:
    return adopt_initial(FleetRecord(), ["A", "A"])


def pushing_b() -> FleetRecord:
    return begin_push(on_a(), B, now=100.0)


def test_record_round_trips_through_the_config_map_data() -> None:
    record = commit(pushing_b(), failed=["e1"], message="left out")
    data = {k: v for k, v in encode_record(record).items() if v is not None}
    assert decode_record(data) == record
    assert data[RECORD_WEIGHT_VERSION] == "B"
    assert data[RECORD_WEIGHT_GENERATION] == "1"
    assert data[RECORD_WEIGHTS_URL] == "http://10.0.0.5:8472"


def test_a_record_for_another_model_starts_over_and_one_for_this_model_keeps_its_pushes() -> None:
    data = {k: v for k, v in encode_record(commit(pushing_b(), [], "")).items() if v is not None}
    kept = data | {RECORD_MODEL: "m1", RECORD_ENGINE_TEMPLATE: "h1"}
    assert operator_fields(kept, "m1", "h1") is None
    # Another template of the same model (new engine args): only the template moves.
    assert operator_fields(kept, "m1", "h2") == {RECORD_ENGINE_TEMPLATE: "h2"}
    change = operator_fields(kept, "m2", "h2")
    assert change is not None
    reset = {k: v for k, v in (kept | change).items() if v is not None}
    assert reset == {RECORD_MODEL: "m2", RECORD_ENGINE_TEMPLATE: "h2"}
    assert decode_record(reset) == FleetRecord(engine_template="h2")
    # A new fleet's empty ConfigMap gets the operator's fields, and nothing else changes.
    assert operator_fields({}, "m1", "h1") == {RECORD_MODEL: "m1", RECORD_ENGINE_TEMPLATE: "h1"}


def test_a_version_is_adopted_only_from_engines_all_on_the_template_the_fleet_rolls_to() -> None:
    record = FleetRecord(engine_template="new")
    # A model change: the old engines still serve (and agree on) the old model's version.
    assert adopt_initial(record, ["b-3", "b-3"], ["old", "old"]) == record
    assert adopt_initial(record, ["A", "b-3"], ["new", "old"]) == record
    assert adopt_initial(record, ["A", "A"], ["new", "new"]).committed == WeightsRef("A", 0)
    # Before the operator wrote the template, pods cannot be trusted; static mode has no pods to ask.
    assert adopt_initial(FleetRecord(), ["A"], ["new"]) == FleetRecord()
    assert adopt_initial(FleetRecord(), ["A"], None).committed == WeightsRef("A", 0)


def test_empty_record_deletes_the_plain_keys() -> None:
    patch = encode_record(FleetRecord())
    assert patch[RECORD_WEIGHT_VERSION] is None and patch[RECORD_SYNC_STATE]
    assert decode_record(None) == FleetRecord()


def test_a_hand_set_version_reads_as_committed_without_a_source() -> None:
    record = decode_record({RECORD_WEIGHT_VERSION: "v7", RECORD_WEIGHT_GENERATION: "7"})
    assert record.committed == WeightsRef("v7", 7)
    assert record.generation_of("v7") == 7


def test_adopt_initial_needs_every_engine_to_agree() -> None:
    assert on_a().committed == A
    assert adopt_initial(FleetRecord(), ["A", "B"]).committed is None
    assert adopt_initial(FleetRecord(), ["A", None]).committed is None
    assert adopt_initial(FleetRecord(), []).committed is None
    assert adopt_initial(on_a(), ["Z"]).committed == A  # never overrides a committed version


def test_begin_push_refuses_a_second_active_push_a_used_version_and_a_gap() -> None:
    record = pushing_b()
    assert record.push is not None and record.push.phase is PushPhase.IN_PROGRESS
    assert record.push.previous == A
    with pytest.raises(PushRefused, match="still InProgress"):
        begin_push(record, WeightsRef("C", 2), now=1.0)
    with pytest.raises(PushRefused, match="already pushed"):
        begin_push(on_a(), WeightsRef("A", 1), now=1.0)
    with pytest.raises(PushRefused, match="does not follow"):
        begin_push(on_a(), WeightsRef("C", 5), now=1.0)


def test_commit_then_complete_moves_the_fleet_and_extends_history() -> None:
    committed = commit(pushing_b(), failed=["e2", "e1"])
    assert committed.committed == B
    assert committed.push is not None and committed.push.phase is PushPhase.COMMITTED
    assert committed.push.failed == ("e1", "e2")
    assert committed.generation_of("B") == 1 and committed.generation_of("A") == 0
    done = complete(committed)
    assert done.push is not None and done.push.phase is PushPhase.DONE
    # The next push may start and must use generation 2.
    assert begin_push(done, WeightsRef("C", 2), now=1.0).push is not None


def test_roll_back_keeps_the_committed_version() -> None:
    rolled = roll_back(pushing_b(), "no engine verified")
    assert rolled.committed == A
    assert rolled.push is not None and rolled.push.phase is PushPhase.ROLLED_BACK
    with pytest.raises(ValueError, match="no active push"):
        complete(rolled)


def test_history_is_bounded() -> None:
    record = on_a()
    for g in range(1, HISTORY_LENGTH + 10):
        record = complete(commit(begin_push(record, WeightsRef(f"v{g}", g), now=0.0)))
    assert len(record.history) == HISTORY_LENGTH
    assert record.generation_of("A") is None


def test_commit_needs_one_verified_engine() -> None:
    assert should_commit(["e0"])
    assert not should_commit([])


@pytest.mark.parametrize(
    ("observed", "target_exists", "previous_exists", "expected"),
    [
        ({"e0": "A", "e1": "B"}, True, True, RecoveryAction.ROLL_FORWARD),
        ({"e0": "A", "e1": "A"}, False, False, RecoveryAction.ROLL_BACK),
        ({"e0": "A", "e1": None}, False, True, RecoveryAction.ROLL_BACK),
        ({"e0": "A", "e1": "B"}, False, True, RecoveryAction.REPUSH_PREVIOUS),
        ({"e0": "A", "e1": "B"}, False, False, RecoveryAction.COMMIT_PARTIAL),
    ],
)
def test_recovery_of_an_interrupted_push(
    observed: dict[str, str | None], target_exists: bool, previous_exists: bool, expected: RecoveryAction
) -> None:
    obs = {k: EngineObservation(v) for k, v in observed.items()}
    assert plan_recovery(pushing_b(), obs, target_exists, previous_exists) is expected


def test_recovery_after_commit_only_resumes_and_nothing_without_an_active_push() -> None:
    obs = {"e0": EngineObservation("A")}
    assert plan_recovery(commit(pushing_b()), obs, False, False) is RecoveryAction.RESUME
    assert plan_recovery(complete(commit(pushing_b())), obs, False, False) is RecoveryAction.NOTHING
    assert plan_recovery(on_a(), obs, True, True) is RecoveryAction.NOTHING


def test_routable_means_on_the_committed_version_or_on_the_target_while_paused_for_it() -> None:
    assert routable("A", on_a()) and not routable("B", on_a()) and not routable(None, on_a())
    assert routable("A", pushing_b()) and routable("B", pushing_b())
    after = commit(pushing_b())
    assert routable("B", after) and not routable("A", after)
    assert routable("anything", FleetRecord())  # nothing to be consistent with yet


def test_the_record_vouches_for_a_version_only_with_the_bytes_it_pinned_for_it() -> None:
    """The proof of the bytes: an engine's label counts only with the manifest its load was verified against,
    where the record pins one (an HTTP push); the weights the engines started with pin none."""
    done = complete(commit(pushing_b()))
    assert proven(B, "abc") and not proven(B, "0ther") and not proven(B, None)
    assert proven(WeightsRef("A", 0), None)
    assert vouched("B", "abc", done) == "B"
    assert vouched("B", "0ther", done) is None and vouched("B", None, done) is None
    assert vouched("A", None, done) == "A"  # not the fleet's: routable() says so, not the proof
    assert vouched("B", None, pushing_b()) is None and vouched("B", "abc", pushing_b()) == "B"  # the push's target
    assert vouched("A", None, on_a()) == "A"  # started with: nothing pinned
    assert EngineObservation("B", manifest="abc").serves(B) and not EngineObservation("B").serves(B)


def test_catch_up_only_without_an_active_push_and_with_a_source() -> None:
    done = complete(commit(pushing_b()))
    assert needs_catch_up(EngineObservation("A"), done)
    assert not needs_catch_up(EngineObservation("B", manifest="abc"), done)
    assert needs_catch_up(EngineObservation("B", intact=False, manifest="abc"), done)  # labelled B, weights mixed
    # Labelled B, its bytes not verified against B's manifest (a relabel, a load from elsewhere): loaded again.
    assert needs_catch_up(EngineObservation("B", manifest="0ther"), done)
    assert needs_catch_up(EngineObservation("B"), done)
    assert not needs_catch_up(EngineObservation(None), done)
    assert not needs_catch_up(EngineObservation("A"), commit(pushing_b()))  # resuming: not yet
    assert not needs_catch_up(EngineObservation("Z"), on_a())  # initial weights: no url to pull from


def test_staleness_counts_generations_from_the_oldest_weights_a_request_ran_on() -> None:
    record = complete(commit(pushing_b()))  # history A=0, B=1
    reqs = [
        InFlight("old", ("A",)),
        InFlight("mixed", ("A", "B")),
        InFlight("fresh", ("B",)),
        InFlight("queued", ()),
        InFlight("unknown", ("pre-history",)),
    ]
    assert stale_requests(reqs, record, target_generation=2, bound=None) == []
    assert stale_requests(reqs, record, target_generation=2, bound=1) == ["old", "mixed", "unknown"]
    assert stale_requests(reqs, record, target_generation=2, bound=2) == ["unknown"]
    assert stale_requests(reqs, record, target_generation=2, bound=0) == ["old", "mixed", "fresh", "unknown"]


def test_a_request_s_own_bound_is_kept_where_tighter_than_the_fleet_s() -> None:
    record = complete(commit(pushing_b()))  # history A=0, B=1
    reqs = [
        InFlight("strict", ("B",), max_weight_lag=0),
        InFlight("loose", ("A",), max_weight_lag=5),
        InFlight("lagging", ("A",), max_weight_lag=1),
        InFlight("queued", (), max_weight_lag=0),
        InFlight("unbounded", ("A",)),
    ]
    # No fleet bound: only the requests' own.
    assert stale_requests(reqs, record, target_generation=2, bound=None) == ["strict", "lagging"]
    # A fleet bound of 1: "loose" asked for more than the fleet allows, the fleet's holds.
    assert stale_requests(reqs, record, target_generation=2, bound=1) == ["strict", "loose", "lagging", "unbounded"]


def test_max_staleness_from_the_fleet_overrides_the_flag() -> None:
    assert max_staleness({}, 3) == 3
    assert max_staleness({ANNOTATION_MAX_STALENESS: "1"}, 3) == 1
    assert max_staleness({ANNOTATION_MAX_STALENESS: " "}, None) is None
    for bad in ("-1", "two", "1.5"):  # refused naming the annotation and what it takes
        with pytest.raises(ValueError, match=r"max-staleness.*whole number >= 0"):
            max_staleness({ANNOTATION_MAX_STALENESS: bad}, None)


def test_a_layout_change_names_what_differs_and_no_change_is_none() -> None:
    current = {"w": ("F32", (4, 4)), "b": ("F32", (4,)), "n": ("BF16", (4,))}
    assert layout_change(current, dict(current)) is None
    new = {"w": ("F32", (4, 5)), "n": ("F32", (4,)), "x": ("F32", (1,))}
    assert layout_change(current, new) == (
        "'x' is not in the current weights; 'b' is missing; 'n' is F32 [4], the current one BF16 [4] (and 1 more)"
    )
