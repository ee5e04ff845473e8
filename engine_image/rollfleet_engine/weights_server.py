"""Trainer-side weights server: serves a state dict or a safetensors directory over HTTP.

Engines with the ``http`` weight backend pull from it. Routes: ``GET /manifest``
(shards, and per tensor name, dtype, shape, offsets and sha256) and ``GET /shards/<i>``
(a byte-exact safetensors file). Python API, reused by the sync sidecar::

    server = WeightsServer(model.state_dict(), host="10.0.0.5", port=0)
    url = server.start()
    engine_client.update_weights(server.update_info())   # {"url", "manifest_sha256"}
    server.stop()

A server serves one immutable snapshot: start a new one (or call ``replace``) for the
next version. Tensors given in memory are referenced, not copied; do not modify them
while engines pull.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rollfleet_engine.protocol import WEIGHTS_MANIFEST_PATH, WeightManifest, WeightUpdateInfo
from rollfleet_engine.safetensors_stream import (
    MemoryShard,
    manifest_bytes,
    sha256_hex,
    shard_from_file,
    shard_from_tensors,
)

_SEND_CHUNK = 16 << 20


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
        if isinstance(source, str | Path):
            files = _weight_files(Path(source))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {source}")
            # Taken before hashing: a write while hashing shows as a change at the next look.
            self.directory, self.stamp = Path(source), _stamp(files)
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


class WeightsServer:
    """A threaded HTTP server over one weights snapshot."""

    def __init__(self, source: Mapping[str, Any] | str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self._snapshot = _Snapshot(source)
        self._host, self._port = host, port
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
        return WeightUpdateInfo(url=self.url, manifest_sha256=self._snapshot.manifest_sha256).model_dump()

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

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per tensor pull would drown the trainer's log."""

    def do_GET(self) -> None:
        snap = self.snapshot()
        if self.path == WEIGHTS_MANIFEST_PATH:
            self._head(len(snap.manifest_raw), "application/json")
            self.wfile.write(snap.manifest_raw)
        elif self.path in snap.memory:
            mem = snap.memory[self.path]
            self._head(mem.shard.size, "application/octet-stream")
            self.wfile.write(mem.header)
            for buf in mem.buffers:
                for start in range(0, buf.nbytes, _SEND_CHUNK):
                    self.wfile.write(buf[start : start + _SEND_CHUNK])
        elif self.path in snap.files:
            file = snap.files[self.path]
            size = file.stat().st_size
            self._head(size, "application/octet-stream")
            with file.open("rb") as f:
                # Zero-copy from the page cache to the socket.
                self.connection.sendfile(f, 0, size)
        else:
            self.send_error(HTTPStatus.NOT_FOUND)

    def _head(self, length: int, content_type: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.end_headers()


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
