"""TRL's own VLLMClient (the real class, trl from PyPI) against a real gateway in front of simulated engines.

The engines are the simulator (devtools/rollfleet_dev/sim_engine.py) with what TRL's client asks of
vLLM besides: completions logprobs (`token_id:N` tokens), `/reset_prefix_cache` and
`/get_world_size`. The same client against REAL vLLM engines is e2e/test_trl.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from aiohttp import web
from tests.unit.gateway.conftest import TOKEN, serve_gateway
from tests.unit.gateway.test_proxy import ADMIN, wait_until

from rollfleet.gateway.proxy import ProxyConfig
from rollfleet_client.protocol import (
    ABORT_PATH,
    COMPLETIONS_PATH,
    GENERATE_PATH,
    REQUEST_ID_HEADER,
    TIMEOUT_HEADER,
    TRL_HEALTH_PATH,
    TRL_PREFIX,
    TRL_RESET_PREFIX_CACHE_PATH,
    TRL_WORLD_SIZE_PATH,
)
from rollfleet_dev import oneshot
from rollfleet_dev.sim_engine import SimEngine

pytest.importorskip("trl")
if TYPE_CHECKING:
    from trl.generation.vllm_client import VLLMClient

Json = dict[str, Any]


def logprob(token: int) -> float:
    return -token / 100


def tokens_after(prompt_len: int, count: int) -> list[int]:
    """What the simulator generates: token i is (prompt length + i) % 97 + 3."""
    return [(prompt_len + i) % 97 + 3 for i in range(count)]


class TrlSim(SimEngine):
    """The simulator, plus the prefix-cache reset and world size that TRL's client uses; logprobs of its own."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.resets: list[str | None] = []  # the Authorization header of each prefix-cache reset

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post(TRL_RESET_PREFIX_CACHE_PATH, self.reset_prefix_cache)
        app.router.add_get(TRL_WORLD_SIZE_PATH, self.world_size)
        return app

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.resets.append(request.headers.get("Authorization"))
        return web.json_response({"success": True})

    async def world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    @staticmethod
    def logprob(token: int) -> float:
        return logprob(token)


@dataclass
class Fleet:
    url: str  # the gateway
    sims: list[TrlSim]

    @property
    def trl(self) -> str:
        return self.url + TRL_PREFIX

    def ran(self) -> dict[str, str]:
        """Request id -> the engine that ran it, for every request the engines ran."""
        return {rid: sim.name for sim in self.sims for rid in sim.finished}

    def ended(self, request_id: str) -> str | None:
        """How the request ended at its engine."""
        return next((sim.finished[request_id] for sim in self.sims if request_id in sim.finished), None)

    def running(self, suffix: str = "") -> list[str]:
        return [rid for sim in self.sims for rid in sim.running if rid.endswith(suffix)]

    def tokens(self, request_id: str) -> int:
        """The tokens the engine running `request_id` has made of it so far."""
        return max((t.output_tokens for sim in self.sims if (t := sim.tracker.get(request_id))), default=0)

    def failovers(self) -> float:
        metrics = oneshot.get(self.url + "/metrics").text.splitlines()
        return float(next(ln.split()[1] for ln in metrics if ln.startswith("rollfleet_gateway_failovers_total")))


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    sims = [TrlSim("sim-a"), TrlSim("sim-b")]
    # continue_min_tokens 1: every sample is streamed from its engine, so that a failover continues it.
    proxy = ProxyConfig(queue_timeout_s=1.0, stop_grace_s=2.0, continue_min_tokens=1)
    with serve_gateway(list(sims), proxy, eject_s=0.0) as (url, _):
        yield Fleet(url, sims)


@pytest.fixture
def gw(fleet: Fleet) -> Iterator[Fleet]:
    yield fleet
    for sim in fleet.sims:
        sim.token_delay_ms, sim.die_after, sim.refuse = 0.0, {}, set()


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> VLLMClient:
    # Imported here: TRL's client imports vLLM and transformers (8 s), which every collection of the suite
    # (each unit worker, the lint's tier check) would otherwise pay.
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=fleet.trl, connection_timeout=10)
    client.session.headers["Authorization"] = f"Bearer {TOKEN}"  # the trainer's: reset_prefix_cache is control
    return client


