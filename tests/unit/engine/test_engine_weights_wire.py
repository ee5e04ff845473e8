"""Safetensors streaming, the weights server and the engine-side pull (no vLLM)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollfleet_engine.safetensors_stream import (
    TransferError,
    read_shard,
    receive_shard,
    shard_from_file,
    shard_from_tensors,
    tensors_from_buffer,
)
from rollfleet_engine.weights_client import fetch_weights, http_get
from rollfleet_engine.weights_server import WeightsServer


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 3, generator=g),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.scalar": torch.tensor(2.5),
        "d.ids": torch.arange(7, dtype=torch.int64),
    }


def _blob(tensors: dict[str, torch.Tensor]) -> tuple[bytes, object]:
    mem = shard_from_tensors(tensors, "/shards/0")
    return mem.header + b"".join(bytes(b) for b in mem.buffers), mem.shard


def test_memory_shard_is_valid_safetensors(tmp_path: Path) -> None:
    tensors = _tensors()
    blob, _ = _blob(tensors)
    (tmp_path / "x.safetensors").write_bytes(blob)
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_read_shard_roundtrip_and_file_manifest(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    shard = shard_from_file(tmp_path / "m.safetensors", "/shards/0")
    stream = io.BytesIO((tmp_path / "m.safetensors").read_bytes())
    got = dict(read_shard(stream.readinto, shard))
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor)


def test_corrupt_and_truncated_streams_fail() -> None:
    blob, shard = _blob(_tensors())
    corrupt = bytearray(blob)
    corrupt[-3] ^= 0xFF
    with pytest.raises(TransferError, match="checksum mismatch"):
        list(read_shard(io.BytesIO(bytes(corrupt)).readinto, shard))  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="truncated"):
        list(read_shard(io.BytesIO(blob[:-5]).readinto, shard))  # type: ignore[arg-type]


def test_receive_shard_lands_the_bytes_in_place_verified_and_reports_progress() -> None:
    blob, shard = _blob(_tensors())
    into, seen = bytearray(len(blob)), []
    receive_shard(io.BytesIO(blob).readinto, shard, memoryview(into), seen.append)  # type: ignore[arg-type]
    assert bytes(into) == blob and seen[-1] == len(blob) and seen == sorted(seen)
    got = dict(tensors_from_buffer(into, shard))  # type: ignore[arg-type]
    assert all(torch.equal(got[n], t) for n, t in _tensors().items())
    corrupt = bytearray(blob)
    corrupt[-3] ^= 0xFF
    with pytest.raises(TransferError, match="checksum mismatch"):
        receive_shard(io.BytesIO(bytes(corrupt)).readinto, shard, memoryview(into), seen.append)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="truncated"):
        receive_shard(io.BytesIO(blob[:-5]).readinto, shard, memoryview(into), seen.append)  # type: ignore[arg-type]


def test_server_and_fetch(tmp_path: Path) -> None:
    tensors = _tensors()
    server = WeightsServer(tensors, host="127.0.0.1")
    url = server.start()
    try:
        info = server.update_info()
        got = dict(fetch_weights(url, info["manifest_sha256"], 10))
        assert all(torch.equal(got[n], t) for n, t in tensors.items())
        with pytest.raises(TransferError, match="manifest"):
            fetch_weights(url, "0" * 64, 10)
        tensors["a.weight"].add_(1)  # changed after the manifest: a corrupt transfer
        with pytest.raises(TransferError, match="checksum mismatch"):
            fetch_weights(url, info["manifest_sha256"], 10)
    finally:
        server.stop()

    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    directory = WeightsServer(tmp_path, host="127.0.0.1")
    url = directory.start()
    try:
        got = dict(fetch_weights(url, directory.update_info()["manifest_sha256"], 10))
        assert set(got) == set(_tensors())
    finally:
        directory.stop()


@pytest.mark.parametrize("kept", ["memory", "file"])
def test_the_server_serves_the_bytes_a_range_asks_for_and_refuses_one_past_the_shard(tmp_path: Path, kept: str) -> None:
    """A relay tree's half, from the sidecar: its tensors held in memory, or a file sent from the page cache."""
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    server = WeightsServer(_tensors() if kept == "memory" else tmp_path, host="127.0.0.1")
    url = server.start()
    try:
        shard = server.manifest.shards[0]
        with http_get(url, shard.path, 10) as resp:
            whole = resp.read()
        assert len(whole) == shard.size
        for window in ((0, 1), (3, shard.size - 5), (shard.size - 1, shard.size), (0, shard.size)):
            with http_get(url, shard.path, 10, window=window) as resp:
                assert resp.status == 206 and resp.getheader("Content-Range") == (
                    f"bytes {window[0]}-{window[1] - 1}/{shard.size}"
                )
                assert resp.read() == whole[window[0] : window[1]], window
        with pytest.raises(TransferError, match="HTTP 416"), http_get(url, shard.path, 10, window=(0, shard.size + 1)):
            pass
    finally:
        server.stop()
