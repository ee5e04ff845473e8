"""The engine's protocol contract, run against real vLLM (`rollfleet_engine`) and the simulator.

The control-plane tier runs its fleets on `rollfleet_dev.sim_engine`; these checks hold it to what
the real engine answers: generation shapes and headers, access (401 and 403, open routes), abort by
caller id (answers, partial output, the tracked request, scoped to the sender's attempt), a client
that goes away, `n` choices and usage, the three pause modes (keep in the sync sidecar's one call, with
a look at the requests), sampling (greedy and seeded requests repeat, other seeds differ), the vLLM
metrics tests read, vLLM's refusals (status and error body), its refusal to start with a context longer
than the model's, and the weight routes the sync sidecar drives (staging from two upstreams, the relay
of what is staged, whole or a Range, the update session in the engine's one call, and the manifest the
state reports; the engine's own tests load in vLLM's three calls). A case runs once per engine (`[vllm]`,
`[sim]`); a simulator that answers one of them differently fails here.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollfleet_dev import oneshot
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.protocol import (
    PAUSE_AND_LOOK_PATH,
    STAGE_PATH,
    STAGE_RELAY_PATH,
    WEIGHT_VERSION_HEADER,
    WEIGHTS_MANIFEST_PATH,
)
from rollfleet_engine.tiny_model import LONG_GENERATION as LONG
from rollfleet_engine.tiny_model import TINY_MODEL_CONTEXT, ensure_tiny_model
from rollfleet_engine.weights_server import WeightsServer

from .calls import (
    PROMPT,
    Stream,
    complete,
    control,
    in_flight_ids,
    load_staged,
    metric_reaches,
    rid,
    state,
    tracked,
)
from .conftest import START_TIMEOUT_S, TOKEN, Engine, engine_command, free_loopback_address, sim_command

FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"  # requests that produced their first token
TOKENS = "vllm:generation_tokens_total"  # tokens the engine made, whoever has read them

pytestmark = pytest.mark.engine


@pytest.fixture(params=["vllm", "sim"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Each case once against the real engine and once against the simulator."""
    return request.getfixturevalue("real_engine" if request.param == "vllm" else "sim_engine")


