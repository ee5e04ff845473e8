"""Weight sync acceptance on real vLLM CPU engines: pushes during rollouts, a dying engine, a dying sidecar.

Every test pushes the weight set the engines do not serve yet (A or B of the tiny
model) under a new version label, and checks the engines' greedy output against
transformers with that set: the proof that the new weights, not only the label, arrived.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from rollfleet_client.errors import SidecarError
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import SPOOL_INCOMING_DIR, EngineStep, PushState, PushStatus
from rollfleet_dev import oneshot
from rollfleet_engine.protocol import MAX_WEIGHT_LAG_HEADER
from tests.engine.calls import CACHED_PROMPT, GREEDY_PROMPTS, Stream, ask_cached, complete, control
from tests.engine.conftest import Engine
from tests.engine.test_engine_live import _reference_greedy

from .conftest import EngineProcess, Sidecar

pytestmark = pytest.mark.engine

GREEDY_TOKENS = 12
# A rollout's budget, which it does not reach: a rollout held through a push is aborted once it has decoded
# AFTER_SWAP tokens on the new weights (the rest would show nothing more). Long, so that a push slowed by a
# loaded machine still lands while every rollout decodes: at 1,800 (about 20 s here) one slowed by kind's image
# loads beside the tier landed after every rollout had ended.
ROLLOUT_TOKENS = 16_000
AFTER_SWAP = 16


def reference_outputs(weights_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy outputs of transformers with each weight set, for GREEDY_PROMPTS."""
    refs = {name: _reference_greedy(str(d), GREEDY_PROMPTS, GREEDY_TOKENS) for name, d in weights_dirs.items()}
    assert refs["A"] != refs["B"]
    return refs


