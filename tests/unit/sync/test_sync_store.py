"""The file record store: optimistic concurrency and the read-decide-write loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollfleet.contract import RECORD_SYNC_STATE, RECORD_WEIGHT_VERSION
from rollfleet.kube import Conflict
from rollfleet.sync.protocol import FleetRecord, adopt_initial, decode_record
from rollfleet.sync.store import FileStore, record_patch, update


def test_write_from_a_stale_read_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        store = FileStore(tmp_path / "record.json")
        first = await store.read()
        await store.write({"k": "1"}, first)
        with pytest.raises(Conflict):
            await store.write({"k": "2"}, first)
        second = await store.read()
        assert second[0] == {"k": "1"} and second[1] != first[1]
        await store.write({"k": None, "j": "x"}, second)
        assert (await store.read())[0] == {"j": "x"}

    asyncio.run(go())


def test_update_re_decides_on_a_fresh_read_after_a_conflict(tmp_path: Path) -> None:
    async def go() -> None:
        store = FileStore(tmp_path / "record.json")
        calls: list[FleetRecord] = []

        def change(record: FleetRecord) -> FleetRecord:
            calls.append(record)
            if len(calls) == 1:  # someone else writes between our read and our write
                store.path.write_text('{"resourceVersion": "7", "data": {"other": "y"}}')
            return adopt_initial(record, ["A"])

        record = await update(store, change)
        data, _ = await store.read()
        assert len(calls) == 2
        assert record.committed is not None and data[RECORD_WEIGHT_VERSION] == "A"
        assert data["other"] == "y"
        assert decode_record(data) == record

    asyncio.run(go())


def test_the_record_is_swapped_only_if_the_record_is_as_read() -> None:
    # Not on the ConfigMap's resourceVersion, which the operator's re-apply of its labels moves.
    before = {RECORD_SYNC_STATE: '{"push":null}', RECORD_WEIGHT_VERSION: "A", "other": "kept"}
    ops = record_patch(before, {RECORD_SYNC_STATE: '{"push":1}', RECORD_WEIGHT_VERSION: None, "new": "x"})
    state = "/data/" + RECORD_SYNC_STATE
    assert ops == [
        {"op": "test", "path": state, "value": '{"push":null}'},
        {"op": "add", "path": state, "value": '{"push":1}'},
        {"op": "remove", "path": "/data/" + RECORD_WEIGHT_VERSION},
        {"op": "add", "path": "/data/new", "value": "x"},
    ]
    # No record yet: nothing to test, the write falls back to the resourceVersion guard.
    assert record_patch({"other": "kept"}, {RECORD_SYNC_STATE: "{}"}) is None
