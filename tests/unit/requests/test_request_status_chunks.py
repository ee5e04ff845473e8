"""Status rendering of a RolloutRequest and the chunk layout of its results store."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from rollfleet.api.request import AbortRecord, ResultsRef, RolloutRequestStatus
from rollfleet.contract import results_chunk_name
from rollfleet.controller.requests.plan import SampleResult
from rollfleet.controller.requests.results import Chunk, Layout, ResultStore, parse_chunk
from rollfleet.controller.requests.status import Tally, Verdict, finished_verdict, request_status

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def result(
    p: int, s: int, reason: str = "stop", error: str | None = None, tokens: int = 3, version: str = "v1"
) -> SampleResult:
    return SampleResult(
        p,
        s,
        f"u-{p}-{s}",
        reason,
        token_ids=list(range(tokens)),
        weight_version=version,
        weight_versions=[version],
        error=error,
    )


def test_tally_counts_outcomes_tokens_and_versions() -> None:
    t = Tally()
    for r in [
        result(0, 0),
        result(0, 1, "length", version="v2"),
        result(1, 0, "abort", tokens=1),
        result(1, 1, "error", error="HTTP 400: bad", tokens=0),
    ]:
        t.add(r)
    assert (t.completed, t.aborted, t.failed, t.tokens, t.stored) == (2, 1, 1, 7, 4)
    assert t.versions == ["v1", "v2"] and t.first_error == "HTTP 400: bad"
    assert finished_verdict(t, 4).phase == "Failed" and "1 of 4 samples failed" in finished_verdict(t, 4).message
    ok = Tally()
    ok.add(result(0, 0))
    assert finished_verdict(ok, 1) == Verdict("Succeeded", "Completed", "all 1 samples completed")


def test_status_has_progress_counts_conditions_and_keeps_transition_times() -> None:
    t = Tally()
    t.add(result(0, 0))
    running = Verdict("Running", "Running", "3 samples in flight")
    wire = request_status(
        None,
        verdict=running,
        tally=t,
        total=8,
        in_flight=3,
        generation=1,
        now=T0,
        results=ResultsRef(config_maps=["x-0000"], samples=1),
        digest="d",
        start_time=T0,
    )
    assert wire["phase"] == "Running" and wire["progress"] == "1/8"
    assert wire["counts"] == {"total": 8, "completed": 1, "aborted": 0, "failed": 0, "inFlight": 3}
    assert {c["type"]: c["status"] for c in wire["conditions"]} == {"Running": "True", "Paused": "False"}
    assert "completionTime" not in wire
    prev = RolloutRequestStatus.model_validate(wire)
    later = T0 + timedelta(seconds=5)
    record = AbortRecord(token="t1", time=later, stopped=3)
    done = request_status(
        prev,
        verdict=Verdict("Aborted", "AbortRequested", "aborted"),
        tally=t,
        total=8,
        in_flight=0,
        generation=1,
        now=later,
        results=ResultsRef(),
        abort=record,
    )
    conds = {c["type"]: c for c in done["conditions"]}
    assert conds["Aborted"]["status"] == "True" and conds["Running"]["status"] == "False"
    assert conds["Paused"]["lastTransitionTime"] == wire["conditions"][1]["lastTransitionTime"]  # unchanged
    assert done["completionTime"] and done["startTime"] == wire["startTime"] and done["promptsDigest"] == "d"
    assert done["abort"]["token"] == "t1" and done["abort"]["stopped"] == 3


def test_layout_fills_chunks_up_to_the_limit_then_seals_them() -> None:
    layout = Layout(limit=100)
    for i in range(7):
        layout.append("x" * 29 + str(i))  # 31 bytes with the newline: 3 lines per chunk
    assert [len(c.lines) for c in layout.chunks] == [3, 3, 1]
    assert [c.sealed for c in layout.chunks] == [True, True, False]
    assert all(c.size <= 100 for c in layout.chunks)
    assert [c.index for c in layout.dirty()] == [0, 1, 2]
    for c in layout.chunks:
        c.written, c.sealed_written = len(c.lines), c.sealed
    assert layout.dirty() == []
    layout.append("y")
    assert [c.index for c in layout.dirty()] == [2]
    big = Layout(limit=10)
    big.append("z" * 50)  # a line over the limit still gets stored, alone in its chunk
    big.append("w")
    assert [len(c.lines) for c in big.chunks] == [1, 1]


def test_stored_chunks_parse_back_and_names_carry_the_uid() -> None:
    cm = {
        "metadata": {"labels": {"rollfleet.dev/chunk": "2"}, "resourceVersion": "7"},
        "data": {"samples.jsonl": "a\nb\n"},
        "immutable": True,
    }
    c = parse_chunk(cm)
    assert (c.index, c.lines, c.sealed, c.dirty, c.resource_version) == (2, ["a", "b"], True, False, "7")
    layout = Layout(100, [c, Chunk(index=0, lines=["z"], written=1)])
    assert [x.index for x in layout.chunks] == [0, 2] and list(layout.lines()) == ["z", "a", "b"]
    assert results_chunk_name("rr1", "0b8f7a52-3f0e", 3) == "rr1-0b8f7a52-0003"


def test_lines_added_while_a_chunk_is_written_are_written_by_the_next_flush() -> None:
    # The runner flushes in the background and records results meanwhile: a write marks as written only
    # the lines it carried.
    release = asyncio.Event()
    bodies: list[str] = []

    class SlowApiServer:  # the two calls ResultStore makes, answering once released
        async def create(self, body: dict[str, Any]) -> dict[str, Any]:
            await release.wait()
            bodies.append(body["data"]["samples.jsonl"])
            return {"metadata": {"resourceVersion": str(len(bodies))}}

        replace = create

    async def scenario() -> None:
        store = ResultStore(SlowApiServer(), "ns", "rr", "0b8f7a52-3f0e")  # type: ignore[arg-type]
        store.add(SampleResult(0, 0, "rr-0-0", "stop", text="a"))
        flush = asyncio.create_task(store.flush())
        await asyncio.sleep(0)  # the write is on its way
        store.add(SampleResult(0, 1, "rr-0-1", "stop", text="b"))
        release.set()
        await flush
        assert store.pending == 1 and store.ref("cmd").samples == 1
        await store.flush()
        assert store.pending == 0 and store.ref("cmd").samples == 2

    asyncio.run(scenario())
    assert [len(b.splitlines()) for b in bodies] == [1, 2]
