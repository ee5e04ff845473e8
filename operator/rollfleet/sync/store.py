"""Where the push record lives, written with optimistic concurrency.

- ``FleetStore``: annotations on the RolloutFleet (Kubernetes mode). Every write is a
  compare-and-swap on the record itself: a JSON patch whose first operation tests that
  the record annotation still holds what was read, so the API server refuses it if
  another writer changed the record; ``update`` then re-reads and re-decides. Guarding
  on the record, not on the fleet's resourceVersion, matters: the operator writes the
  fleet's status every second during a push, and a resourceVersion guard loses to each
  of those writes on a busy API server. The first record (none to test) is guarded by
  the resourceVersion. Talks to kube-apiserver (through ``rollfleet.kube``).
- ``FileStore``: the same annotations in a JSON file (static mode, tests, benchmarks),
  replaced atomically, with a counter standing in for the resourceVersion.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rollfleet.contract import ANNOTATION_SYNC_STATE
from rollfleet.kube import FLEET, ApiError, Conflict, Kube
from rollfleet.sync.protocol import FleetRecord, decode_record, encode_record

_MAX_CONFLICT_RETRIES = 20


Read = tuple[dict[str, str], str]  # the fleet's annotations, and the resourceVersion they were read at


class RecordStore(Protocol):
    async def read(self) -> Read:
        """The fleet's annotations and the resourceVersion they were read at."""
        ...

    async def write(self, annotations: Mapping[str, str | None], read: Read) -> None:
        """Merge ``annotations`` (None deletes) if the record is still as ``read``, else raise Conflict."""
        ...


async def read_record(store: RecordStore) -> tuple[FleetRecord, dict[str, str]]:
    annotations, _ = await store.read()
    return decode_record(annotations), annotations


async def update(store: RecordStore, change: Callable[[FleetRecord], FleetRecord]) -> FleetRecord:
    """Read, apply the pure ``change``, write; on a conflict start over from a fresh read."""
    for _ in range(_MAX_CONFLICT_RETRIES):
        read = await store.read()
        record = change(decode_record(read[0]))
        try:
            await store.write(encode_record(record), read)
        except Conflict:
            continue
        return record
    raise Conflict(f"record kept changing: gave up after {_MAX_CONFLICT_RETRIES} conflicting writes")


def _merge(annotations: Mapping[str, str], patch: Mapping[str, str | None]) -> dict[str, str]:
    merged = dict(annotations)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


class FileStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = asyncio.Lock()

    def _load(self) -> tuple[dict[str, str], str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}, "0"
        return dict(data.get("annotations", {})), str(data.get("resourceVersion", "0"))

    async def read(self) -> tuple[dict[str, str], str]:
        return self._load()

    async def write(self, annotations: Mapping[str, str | None], read: Read) -> None:
        async with self._lock:
            current, rv = self._load()
            if rv != read[1]:  # only record writes change this file: its version is the record's
                raise Conflict(f"{self.path}: resourceVersion {rv}, write computed from {read[1]}")
            data = {"resourceVersion": str(int(rv) + 1), "annotations": _merge(current, annotations)}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                # Durable before the rename: the record must survive a crash of the whole pod.
                os.fsync(f.fileno())
            tmp.replace(self.path)


class FleetStore:
    def __init__(self, kube: Kube, namespace: str, fleet: str) -> None:
        self._kube = kube
        self.namespace, self.fleet = namespace, fleet

    async def read(self) -> tuple[dict[str, str], str]:
        obj = await self._kube.get(FLEET, self.namespace, self.fleet)
        meta = obj.get("metadata") or {}
        return dict(meta.get("annotations") or {}), str(meta["resourceVersion"])

    async def write(self, annotations: Mapping[str, str | None], read: Read) -> None:
        ops = record_patch(read[0], annotations)
        if ops is None:  # the first record: guarded by the resourceVersion (a stale one: Conflict)
            body = {"metadata": {"resourceVersion": read[1], "annotations": dict(annotations)}}
            await self._kube.patch(FLEET, self.namespace, self.fleet, body)
            return
        try:
            await self._kube.json_patch(FLEET, self.namespace, self.fleet, ops)
        except ApiError as err:
            if err.status == 422:  # the test operation failed: the record moved
                raise Conflict(str(err)) from err
            raise


def _pointer(key: str) -> str:
    """An annotation's JSON pointer (RFC 6901 escapes: annotation keys hold '/')."""
    return "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")


def record_patch(before: Mapping[str, str], changes: Mapping[str, str | None]) -> list[dict[str, Any]] | None:
    """A JSON patch that applies ``changes`` only if the record annotation still holds what was read
    (``before``); None when there was no record to test (the first write)."""
    if ANNOTATION_SYNC_STATE not in before:
        return None
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": _pointer(ANNOTATION_SYNC_STATE), "value": before[ANNOTATION_SYNC_STATE]}
    ]
    for key, value in changes.items():
        if value is not None:
            ops.append({"op": "add", "path": _pointer(key), "value": value})  # add replaces an existing key
        elif key in before:
            ops.append({"op": "remove", "path": _pointer(key)})
    return ops
