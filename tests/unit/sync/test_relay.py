"""The relay plan (rollfleet.sync.relay) and a push through the real sidecar down a relay tree of simulated engines
(rollfleet_dev.sim_engine: the engine's own stager, relay and proof of the bytes, without a model)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bench.bench_sync import free_port, sidecar
from safetensors.torch import save_file
from tests.unit.sim_serving import serve_sims, stop_sims

from rollfleet.sync.relay import depth, relay_fanout, relay_parents, second_parents
from rollfleet_client.sync_protocol import EngineStep, PushState
from rollfleet_dev import oneshot
from rollfleet_dev.sim_engine import SimEngine
from rollfleet_engine.protocol import STATE_PATH
from rollfleet_engine.safetensors_stream import PIECE_BYTES


def test_a_chain_up_to_its_length_then_a_binary_tree_whose_upstreams_come_first() -> None:
    assert relay_parents(4, 1) == [None, 0, 1, 2]
    # A chain while the engines are no more than the weights' receive pieces (each is a hop of the chain).
    assert relay_fanout(128, 128 * PIECE_BYTES) == 1 and relay_fanout(129, 128 * PIECE_BYTES) == 2
    assert relay_fanout(2000, 16 << 30) == 1 and relay_fanout(200, 5 << 20) == 2
    assert relay_fanout(4, 16 << 30, chain_max=3) == 2  # the sidecar's --relay-chain-max
    assert relay_parents(7, 2) == [None, 0, 0, 1, 1, 2, 2]
    for n in (1, 2, 17, 2000):
        fanout = relay_fanout(n, 8 * PIECE_BYTES)
        parents = relay_parents(n, fanout)
        assert all(p is None or p < i for i, p in enumerate(parents)), "an upstream is asked to stage first"
        assert max((parents.count(i) for i in range(n)), default=0) <= fanout
    assert depth(relay_parents(2000, 2)) == 11 and depth(relay_parents(8, 1)) == 8


def test_the_second_tree_mirrors_the_first_so_the_engines_that_relay_in_one_are_leaves_of_the_other() -> None:
    assert second_parents(7, 2) == [4, 4, 5, 5, 6, 6, None]
    for n in (2, 3, 8, 17, 2000):
        first, second = relay_parents(n, 2), second_parents(n, 2)
        relaying = [{p for p in tree if p is not None} for tree in (first, second)]
        assert not relaying[0] & relaying[1], n
        assert second.count(None) == 1 and max(second.count(i) for i in range(n)) <= 2
        assert depth(second) == depth(first)
    with pytest.raises(ValueError, match="fanout"):
        relay_parents(3, 0)


@contextlib.contextmanager
def served(sims: list[SimEngine]) -> Iterator[list[str]]:
    """The simulated engines, each on a port of its own, on a background event loop."""
    loop = asyncio.new_event_loop()
    ports = [free_port() for _ in sims]
    ready, stop = threading.Event(), asyncio.Event()

    async def main() -> None:
        runners = await serve_sims(sims, ports)
        ready.set()
        await stop.wait()
        await stop_sims(runners)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the simulated engines did not start"
    try:
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        for sim in sims:
            sim.weights.close()


def test_a_push_runs_down_a_relay_tree_and_every_engine_proves_the_bytes(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    # 4 MiB and a bias: past two receive pieces, so the second tree carries the second half of the shard.
    save_file({"w": torch.randn(1024, 1024), "b": torch.randn(256)}, str(weights / "model.safetensors"))
    sims = [SimEngine(f"sim-{i}") for i in range(7)]
    with served(sims) as urls, sidecar(urls, tmp_path, "--relay-chain-max", "3") as client:
        status = client.push_dir(weights, "v2")
        assert status.state is PushState.DONE, status
        # Past 3 engines, two binary trees: each engine staged the first half of the shard from its parent in the
        # heap and the second half from its parent in the mirrored heap, none from a failed relay.
        by_name = {e.name: e for e in status.engines}
        first = [None if p is None else urls[p] for p in relay_parents(7, 2)]
        second = [None if p is None else urls[p] for p in second_parents(7, 2)]
        assert [(by_name[u].source, by_name[u].second_source, by_name[u].relay_error) for u in urls] == [
            (p, q, None) for p, q in zip(first, second, strict=True)
        ]
        assert all(e.step is EngineStep.RESUMED for e in status.engines)
        states = [oneshot.get(url + STATE_PATH, timeout=10).json() for url in urls]
        assert all(s["weight_version"] == "v2" and not s["paused"] for s in states), states
        # Loaded from what it staged, every tensor verified as it landed against the one manifest of the push.
        manifests = {s["weights_manifest_sha256"] for s in states}
        assert len(manifests) == 1 and len(manifests.pop() or "") == 64, states
    assert not any(sim.weights.stager.root.exists() for sim in sims), "a staging area was left behind"
