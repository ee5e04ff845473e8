"""Relay: a stager serves what it has received so far to the next engine, and breaks off when its own
staging does. The upstream is a weights server held halfway through a shard, so the relay's bytes are
seen to flow before the shard is whole."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tests.unit.engine.test_staging import settled

from rollfleet_engine.protocol import STAGING_DIR_ENV, StageState, WeightManifest, WeightUpdateInfo
from rollfleet_engine.safetensors_stream import manifest_bytes, sha256_hex, shard_from_tensors
from rollfleet_engine.staging import RelayUnavailable, Stager
from rollfleet_engine.weights_client import fetch_weights


@dataclass
class HeldServer:
    """Serves one shard: its first half at once, the rest when `release` is set (or cuts it if `cut` is)."""

    manifest_raw: bytes
    data: bytes
    release: threading.Event = field(default_factory=threading.Event)
    cut: bool = False
    url: str = ""

    def serve(self) -> ThreadingHTTPServer:
        held = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                body = held.manifest_raw if self.path == "/manifest" else held.data
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body is held.manifest_raw:
                    self.wfile.write(body)
                    return
                half = len(body) // 2
                self.wfile.write(body[:half])
                self.wfile.flush()
                held.release.wait(30)
                if not held.cut:
                    self.wfile.write(body[half:])

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        return server


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a.weight": torch.randn(256, 256, generator=g), "b.bias": torch.randn(1024, generator=g)}


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldServer]:
    monkeypatch.setenv(STAGING_DIR_ENV, str(tmp_path / "staging"))
    mem = shard_from_tensors(tensors(), "/shards/0")
    server = HeldServer(manifest_bytes(WeightManifest(shards=[mem.shard])), mem.header + b"".join(mem.buffers))
    http = server.serve()
    yield server
    server.release.set()
    http.shutdown()


def test_a_relay_passes_bytes_on_before_the_shard_is_whole_then_all_of_it(held: HeldServer, tmp_path: Path) -> None:
    sha = sha256_hex(held.manifest_raw)
    upstream = Stager(tmp_path / "staging" / "up", max_bytes=None)
    upstream.start(WeightUpdateInfo(url=held.url, manifest_sha256=sha))
    assert upstream.relay_manifest(sha) == held.manifest_raw
    shard, chunks = upstream.relay_shard("/shards/0")
    first = bytes(next(chunks))  # the held server has sent half: the relay already has bytes to give
    assert 0 < len(first) <= len(held.data) // 2 and held.data.startswith(first)
    assert upstream.status().state is StageState.STAGING
    held.release.set()
    relayed = first + b"".join(chunks)
    assert relayed == held.data and shard.size == len(held.data)
    status = settled(upstream)
    assert status.state is StageState.STAGED
    got = dict(fetch_weights(status.staged_url or "", sha, 10))
    assert all(torch.equal(got[n], t) for n, t in tensors().items())


def test_a_relay_breaks_off_when_its_own_staging_fails(held: HeldServer, tmp_path: Path) -> None:
    sha = sha256_hex(held.manifest_raw)
    upstream = Stager(tmp_path / "staging" / "up", max_bytes=None)
    upstream.start(WeightUpdateInfo(url=held.url, manifest_sha256=sha))
    upstream.relay_manifest(sha)
    _, chunks = upstream.relay_shard("/shards/0")
    assert next(chunks)
    held.cut = True
    held.release.set()
    with pytest.raises(RelayUnavailable, match="failed after"):
        for _ in chunks:
            pass
    assert settled(upstream).state is StageState.FAILED


def test_a_stager_that_stages_nothing_or_another_set_relays_nothing(held: HeldServer, tmp_path: Path) -> None:
    idle = Stager(tmp_path / "staging" / "idle", max_bytes=None)
    with pytest.raises(RelayUnavailable, match="not staging"):
        idle.relay_manifest()
    with pytest.raises(RelayUnavailable, match="not staging"):
        idle.relay_shard("/shards/0")
    sha = sha256_hex(held.manifest_raw)
    busy = Stager(tmp_path / "staging" / "busy", max_bytes=None)
    busy.start(WeightUpdateInfo(url=held.url, manifest_sha256=sha))
    with pytest.raises(RelayUnavailable, match=r"not 0+"):
        busy.relay_manifest("0" * 64)
    with pytest.raises(RelayUnavailable, match="no shard"):
        busy.relay_shard("/shards/9")


def test_a_status_asked_with_a_wait_answers_once_the_staging_has_ended(held: HeldServer, tmp_path: Path) -> None:
    sha = sha256_hex(held.manifest_raw)
    stager = Stager(tmp_path / "staging" / "waited", max_bytes=None)
    stager.start(WeightUpdateInfo(url=held.url, manifest_sha256=sha))
    assert stager.status(wait_s=0.2).state is StageState.STAGING  # held half-way: the wait runs out
    held.release.set()
    assert stager.status(wait_s=30).state is StageState.STAGED  # answered when staged, not before