@pytest.fixture(scope="package")
def references(weights_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    return reference_outputs(weights_dirs)


def greedy(engine: Engine) -> list[list[int]]:
    out = []
    for prompt in GREEDY_PROMPTS:
        resp = complete(engine, prompt, GREEDY_TOKENS, ignore_eos=True)
        assert resp.status_code == 200, resp.text
        out.append(resp.json()["choices"][0]["token_ids"])
    return out


def serving(engine: Engine, references: dict[str, list[list[int]]]) -> str:
    """Which weight set the engine computes with, by its outputs."""
    out = greedy(engine)
    matches = [name for name, ref in references.items() if ref == out]
    assert len(matches) == 1, f"{engine.url} serves neither A nor B"
    return matches[0]


def state(engine: Engine) -> dict[str, object]:
    return oneshot.get(engine.url + "/rollfleet/v1/state", timeout=10).raise_for_status().json()


def tracked(engine: Engine, request_id: str) -> dict[str, Any]:
    """The engine's record of a request."""
    return dict(oneshot.get(f"{engine.url}/rollfleet/v1/requests/{request_id}", timeout=10).raise_for_status().json())


def tracked_versions(engine: Engine, request_id: str) -> list[str]:
    return list(tracked(engine, request_id)["weight_versions"])


def end_after_the_swap(rollouts: list[tuple[Stream, Engine]], old_label: str, version: str) -> None:
    """Each rollout, held through a push, goes on decoding after it; once it has AFTER_SWAP more tokens it is
    aborted at its engine. Its tokens are then in two segments, the old version's then the new one's, which
    end where the caller's stream ended: the pause lost and repeated none."""
    for r, _ in rollouts:
        r.wait_tokens(len(r.tokens) + AFTER_SWAP)
    for r, e in rollouts:
        resp = control(e, "/rollfleet/v1/abort", json={"request_ids": [r.request_id]})
        assert resp.json()["results"] == {r.request_id: "aborted"}, resp.text
    for r, e in rollouts:
        r.join(timeout=60)
        assert r.finish_reason == "abort" and len(r.tokens) < ROLLOUT_TOKENS, (r.request_id, r.finish_reason)
        segs = tracked(e, r.request_id)["weight_segments"]
        assert [s["version"] for s in segs] == [old_label, version], segs
        assert segs[0]["start"] == 0 and segs[0]["end"] == segs[1]["start"] > 0, segs
        assert segs[1]["end"] == len(r.tokens), (segs, len(r.tokens))


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # polling a condition


def wait_engine_step(client: SyncClient, generation: int, engine: Engine, step: EngineStep) -> PushStatus:
    status: PushStatus | None = None

    def reached() -> bool:
        nonlocal status
        status = client.progress(generation)
        steps = "; ".join(f"{e.name} {e.step.value}{f' ({e.error})' if e.error else ''}" for e in status.engines)
        assert status.state is PushState.RUNNING, f"push {status.state.value}: {status.message}; engines: {steps}"
        return any(e.name == engine.url and e.step is step for e in status.engines)

    wait_until(f"{engine.url} {step.value}", reached)
    assert status is not None
    return status


def fresh_version(weights: str) -> str:
    return f"{weights.lower()}-{uuid.uuid4().hex[:6]}"


def other(weights: str) -> str:
    return "B" if weights == "A" else "A"


def test_push_during_streaming_rollouts_keeps_them_and_moves_every_engine(
    engines: list[EngineProcess],
    sidecar: Sidecar,
    weights_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    client = sidecar.client()
    wait_until("the sidecar adopts the engines' version", lambda: client.fleet_version().version is not None)
    old = serving(engines[0].engine, references)
    assert serving(engines[1].engine, references) == old  # also warms both up: rollouts start together
    new, version = other(old), fresh_version(other(old))
    old_label = str(state(engines[0].engine)["weight_version"])
    rollouts = [
        Stream(e.engine, f"rollout-{i}-{uuid.uuid4().hex[:6]}", ROLLOUT_TOKENS) for i, e in enumerate(engines * 2)
    ]
    for r in rollouts:
        r.wait_tokens(5)

    status = client.push_dir(weights_dirs[new], version)

    assert status.state is PushState.DONE
    assert status.pause_window_s is not None and status.total_s is not None
    assert 0 < status.pause_window_s <= status.total_s
    assert [e.step for e in status.engines] == [EngineStep.RESUMED] * 2
    # Prefetch: each engine staged the weights while it served; the pause covered only the load. The
    # second engine staged them from the first, as they arrived (relay), through its token-checked route.
    assert status.prefetch_s is not None and all(e.stage_s is not None for e in status.engines), status
    assert [(e.source, e.relay_error) for e in status.engines] == [(None, None), (engines[0].engine.url, None)]
    # Every rollout was held through the pause and went on on the new weights, its versions in order.
    end_after_the_swap([(r, e.engine) for r, e in zip(rollouts, engines * 2, strict=True)], old_label, version)
    for e in engines:
        s = state(e.engine)
        assert (s["weight_version"], s["paused"]) == (version, False)
        assert greedy(e.engine) == references[new]
    fv = client.fleet_version()
    assert (fv.version, fv.pending_sync) == (version, [])
    assert sorted(fv.routable) == sorted(e.engine.url for e in engines)


def test_a_request_past_its_own_weight_lag_bound_is_aborted_at_a_push_and_one_within_it_spans_the_swap(
    engines: list[EngineProcess],
    sidecar: Sidecar,
    weights_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    """X-Rollfleet-Max-Weight-Lag (what the gateway passes on): on real vLLM the tokens in flight are known by
    version (vLLM tells its spans only at the end), so the push aborts exactly the requests its bound excludes."""
    client = sidecar.client()
    wait_until("the sidecar adopts the engines' version", lambda: client.fleet_version().version is not None)
    old = serving(engines[0].engine, references)
    assert serving(engines[1].engine, references) == old
    new, version = other(old), fresh_version(other(old))
    old_label = str(state(engines[0].engine)["weight_version"])
    tag = uuid.uuid4().hex[:6]
    strict = [
        Stream(e.engine, f"lag0-{i}-{tag}", ROLLOUT_TOKENS, headers={MAX_WEIGHT_LAG_HEADER: "0"})
        for i, e in enumerate(engines)
    ]
    loose = [
        Stream(e.engine, f"lag1-{i}-{tag}", ROLLOUT_TOKENS, headers={MAX_WEIGHT_LAG_HEADER: "1"})
        for i, e in enumerate(engines)
    ]
    for r in strict + loose:
        r.wait_tokens(5)

    status = client.push_dir(weights_dirs[new], version)

    assert status.state is PushState.DONE and status.aborted_stale == 2, status
    # Bound 0: the old weights made some of its tokens, so the push ended it (to run again on the new ones).
    for r, e in zip(strict, engines, strict=True):
        r.join(timeout=60)
        assert tracked_versions(e.engine, r.request_id) == [old_label]
    assert [r.finish_reason for r in strict] == ["abort", "abort"]
    assert all(len(r.tokens) < ROLLOUT_TOKENS for r in strict)
    # Bound 1: one generation behind is allowed; it went on through the swap, and its versions say which.
    end_after_the_swap([(r, e.engine) for r, e in zip(loose, engines, strict=True)], old_label, version)


def test_engine_killed_during_a_push_is_left_out_then_joins_on_the_new_version(
    engines: list[EngineProcess],
    sidecar: Sidecar,
    references: dict[str, list[list[int]]],
    weights_dirs: dict[str, Path],
) -> None:
    client = sidecar.client()
    survivor, victim = engines
    old = serving(survivor.engine, references)
    new, version = other(old), fresh_version(other(old))
    victim.signal_server(signal.SIGSTOP)  # it stops answering: the push waits on it
    try:
        started = client.push_dir(weights_dirs[new], version, wait=False)
        # The survivor has staged the new weights; the victim's staging call hangs.
        wait_engine_step(client, started.generation, survivor.engine, EngineStep.STAGED)
    finally:
        victim.kill()  # mid-push: its staging fails, so it is not paused, and the survivor loads alone
    status = client.wait(started.generation, timeout_s=120)

    steps = {e.name: e.step for e in status.engines}
    assert steps == {survivor.engine.url: EngineStep.RESUMED, victim.engine.url: EngineStep.PENDING_SYNC}
    fv = client.fleet_version()
    assert (fv.version, fv.routable, fv.pending_sync) == (version, [survivor.engine.url], [victim.engine.url])
    assert greedy(survivor.engine) == references[new]

    victim.start()  # the replacement starts on its image's weights (A, labelled "A")
    victim.wait_ready()
    wait_until(
        "the replacement is caught up",
        lambda: state(victim.engine)["weight_version"] == version and not state(victim.engine)["paused"],
    )
    assert greedy(victim.engine) == references[new]
    fv = client.fleet_version()
    assert (fv.version, fv.pending_sync) == (version, [])


def test_a_state_dict_written_into_the_shared_spool_reaches_every_engine(
    engines: list[EngineProcess],
    sidecar: Sidecar,
    references: dict[str, list[list[int]]],
    weights_dirs: dict[str, Path],
) -> None:
    # The trainer container mounts the sidecar's spool: the client writes the shard there, no HTTP hop.
    client = sidecar.client(spool=sidecar.spool)
    wait_until("the sidecar adopts the engines' version", lambda: client.fleet_version().version is not None)
    new = other(serving(engines[0].engine, references))
    version = fresh_version(new)
    state_dict = load_file(weights_dirs[new] / "model.safetensors")
    incoming = sidecar.spool / SPOOL_INCOMING_DIR

    status = client.push(state_dict, version)

    assert status.state is PushState.DONE and status.receive_s is not None
    for e in engines:
        assert greedy(e.engine) == references[new]
    assert list(incoming.iterdir()) == []  # the sidecar took the shard over
    assert [p.name for p in (sidecar.spool / "pushes").iterdir()] == [version]  # and keeps only the fleet's

    # Refused (the version exists): the trainer's write does not stay behind in the spool's memory.
    with pytest.raises(SidecarError, match="already pushed") as refused:
        client.push(state_dict, version)
    assert refused.value.status == 409
    assert list(incoming.iterdir()) == []
    assert client.fleet_version().version == version


def test_sidecar_killed_mid_push_is_restarted_and_the_fleet_ends_on_one_version(
    engines: list[EngineProcess],
    sidecar: Sidecar,
    references: dict[str, list[list[int]]],
    weights_dirs: dict[str, Path],
) -> None:
    # Killed in the pull, with an engine paused on the new weights: a sidecar that pulls in the pause
    # (--no-prefetch; with prefetch an engine that hangs is left out before any pause). The sidecar
    # that restarts prefetches, as by default.
    sidecar.kill()
    pulling = Sidecar([*sidecar.cmd, "--no-prefetch"], sidecar.url, sidecar.log, sidecar.spool)
    pulling.start()
    first, second = engines
    try:
        client = pulling.client()
        old_label = str(state(first.engine)["weight_version"])
        old = serving(first.engine, references)
        new, version = other(old), fresh_version(other(old))
        state_dict = load_file(weights_dirs[new] / "model.safetensors")
        second.signal_server(signal.SIGSTOP)
        try:
            started = client.push(state_dict, version, wait=False)  # streamed into the sidecar's spool
            wait_engine_step(client, started.generation, first.engine, EngineStep.VERIFIED)
            pulling.kill()
        finally:
            second.signal_server(signal.SIGCONT)
    finally:
        pulling.stop()  # killed above; after a failure, it must not hold the sidecar's ports for the later tests

    # No sidecar: the engine that has the new weights is paused; nothing serves them yet.
    s = state(first.engine)
    assert (s["weight_version"], s["paused"]) == (version, True)
    assert state(second.engine)["weight_version"] == old_label

    sidecar.start()  # same record file and spool: it finds the push InProgress and rolls it forward
    client = sidecar.client()
    wait_until("the fleet converges", lambda: client.fleet_version().version == version, timeout_s=120)
    wait_until("every engine is resumed", lambda: not any(state(e.engine)["paused"] for e in engines))
    for e in engines:
        assert state(e.engine)["weight_version"] == version
        assert greedy(e.engine) == references[new]
    fv = client.fleet_version()
    assert fv.pending_sync == [] and len(fv.routable) == 2


def test_a_prompt_cached_before_a_push_is_computed_again_on_the_new_weights(
    engines: list[EngineProcess],
    sidecar: Sidecar,
    weights_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    """vLLM's prefix-cache counters (in tokens): a prompt asked twice before a push hits the cache, the same
    prompt after it hits nothing (the blocks computed by the old weights went with the swap), and hits again
    on the new weights' blocks. A request held across the push (pause keep) is what keeps vLLM from clearing
    its caches itself: its blocks are in use, so the engine drops them too (the request recomputes them on
    the new weights) and it goes on, its tokens in two segments, one per version."""
    client = sidecar.client()
    wait_until("the sidecar adopts the engines' version", lambda: client.fleet_version().version is not None)
    engine = engines[0].engine
    new = other(serving(engine, references))
    old_label, version = str(state(engine)["weight_version"]), fresh_version(new)

    def ask() -> tuple[list[int], float]:
        return ask_cached(engine, GREEDY_TOKENS)

    before, _ = ask()
    again, hit = ask()
    assert again == before and hit >= len(CACHED_PROMPT) // 2, hit  # cached: the counters do show hits

    held = Stream(engine, f"held-{uuid.uuid4().hex[:6]}", ROLLOUT_TOKENS)
    held.wait_tokens(5)
    assert client.push_dir(weights_dirs[new], version).state is PushState.DONE

    after, hit = ask()
    assert hit == 0, f"{hit} tokens of the prompt were served from blocks the old weights computed"
    assert after != before
    again, hit = ask()
    assert again == after and hit >= len(CACHED_PROMPT) // 2, hit

    end_after_the_swap([(held, engine)], old_label, version)