def test_completions_and_chat_stream_and_complete(engine: Engine) -> None:
    r = complete(engine, PROMPT, 8, ignore_eos=True)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
    assert r.headers[WEIGHT_VERSION_HEADER] == "a-0"

    chat = oneshot.post(
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
            r = oneshot.post(engine.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.status_code)
    assert state(engine) == before
    assert state(engine)["paused"] is False and state(engine)["weight_version"] == "a-0"
    # Arbitrary code stays off even with the token.
    assert control(engine, "/collective_rpc", json={"method": "get_model"}).status_code == 403
    for path in ("/health", "/metrics", "/v1/models", "/rollfleet/v1/state", "/rollfleet/v1/ready"):
        assert oneshot.get(engine.url + path, timeout=30).status_code == 200, path


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


def test_an_abort_naming_another_senders_attempt_leaves_the_request_running(engine: Engine) -> None:
    # Ids are the clients': a gateway stopping its own request names its attempt, and must not end another
    # sender's request under the same id (issue 32, D4).
    mine = Stream(engine, rid("scoped"), LONG, attempt="gw-a-1")
    mine.wait_tokens(4)
    ids = {"request_ids": [mine.request_id], "timeout_s": 2}
    other = control(engine, "/rollfleet/v1/abort", json=ids | {"attempt": "gw-b-7"})
    assert other.status_code == 200 and other.json()["results"] == {mine.request_id: "unknown"}
    assert tracked(engine, mine.request_id)["phase"] == "running" and mine.finish_reason is None
    own = control(engine, "/rollfleet/v1/abort", json=ids | {"attempt": "gw-a-1"})
    assert own.json()["results"] == {mine.request_id: "aborted"}
    mine.join()
    assert mine.finish_reason == "abort" and len(mine.tokens) < LONG


def test_abort_non_streaming_returns_partial_output(engine: Engine) -> None:
    request_id = rid("plain")
    result: dict[str, httpx.Response] = {}
    # A non-streaming request shows no tokens until it ends: the engine's count of first tokens says
    # when it has one (every earlier request has its own counted: none runs now).
    first_tokens = engine_metric(engine.url, FIRST_TOKENS)

    def call() -> None:
        body = {"model": engine.model, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
        result["response"] = oneshot.post(
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

    # A generation that cannot end within the test: the engine decodes far ahead of what a client has read, so a
    # short one may have ended at the engine before the pause lands, whatever its client has seen so far.
    s = Stream(engine, rid("keep"), LONG)
    s.wait_tokens(20)
    # The sync sidecar's pause: vLLM's, and the requests as they stand paused, in one call.
    paused = control(engine, PAUSE_AND_LOOK_PATH, params={"mode": "keep"})
    try:
        assert paused.status_code == 200 and s.request_id in {r["request_id"] for r in paused.json()["in_flight"]}
        st = state(engine)
        assert st["paused"] is True and st["pause_mode"] == "keep"
        made = engine_metric(engine.url, TOKENS)
        time.sleep(1.5)  # the observation window: the engine may make no token in it
        assert engine_metric(engine.url, TOKENS) == made
        assert s.request_id in in_flight_ids(engine)  # kept, not ended
    finally:
        assert control(engine, "/resume").status_code == 200
    s.wait_tokens(len(baseline))
    assert control(engine, "/rollfleet/v1/abort", json={"request_ids": [s.request_id]}).status_code == 200
    s.join()
    assert s.finish_reason == "abort"
    assert s.tokens[: len(baseline)] == baseline  # every token, and the same ones as without the pause
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


def _refusal(message: str, param: str | None = None, kind: str = "BadRequestError", code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# What vLLM 0.32 answers (recorded from the real engine): the gateway and the request runner act on these.
OUT_OF_VOCAB = _refusal("Token id 1000000000 is out of vocabulary")
REFUSALS = [
    ("/v1/completions", {"prompt": [1, 10**9], "max_tokens": 4}, 400, OUT_OF_VOCAB),
    ("/inference/v1/generate", {"token_ids": [1, 10**9], "sampling_params": {"max_tokens": 4}}, 400, OUT_OF_VOCAB),
    (
        "/v1/completions",
        {"model": "nope", "prompt": [1], "max_tokens": 4},
        404,
        _refusal("The model `nope` does not exist. Valid aliases: tiny.", "model", "NotFoundError", 404),
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": TINY_MODEL_CONTEXT + 1},
        400,
        _refusal(
            f"max_tokens={TINY_MODEL_CONTEXT + 1} cannot be greater than max_model_len={TINY_MODEL_CONTEXT}. Please "
            f"request fewer output tokens. (parameter=max_tokens, value={TINY_MODEL_CONTEXT + 1})",
            "max_tokens",
        ),
    ),
]


TOO_MANY_LOGPROBS = _refusal(
    "Requested sample logprobs of 10000, which is greater than max allowed: 20 (parameter=logprobs, value=10000)",
    "logprobs",
)
# Refusals a streaming request gets after its 200, as an event (then [DONE]); the others come before it.
IN_STREAM = [
    ({"prompt": [1, 10**9], "max_tokens": 4}, OUT_OF_VOCAB),
    ({"prompt": "Hi", "max_tokens": 4, "logprobs": 10**4}, TOO_MANY_LOGPROBS),
]


def test_refusals_are_vllms_status_and_error_body(engine: Engine) -> None:
    chat_logprobs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
    refusals = [
        *REFUSALS,
        ("/v1/completions", IN_STREAM[1][0], 400, TOO_MANY_LOGPROBS),
        ("/v1/chat/completions", {**chat_logprobs, "top_logprobs": 10**4}, 400, TOO_MANY_LOGPROBS),
    ]
    for path, body, status, error in refusals:
        r = engine.client.post(engine.url + path, json={"model": engine.model, **body}, timeout=60)
        assert (r.status_code, r.json()) == (status, error), (path, r.status_code, r.text[:300])
    for body, error in IN_STREAM:
        stream = {"model": engine.model, **body, "stream": True}
        r = engine.client.post(engine.url + "/v1/completions", json=stream, timeout=60)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and [json.loads(events[0]), events[1:]] == [error, ["[DONE]"]], r.text[:300]
    # A request over the context is refused before any stream.
    over = {"model": engine.model, "prompt": "Hi", "max_tokens": TINY_MODEL_CONTEXT + 1, "stream": True}
    r = engine.client.post(engine.url + "/v1/completions", json=over, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text[:300]


def test_greedy_and_seeded_requests_repeat_and_other_seeds_differ(engine: Engine) -> None:
    def tokens(**sampling: Any) -> tuple[int, ...]:
        r = complete(engine, PROMPT, 16, ignore_eos=True, **sampling)
        return tuple(r.raise_for_status().json()["choices"][0]["token_ids"])

    assert tokens(temperature=0) == tokens(temperature=0)
    assert tokens(temperature=1.0, seed=1) == tokens(temperature=1.0, seed=1)
    assert len({tokens(temperature=1.0, seed=s) for s in range(2, 6)}) > 1  # samples of a prompt differ


def test_the_metrics_the_tests_read_count_requests(engine: Engine) -> None:
    """Requests decoding, and requests finished whole: the control-plane tier judges engines by them."""
    metric_reaches(engine, "vllm:num_requests_running", 0)
    successes = engine_metric(engine.url, "vllm:request_success_total")
    s = Stream(engine, rid("metrics"), LONG)
    s.wait_tokens(4)
    metric_reaches(engine, "vllm:num_requests_running", 1)
    assert control(engine, "/rollfleet/v1/abort", json={"request_ids": [s.request_id]}).status_code == 200
    s.join()
    metric_reaches(engine, "vllm:num_requests_running", 0)
    assert complete(engine, PROMPT, 4).status_code == 200
    metric_reaches(engine, "vllm:request_success_total", successes + 1)  # the aborted one is no success


def test_a_client_that_goes_away_frees_its_request(engine: Engine) -> None:
    url, body = engine.url + "/v1/completions", {"model": engine.model, "prompt": PROMPT, "max_tokens": LONG}
    for stream in (False, True):
        request_id = rid(f"gone-{stream}")
        headers = {"X-Request-Id": request_id}
        if stream:
            with oneshot.stream("POST", url, json={**body, "stream": True, "ignore_eos": True}, headers=headers) as r:
                next(r.iter_lines())  # one event, then the connection closes
        else:
            with pytest.raises(httpx.ReadTimeout):
                oneshot.post(url, json={**body, "ignore_eos": True}, headers=headers, timeout=httpx.Timeout(60, read=1))
        deadline = time.monotonic() + 30
        while (view := tracked(engine, request_id))["phase"] != "finished":
            assert time.monotonic() < deadline, view
            time.sleep(0.05)  # polling a condition
        assert view["finish_reason"] == "abort" and view["output_tokens"] < LONG, view
        metric_reaches(engine, "vllm:num_requests_running", 0)


def test_n_choices_come_each_with_its_index_and_the_usage_counts_them_all(engine: Engine) -> None:
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 8, "n": 2, "ignore_eos": True, "seed": 3}
    plain = engine.client.post(engine.url + "/v1/completions", json=body, timeout=60).raise_for_status().json()
    assert [c["token_ids"] for c in plain["choices"]] == [None, None]  # token ids only when asked
    body["return_token_ids"] = True
    whole = engine.client.post(engine.url + "/v1/completions", json=body, timeout=60).raise_for_status().json()
    assert [(c["index"], len(c["token_ids"]), c["finish_reason"]) for c in whole["choices"]] == [
        (0, 8, "length"),
        (1, 8, "length"),
    ]
    assert whole["usage"]["completion_tokens"] == 16
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = engine.client.post(engine.url + "/v1/completions", json=stream, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    tokens: dict[int, int] = {}
    finish = {}
    for event in events[:-1]:
        for c in event["choices"]:
            tokens[c["index"]] = tokens.get(c["index"], 0) + len(c["token_ids"])
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    assert tokens == {0: 8, 1: 8} and finish == {0: "length", 1: "length"}, (tokens, finish)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 16, events[-1]


def test_weights_are_staged_relayed_and_loaded_with_the_proof_of_their_bytes(engine: Engine) -> None:
    version = state(engine)["weight_version"]
    server = WeightsServer(engine.model_dir, host=engine.url.split("//")[1].split(":")[0])
    server.start()
    try:
        info = server.update_info()
        assert control(engine, STAGE_PATH, json={"url": info["url"]}).status_code == 400  # no manifest to pin
        # From two upstreams, as down the sidecar's two relay trees: the first half of every shard from `url`, the
        # second from `second_url` (here the same server: the halves are the unit tests').
        started = control(engine, STAGE_PATH, json=info | {"second_url": info["url"]})
        assert started.status_code == 202 and started.json()["manifest_sha256"] == info["manifest_sha256"]
        # What it stages, it relays on: the manifest as the weights server serves it, byte for byte.
        relayed = control(engine, STAGE_RELAY_PATH + WEIGHTS_MANIFEST_PATH, method="GET")
        assert relayed.status_code == 200 and hashlib.sha256(relayed.content).hexdigest() == info["manifest_sha256"]
        staged = control(engine, STAGE_PATH, method="GET", params={"wait": 30}).json()
        assert staged["state"] == "staged" and staged["staged_url"].startswith("file://"), staged
        assert server.bytes_sent == staged["bytes"]  # each half once
    finally:
        server.stop()
    # And each shard whole, or the bytes a Range asks for (a relay tree's half), or 416 for a Range past it.
    shard = json.loads(relayed.content)["shards"][0]
    url = engine.url + STAGE_RELAY_PATH + shard["path"]
    whole = engine.client.get(url, headers=engine.auth, timeout=30)
    assert whole.status_code == 200 and len(whole.content) == shard["size"]
    part = engine.client.get(url, headers=engine.auth | {"Range": "bytes=10-99"}, timeout=30)
    assert (part.status_code, part.content) == (206, whole.content[10:100])
    assert part.headers["Content-Range"] == f"bytes 10-99/{shard['size']}"
    past = engine.client.get(url, headers=engine.auth | {"Range": f"bytes=0-{shard['size']}"}, timeout=30)
    assert past.status_code == 416, past.text
    # The same weights under the same label: the cases after this one see the engine as before.
    load_staged(engine, staged["staged_url"], info["manifest_sha256"], version, one_call=True)
    after = state(engine)
    assert (after["weight_version"], after["weights_manifest_sha256"]) == (version, info["manifest_sha256"])
    # Loaded, the staged set is released: nothing is left to relay.
    assert control(engine, STAGE_RELAY_PATH + WEIGHTS_MANIFEST_PATH, method="GET").status_code == 409


@pytest.mark.parametrize("kind", ["vllm", "sim"])
def test_a_context_longer_than_the_models_stops_the_engine_at_start(kind: str, tmp_path: Path) -> None:
    """What the operator reports as a crash loop (`tests/unit/controller`, e2e/test_fleet.py): the engine
    exits non-zero, and its last words name max_model_len."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    host, port = free_loopback_address()
    cmd = (engine_command if kind == "vllm" else sim_command)(ensure_tiny_model(), host, port, token_file, "a-0")
    cmd[cmd.index("--max-model-len") + 1] = str(10 * TINY_MODEL_CONTEXT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    last_words = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
    assert proc.returncode != 0 and any(
        f"User-specified max_model_len ({10 * TINY_MODEL_CONTEXT}) is greater than the derived max_model_len" in line
        for line in last_words
    ), (proc.returncode, last_words)