def test_trl_generates_n_samples_per_prompt_each_a_gateway_request_of_its_own(gw: Fleet, client: VLLMClient) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    before = gw.ran()
    out = client.generate(prompts, n=3, max_tokens=4, temperature=0.7, top_k=5)
    assert out["prompt_ids"] == prompts
    expected = [tokens_after(3, 4)] * 3 + [tokens_after(4, 4)] * 3
    assert out["completion_ids"] == expected
    # logprobs=0 (TRL's default): the sampled token's own, per token, named by its id.
    assert out["logprobs"] == [[[logprob(t)] for t in c] for c in expected]
    assert out["logprob_token_ids"] == [[[t] for t in c] for c in expected]
    # One request id per sample; the samples of a prompt ran on one engine (and its prefix cache).
    ran = {rid: engine for rid, engine in gw.ran().items() if rid not in before}
    assert len(ran) == 6
    for p in range(2):
        group = {engine for rid, engine in ran.items() if rid.rsplit("-s", 1)[0].endswith(f"-p{p}")}
        assert len(group) == 1, ran


def test_text_prompts_and_no_logprobs(gw: Fleet, client: VLLMClient) -> None:
    out = client.generate(["ab", "cde"], n=2, max_tokens=3, logprobs=None)
    assert out["prompt_ids"] == [[ord(c) % 97 + 3 for c in p] for p in ("ab", "cde")]
    assert out["completion_ids"] == [tokens_after(2, 3)] * 2 + [tokens_after(3, 3)] * 2
    assert out["logprobs"] is None


def test_a_sample_whose_engine_dies_is_continued_elsewhere_and_keeps_its_logprobs(
    gw: Fleet, client: VLLMClient
) -> None:
    for sim in gw.sims:
        sim.die_after = {COMPLETIONS_PATH: 2}  # first attempts die; continuations (the generate route) do not
    before = gw.failovers()
    out = client.generate([[5, 6, 7]], n=2, max_tokens=5)
    expected = [tokens_after(3, 5)] * 2
    # Exactly what one engine would have made, and TRL parses every logprob (tokens 3-5 came back as text).
    assert out["completion_ids"] == expected
    assert out["logprob_token_ids"] == [[[t] for t in c] for c in expected]
    assert out["logprobs"] == [[[logprob(t)] for t in c] for c in expected]
    assert gw.failovers() - before == 2


def test_aborting_one_sample_by_its_id_gives_back_its_partial_completion(gw: Fleet, client: VLLMClient) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(client.generate([[1, 2]], n=2, max_tokens=300)))
    thread.start()
    wait_until(lambda: len(gw.running("-p0-s1")) == 1 and len(gw.running("-p0-s0")) == 1)
    rid = gw.running("-p0-s1")[0]
    wait_until(lambda: gw.tokens(rid) > 0)  # a partial completion to give back
    r = oneshot.post(gw.url + ABORT_PATH, json={"request_ids": [rid]}, headers=ADMIN)
    assert r.json()["results"] == {rid: "aborted"}
    thread.join(30)
    whole, partial = out["completion_ids"]
    assert len(whole) == 300 and 0 < len(partial) < 300 and partial == whole[: len(partial)]
    assert len(out["logprobs"][1]) == len(partial)


