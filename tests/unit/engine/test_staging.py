"""Prefetch into the staging area: a real weights server, the engine's stager, and the load from memory."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollfleet_engine.protocol import STAGING_DIR_ENV, StageState, StageStatus, WeightUpdateInfo
from rollfleet_engine.safetensors_stream import TransferError
from rollfleet_engine.staging import Stager, fits
from rollfleet_engine.weights_client import fetch_weights
from rollfleet_engine.weights_server import WeightsServer


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "layer.weight": torch.randn(64, 32, generator=g),
        "layer.bias": torch.randn(64, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5),
    }


@contextmanager
def serving(directory: Path) -> Iterator[tuple[str, str]]:
    server = WeightsServer(directory, host="127.0.0.1")
    url = server.start()
    try:
        yield url, server.update_info()["manifest_sha256"]
    finally:
        server.stop()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    (tmp_path / "weights").mkdir()
    save_file(tensors(), str(tmp_path / "weights" / "model.safetensors"))
    with serving(tmp_path / "weights") as running:
        yield running


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(STAGING_DIR_ENV, str(tmp_path / "staging"))
    return tmp_path / "staging"


def settled(stager: Stager) -> StageStatus:
    deadline = time.monotonic() + 30
    while (status := stager.status()).state is StageState.STAGING:
        assert time.monotonic() < deadline, status
        time.sleep(0.01)  # polling a condition: the stager's thread
    return status


def test_staged_weights_load_from_the_staging_area_as_served(served: tuple[str, str], root: Path) -> None:
    url, sha = served
    stager = Stager(root, max_bytes=None)
    first = stager.start(WeightUpdateInfo(url=url, manifest_sha256=sha))
    assert first.state is StageState.STAGING and first.manifest_sha256 == sha
    status = settled(stager)
    assert status.state is StageState.STAGED and status.staged_url == f"file://{root / sha}", status
    assert stager.start(WeightUpdateInfo(url=url, manifest_sha256=sha)) == status  # the same set: nothing to do
    got = dict(fetch_weights(status.staged_url, sha, 10))
    assert set(got) == set(tensors()) and all(torch.equal(got[n], t) for n, t in tensors().items())
    with pytest.raises(TransferError, match="manifest sha256"):
        fetch_weights(status.staged_url, "0" * 64, 10)


def test_a_loaded_set_cannot_be_loaded_again_and_the_next_set_is_written_over_its_memory(
    served: tuple[str, str], root: Path, tmp_path: Path
) -> None:
    url, sha = served
    stager = Stager(root, max_bytes=None)
    stager.start(WeightUpdateInfo(url=url, manifest_sha256=sha))
    first = settled(stager).staged_url
    assert first is not None
    inode = (root / sha / "shard-0.safetensors").stat().st_ino
    loaded = dict(fetch_weights(first, sha, 10))  # the loader keeps its mapping of the file (``mappings``)
    assert all(torch.equal(loaded[n], t) for n, t in tensors().items())
    del loaded
    stager.release()  # as after the engine's finish_weight_update
    with pytest.raises(TransferError, match="stage the weights again"):
        fetch_weights(first, sha, 10)
    changed = {**tensors(), "steps": torch.arange(5) * 7}
    save_file(changed, str(tmp_path / "weights" / "model.safetensors"))
    with serving(tmp_path / "weights") as (other_url, other_sha):
        stager.start(WeightUpdateInfo(url=other_url, manifest_sha256=other_sha))
        status = settled(stager)
    assert status.state is StageState.STAGED and status.staged_url is not None, status
    assert (root / other_sha / "shard-0.safetensors").stat().st_ino == inode  # the same memory, written over
    got = dict(fetch_weights(status.staged_url, other_sha, 10))
    assert all(torch.equal(got[n], t) for n, t in changed.items())


def test_only_the_staging_area_can_be_loaded_from(served: tuple[str, str], root: Path, tmp_path: Path) -> None:
    with pytest.raises(TransferError, match="staging area"):
        fetch_weights(f"file://{tmp_path / 'weights'}", served[1], 10)
    with pytest.raises(TransferError, match="stage the weights again"):
        fetch_weights(f"file://{root / 'gone'}", served[1], 10)


def test_weights_that_do_not_fit_or_are_not_the_named_ones_fail_with_what_to_do(
    served: tuple[str, str], root: Path
) -> None:
    url, sha = served
    small = Stager(root, max_bytes=100)
    small.start(WeightUpdateInfo(url=url, manifest_sha256=sha))
    status = settled(small)
    assert status.state is StageState.FAILED and "ROLLFLEET_STAGING_MAX_BYTES" in (status.error or ""), status
    assert not list(root.rglob("*.safetensors")) and not list(root.rglob("*.json"))  # nothing half-staged
    other = Stager(root, max_bytes=None)
    other.start(WeightUpdateInfo(url=url, manifest_sha256="0" * 64))
    assert "manifest sha256" in (settled(other).error or "")
    with pytest.raises(ValueError, match="manifest_sha256"):
        other.start(WeightUpdateInfo(url=url))


def test_fits_says_which_bound_refused() -> None:
    assert fits(10, None, 100) is None and fits(10, 10, 10) is None
    assert "staging limit" in (fits(11, 10, 100) or "")
    assert "free" in (fits(11, None, 10) or "")
