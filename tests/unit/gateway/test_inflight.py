"""The in-flight table: ids are not reused while in flight; finished ids are remembered, bounded."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.gateway.inflight import IdInUse, InFlightTable, StopReason, segments_report


def test_ids_in_flight_are_refused_and_finished_ones_remembered_within_bounds() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        table = InFlightTable(keep_finished=2)
        entry = table.open("a", loop)
        with pytest.raises(IdInUse):
            table.open("a", loop)
        entry.choice(0).token_ids += [1, 2]
        entry.choice(1).token_ids += [3]
        entry.add_versions(["v1", "v1", "v2"])
        entry.request_stop(StopReason.ADMIN)
        entry.request_stop(StopReason.DEADLINE)  # the first reason wins
        assert entry.generated == 3 and entry.versions == ["v1", "v2"] and entry.stop is StopReason.ADMIN
        table.close(entry, "abort")
        assert entry.ended.done() and table.get("a") is None and len(table) == 0
        finished = table.finished("a")
        assert finished is not None and finished.finish_reason == "abort"
        for rid in ("b", "c"):
            table.close(table.open(rid, loop), "length")
        assert table.finished("a") is None and table.finished("c") is not None
        assert table.open("a", loop).request_id == "a"  # an id may be used again once it ended

    asyncio.run(scenario())


def test_segments_are_reported_only_when_known_end_to_end() -> None:
    def seg(version: str, start: int, end: int) -> dict[str, object]:
        return {"version": version, "start": start, "end": end}

    told = {0: seg("A", 0, 5), 5: seg("A", 5, 8), 8: seg("B", 8, 12)}
    assert segments_report(told, ["A", "B"], 12) == [seg("A", 0, 8), seg("B", 8, 12)]  # one version, one segment
    assert segments_report({}, ["A"], 7) == [seg("A", 0, 7)]  # one version made everything
    assert segments_report({}, ["A", "B"], 7) is None  # two versions, nobody said where the swap was
    assert segments_report({8: seg("B", 8, 12)}, ["A", "B"], 12) is None  # a failover's first attempt untold
    assert segments_report({0: seg("A", 0, 5)}, ["A"], 9) is None  # short of the answer's tokens
