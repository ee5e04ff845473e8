"""Prefetch through the real sidecar to stand-in engines that run the engine's own stager and loader
(bench/bench_sync.py's receivers: the engine's control routes without vLLM). Real vLLM engines
stage in tests/sync/test_sync_live.py and in the e2e suite."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from bench.bench_sync import RELAY_DIES_AFTER_ENV, receivers, sidecar
from safetensors.torch import save_file

from rollfleet_client.sync_protocol import EngineStep, PushState
from rollfleet_dev import oneshot
from rollfleet_engine.protocol import STAGING_MAX_BYTES_ENV


def version_of(url: str) -> str:
    return str(oneshot.get(url + "/rollfleet/v1/state", timeout=10).json()["weight_version"])


def test_an_engine_that_cannot_stage_is_not_paused_and_is_caught_up_after_the_commit(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.randn(256, 256)}, str(weights / "model.safetensors"))
    # Engine 1's staging area holds 100 bytes: its staging fails, for want of room.
    with receivers(2, tmp_path, {1: {STAGING_MAX_BYTES_ENV: "100"}}) as urls, sidecar(urls, tmp_path) as client:
        status = client.push_dir(weights, "v2")
        assert status.state is PushState.DONE and status.prefetch_s is not None
        fits, full = status.engines
        assert fits.step is EngineStep.RESUMED and fits.stage_s is not None
        assert full.step is EngineStep.PENDING_SYNC and full.stage_s is None
        assert "not paused" in (full.error or "") and STAGING_MAX_BYTES_ENV in (full.error or ""), full
        assert version_of(urls[0]) == "v2"
        # Left out of the push, never paused; the reconcile loop then pulls it to the fleet's version.
        deadline = time.monotonic() + 60
        while version_of(urls[1]) != "v2":
            assert time.monotonic() < deadline, "the engine that could not stage was never caught up"
            time.sleep(0.2)  # polling a condition: the sidecar's reconcile loop
        assert client.fleet_version().pending_sync == []


def test_engines_relay_the_weights_down_a_chain_and_each_verifies_them(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.randn(512, 512), "b": torch.randn(512)}, str(weights / "model.safetensors"))
    # A chain of 3 whatever the size of the weights (2 receive pieces here: a tree by default).
    flags = ("--relay-min-engines", "3", "--relay-chain-max", "3")
    with receivers(3, tmp_path) as urls, sidecar(urls, tmp_path, *flags) as client:
        status = client.push_dir(weights, "v2")
        assert status.state is PushState.DONE, status
        assert [(e.source, e.relay_error) for e in status.engines] == [(None, None), (urls[0], None), (urls[1], None)]
        assert all(e.step is EngineStep.RESUMED for e in status.engines) and {version_of(u) for u in urls} == {"v2"}


def test_an_engine_whose_relay_fails_stages_from_the_sidecar(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.randn(256, 256)}, str(weights / "model.safetensors"))
    # The head of the chain cannot stage (100 bytes of room), so it has nothing to relay to the next.
    with (
        receivers(2, tmp_path, {0: {STAGING_MAX_BYTES_ENV: "100"}}) as urls,
        sidecar(urls, tmp_path, "--relay-min-engines", "2") as client,
    ):
        status = client.push_dir(weights, "v2")
        head, second = status.engines
        assert head.step is EngineStep.PENDING_SYNC and STAGING_MAX_BYTES_ENV in (head.error or ""), head
        assert second.step is EngineStep.RESUMED and second.source is None, second
        # Where the head had failed before the second's turn came, the sidecar did not try the relay at all.
        assert second.relay_error is None or "not staging" in second.relay_error, second
        assert version_of(urls[1]) == "v2"


def test_an_engine_whose_relay_peer_dies_mid_chunk_stages_from_the_sidecar(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    tensors = {"w": torch.randn(512, 512), "b": torch.randn(512)}
    save_file(tensors, str(weights / "model.safetensors"))
    # The head of the chain dies 100,000 bytes into what it relays: inside the first tensor and the first chunk.
    with (
        receivers(2, tmp_path, {0: {RELAY_DIES_AFTER_ENV: "100000"}}) as urls,
        sidecar(urls, tmp_path, "--relay-min-engines", "2") as client,
    ):
        status = client.push_dir(weights, "v2")
        head, second = status.engines
        # The dead engine is left out (found dead while it stages or at the pause: a matter of timing); the one
        # it fed saw a truncated tensor, and staged everything again from the sidecar.
        assert head.step is EngineStep.PENDING_SYNC and urls[0] in (head.error or ""), head
        assert second.step is EngineStep.RESUMED and second.source is None, second
        assert "truncated" in (second.relay_error or ""), second
        assert version_of(urls[1]) == "v2"
        assert status.state is PushState.DONE, status
