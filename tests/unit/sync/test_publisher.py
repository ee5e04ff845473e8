"""The sidecar serves what a push's directory holds when it is pushed: a trainer that writes each checkpoint
into the same directory pushes the new weights, not the ones hashed at an earlier push."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import torch
from bench.bench_sync import receivers, sidecar
from safetensors.torch import save_file

from rollfleet.sync.orchestrator import Publisher
from rollfleet_client.sync_protocol import PushState
from rollfleet_dev import oneshot
from rollfleet_engine.protocol import WEIGHTS_MANIFEST_PATH
from rollfleet_engine.safetensors_stream import tensor_checksum


def write_checkpoint(directory: Path, w: torch.Tensor) -> None:
    directory.mkdir(exist_ok=True)
    save_file({"w": w}, str(directory / "model.safetensors"))


def test_a_directory_written_over_is_served_as_its_new_weights(tmp_path: Path) -> None:
    ckpt = tmp_path / "latest"
    first, second = torch.randn(64, 64), torch.randn(64, 64)
    write_checkpoint(ckpt, first)

    async def run() -> None:
        publisher = Publisher("127.0.0.1", 0)
        try:
            url, sha_first, _ = await publisher.serve(ckpt)
            assert await publisher.serve(ckpt) == (url, sha_first, publisher.total_bytes)
            write_checkpoint(ckpt, second)  # the same directory, file and layout; other values
            _, sha_second, _ = await publisher.serve(ckpt)
            assert sha_second != sha_first
            async with httpx.AsyncClient() as http:
                served = (await http.get(url + WEIGHTS_MANIFEST_PATH, timeout=10)).json()
            (tensor,) = served["shards"][0]["tensors"]
            assert tensor["xxh3_128"] == tensor_checksum(memoryview(second.numpy()).cast("B"))
        finally:
            publisher.stop()

    asyncio.run(run())


def test_a_checkpoint_written_over_in_place_is_pushed_as_its_new_weights(tmp_path: Path) -> None:
    ckpt = tmp_path / "latest"
    write_checkpoint(ckpt, torch.randn(256, 256))
    with receivers(2, tmp_path) as urls, sidecar(urls, tmp_path) as client:
        assert client.push_dir(ckpt, "step-1").state is PushState.DONE
        write_checkpoint(ckpt, torch.randn(256, 256))
        # Every engine checks every tensor against the manifest: served stale, this push would fail at all.
        status = client.push_dir(ckpt, "step-2")
        assert status.state is PushState.DONE, status
        assert client.fleet_version().pending_sync == []
        assert {oneshot.get(u + "/rollfleet/v1/state", timeout=10).json()["weight_version"] for u in urls} == {"step-2"}
