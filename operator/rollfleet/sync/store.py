"""Where the push record lives, written with optimistic concurrency.

- ``ConfigMapStore``: the data of the fleet's ConfigMap ``<fleet>-weights`` (Kubernetes
  mode). The operator creates it, owned by the fleet; the trainers' Role may patch that
  one object, so a trainer can record pushes without being able to change the fleet's
  spec (which runs in the engines). Every write is a compare-and-swap on the record
  itself: a JSON patch whose first operation tests that the record key still holds what
  was read, so the API server refuses it if another writer changed the record; ``update``
  then re-reads and re-decides. The first record (none to test) is guarded by the
  resourceVersion. Talks to kube-apiserver (through ``rollfleet.kube``): that ConfigMap,
  and a read of the fleet for its ``rollfleet.dev/max-staleness`` annotation.
- ``FileStore``: the same data in a JSON file (static mode, tests, benchmarks), replaced
  atomically, with a counter standing in for the resourceVersion.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rollfleet.contract import RECORD_SYNC_STATE, trainer_name, weights_record_name
from rollfleet.errors import RollfleetError
from rollfleet.kube import CONFIG_MAP, FLEET, ApiError, Conflict, Kube, NotFound
from rollfleet.sync.protocol import FleetRecord, decode_record, encode_record

_MAX_CONFLICT_RETRIES = 20


Read = tuple[dict[str, str], str]  # the record's data, and the resourceVersion it was read at


class RecordUnavailable(RollfleetError, RuntimeError):
    """The record's object is missing or may not be read or written: what to fix is in the message."""


class RecordStore(Protocol):
    async def read(self) -> Read:
        """The record's data and the resourceVersion it was read at."""
        ...

    async def write(self, data: Mapping[str, str | None], read: Read) -> None:
        """Merge ``data`` (None deletes) if the record is still as ``read``, else raise Conflict."""
        ...

    async def fleet_annotations(self) -> Mapping[str, str]:
        """The fleet's annotations (settings people put there: the staleness bound)."""
        ...


async def read_record(store: RecordStore) -> FleetRecord:
    data, _ = await store.read()
    return decode_record(data)


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


def _merge(data: Mapping[str, str], patch: Mapping[str, str | None]) -> dict[str, str]:
    merged = dict(data)
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
        return dict(data.get("data", {})), str(data.get("resourceVersion", "0"))

    async def read(self) -> tuple[dict[str, str], str]:
        return self._load()

    async def fleet_annotations(self) -> Mapping[str, str]:
        return {}  # no fleet object: the sidecar's --max-staleness is the bound

    async def write(self, data: Mapping[str, str | None], read: Read) -> None:
        async with self._lock:
            current, rv = self._load()
            if rv != read[1]:  # only record writes change this file: its version is the record's
                raise Conflict(f"{self.path}: resourceVersion {rv}, write computed from {read[1]}")
            stored = {"resourceVersion": str(int(rv) + 1), "data": _merge(current, data)}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w") as f:
                json.dump(stored, f, indent=1, sort_keys=True)
                f.flush()
                # Durable before the rename: the record must survive a crash of the whole pod.
                os.fsync(f.fileno())
            tmp.replace(self.path)


class ConfigMapStore:
    def __init__(self, kube: Kube, namespace: str, fleet: str) -> None:
        self._kube = kube
        self.namespace, self.fleet = namespace, fleet
        self.name = weights_record_name(fleet)

    async def read(self) -> tuple[dict[str, str], str]:
        try:
            obj = await self._kube.get(CONFIG_MAP, self.namespace, self.name)
        except ApiError as err:
            raise self._unavailable("read", err) from err
        return dict(obj.get("data") or {}), str(obj["metadata"]["resourceVersion"])

    async def fleet_annotations(self) -> Mapping[str, str]:
        try:
            obj = await self._kube.get(FLEET, self.namespace, self.fleet)
        except ApiError as err:
            raise self._unavailable("read", err, what=f"RolloutFleet {self.namespace}/{self.fleet}") from err
        return dict((obj.get("metadata") or {}).get("annotations") or {})

    async def write(self, data: Mapping[str, str | None], read: Read) -> None:
        ops = record_patch(read[0], data)
        try:
            if ops is None:  # the first record: guarded by the resourceVersion (a stale one: Conflict)
                body = {"metadata": {"resourceVersion": read[1]}, "data": dict(data)}
                await self._kube.patch(CONFIG_MAP, self.namespace, self.name, body)
            else:
                await self._kube.json_patch(CONFIG_MAP, self.namespace, self.name, ops)
        except Conflict:  # a stale resourceVersion, or the patch's test failed: the record moved
            raise
        except ApiError as err:
            raise self._unavailable("write", err) from err

    def _unavailable(self, verb: str, err: ApiError, what: str | None = None) -> RecordUnavailable:
        what = what or f"ConfigMap {self.namespace}/{self.name} (the fleet's weight-sync record)"
        if isinstance(err, NotFound):
            hint = (
                f"the operator creates it for RolloutFleet {self.fleet}: check that the fleet exists in "
                f"namespace {self.namespace} and the operator runs"
            )
        elif err.status in (401, 403):
            hint = f"run the trainer pod as ServiceAccount {trainer_name(self.fleet)}, which the operator grants this"
        else:
            hint = "the API server refused it; the sidecar retries"
        return RecordUnavailable(f"cannot {verb} {what}: {err.status} {err.reason}; {hint}")


def _pointer(key: str) -> str:
    """A data key's JSON pointer (RFC 6901 escapes, for keys that hold them)."""
    return "/data/" + key.replace("~", "~0").replace("/", "~1")


def record_patch(before: Mapping[str, str], changes: Mapping[str, str | None]) -> list[dict[str, Any]] | None:
    """A JSON patch that applies ``changes`` only if the record key still holds what was read
    (``before``); None when there was no record to test (the first write)."""
    if RECORD_SYNC_STATE not in before:
        return None
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": _pointer(RECORD_SYNC_STATE), "value": before[RECORD_SYNC_STATE]}
    ]
    for key, value in changes.items():
        if value is not None:
            ops.append({"op": "add", "path": _pointer(key), "value": value})  # add replaces an existing key
        elif key in before:
            ops.append({"op": "remove", "path": _pointer(key)})
    return ops
