"""Events of many engines at once share one Event per reason; a few stay one each."""

from __future__ import annotations

from rollfleet.controller.events import EVENTS_ONE_BY_ONE, batched


def test_a_few_engine_events_stay_one_each_and_many_share_one_per_reason() -> None:
    few = [("Normal", "EngineReady", f"f-engine-{i}: Starting -> Ready") for i in range(EVENTS_ONE_BY_ONE)]
    assert batched(few) == few
    many = [("Normal", "EngineCreated", f"f-engine-{i} created (2000 engines wanted, 0 exist)") for i in range(2000)]
    many.append(("Warning", "EngineFailed", "f-engine-7: Starting -> Failed (pod Failed)"))
    out = batched(many)
    assert len(out) == 2
    assert out[0][:2] == ("Normal", "EngineCreated")
    assert out[0][2].startswith("2000 engines (f-engine-0, f-engine-1, ") and "and 1990 more)" in out[0][2]
    assert out[0][2].endswith("the first: f-engine-0 created (2000 engines wanted, 0 exist)")
    assert out[1] == ("Warning", "EngineFailed", "f-engine-7: Starting -> Failed (pod Failed)")  # alone: as is
