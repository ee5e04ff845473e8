"""Calls to one engine, shared by the contract suite and the real engine's own tests: a stream read on
a thread, the state and tracked-request routes, control calls with the token, plain completions."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx

from rollfleet import jsonl
from rollfleet_dev import oneshot
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.protocol import ATTEMPT_HEADER, LOAD_PATH

from .conftest import Engine

PROMPT = [5, 6, 7, 8]
# Prompts whose greedy tokens tell weight sets apart (compared with transformers' on a known set).
GREEDY_PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 200, 17, 9]]
# Longer than several KV blocks: vLLM's prefix cache keeps whole blocks only. Within the CPU defaults' 512.
CACHED_PROMPT = [(7 * i + 3) % 250 + 1 for i in range(400)]


class Stream:
    """A streaming completion read on a thread, with the arrival time of every token."""

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        max_tokens: int,
        chat: bool = False,
        attempt: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.request_id = request_id
        self.sent_headers = {"X-Request-Id": request_id} | ({ATTEMPT_HEADER: attempt} if attempt else {})
        self.sent_headers |= headers or {}
        self.tokens: list[int] = []
        self.arrivals: list[float] = []
        self.finish_reason: str | None = None
        self.headers: httpx.Headers | None = None
        self.error: BaseException | None = None
        self._changed = threading.Condition()
        body: dict[str, Any] = {
            "model": engine.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "count"}]
        else:
            path, body["prompt"] = "/v1/completions", PROMPT
        self._thread = threading.Thread(target=self._run, args=(engine.url + path, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with oneshot.stream("POST", url, json=body, headers=self.sent_headers, timeout=120) as r:
                self.headers = r.headers
                r.raise_for_status()
                for line in jsonl.iter_lines(r.iter_bytes()):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        with self._changed:
                            ids = choice.get("token_ids") or []
                            self.tokens += ids
                            self.arrivals += [time.monotonic()] * len(ids)
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
                            self._changed.notify_all()
        except BaseException as err:
            self.error = err
        finally:
            with self._changed:
                self._changed.notify_all()

    def wait_tokens(self, n: int, timeout: float = 60) -> None:
        with self._changed:
            ok = self._changed.wait_for(lambda: len(self.tokens) >= n or not self._thread.is_alive(), timeout)
        assert ok and len(self.tokens) >= n, f"{self.request_id}: {len(self.tokens)} tokens, error {self.error}"

    def join(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.request_id} did not finish"
        assert self.error is None, self.error


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def state(engine: Engine) -> dict[str, Any]:
    return engine.client.get(engine.url + "/rollfleet/v1/state").raise_for_status().json()


def tracked(engine: Engine, request_id: str) -> dict[str, Any]:
    return engine.client.get(f"{engine.url}/rollfleet/v1/requests/{request_id}").raise_for_status().json()


def in_flight_ids(engine: Engine) -> set[str]:
    view = engine.client.get(engine.url + "/rollfleet/v1/requests").raise_for_status().json()
    return {r["request_id"] for r in view["in_flight"]}


def control(engine: Engine, path: str, method: str = "POST", **kwargs: Any) -> httpx.Response:
    return engine.client.request(method, engine.url + path, headers=engine.auth, timeout=120, **kwargs)


def complete(
    engine: Engine, prompt: list[int], max_tokens: int, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    body = {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return engine.client.post(
        engine.url + "/v1/completions", json={**body, "return_token_ids": True}, headers=headers, timeout=120
    )


def ask_cached(engine: Engine, max_tokens: int) -> tuple[list[int], float]:
    """CACHED_PROMPT's greedy answer, and how many of its tokens vLLM's prefix cache served (its counters)."""
    hits, queries = (engine_metric(engine.url, f"vllm:prefix_cache_{c}_total") for c in ("hits", "queries"))
    r = complete(engine, CACHED_PROMPT, max_tokens, ignore_eos=True)
    assert r.status_code == 200, r.text
    # vLLM counts a request's lookups with its outputs, at most a step after the answer.
    deadline = time.monotonic() + 30
    while engine_metric(engine.url, "vllm:prefix_cache_queries_total") <= queries:
        assert time.monotonic() < deadline, "vLLM did not count the prompt's prefix-cache lookup"
        time.sleep(0.05)  # polling a condition
    return r.json()["choices"][0]["token_ids"], engine_metric(engine.url, "vllm:prefix_cache_hits_total") - hits


def metric_reaches(engine: Engine, name: str, value: float, /, timeout: float = 30, **labels: str) -> None:
    """Wait until an engine's counter (summed over its labels, or these labels') is `value`. Positional: vLLM's
    label of a data parallel rank is `engine`."""
    deadline = time.monotonic() + timeout
    while (seen := engine_metric(engine.url, name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels or ''} is {seen}, not {value}"
        time.sleep(0.05)  # polling a condition: vLLM updates its gauges once per step


def load_staged(engine: Engine, staged_url: str, manifest_sha256: str, version: str, one_call: bool = False) -> None:
    """The load in the pause of a staged set, as the sync sidecar does it: a load naming a file outside the staging
    area is refused first, then the staged set loads and finishes as `version`. With `one_call`, each load is
    the engine's one call (LOAD_PATH), whose answer is the state after it; else vLLM's three calls."""
    outside = {"url": f"file://{engine.model_dir}", "manifest_sha256": manifest_sha256}
    staged = {"url": staged_url, "manifest_sha256": manifest_sha256}
    if one_call:
        before = state(engine)
        refused = control(engine, LOAD_PATH, json={"update_info": outside, "weight_version": version})
        assert refused.status_code >= 400 and state(engine) == before, refused.text
        loaded = control(engine, LOAD_PATH, json={"update_info": staged, "weight_version": version})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json() == state(engine)
        return
    assert control(engine, "/start_weight_update").status_code == 200
    assert control(engine, "/update_weights", json={"update_info": outside}).status_code >= 400
    assert control(engine, "/start_weight_update").status_code == 200
    assert control(engine, "/update_weights", json={"update_info": staged}).status_code == 200
    assert control(engine, "/finish_weight_update", json={"weight_version": version}).status_code == 200