def test_aborting_the_batch_id_or_leaving_stops_every_sample_at_its_engine(gw: Fleet) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5
    body = {"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2000, "logprobs": 0, "return_tokens_as_token_ids": True}
    out: dict[str, httpx.Response] = {}

    def run() -> None:
        out["r"] = oneshot.post(
            gw.trl + COMPLETIONS_PATH, json=body, headers={REQUEST_ID_HEADER: "batch-ab"}, timeout=30
        )

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: len(gw.running()) == 4)
    r = oneshot.post(gw.url + ABORT_PATH, json={"request_ids": ["batch-ab"]}, headers=ADMIN)
    assert r.json()["results"] == {"batch-ab": "aborted"}
    thread.join(30)
    answer = out["r"].json()
    assert out["r"].status_code == 200 and [c["finish_reason"] for c in answer["choices"]] == ["abort"] * 4
    ids = [c["rollfleet"]["request_id"] for c in answer["choices"]]
    assert ids == [f"batch-ab-p{p}-s{s}" for p in range(2) for s in range(2)]
    assert [gw.ended(rid) for rid in ids] == ["abort"] * 4
    # A client that leaves: its samples are stopped at their engines too.
    with pytest.raises(httpx.ReadTimeout):
        oneshot.post(gw.trl + COMPLETIONS_PATH, json=body, headers={REQUEST_ID_HEADER: "batch-gone"}, timeout=1.0)
    ids = [f"batch-gone-p{p}-s{s}" for p in range(2) for s in range(2)]
    wait_until(lambda: [gw.ended(rid) for rid in ids] == ["abort"] * 4)


def test_a_failing_sample_fails_the_batch_with_the_engines_reason(gw: Fleet, client: VLLMClient) -> None:
    for sim in gw.sims:
        sim.refuse = {COMPLETIONS_PATH}
    with pytest.raises(Exception, match=r"Request failed: 404.*sample \S+-p0-s0 \(prompt 0, sample 0\).*Not Found"):
        client.generate([[5, 6, 7], [8]], n=2, max_tokens=2)


def test_health_prefix_cache_reset_and_world_size_answer_for_the_fleet(gw: Fleet, client: VLLMClient) -> None:
    assert oneshot.get(gw.trl + TRL_HEALTH_PATH).json() == {"status": "ok", "routable_engines": 2}
    before = [len(sim.resets) for sim in gw.sims]
    client.reset_prefix_cache()
    assert [len(sim.resets) - b for sim, b in zip(gw.sims, before, strict=True)] == [1, 1]
    assert {sim.resets[-1] for sim in gw.sims} == {f"Bearer {TOKEN}"}  # a control route at the engine
    assert client.get_world_size() == 2


def test_weight_sync_and_image_features_are_refused_with_what_to_do_instead(gw: Fleet, client: VLLMClient) -> None:
    import torch

    with pytest.raises(Exception, match=r"501.*sync sidecar.*SyncClient.push"):
        client.init_communicator(device="cpu")
    with pytest.raises(Exception, match=r"501.*/trl/start_weight_update.*sync sidecar"):
        client.update_named_param("w", torch.zeros(2))
    r = oneshot.post(gw.trl + GENERATE_PATH, json={"token_ids": [1], "features": {}})
    assert r.status_code == 501 and "multimodal" in r.json()["error"]["message"]


def test_chat_is_the_gateways_own_chat_route(gw: Fleet, client: VLLMClient) -> None:
    out = client.chat([[{"role": "user", "content": "hi"}]], max_tokens=3)
    prompt = [1, *(ord(c) % 97 + 3 for c in "hi")]
    assert out["prompt_ids"] == [prompt] and out["completion_ids"] == [tokens_after(len(prompt), 3)]


def test_the_batchs_deadline_stops_every_sample_with_what_it_made(gw: Fleet) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5  # 25 s for 5,000 tokens: the deadline comes first
    started = time.monotonic()
    # 3 s: on a loaded host (the tier's other worker, kind's image loads) a sample may wait a second for its
    # engine before its first token; a 0.5 s deadline could end one with nothing made (seen in a CI run).
    r = oneshot.post(
        gw.trl + COMPLETIONS_PATH,
        json={"prompt": [[1]], "n": 2, "max_tokens": 5000},
        headers={TIMEOUT_HEADER: "3"},
        timeout=30,
    )
    assert r.status_code == 200 and time.monotonic() - started < 15
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort", "abort"] and all(c["token_ids"] for c in choices)
