"""Relay: a stager serves what it has received so far to the next engine, and breaks off when its own
staging does. The upstream is a weights server held halfway through a shard, so the relay's bytes are
seen to flow before the shard is whole. A stager with two upstreams takes half of every shard from each."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tests.unit.engine.test_staging import settled

from rollfleet_engine.protocol import STAGING_DIR_ENV, StageState, StageStatus, WeightManifest, WeightUpdateInfo
from rollfleet_engine.safetensors_stream import manifest_bytes, second_half, sha256_hex, shard_from_tensors
from rollfleet_engine.staging import RelayUnavailable, Stager
from rollfleet_engine.weights_client import fetch_weights, http_get
from rollfleet_engine.weights_server import WeightsServer


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
    shard, window, chunks = upstream.relay_shard("/shards/0")
    assert window == (0, len(held.data))
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
    _, _, chunks = upstream.relay_shard("/shards/0")
    assert next(chunks)
    held.cut = True
    held.release.set()
    with pytest.raises(RelayUnavailable, match="failed after"):
        for _ in chunks:
            pass
    assert settled(upstream).state is StageState.FAILED


def test_a_stager_that_stages_nothing_or_another_set_relays_nothing(held: HeldServer, tmp_path: Path) -> None:
    idle = Stager(tmp_path / "staging" / "idle", max_bytes=None, relay_begin_wait_s=0.2)
    with pytest.raises(RelayUnavailable, match="not staging"):
        idle.relay_manifest()  # at once: no set named to wait for
    with pytest.raises(RelayUnavailable, match="not staging"):
        idle.relay_shard("/shards/0", None, sha256_hex(held.manifest_raw))  # after its wait
    sha = sha256_hex(held.manifest_raw)
    busy = Stager(tmp_path / "staging" / "busy", max_bytes=None, relay_begin_wait_s=0.2)
    busy.start(WeightUpdateInfo(url=held.url, manifest_sha256=sha))
    with pytest.raises(RelayUnavailable, match=r"not 0+"):
        busy.relay_manifest("0" * 64)
    with pytest.raises(RelayUnavailable, match="no shard"):
        busy.relay_shard("/shards/9")
    with pytest.raises(ValueError, match="not within"):
        busy.relay_shard("/shards/0", f"bytes=0-{len(held.data)}")


def test_a_relay_asked_before_its_staging_begins_waits_for_it_then_serves_the_range_asked(
    held: HeldServer, tmp_path: Path
) -> None:
    """The sidecar's second relay tree may ask an engine's relay before that engine was asked to stage."""
    sha = sha256_hex(held.manifest_raw)
    upstream = Stager(tmp_path / "staging" / "up", max_bytes=None)
    asked: list[tuple[int, int] | bytes] = []

    def ask() -> None:
        _, window, chunks = upstream.relay_shard("/shards/0", "bytes=10-", sha)
        asked.extend([window, b"".join(chunks)])

    relay = threading.Thread(target=ask)
    relay.start()
    relay.join(0.3)
    assert relay.is_alive() and asked == []  # waiting for a staging to begin
    upstream.start(WeightUpdateInfo(url=held.url, manifest_sha256=sha))
    held.release.set()
    relay.join(10)
    assert asked == [(10, len(held.data)), held.data[10:]]


def test_a_status_asked_with_a_wait_answers_once_the_staging_has_ended(held: HeldServer, tmp_path: Path) -> None:
    sha = sha256_hex(held.manifest_raw)
    stager = Stager(tmp_path / "staging" / "waited", max_bytes=None)
    stager.start(WeightUpdateInfo(url=held.url, manifest_sha256=sha))
    assert stager.status(wait_s=0.2).state is StageState.STAGING  # held half-way: the wait runs out
    held.release.set()
    assert stager.status(wait_s=30).state is StageState.STAGED  # answered when staged, not before


def big_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Past two receive pieces (4 MiB and a bias): a shard with a second half."""
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(1024, 1024, generator=g), "b.bias": torch.randn(1024, generator=g)}


@contextlib.contextmanager
def serving(*seeds: int) -> Iterator[list[WeightsServer]]:
    """A weights server of `big_tensors(seed)` for each seed, started."""
    servers = [WeightsServer(big_tensors(seed)) for seed in seeds]
    for server in servers:
        server.start()
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def stage_halves(root: Path, first: WeightsServer, second: WeightsServer) -> tuple[Stager, StageStatus]:
    """A stager that staged the first half of every shard from `first`, the second from `second`; its status."""
    stager = Stager(root, max_bytes=None)
    stager.start(WeightUpdateInfo(**first.update_info(), second_url=second.update_info()["url"]))
    return stager, stager.status(30)


def relayed(stager: Stager, byte_range: str | None = None, manifest_sha256: str | None = None) -> bytes:
    """What the stager relays of shard 0, whole or the range asked for."""
    return b"".join(bytes(c) for c in stager.relay_shard("/shards/0", byte_range, manifest_sha256)[2])


def test_a_staging_from_two_upstreams_takes_each_half_from_one_and_relays_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar's two relay trees: the first half of every shard from `url`, the second from `second_url`."""
    monkeypatch.setenv(STAGING_DIR_ENV, str(tmp_path / "staging"))
    with serving(1, 1) as (first, second):
        stager, status = stage_halves(tmp_path / "staging", first, second)
        assert status.state is StageState.STAGED, status
        got = dict(fetch_weights(status.staged_url or "", first.update_info()["manifest_sha256"], 10))
        assert all(torch.equal(got[n], t) for n, t in big_tensors(1).items())
        size = first.manifest.shards[0].size
        middle = second_half(size)
        assert 0 < middle < size and (first.bytes_sent, second.bytes_sent) == (middle, size - middle)
        # Staged, it relays either half, as the engines below it in each tree ask.
        data = relayed(stager)
        assert relayed(stager, f"bytes={middle}-") == data[middle:]
        assert relayed(stager, f"bytes=0-{middle - 1}") == data[:middle]


def test_a_half_that_is_not_the_manifests_fails_the_staging(tmp_path: Path) -> None:
    with serving(1, 2) as (first, other):  # the same layout, other values
        _, status = stage_halves(tmp_path / "staging", first, other)
        assert status.state is StageState.FAILED and "checksum mismatch" in (status.error or ""), status


def test_a_relay_serves_only_the_set_asked_for_and_waits_for_its_staging_to_begin(tmp_path: Path) -> None:
    """An engine that still holds an earlier set staged (a push rolled back) must not pass it on as the new one."""
    with serving(1, 2) as (old, new):
        stager = Stager(tmp_path / "staging", max_bytes=None, relay_begin_wait_s=5)
        stager.start(WeightUpdateInfo(**old.update_info()))
        assert stager.status(30).state is StageState.STAGED
        wanted = new.update_info()["manifest_sha256"]
        asked: list[bytes] = []
        relay = threading.Thread(target=lambda: asked.append(relayed(stager, "bytes=0-99", wanted)))
        relay.start()
        relay.join(0.3)
        assert relay.is_alive() and asked == []  # the staged set is another: waiting for this one
        stager.start(WeightUpdateInfo(**new.update_info()))
        relay.join(10)
        with http_get(new.update_info()["url"], "/shards/0", 10, window=(0, 100)) as resp:
            assert asked == [resp.read()]
        quick = Stager(tmp_path / "other", max_bytes=None, relay_begin_wait_s=0.2)
        quick.start(WeightUpdateInfo(**old.update_info()))
        with pytest.raises(RelayUnavailable, match=f"not {wanted}"):
            quick.relay_shard("/shards/0", None, wanted)
