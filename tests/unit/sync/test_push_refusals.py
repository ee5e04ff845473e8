"""Pushes that must change nothing, through the real sidecar to stand-in engines (bench_sync's receivers:
the engine's control routes, stager and loader without vLLM): weights of another layout, a second push
while one runs, a trainer that stops sending mid-stream, and a spooled push of nothing written."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bench.bench_sync import receivers, sidecar
from safetensors.torch import save_file

from rollfleet_client.errors import SidecarError
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import PUSH_SPOOLED_PATH, PUSH_STREAM_PATH, PushState
from rollfleet_client.tensors import tensor_file
from rollfleet_dev import oneshot


def version_of(url: str) -> str:
    return str(oneshot.get(url + "/rollfleet/v1/state", timeout=10).json()["weight_version"])


def checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[list[str], SyncClient]]:
    with receivers(2, tmp_path) as urls, sidecar(urls, tmp_path) as client:
        yield urls, client


def test_weights_of_another_layout_are_refused_before_anything_changes(
    fleet: tuple[list[str], SyncClient], tmp_path: Path
) -> None:
    urls, client = fleet
    good = checkpoint(tmp_path / "good", {"w": torch.randn(64, 64), "b": torch.randn(64)})
    assert client.push_dir(good, "v1").state is PushState.DONE
    other = checkpoint(tmp_path / "other", {"w": torch.randn(64, 65), "extra": torch.randn(3)})
    with pytest.raises(SidecarError, match=r"HTTP 409.*do not match the fleet's current ones \(v1\)") as refused:
        client.push_dir(other, "v2")
    assert "'extra' is not in the current weights" in str(refused.value)
    assert "'b' is missing" in str(refused.value) and "'w' is F32 [64, 65], the current one F32 [64, 64]" in str(
        refused.value
    )
    assert {version_of(u) for u in urls} == {"v1"} and client.fleet_version().version == "v1"
    assert client.push_dir(good, "v2").state is PushState.DONE  # the label was not used up


def test_a_second_push_while_one_runs_is_refused(fleet: tuple[list[str], SyncClient], tmp_path: Path) -> None:
    _, client = fleet
    big = checkpoint(tmp_path / "big", {f"w{i}": torch.randn(4 << 20) for i in range(16)})  # 256 MiB
    running = client.push_dir(big, "v1", wait=False)
    with pytest.raises(SidecarError, match=r"HTTP 409.*a push is running"):
        client.push_dir(big, "v2")
    assert client.progress(running.generation).state is PushState.RUNNING  # refused while it ran, untouched
    assert client.wait(running.generation).state is PushState.DONE
    assert client.fleet_version().version == "v1"


def test_a_trainer_that_stops_sending_mid_stream_pushes_nothing(
    fleet: tuple[list[str], SyncClient], tmp_path: Path
) -> None:
    urls, client = fleet
    tensors = {f"w{i}": torch.randn(1 << 20) for i in range(8)}
    out = tensor_file(tensors)
    half = threading.Event()

    def stops_halfway() -> Iterator[bytes]:
        sent = 0
        for chunk in out.chunks(1 << 20):
            if sent >= out.size // 2:
                half.set()
                raise ConnectionResetError("the trainer died")
            sent += len(chunk)
            yield chunk

    headers = {"Content-Length": str(out.size)}
    with pytest.raises(ConnectionResetError):
        oneshot.put(client.url + PUSH_STREAM_PATH, params={"version": "v1"}, content=stops_halfway(), headers=headers)
    assert half.is_set()
    fv = client.fleet_version()
    assert fv.last_push is None and {version_of(u) for u in urls} == {"initial"}
    assert client.push(tensors, "v1").state is PushState.DONE  # same label: nothing was recorded
    assert {version_of(u) for u in urls} == {"v1"}


def test_a_spooled_push_that_names_no_write_in_the_spool_is_refused(
    fleet: tuple[list[str], SyncClient], tmp_path: Path
) -> None:
    urls, client = fleet
    for name, status, why in (
        ("../../etc", 400, "string_pattern_mismatch"),  # a name, never a path out of the spool
        ("never-written", 409, "must mount this sidecar's spool volume"),
    ):
        with pytest.raises(SidecarError, match=why) as refused:
            client.call("POST", PUSH_SPOOLED_PATH, content=json.dumps({"version": "v1", "name": name}))
        assert refused.value.status == status
    assert client.fleet_version().last_push is None and {version_of(u) for u in urls} == {"initial"}

    # A trainer whose spool variable names another directory learns it before writing anything.
    elsewhere = SyncClient(client.url, spool=tmp_path / "not-the-spool")
    with pytest.raises(SidecarError, match="is not the sync sidecar's spool volume"):
        elsewhere.push({"w": torch.randn(8)}, "v1")
    elsewhere.close()
    assert not (tmp_path / "not-the-spool").exists()
