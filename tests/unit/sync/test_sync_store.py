"""The file record store: optimistic concurrency and the read-decide-write loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollfleet.contract import ANNOTATION_WEIGHT_VERSION
from rollfleet.sync.protocol import FleetRecord, adopt_initial, decode_record
from rollfleet.sync.store import Conflict, FileStore, update


def test_write_from_a_stale_read_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        store = FileStore(tmp_path / "record.json")
        _, rv = await store.read()
        await store.write({"k": "1"}, rv)
        with pytest.raises(Conflict):
            await store.write({"k": "2"}, rv)
        annotations, rv2 = await store.read()
        assert annotations == {"k": "1"} and rv2 != rv
        await store.write({"k": None, "j": "x"}, rv2)
        assert (await store.read())[0] == {"j": "x"}

    asyncio.run(go())


def test_update_re_decides_on_a_fresh_read_after_a_conflict(tmp_path: Path) -> None:
    async def go() -> None:
        store = FileStore(tmp_path / "record.json")
        calls: list[FleetRecord] = []

        def change(record: FleetRecord) -> FleetRecord:
            calls.append(record)
            if len(calls) == 1:  # someone else writes between our read and our write
                store.path.write_text('{"resourceVersion": "7", "annotations": {"other": "y"}}')
            return adopt_initial(record, ["A"])

        record = await update(store, change)
        annotations, _ = await store.read()
        assert len(calls) == 2
        assert record.committed is not None and annotations[ANNOTATION_WEIGHT_VERSION] == "A"
        assert annotations["other"] == "y"
        assert decode_record(annotations) == record

    asyncio.run(go())
