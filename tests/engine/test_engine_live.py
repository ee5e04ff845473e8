"""The engine's acceptance, on real vLLM (CPU) with the tiny model: one shared engine.

Order matters only at the end: the weight update test runs last (it changes weights).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from rollfleet import jsonl
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.protocol import STAGE_PATH, WEIGHT_VERSION_HEADER
from rollfleet_engine.tiny_model import LONG_GENERATION as LONG
from rollfleet_engine.tiny_model import WEIGHTS_B_DIR
from rollfleet_engine.weights_server import WeightsServer

from .conftest import Engine

FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"  # requests that produced their first token

pytestmark = pytest.mark.engine

PROMPT = [5, 6, 7, 8]


class Stream:
    """A streaming completion read on a thread, with the arrival time of every token."""

    def __init__(self, engine: Engine, request_id: str, max_tokens: int, chat: bool = False) -> None:
        self.request_id = request_id
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
            with httpx.stream("POST", url, json=body, headers={"X-Request-Id": self.request_id}, timeout=120) as r:
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


def complete(engine: Engine, prompt: list[int], max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return engine.client.post(engine.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120)


def test_completions_and_chat_stream_and_complete(engine: Engine) -> None:
    r = complete(engine, PROMPT, 8, ignore_eos=True)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
    assert r.headers[WEIGHT_VERSION_HEADER] == "a-0"

    chat = httpx.post(
        engine.url + "/v1/chat/completions",
        json={"model": engine.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        headers={"X-Request-Id": "chat-plain"},
        timeout=120,
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert chat.headers["X-Request-Id"] == "chat-plain"

    for is_chat in (False, True):
        s = Stream(engine, rid("stream"), 16, chat=is_chat)
        s.join()
        assert s.finish_reason == "length" and len(s.tokens) == 16
        assert s.headers is not None and s.headers[WEIGHT_VERSION_HEADER] == "a-0"
        assert tracked(engine, s.request_id)["phase"] == "finished"


def test_control_calls_without_token_get_401_and_change_nothing(engine: Engine) -> None:
    before = state(engine)
    calls = [
        ("/pause?mode=abort", None),
        ("/pause?mode=keep", None),
        ("/resume", None),
        ("/rollfleet/v1/abort", {"request_ids": ["x"]}),
        ("/abort_requests", {"request_ids": ["x"]}),
        ("/start_weight_update", None),
        ("/finish_weight_update", {"weight_version": "evil"}),
        ("/update_weight_version", {"new_version": "evil"}),
        ("/reset_prefix_cache", None),
        ("/sleep", None),
        ("/init_weight_transfer_engine", {"init_info": {}}),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": engine.token}):
        for path, body in calls:
            r = httpx.post(engine.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.status_code)
    assert state(engine) == before
    assert state(engine)["paused"] is False and state(engine)["weight_version"] == "a-0"
    # Arbitrary code stays off even with the token.
    assert control(engine, "/collective_rpc", json={"method": "get_model"}).status_code == 403
    for path in ("/health", "/metrics", "/v1/models", "/rollfleet/v1/state", "/rollfleet/v1/ready"):
        assert httpx.get(engine.url + path, timeout=30).status_code == 200, path


def test_abort_by_caller_id_ends_that_request_only(engine: Engine) -> None:
    victim = Stream(engine, rid("victim"), LONG)
    chat_victim = Stream(engine, rid("chat-victim"), LONG, chat=True)
    bystander = Stream(engine, rid("bystander"), 64)
    victim.wait_tokens(4)
    chat_victim.wait_tokens(4)

    ids = [victim.request_id, chat_victim.request_id, "nope"]
    r = control(engine, "/rollfleet/v1/abort", json={"request_ids": ids})
    assert r.status_code == 200
    assert r.json()["results"] == {victim.request_id: "aborted", chat_victim.request_id: "aborted", "nope": "unknown"}
    for s in (victim, chat_victim):
        s.join()
        assert s.finish_reason == "abort" and 4 <= len(s.tokens) < LONG  # the caller got its partial output
        view = tracked(engine, s.request_id)
        assert view["phase"] == "finished" and view["finish_reason"] == "abort", view
        assert s.request_id not in in_flight_ids(engine)
    bystander.join()
    assert bystander.finish_reason == "length" and len(bystander.tokens) == 64

    again = control(engine, "/rollfleet/v1/abort", json={"request_ids": [victim.request_id, bystander.request_id]})
    assert again.json()["results"] == {victim.request_id: "aborted", bystander.request_id: "finished"}


def test_abort_non_streaming_returns_partial_output(engine: Engine) -> None:
    request_id = rid("plain")
    result: dict[str, httpx.Response] = {}
    # A non-streaming request shows no tokens until it ends: the engine's count of first tokens says
    # when it has one (every earlier request has its own counted: none runs now).
    first_tokens = engine_metric(engine.url, FIRST_TOKENS)

    def call() -> None:
        body = {"model": engine.model, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
        result["response"] = httpx.post(
            engine.url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=120
        )

    t = threading.Thread(target=call)
    t.start()
    companion = Stream(engine, rid("companion"), 256)  # decodes beside it: the abort must leave it be
    deadline = time.monotonic() + 60
    while engine_metric(engine.url, FIRST_TOKENS) < first_tokens + 2:
        assert time.monotonic() < deadline, "the request never produced a token on the engine"
        time.sleep(0.05)  # polling a condition
    r = control(engine, "/rollfleet/v1/abort", json={"request_ids": [request_id]})
    assert r.json()["results"] == {request_id: "aborted"}
    t.join(120)
    response = result["response"]
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "abort"
    assert 0 < response.json()["usage"]["completion_tokens"] < LONG
    companion.join()
    assert companion.finish_reason == "length"


def test_pause_keep_freezes_then_resumes_every_token(engine: Engine) -> None:
    baseline = complete(engine, PROMPT, 300, ignore_eos=True).json()["choices"][0]["token_ids"]
    assert len(baseline) == 300

    s = Stream(engine, rid("keep"), 300)
    s.wait_tokens(20)
    assert control(engine, "/pause?mode=keep").status_code == 200
    paused_at = time.monotonic()
    st = state(engine)
    assert st["paused"] is True and st["pause_mode"] == "keep"
    time.sleep(1.5)  # the observation window: no token may arrive in it
    resumed_at = time.monotonic()
    assert control(engine, "/resume").status_code == 200
    s.join()
    # Outputs already on the wire when pause returned may land a moment later.
    during = [t for t in s.arrivals if paused_at + 0.2 < t < resumed_at]
    assert during == []
    assert s.finish_reason == "length"
    assert s.tokens == baseline  # every token, and the same ones as without the pause
    assert state(engine)["paused"] is False


def test_pause_wait_finishes_in_flight(engine: Engine) -> None:
    s = Stream(engine, rid("wait"), 120)
    s.wait_tokens(4)
    assert control(engine, "/pause?mode=wait").status_code == 200
    try:
        s.join()
        assert s.finish_reason == "length" and len(s.tokens) == 120
        assert state(engine)["pause_mode"] == "wait"
    finally:
        assert control(engine, "/resume").status_code == 200


def test_pause_abort_ends_in_flight_with_abort(engine: Engine) -> None:
    """An abort-mode pause ends the request the engine core runs, with finish_reason abort."""
    s = Stream(engine, rid("pause-abort"), LONG)
    s.wait_tokens(1)
    assert control(engine, "/pause?mode=abort").status_code == 200
    try:
        s.join()
        assert s.finish_reason == "abort" and len(s.tokens) < LONG, (s.finish_reason, len(s.tokens))
        view = tracked(engine, s.request_id)
        assert view["phase"] == "finished" and view["finish_reason"] == "abort", view
        assert s.request_id not in in_flight_ids(engine)
    finally:
        assert control(engine, "/resume").status_code == 200
    assert complete(engine, PROMPT, 4).status_code == 200


def _reference_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_weight_update_a_to_b_matches_transformers(engine: Engine) -> None:
    prompts = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 200, 17, 9]]
    max_tokens = 16

    def served() -> list[list[int]]:
        return [complete(engine, p, max_tokens, ignore_eos=True).json()["choices"][0]["token_ids"] for p in prompts]

    b_dir = engine.model_dir / WEIGHTS_B_DIR
    ref_a = _reference_greedy(str(engine.model_dir), prompts, max_tokens)
    ref_b = _reference_greedy(str(b_dir), prompts, max_tokens)
    assert ref_a != ref_b
    assert served() == ref_a

    server = WeightsServer(b_dir, host=engine.url.split("//")[1].split(":")[0])
    server.start()
    try:
        assert control(engine, "/init_weight_transfer_engine", json={"init_info": {}}).status_code == 200
        assert control(engine, "/start_weight_update").status_code == 200
        assert control(engine, "/update_weights", json={"update_info": server.update_info()}).status_code == 200
        assert control(engine, "/finish_weight_update", json={"weight_version": "b-1"}).status_code == 200
    finally:
        server.stop()
    assert served() == ref_b
    assert state(engine)["weight_version"] == "b-1"
    assert complete(engine, PROMPT, 2).headers[WEIGHT_VERSION_HEADER] == "b-1"


def test_corrupt_transfer_fails_and_old_weights_keep_serving(engine: Engine) -> None:
    import torch
    from safetensors.torch import load_file

    before_version = state(engine)["weight_version"]
    before = complete(engine, PROMPT, 8, ignore_eos=True).json()["choices"][0]["token_ids"]
    tensors = load_file(str(engine.model_dir / "model.safetensors"))
    server = WeightsServer(tensors, host=engine.url.split("//")[1].split(":")[0])
    server.start()
    try:
        # The server references the tensors: changing one after the manifest was made
        # is exactly a corruption in transit as far as the engine can tell.
        next(iter(tensors.values())).add_(torch.ones(()))
        assert control(engine, "/start_weight_update").status_code == 200
        assert control(engine, "/update_weights", json={"update_info": server.update_info()}).status_code >= 400
        assert control(engine, "/finish_weight_update", json={"weight_version": "corrupt"}).status_code >= 400
    finally:
        server.stop()
    assert state(engine)["weight_version"] == before_version
    assert complete(engine, PROMPT, 8, ignore_eos=True).json()["choices"][0]["token_ids"] == before


def test_prefetched_weights_load_from_the_staging_area(engine: Engine) -> None:
    """Stage while serving (POST, then GET until staged), then the handshake loads the staged copy."""
    prompts, max_tokens = [[5, 6, 7, 8], [40, 41, 42]], 12
    ref_a = _reference_greedy(str(engine.model_dir), prompts, max_tokens)
    server = WeightsServer(engine.model_dir, host=engine.url.split("//")[1].split(":")[0])
    server.start()
    try:
        info = server.update_info()
        assert control(engine, STAGE_PATH, json=info).status_code == 202
        deadline = time.monotonic() + 60
        while (staged := control(engine, STAGE_PATH, method="GET").json())["state"] == "staging":
            assert time.monotonic() < deadline, staged
            time.sleep(0.05)  # polling a condition: the engine's staging thread
        assert staged["state"] == "staged" and staged["staged_url"].startswith("file://"), staged
        # Serving goes on while staged: the engine still answers on its old weights.
        assert complete(engine, PROMPT, 2).headers[WEIGHT_VERSION_HEADER] == state(engine)["weight_version"]
    finally:
        server.stop()  # the load below reads the staging area: the weights server is not needed any more
    outside = {"url": f"file://{engine.model_dir}", "manifest_sha256": info["manifest_sha256"]}
    assert control(engine, "/start_weight_update").status_code == 200
    assert control(engine, "/update_weights", json={"update_info": outside}).status_code >= 400
    staged_info = {"url": staged["staged_url"], "manifest_sha256": info["manifest_sha256"]}
    assert control(engine, "/start_weight_update").status_code == 200
    assert control(engine, "/update_weights", json={"update_info": staged_info}).status_code == 200
    assert control(engine, "/finish_weight_update", json={"weight_version": "a-staged"}).status_code == 200
    assert state(engine)["weight_version"] == "a-staged"
    assert [
        complete(engine, p, max_tokens, ignore_eos=True).json()["choices"][0]["token_ids"] for p in prompts
    ] == ref_a


def test_weights_that_do_not_fit_fail_the_load_and_the_engine_refuses_to_resume_until_a_full_update(
    engine: Engine,
) -> None:
    import torch
    from safetensors.torch import load_file

    prompts, max_tokens = [[5, 6, 7, 8], [40, 41, 42]], 12
    ref_a = _reference_greedy(str(engine.model_dir), prompts, max_tokens)
    host = engine.url.split("//")[1].split(":")[0]
    bad = load_file(str(engine.model_dir / "model.safetensors"))
    last = sorted(bad)[-1]  # loaded after the others: some layers take the new values first
    bad[last] = torch.zeros(bad[last].shape[0] + 1, *bad[last].shape[1:], dtype=bad[last].dtype)
    assert control(engine, "/pause", params={"mode": "keep"}).status_code == 200
    try:
        for weights, ok in ((bad, False), (engine.model_dir, True)):
            server = WeightsServer(weights, host=host)
            server.start()
            try:
                assert control(engine, "/start_weight_update").status_code == 200
                update = control(engine, "/update_weights", json={"update_info": server.update_info()})
                finish = control(engine, "/finish_weight_update", json={"weight_version": f"fit-{ok}"})
            finally:
                server.stop()
            # Every tensor verified, then the load: it fails at the tensor that does not fit.
            assert (update.status_code == 200) is ok and (finish.status_code == 200) is ok, (update.text, finish.text)
            assert state(engine)["weights_intact"] is ok
            if not ok:
                assert "do not fit the model" in update.text and "Attempted to load weight" in update.text
                refused = control(engine, "/resume")
                assert refused.status_code == 409 and "partly updated" in refused.text  # checked at the engine
    finally:
        assert control(engine, "/resume").status_code == 200
    assert state(engine)["weight_version"] == "fit-True"
    assert [
        complete(engine, p, max_tokens, ignore_eos=True).json()["choices"][0]["token_ids"] for p in prompts
    ] == ref_a
