"""Trainer-side weights server: serves a state dict or a safetensors directory over HTTP.

Engines with the ``http`` weight backend pull from it. Routes: ``GET /manifest``
(shards, and per tensor name, dtype, shape, offsets and checksum), ``GET /shards/<i>``
(a byte-exact safetensors file; with ``Range: bytes=B-E``, those bytes of it: a relay tree's half),
and, for a rank that needs only its part of each tensor (``tp_slices``), ``POST /slices`` with a
``SlicePlan``: the manifest of one shard of those parts, each checksummed from bytes first checked
against the pinned manifest, served at ``GET /slices/<id>``. Python API, reused by the sync sidecar::

    server = WeightsServer(model.state_dict(), host="10.0.0.5", port=0)
    url = server.start()
    engine_client.update_weights(server.update_info())   # {"url", "manifest_sha256"}
    server.stop()

A server serves one immutable snapshot: start a new one (or call ``replace``) for the
next version. Tensors given in memory are referenced, not copied; do not modify them
while engines pull.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollfleet_engine.protocol import (
    WEIGHTS_MANIFEST_PATH,
    WEIGHTS_SLICES_PATH,
    Shard,
    SlicePlan,
    TensorCut,
    TensorEntry,
    WeightManifest,
    WeightUpdateInfo,
)
from rollfleet_engine.safetensors_stream import (
    HEADER_LEN,
    MemoryShard,
    manifest_bytes,
    parse_byte_range,
    safetensors_header,
    sha256_hex,
    shard_from_file,
    shard_from_tensors,
    tensor_checksum,
)
from rollfleet_engine.tp_slices import ITEMSIZE, cut_bytes, cut_run, cut_shape

_SEND_CHUNK = 16 << 20
_MAX_PLAN_BYTES = 16 << 20  # a plan names every tensor once: far below this for any model
_KEPT_SLICE_SETS = 64  # per snapshot: a group's ranks each ask once per push
# A stamp taken when no file had been written for this long vouches for the bytes hashed after it: a
# later write moves a file's times past it, even where the filesystem's clock is coarse (a kernel tick).
_SETTLED_NS = 1_000_000_000


class PlanRefused(ValueError):
    """A slice plan this server cannot serve; the message says why."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


FileStamp = tuple[tuple[str, int, int, int, int], ...]


