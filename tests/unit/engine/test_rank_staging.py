"""Prefetch for an engine whose ranks span pods (``rank_staging``): each rank's staging, taken once by its load,
and the group's staging as one (no vLLM: the real ranks are in the multipod tier)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rollfleet_engine.protocol import StageState, StageStatus, WeightUpdateInfo
from rollfleet_engine.rank_staging import RankStage, merge_rank_status
from rollfleet_engine.safetensors_stream import TransferError

SHA = "a" * 64
INFO = WeightUpdateInfo(url="http://sidecar:8000", manifest_sha256=SHA)


def staged(stage: RankStage) -> StageStatus:
    """The stage's status once it has ended (its thread is the test's to wait for: a gate it opens)."""
    for thread in threading.enumerate():
        if thread.name == "rollfleet-rank-stage":
            thread.join(timeout=30)
    return stage.status()


def test_a_rank_stages_on_a_thread_and_its_load_takes_the_part_once() -> None:
    gate = threading.Event()
    weights = [("w", torch.ones(4, 2))]

    def pull(info: WeightUpdateInfo) -> list[tuple[str, Any]]:
        assert info == INFO
        gate.wait(30)
        return weights

    stage = RankStage()
    assert stage.start(INFO, pull).state is StageState.STAGING
    assert stage.start(INFO, pull).state is StageState.STAGING  # the same set again: the same staging
    gate.set()
    done = staged(stage)
    assert (done.state, done.bytes, done.staged_url) == (StageState.STAGED, 32, f"rank-staged://{SHA}")
    with pytest.raises(TransferError, match="has not staged"):
        stage.take(f"rank-staged://{'b' * 64}")
    assert stage.take(done.staged_url) is weights
    with pytest.raises(TransferError, match="stage again"):  # loaded: released
        stage.take(done.staged_url)


def test_a_failed_pull_is_the_stagings_error_and_nothing_is_taken() -> None:
    def pull(_: WeightUpdateInfo) -> list[tuple[str, Any]]:
        raise TransferError("model.norm.weight: checksum mismatch (corrupt transfer)")

    stage = RankStage()
    stage.start(INFO, pull)
    failed = staged(stage)
    assert failed.state is StageState.FAILED and "checksum mismatch" in (failed.error or "")
    with pytest.raises(TransferError):
        stage.take(f"rank-staged://{SHA}")
    with pytest.raises(ValueError, match="needs manifest_sha256"):
        stage.start(WeightUpdateInfo(url="http://sidecar:8000"), pull)


def test_the_group_is_staged_once_every_rank_is_and_failed_if_any_rank_failed() -> None:
    def rank(state: StageState, sha: str = SHA, nbytes: int = 0, error: str | None = None) -> StageStatus:
        return StageStatus(state=state, manifest_sha256=sha, bytes=nbytes, seconds=0.5, error=error)

    done = rank(StageState.STAGED, nbytes=10)
    assert merge_rank_status([done, rank(StageState.STAGING)]).state is StageState.STAGING
    assert merge_rank_status([done, rank(StageState.STAGED, sha="b" * 64)]).state is StageState.STAGING
    both = merge_rank_status([done, rank(StageState.STAGED, nbytes=12)])
    assert (both.state, both.bytes, both.staged_url) == (StageState.STAGED, 22, f"rank-staged://{SHA}")
    failed = merge_rank_status([done, rank(StageState.FAILED, error="no room")])
    assert failed.state is StageState.FAILED and failed.error == "rank 1: no room"
    assert merge_rank_status([done, StageStatus()]).state is StageState.IDLE  # a rank restarted: stage again
    assert merge_rank_status([]).state is StageState.IDLE
