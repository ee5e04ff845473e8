"""The collective path on real vLLM: this process is the trainer (rank 0 of a gloo group) and broadcasts.

Through vLLM's own trainer API (the engine package's gloo twin of vLLM's nccl engines),
with the sidecar driving the engines' side: the push lands on every engine (greedy output
equals transformers with the pushed weights), a restarted engine is PendingSync until
the next push forms the group again and brings it up, and weights that do not fit the
model end the push with no engine serving them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollfleet_client.collective import CollectivePusher, state_dict_source
from rollfleet_client.errors import PushFailed
from rollfleet_client.sync_protocol import EngineStep, PushState, PushStatus
from rollfleet_dev import oneshot
from tests.sync.conftest import EngineProcess, Sidecar
from tests.sync.test_sync_live import fresh_version, greedy, state, wait_until

pytestmark = pytest.mark.engine

TRAINER_ADDRESS = "127.0.0.1"  # the engines' loopback addresses reach it


def tensors(weights_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(weights_dir / "model.safetensors"))


def pusher_for(sidecar: Sidecar, state_dict: dict[str, torch.Tensor]) -> CollectivePusher:
    return CollectivePusher(
        state_dict_source(state_dict), backend="gloo", sync=sidecar.client(), address=TRAINER_ADDRESS, timeout_s=60
    )


def push_and_check(
    sidecar: Sidecar, engines: list[EngineProcess], weights_dir: Path, expected: list[list[int]]
) -> PushStatus:
    """A good push: every engine on it, intact and serving, computing as transformers does; none pending."""
    with pusher_for(sidecar, tensors(weights_dir)) as pusher:
        status = pusher.push(fresh_version(weights_dir.name))
    assert status.state is PushState.DONE, status
    for e in engines:
        s = state(e.engine)
        assert (s["weight_version"], s["weights_intact"], s["paused"]) == (status.version, True, False), s
        assert greedy(e.engine) == expected
    assert sidecar.client().fleet_version().pending_sync == []
    return status


def test_a_collective_push_reaches_every_engine_and_matches_transformers(
    collective_engines: list[EngineProcess],
    collective_sidecar: Sidecar,
    weights_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    client = collective_sidecar.client()
    wait_until("the sidecar adopts the engines' version", lambda: client.fleet_version().version is not None)
    status = push_and_check(collective_sidecar, collective_engines, weights_dirs["B"], references["B"])
    assert [e.step for e in status.engines] == [EngineStep.RESUMED] * 2, status
    assert client.fleet_version().version == status.version


def test_a_restarted_engine_waits_out_of_routing_then_the_next_push_brings_it_up(
    collective_engines: list[EngineProcess],
    collective_sidecar: Sidecar,
    weights_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    client = collective_sidecar.client()
    restarted = collective_engines[1]
    restarted.kill()
    restarted.start()
    restarted.wait_ready()  # back on its initial weights (A), which are not the fleet's version
    wait_until(
        "the restarted engine is pending sync", lambda: restarted.engine.url in client.fleet_version().pending_sync
    )
    with pusher_for(collective_sidecar, {}) as pusher:
        assert not pusher.client.group().formed  # the group changed: the next push forms it again
    push_and_check(collective_sidecar, collective_engines, weights_dirs["B"], references["B"])


def test_weights_that_do_not_fit_the_model_fail_the_push_and_no_engine_serves_them(
    collective_engines: list[EngineProcess],
    collective_sidecar: Sidecar,
    weights_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    client = collective_sidecar.client()
    before = client.fleet_version().version
    bad = tensors(weights_dirs["A"])
    last = list(bad)[-1]  # the others arrive, and are loaded, first: the engines end up with mixed weights
    bad[last] = torch.zeros(bad[last].shape[0] + 1, *bad[last].shape[1:], dtype=bad[last].dtype)

    with pusher_for(collective_sidecar, bad) as pusher, pytest.raises(PushFailed) as failed:
        pusher.push(fresh_version("bad"))

    assert failed.value.push.state is PushState.ROLLED_BACK, failed.value.push
    assert all(repr(last) in (e.error or "") for e in failed.value.push.engines), failed.value.push
    fv = client.fleet_version()
    assert fv.version == before and sorted(fv.pending_sync) == sorted(e.engine.url for e in collective_engines)
    for e in collective_engines:
        s = state(e.engine)
        assert (s["paused"], s["weights_intact"]) == (True, False), s
        # Checked at the engine: it refuses to serve its mixed weights.
        resumed = oneshot.post(e.engine.url + "/resume", headers=e.engine.auth, timeout=10)
        assert resumed.status_code == 409 and "partly updated" in resumed.text

    push_and_check(collective_sidecar, collective_engines, weights_dirs["A"], references["A"])


def test_a_trainer_that_dies_mid_broadcast_leaves_no_engine_serving_and_the_next_push_heals(
    collective_engines: list[EngineProcess],
    collective_sidecar: Sidecar,
    weights_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    client = collective_sidecar.client()
    before = client.fleet_version().version
    version = fresh_version("B")
    cmd = [
        sys.executable,
        "-m",
        "tests.collective.stalling_trainer",
        collective_sidecar.url,
        str(weights_dirs["B"]),
        version,
    ]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "stalled"
        status = client.fleet_version().last_push
        assert status is not None and (status.version, status.state) == (version, PushState.RUNNING)
    finally:
        trainer.kill()
        trainer.wait()

    with pytest.raises(PushFailed) as failed:
        client.wait(status.generation, timeout_s=120)
    assert failed.value.push.state is PushState.ROLLED_BACK, failed.value.push
    fv = client.fleet_version()
    assert fv.version == before and len(fv.pending_sync) == 2
    for e in collective_engines:
        assert state(e.engine)["weights_intact"] is False

    push_and_check(collective_sidecar, collective_engines, weights_dirs["B"], references["B"])