def _weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _stamp(files: list[Path]) -> FileStamp:
    """What changes when a file is written over or replaced (as make and rsync tell): name, size, inode, and
    the times of its last write and of its last change of metadata."""
    stats = [(f.name, f.stat()) for f in files]
    return tuple((name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for name, st in stats)


class _Snapshot:
    """One version of the weights, as shards ready to send."""

    def __init__(self, source: Mapping[str, Any] | str | Path) -> None:
        self.memory: dict[str, MemoryShard] = {}
        self.files: dict[str, Path] = {}
        self.directory: Path | None = None
        self.stamp: FileStamp = ()
        self.settled = False  # whether the stamp vouches for the files' bytes (`unchanged`)
        if isinstance(source, str | Path):
            files = _weight_files(Path(source))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {source}")
            # Taken before hashing: a write while hashing shows as a change at the next look.
            self.directory, self.stamp = Path(source), _stamp(files)
            settled = time.time_ns() - _SETTLED_NS
            self.settled = all(mtime < settled and ctime < settled for *_, mtime, ctime in self.stamp)
            shards = []
            for i, file in enumerate(files):
                path = f"/shards/{i}"
                self.files[path] = file
                shards.append(shard_from_file(file, path))
        else:
            mem = shard_from_tensors(source, "/shards/0")
            self.memory[mem.shard.path] = mem
            shards = [mem.shard]
        self.manifest = WeightManifest(shards=shards)
        self.manifest_raw = manifest_bytes(self.manifest)
        self.manifest_sha256 = sha256_hex(self.manifest_raw)
        # name -> (shard path, index in it, entry); the slice sets planned so far, by id: (their shard, the cuts)
        self.entries = {t.name: (sh.path, i, t) for sh in shards for i, t in enumerate(sh.tensors)}
        self.slice_sets: dict[str, tuple[Shard, list[tuple[TensorEntry, TensorCut]]]] = {}
        self._lock = threading.Lock()

    def tensor_bytes(self, name: str, run: tuple[int, int] | None = None) -> memoryview | bytes:
        """The bytes of tensor `name` (or of the `run` of them: first and last offset), as served now (a file
        is read again: it may have been written over)."""
        path, index, entry = self.entries[name]
        begin, end = entry.data_offsets
        first, last = run or (0, end - begin)
        if path in self.memory:
            return memoryview(self.memory[path].buffers[index])[first:last]
        with self.files[path].open("rb") as f:
            (n,) = HEADER_LEN.unpack(f.read(8))
            return os.pread(f.fileno(), last - first, 8 + n + begin + first)

    def cut_data(self, entry: TensorEntry, cut: TensorCut) -> memoryview | bytes:
        """The bytes of `cut` as served now: only those read where they are one run of the tensor's."""
        run = cut_run(entry, cut)
        return (
            self.tensor_bytes(entry.name, run)
            if run
            else cut_bytes(memoryview(self.tensor_bytes(entry.name)), entry, cut)
        )

    def unchanged(self) -> bool:
        """Whether the files still hold the bytes this snapshot hashed, as their stamp tells (settled files
        only: a write in the same clock tick as the stamp would not show). Tensors in memory are the
        trainer's: never vouched for."""
        return self.settled and _stamp(list(self.files.values())) == self.stamp

    def plan_slices(self, plan: SlicePlan) -> Shard:
        """The shard of `plan`'s cuts, each checksummed from bytes that first matched this snapshot's
        manifest (so a slice a rank verifies is a slice of the version it pinned). Raises PlanRefused."""
        if plan.manifest_sha256 != self.manifest_sha256:
            raise PlanRefused(HTTPStatus.CONFLICT, "the plan is for other weights than the ones served now")
        set_id = hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:32]
        with self._lock:
            if set_id in self.slice_sets:
                return self.slice_sets[set_id][0]
        cuts = []
        for cut in plan.cuts:
            if cut.name not in self.entries:
                raise PlanRefused(HTTPStatus.BAD_REQUEST, f"no tensor {cut.name!r} in the weights served")
            entry = self.entries[cut.name][2]
            try:
                cuts.append((entry, cut, cut_shape(entry, cut)))
            except ValueError as err:
                raise PlanRefused(HTTPStatus.BAD_REQUEST, str(err)) from None
        if len({cut.name for cut in plan.cuts}) != len(plan.cuts):
            raise PlanRefused(HTTPStatus.BAD_REQUEST, "the plan names a tensor more than once")

        # Files whose stamp held from before the manifest's hashing until after the cuts' are the bytes
        # hashed; any others are checked whole before they are cut (each rank's plan would hash the model).
        vouched = self.unchanged()

        def checksum(entry: TensorEntry, cut: TensorCut) -> str:
            if vouched:
                return tensor_checksum(self.cut_data(entry, cut))
            data = memoryview(self.tensor_bytes(entry.name))
            if tensor_checksum(data) != entry.xxh3_128:
                raise PlanRefused(HTTPStatus.CONFLICT, f"{entry.name} changed since it was hashed; push again")
            return tensor_checksum(cut_bytes(data, entry, cut))

        with ThreadPoolExecutor(max_workers=os.cpu_count(), thread_name_prefix="xxh3") as pool:
            sums = list(pool.map(lambda c: checksum(c[0], c[1]), cuts))
        if vouched and not self.unchanged():
            raise PlanRefused(HTTPStatus.CONFLICT, "the weights' files were written while being cut; push again")
        entries, offset = [], 0
        for (entry, _, shape), sum_ in zip(cuts, sums, strict=True):
            size = math.prod(shape) * ITEMSIZE[entry.dtype]
            entries.append(
                TensorEntry(
                    name=entry.name, dtype=entry.dtype, shape=shape, data_offsets=(offset, offset + size), xxh3_128=sum_
                )
            )
            offset += size
        size = len(safetensors_header(entries)) + offset
        shard = Shard(path=f"{WEIGHTS_SLICES_PATH}/{set_id}", size=size, tensors=entries)
        with self._lock:
            while len(self.slice_sets) >= _KEPT_SLICE_SETS:
                self.slice_sets.pop(next(iter(self.slice_sets)))
            self.slice_sets[set_id] = (shard, [(entry, cut) for entry, cut, _ in cuts])
        return shard

    def slice_stream(self, path: str) -> tuple[Shard, Iterator[memoryview | bytes]] | None:
        """The planned slice set at `path` and its bytes, header first; None if no plan made it."""
        with self._lock:
            planned = self.slice_sets.get(path.removeprefix(WEIGHTS_SLICES_PATH + "/"))
        if planned is None:
            return None
        shard, cuts = planned

        def chunks() -> Iterator[memoryview | bytes]:
            yield safetensors_header(shard.tensors)
            for entry, cut in cuts:
                yield self.cut_data(entry, cut)

        return shard, chunks()


