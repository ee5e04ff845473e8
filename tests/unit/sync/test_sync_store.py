"""The file record store: optimistic concurrency and the read-decide-write loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollfleet.contract import ANNOTATION_SYNC_STATE, ANNOTATION_WEIGHT_VERSION
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
                store.path.write_text('{"resourceVersion": "7", "annotations": {"other": "y"}}')
            return adopt_initial(record, ["A"])

        record = await update(store, change)
        annotations, _ = await store.read()
        assert len(calls) == 2
        assert record.committed is not None and annotations[ANNOTATION_WEIGHT_VERSION] == "A"
        assert annotations["other"] == "y"
        assert decode_record(annotations) == record

    asyncio.run(go())


def test_the_fleet_record_is_swapped_only_if_the_record_is_as_read() -> None:
    # Not on the fleet's resourceVersion, which every status write of the operator moves.
    before = {ANNOTATION_SYNC_STATE: '{"push":null}', ANNOTATION_WEIGHT_VERSION: "A", "other": "kept"}
    ops = record_patch(before, {ANNOTATION_SYNC_STATE: '{"push":1}', ANNOTATION_WEIGHT_VERSION: None, "new": "x"})
    state = "/metadata/annotations/" + ANNOTATION_SYNC_STATE.replace("/", "~1")
    assert ops == [
        {"op": "test", "path": state, "value": '{"push":null}'},
        {"op": "add", "path": state, "value": '{"push":1}'},
        {"op": "remove", "path": "/metadata/annotations/" + ANNOTATION_WEIGHT_VERSION.replace("/", "~1")},
        {"op": "add", "path": "/metadata/annotations/new", "value": "x"},
    ]
    # No record yet: nothing to test, the write falls back to the resourceVersion guard.
    assert record_patch({"other": "kept"}, {ANNOTATION_SYNC_STATE: "{}"}) is None
