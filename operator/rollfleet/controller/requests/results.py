"""The results store of a RolloutRequest: finished samples as JSONL in ConfigMaps it owns.

Why ConfigMaps: they live in the API server's etcd (they survive operator, gateway
and pod restarts with no volume to provision), are garbage-collected with their
owner (deleting the request, or its TTL, deletes its results), are guarded by the
request's namespace RBAC, and need nothing beyond the cluster itself (kind included).
A ConfigMap holds at most 1 MiB, so results are chunked: the operator appends lines
to the open chunk and rewrites it at most once per flush; a full chunk is sealed
(`immutable: true`) and a new one opened. Chunks are named
`<request>-<uid[:8]>-<index>` (`contract.results_chunk_name`) and labelled with the
request's name, uid and chunk index. The runner reads its chunks back by name, one after
the other, as its Role grants them by name (no list: it reads no other ConfigMap).

`Layout` is the pure part (which lines go in which chunk, which chunks need a write);
`ResultStore` does the I/O (ConfigMaps, through `rollfleet.kube`); `print_results` is
`rollfleet results` (for results on a PersistentVolumeClaim: `results_volume`, `reader`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from rollfleet import jsonl
from rollfleet.api.request import CONFIG_MAP_RESULTS_LIMIT, KIND, PLURAL, ResultsRef, RolloutRequest
from rollfleet.contract import (
    API_VERSION,
    APP_NAME,
    COMPONENT_RESULTS,
    GROUP,
    LABEL_CHUNK,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_REQUEST,
    LABEL_REQUEST_UID,
    MANAGER,
    MAX_RESULT_CHUNKS,
    results_chunk_name,
)
from rollfleet.controller.requests.plan import SampleResult
from rollfleet.controller.requests.reader import ReaderError, read_volume_results
from rollfleet.kube import CONFIG_MAP, REQUEST, Kube, NotFound, context_namespace, load_client

DATA_KEY = "samples.jsonl"
# Bytes of JSONL per chunk: ConfigMaps hold 1 MiB with their metadata; leave room for it.
CHUNK_LIMIT = 900 * 1024


@dataclass
class Chunk:
    index: int
    lines: list[str] = field(default_factory=list)
    size: int = 0
    sealed: bool = False
    written: int = -1  # lines the API server holds; -1: the ConfigMap does not exist yet
    sealed_written: bool = False
    resource_version: str | None = None

    @property
    def dirty(self) -> bool:
        return self.written != len(self.lines) or self.sealed != self.sealed_written

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)


class Layout:
    """Which chunk each line goes in. Pure: the store writes what `dirty()` names."""

    def __init__(self, limit: int = CHUNK_LIMIT, chunks: Iterable[Chunk] = ()) -> None:
        self.limit = limit
        self.chunks = sorted(chunks, key=lambda c: c.index)

    def append(self, line: str) -> None:
        size = len(line.encode()) + 1
        current = self.chunks[-1] if self.chunks else None
        if current is not None and not current.sealed and current.lines and current.size + size > self.limit:
            current.sealed = True
        if current is None or current.sealed:
            current = Chunk(index=current.index + 1 if current else 0)
            self.chunks.append(current)
        current.lines.append(line)
        current.size += size

    def dirty(self) -> list[Chunk]:
        return [c for c in self.chunks if c.dirty]

    def lines(self) -> Iterator[str]:
        for c in self.chunks:
            yield from c.lines


def parse_chunk(cm: dict[str, Any]) -> Chunk:
    """A stored chunk (a ConfigMap as JSON) back as a Chunk that needs no write."""
    meta = cm["metadata"]
    text = (cm.get("data") or {}).get(DATA_KEY, "")
    lines = jsonl.lines(text)
    sealed = bool(cm.get("immutable"))
    return Chunk(
        index=int(meta["labels"][LABEL_CHUNK]),
        lines=lines,
        size=len(text.encode()),
        sealed=sealed,
        written=len(lines),
        sealed_written=sealed,
        resource_version=meta.get("resourceVersion"),
    )


class ResultStore:
    """The results of one RolloutRequest, loaded from and written to its ConfigMaps."""

    limit: int | None = CONFIG_MAP_RESULTS_LIMIT  # etcd is no place for more

    def __init__(self, kube: Kube, namespace: str, name: str, uid: str, limit: int = CHUNK_LIMIT) -> None:
        self.kube, self.namespace, self.name, self.uid = kube, namespace, name, uid
        self.layout = Layout(limit)
        self.results: dict[tuple[int, int], SampleResult] = {}

    async def load(self) -> list[SampleResult]:
        """Read every stored chunk; returns the stored results (one per sample)."""
        items = await self._stored_chunks()
        self.layout = Layout(self.layout.limit, (parse_chunk(cm) for cm in items))
        self.results = {}
        for line in self.layout.lines():
            r = SampleResult.from_line(line)
            self.results[r.key] = r
        return list(self.results.values())

    async def _stored_chunks(self) -> list[dict[str, Any]]:
        """The chunks written so far, in order: chunk k+1 is made only after chunk k, so the first missing
        one ends them."""
        items = []
        for index in range(MAX_RESULT_CHUNKS):
            try:
                items.append(await self.kube.get(CONFIG_MAP, self.namespace, self.chunk(index)))
            except NotFound:
                break
        return items

    def chunk(self, index: int) -> str:
        return results_chunk_name(self.name, self.uid, index)

    def add(self, result: SampleResult) -> bool:
        """Buffer a result; False (and nothing stored) when the sample already has one."""
        if result.key in self.results:
            return False
        self.results[result.key] = result
        self.layout.append(result.line())
        return True

    @property
    def pending(self) -> int:
        return sum(len(c.lines) - max(c.written, 0) for c in self.layout.chunks)

    async def flush(self) -> None:
        """Write every chunk with unwritten lines (and seal full ones)."""
        for chunk in self.layout.dirty():
            await self._write(chunk)

    @property
    def bytes(self) -> int:
        return sum(c.size for c in self.layout.chunks)

    def names(self) -> list[str]:
        return [self.chunk(c.index) for c in self.layout.chunks if c.written >= 0]

    def ref(self, command: str) -> ResultsRef:
        written = [c for c in self.layout.chunks if c.written >= 0]
        return ResultsRef(
            config_maps=self.names(),
            samples=len(self.results) - self.pending,
            bytes=sum(len("".join(line + "\n" for line in c.lines[: c.written]).encode()) for c in written),
            command=command,
        )

    def close(self) -> None:
        """Nothing held between writes."""

    def _body(self, chunk: Chunk) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": self.chunk(chunk.index),
            "namespace": self.namespace,
            "labels": {
                LABEL_NAME: APP_NAME,
                LABEL_COMPONENT: COMPONENT_RESULTS,
                LABEL_MANAGED_BY: MANAGER,
                LABEL_REQUEST: self.name,
                LABEL_REQUEST_UID: self.uid,
                LABEL_CHUNK: str(chunk.index),
            },
            "ownerReferences": [
                {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid, "controller": True}
            ],
        }
        if chunk.resource_version is not None:
            meta["resourceVersion"] = chunk.resource_version
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {DATA_KEY: chunk.text()},
        }
        if chunk.sealed:
            body["immutable"] = True
        return body

    async def _write(self, chunk: Chunk) -> None:
        # What this write holds: lines added while it is on its way wait for the next one.
        lines, sealed, body = len(chunk.lines), chunk.sealed, self._body(chunk)
        if chunk.written < 0:
            out = await self.kube.create(body)
        else:
            # resourceVersion makes this conditional: a second writer (an operator that should have
            # stopped) gets 409 instead of silently dropping lines; the runner then reloads.
            out = await self.kube.replace(body)
        chunk.written = lines
        chunk.sealed_written = sealed
        chunk.resource_version = out["metadata"]["resourceVersion"]


async def list_chunks(kube: Kube, namespace: str, uid: str) -> list[dict[str, Any]]:
    """The stored chunks of the request with this uid, in order, as JSON."""
    items = await kube.list(CONFIG_MAP, namespace, f"{LABEL_REQUEST_UID}={uid}")
    return sorted(items, key=lambda cm: int(cm["metadata"]["labels"][LABEL_CHUNK]))


async def read_lines(kube: Kube, namespace: str, uid: str) -> list[str]:
    """Every stored result line, ordered by prompt and sample."""
    lines = [line for cm in await list_chunks(kube, namespace, uid) for line in parse_chunk(cm).lines]
    return sorted(lines, key=lambda line: SampleResult.from_line(line).key)


def print_results(target: str, namespace: str | None, kubeconfig: str | None, image: str, out: TextIO) -> int:
    """`rollfleet results rr/NAME`: every stored sample of the request as JSONL on `out`, from its
    ConfigMaps or (through a reader pod running `image`) from its PersistentVolumeClaim."""
    kind, _, name = target.rpartition("/")
    if kind not in ("", "rr", "rolloutrequest", "rolloutrequests", f"{PLURAL}.{GROUP}"):
        print(f"rollfleet results: want rr/NAME, not {target!r}", file=sys.stderr)
        return 2
    if namespace is None:
        namespace = context_namespace(kubeconfig)
    namespace = namespace or "default"
    kube = Kube(load_client(kubeconfig))
    try:
        rr = asyncio.run(kube.get(REQUEST, namespace, name))
        if RolloutRequest.model_validate(rr).spec.results.persistent_volume_claim is not None:
            asyncio.run(read_volume_results(kube, rr, image, out))
            return 0
        lines = asyncio.run(read_lines(kube, namespace, rr["metadata"]["uid"]))
    except NotFound:
        print(f"rollfleet results: RolloutRequest {namespace}/{name} not found", file=sys.stderr)
        return 1
    except ReaderError as err:
        print(f"rollfleet results: {err}", file=sys.stderr)
        return 1
    finally:
        kube.close()
    for line in lines:
        out.write(jsonl.safe_line(line) + "\n")  # lines stored by an older operator may hold raw breaks
    return 0