class WeightsServer:
    """A threaded HTTP server over one weights snapshot."""

    def __init__(self, source: Mapping[str, Any] | str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self._snapshot = _Snapshot(source)
        self._host, self._port = host, port
        # Weights' bytes (shards and slice sets) sent since the start, all versions. Counted as each write
        # starts: a client that has the bytes then always sees them counted, never a moment before.
        self.bytes_sent = 0
        self._count_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def manifest(self) -> WeightManifest:
        return self._snapshot.manifest

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("weights server not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> str:
        """Bind and serve in a background thread; returns the base URL."""
        server = self

        class Handler(_Handler):
            def snapshot(self) -> _Snapshot:
                return server._snapshot

            def sent(self, n: int) -> None:
                with server._count_lock:
                    server.bytes_sent += n

        self._httpd = ThreadingHTTPServer((self._host, self._port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="rollfleet-weights", daemon=True)
        self._thread.start()
        return self.url

    def replace(self, source: Mapping[str, Any] | str | Path) -> None:
        """Serve a new snapshot from now on (requests already streaming finish on the old one)."""
        self._snapshot = _Snapshot(source)

    def serves(self, directory: Path) -> bool:
        """Whether this serves the weights in `directory` as they are now: its files, none written over,
        added or removed since they were hashed."""
        snapshot = self._snapshot
        try:
            return snapshot.directory == directory and snapshot.stamp == _stamp(_weight_files(directory))
        except OSError:  # a file went while we looked: not the same
            return False

    def update_info(self) -> dict[str, Any]:
        """The ``update_info`` body for vLLM's ``/update_weights`` with the ``http`` backend."""
        return WeightUpdateInfo(url=self.url, manifest_sha256=self._snapshot.manifest_sha256).for_load()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def snapshot(self) -> _Snapshot:
        raise NotImplementedError

    def sent(self, n: int) -> None:
        raise NotImplementedError

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per tensor pull would drown the trainer's log."""

    def do_GET(self) -> None:
        snap = self.snapshot()
        if self.path == WEIGHTS_MANIFEST_PATH:
            self._head(len(snap.manifest_raw), "application/json")
            self.wfile.write(snap.manifest_raw)
        elif self.path in snap.memory:
            mem = snap.memory[self.path]
            if (window := self._range(mem.shard.size)) is not None:
                self._write(byte_window([mem.header, *mem.buffers], *window))
        elif self.path in snap.files:
            file = snap.files[self.path]
            if (window := self._range(file.stat().st_size)) is not None:
                begin, end = window
                self.sent(end - begin)
                with file.open("rb") as f:
                    # Zero-copy from the page cache to the socket.
                    self.connection.sendfile(f, begin, end - begin)
        elif (planned := snap.slice_stream(self.path)) is not None:
            shard, chunks = planned
            self._head(shard.size, "application/octet-stream")
            self._write(chunks)
        else:
            self.send_error(HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        if self.path != WEIGHTS_SLICES_PATH:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        try:
            length = int(self.headers.get("Content-Length") or -1)
            if not 0 <= length <= _MAX_PLAN_BYTES:
                raise PlanRefused(HTTPStatus.BAD_REQUEST, f"a slice plan needs a Content-Length of 0-{_MAX_PLAN_BYTES}")
            plan = SlicePlan.model_validate_json(self.rfile.read(length))
            shard = self.snapshot().plan_slices(plan)
        except ValidationError as err:
            self._refuse(HTTPStatus.BAD_REQUEST, f"not a slice plan: {err.errors(include_url=False)[:3]}")
        except ValueError as err:  # PlanRefused, or a Content-Length that is no number
            self._refuse(getattr(err, "status", HTTPStatus.BAD_REQUEST), str(err))
        else:
            body = WeightManifest(shards=[shard]).model_dump_json().encode()
            self._head(len(body), "application/json")
            self.wfile.write(body)

    def _write(self, chunks: Iterable[memoryview | bytes]) -> None:
        for chunk in chunks:
            view = memoryview(chunk)
            self.sent(view.nbytes)
            for start in range(0, view.nbytes, _SEND_CHUNK):
                self.wfile.write(view[start : start + _SEND_CHUNK])

    def _refuse(self, status: HTTPStatus, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _head(self, length: int, content_type: str, window: tuple[int, int, int] | None = None) -> None:
        """The head of a 200, or with `window` (begin, end, size) of a 206 answering a Range."""
        self.send_response(HTTPStatus.OK if window is None else HTTPStatus.PARTIAL_CONTENT)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        if window is not None:
            self.send_header("Content-Range", content_range(*window))
        self.end_headers()

    def _range(self, size: int) -> tuple[int, int] | None:
        """Sends the head of a shard of `size` bytes, whole or the range asked for (a relay tree's half); the bytes
        to send, or None once a bad range was refused (416)."""
        try:
            window = parse_byte_range(self.headers.get("Range"), size)
        except ValueError as err:
            self._refuse(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, str(err))
            return None
        if window is None:
            self._head(size, "application/octet-stream")
            return 0, size
        self._head(window[1] - window[0], "application/octet-stream", (*window, size))
        return window


def content_range(begin: int, end: int, size: int) -> str:
    """The Content-Range of an answer with bytes ``[begin, end)`` of `size`."""
    return f"bytes {begin}-{end - 1}/{size}"


def byte_window(chunks: Iterable[memoryview | bytes], begin: int, end: int) -> Iterator[memoryview]:
    """Bytes ``[begin, end)`` of the concatenation of `chunks`, as views (no copy)."""
    position = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        lo, hi = max(begin - position, 0), min(end - position, view.nbytes)
        if lo < hi:
            yield view[lo:hi]
        position += view.nbytes
        if position >= end:
            return


def serve_forever(source: str, host: str, port: int) -> None:
    """Serve a safetensors directory until interrupted (``python -m rollfleet_engine.weights_server DIR``)."""
    server = WeightsServer(source, host, port)
    print(server.start(), flush=True)
    print(server.update_info(), flush=True)
    try:
        threading.Event().wait()
    finally:
        server.stop()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rollfleet_engine.weights_server")
    parser.add_argument("dir")
    parser.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=0)
    a = parser.parse_args()
    serve_forever(a.dir, a.host, a.port)
