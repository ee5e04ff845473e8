"""Where the push record lives, written with optimistic concurrency.

- ``FleetStore``: annotations on the RolloutFleet (Kubernetes mode). Every write is a
  merge patch carrying the resourceVersion it was computed from, so the API server
  refuses it (409) if anyone changed the fleet meanwhile; ``update`` then re-reads and
  re-decides. Talks to kube-apiserver (the official client is synchronous: calls run in
  a thread).
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

from rollfleet.api.fleet import PLURAL
from rollfleet.contract import GROUP, VERSION
from rollfleet.errors import RollfleetError
from rollfleet.sync.protocol import FleetRecord, decode_record, encode_record

_MAX_CONFLICT_RETRIES = 20


class Conflict(RollfleetError, RuntimeError):
    """The record changed since it was read."""


class RecordStore(Protocol):
    async def read(self) -> tuple[dict[str, str], str]:
        """The fleet's annotations and the resourceVersion they were read at."""
        ...

    async def write(self, annotations: Mapping[str, str | None], resource_version: str) -> None:
        """Merge ``annotations`` (None deletes) if the resourceVersion still matches, else raise Conflict."""
        ...


async def read_record(store: RecordStore) -> tuple[FleetRecord, dict[str, str]]:
    annotations, _ = await store.read()
    return decode_record(annotations), annotations


async def update(store: RecordStore, change: Callable[[FleetRecord], FleetRecord]) -> FleetRecord:
    """Read, apply the pure ``change``, write; on a conflict start over from a fresh read."""
    for _ in range(_MAX_CONFLICT_RETRIES):
        annotations, rv = await store.read()
        record = change(decode_record(annotations))
        try:
            await store.write(encode_record(record), rv)
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

    async def write(self, annotations: Mapping[str, str | None], resource_version: str) -> None:
        async with self._lock:
            current, rv = self._load()
            if rv != resource_version:
                raise Conflict(f"{self.path}: resourceVersion {rv}, write computed from {resource_version}")
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
    def __init__(self, api: Any, namespace: str, fleet: str) -> None:
        self._api = api  # kubernetes.client.CustomObjectsApi
        self.namespace, self.fleet = namespace, fleet

    async def read(self) -> tuple[dict[str, str], str]:
        obj = await asyncio.to_thread(
            self._api.get_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, self.fleet
        )
        meta = obj.get("metadata") or {}
        return dict(meta.get("annotations") or {}), str(meta["resourceVersion"])

    async def write(self, annotations: Mapping[str, str | None], resource_version: str) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"metadata": {"resourceVersion": resource_version, "annotations": dict(annotations)}}
        try:
            await asyncio.to_thread(
                self._api.patch_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                self.fleet,
                body,
                _content_type="application/merge-patch+json",
            )
        except ApiException as err:
            if err.status == 409:
                raise Conflict(str(err.reason)) from err
            raise
