"""Tracker bookkeeping and the abort protocol against a fake engine."""

from __future__ import annotations

import asyncio

from rollfleet_engine.abort import abort_requests
from rollfleet_engine.protocol import AbortStatus, RequestPhase
from rollfleet_engine.tracker import ABORT, RequestTracker


def test_tracker_lifecycle() -> None:
    t = RequestTracker()
    assert t.open("a")
    assert not t.open("a")  # in flight: id reuse refused
    assert t.get("a").phase is RequestPhase.QUEUED  # type: ignore[union-attr]
    t.attach("a", "cmpl-a-0")
    t.on_output("a", "cmpl-a-0", output_tokens=3, cumulative=False, finish_reason=None)
    t.on_output("a", "cmpl-a-0", output_tokens=2, cumulative=False, finish_reason=None)
    view = t.get("a")
    assert view is not None and view.phase is RequestPhase.RUNNING and view.output_tokens == 5
    assert t.counts() == (1, 0)
    t.on_output("a", "cmpl-a-0", output_tokens=1, cumulative=False, finish_reason="length", versions=["v1"])
    view = t.get("a")
    assert view is not None and view.phase is RequestPhase.FINISHED and view.finish_reason == "length"
    assert view.weight_versions == ["v1"]
    t.close("a")
    assert t.view().in_flight == []
    assert [r.request_id for r in t.view().recently_finished] == ["a"]
    assert t.open("a")  # finished ids may be reused


def test_tracker_rejected_and_bounded() -> None:
    t = RequestTracker(keep_finished=2)
    for rid in ("a", "b", "c"):
        t.open(rid)
        t.close(rid)
    assert t.get("a") is None
    assert t.get("c").finish_reason == "rejected"  # type: ignore[union-attr]


def test_a_request_cut_at_the_engine_ended_aborted_whenever_vllm_says_so() -> None:
    """A client gone mid-request: the exchange closes before vLLM's output generator does (a non-streaming
    request, found by the engine contract); the request ran at the engine, so it was aborted, not refused."""
    t = RequestTracker()
    t.open("cut")
    t.attach("cut", "cmpl-cut-0")
    t.on_output("cut", "cmpl-cut-0", output_tokens=3, cumulative=False, finish_reason=None)
    t.close("cut")
    t.on_engine_end("cut", "cmpl-cut-0", ABORT)  # late: the entry is closed already
    view = t.get("cut")
    assert view is not None and view.phase is RequestPhase.FINISHED and view.finish_reason == ABORT


class FakeEngine:
    """Aborting an external id ends it with finish_reason abort, as AsyncLLM does."""

    def __init__(self, tracker: RequestTracker, owners: dict[str, str]) -> None:
        self.tracker, self.owners, self.calls = tracker, owners, []

    async def abort(self, engine_ids: list[str]) -> None:
        self.calls.append(list(engine_ids))
        for eid in engine_ids:
            self.tracker.on_output(self.owners[eid], eid, output_tokens=0, cumulative=False, finish_reason=ABORT)


def test_abort_statuses() -> None:
    async def run() -> dict[str, AbortStatus]:
        t = RequestTracker()
        for rid in ("run", "done", "two"):
            t.open(rid)
        t.attach("run", "cmpl-run-0")
        t.attach("done", "cmpl-done-0")
        t.on_output("done", "cmpl-done-0", output_tokens=4, cumulative=True, finish_reason="stop")
        t.attach("two", "cmpl-two-0")
        t.attach("two", "cmpl-two-1")
        engine = FakeEngine(t, {"cmpl-run-0": "run", "cmpl-two-0": "two", "cmpl-two-1": "two"})
        return await abort_requests(t, engine.abort, ["run", "done", "two", "ghost", "run"], timeout_s=2)

    assert asyncio.run(run()) == {
        "run": AbortStatus.ABORTED,
        "done": AbortStatus.FINISHED,
        "two": AbortStatus.ABORTED,
        "ghost": AbortStatus.UNKNOWN,
    }


def test_abort_waits_for_the_request_to_reach_the_engine() -> None:
    async def run() -> tuple[dict[str, AbortStatus], list[list[str]]]:
        t = RequestTracker()
        t.open("late")  # still tokenizing: no engine id yet
        engine = FakeEngine(t, {"cmpl-late-0": "late"})

        async def arrive() -> None:
            await asyncio.sleep(0.1)
            t.attach("late", "cmpl-late-0")

        task = asyncio.create_task(arrive())
        result = await abort_requests(t, engine.abort, ["late"], timeout_s=2)
        await task
        return result, engine.calls

    result, calls = asyncio.run(run())
    assert result == {"late": AbortStatus.ABORTED}
    assert calls == [["cmpl-late-0"]]


def test_abort_that_does_not_take_effect_is_pending_not_aborted() -> None:
    async def run() -> dict[str, AbortStatus]:
        t = RequestTracker()
        t.open("stuck")
        t.attach("stuck", "cmpl-stuck-0")

        async def ignore(_: list[str]) -> None:
            """An engine that accepts the abort and does nothing (vLLM's trap)."""

        return await abort_requests(t, ignore, ["stuck"], timeout_s=0.3)

    assert asyncio.run(run()) == {"stuck": AbortStatus.PENDING}
