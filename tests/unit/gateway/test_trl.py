"""The TRL translation (rollfleet.gateway.trl): TRL's batch into per-sample requests, and their answers back.

Pure functions, dicts in and out; then the routes' admission in-process, with no engine. TRL's own
client against a running gateway and simulated engines is test_trl_client.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from rollfleet.gateway.app import GatewayConfig, build_app
from rollfleet.gateway.dialects import MAX_CHOICES, BadRequest, Json
from rollfleet.gateway.proxy import ProxyConfig
from rollfleet.gateway.trl import batch_answer, batch_failure, batch_finish_reason, fan_out
from rollfleet_client.protocol import (
    COMPLETIONS_PATH,
    REQUEST_ID_HEADER,
    TRL_HEALTH_PATH,
    TRL_PREFIX,
    TRL_RESET_PREFIX_CACHE_PATH,
    TRL_WEIGHT_SYNC_PATHS,
    TRL_WORLD_SIZE_PATH,
)
from rollfleet_engine.protocol import FINISH_WEIGHT_UPDATE_PATH, START_WEIGHT_UPDATE_PATH, UPDATE_WEIGHTS_PATH

# What TRL 1.16's VLLMClient.generate posts (its defaults), for two token-id prompts and n=2.
TRL_BODY: Json = {
    "model": "tiny",
    "prompt": [[5, 6, 7], [8, 9]],
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "n": 2,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 3,
    "logprobs": 0,
}


def answer(token_ids: list[int], prompt_ids: list[int] | None, finish: str = "length", **report: object) -> Json:
    """One sample's answer as the gateway's completions route gives it (token-id logprobs, a report)."""
    lps = [-0.5] * len(token_ids)
    logprobs = {
        "tokens": [f"token_id:{t}" for t in token_ids],
        "token_logprobs": lps,
        "top_logprobs": [{f"token_id:{t}": -0.5} for t in token_ids],
        "text_offset": list(range(len(token_ids))),
    }
    choice = {"index": 0, "text": "x", "token_ids": token_ids, "prompt_token_ids": prompt_ids}
    choice |= {"logprobs": logprobs, "finish_reason": finish}
    rollfleet = {"weight_versions": ["v1"], "engines": ["e1"], "attempts": 1} | report
    return {"id": "cmpl-x", "created": 7, "model": "tiny", "choices": [choice], "rollfleet": rollfleet}


def test_a_batch_becomes_one_request_per_sample_grouped_by_prompt() -> None:
    samples = fan_out(TRL_BODY | {"request_id": "ignored", "stream_options": {"x": 1}}, "b1")
    assert [(s.prompt, s.index, s.request_id, s.group) for s in samples] == [
        (0, 0, "b1-p0-s0", "b1-p0"),
        (0, 1, "b1-p0-s1", "b1-p0"),
        (1, 0, "b1-p1-s0", "b1-p1"),
        (1, 1, "b1-p1-s1", "b1-p1"),
    ]
    first = samples[0].body
    assert first["prompt"] == [5, 6, 7] and first["n"] == 1 and samples[2].body["prompt"] == [8, 9]
    # Everything else TRL sent goes on as it came (sampling, logprobs, token ids); the batch's id does not.
    kept = {k: v for k, v in TRL_BODY.items() if k not in ("prompt", "n")}
    assert {k: first[k] for k in kept} == kept and "request_id" not in first and "stream_options" not in first


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_every_prompt_form_of_vllm_is_read(prompt: object, expected: list[object]) -> None:
    assert [s.body["prompt"] for s in fan_out({"prompt": prompt}, "b")] == expected


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"prompt": []}, "'prompt' must be"),
        ({"prompt": [[1], []]}, "'prompt' must be"),
        ({"prompt": [[1], "a"]}, "'prompt' must be"),
        ({"prompt": [1, -2]}, "'prompt' must be"),
        ({"prompt": [True]}, "'prompt' must be"),
        ({"prompt": "a", "stream": True}, "stream from /v1/completions"),
        ({"prompt": "a", "prompt_logprobs": 1}, "'prompt_logprobs' is not served"),
        ({"prompt": ["a", "b"], "n": MAX_CHOICES}, "split the batch"),
    ],
)
def test_bodies_the_fan_out_cannot_serve_are_refused_with_the_reason(body: Json, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        fan_out(body, "b")


def test_a_seed_gives_each_sample_of_a_prompt_its_own_seed() -> None:
    seeds = [s.body["seed"] for s in fan_out({"prompt": ["a", "b"], "n": 3, "seed": 10}, "b")]
    assert seeds == [10, 11, 12, 10, 11, 12]


def test_answers_are_put_back_together_prompt_major_as_vllm_answers_a_batch() -> None:
    samples = fan_out(TRL_BODY, "b1")
    answers = [
        answer([10, 11, 12], [5, 6, 7]),
        answer([13, 14, 15], [5, 6, 7], weight_versions=["v1", "v2"], engines=["e1", "e2"], attempts=2),
        answer([16], [8, 9], finish="abort"),
        answer([17, 18, 19], [8, 9]),
    ]
    out = batch_answer("b1", TRL_BODY, samples, answers)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in out["choices"]] == [[10, 11, 12], [13, 14, 15], [16], [17, 18, 19]]
    assert [c["prompt_token_ids"] for c in out["choices"][::2]] == [[5, 6, 7], [8, 9]]
    assert out["choices"][1]["rollfleet"] == {
        "request_id": "b1-p0-s1",
        "weight_versions": ["v1", "v2"],
        "engines": ["e1", "e2"],
        "attempts": 2,
    }
    assert out["rollfleet"] == {"weight_versions": ["v1", "v2"], "engines": ["e1", "e2"]}
    # vLLM counts a prompt once however many samples it has.
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
    assert out["id"] == "cmpl-b1" and out["object"] == "text_completion" and out["model"] == "tiny"
    assert batch_finish_reason(out) == "abort"


def test_a_sample_stopped_before_the_engine_spoke_gets_its_prompts_ids_from_the_others() -> None:
    samples = fan_out(TRL_BODY, "b1")
    answers = [answer([], None, "abort"), answer([1], [5, 6, 7]), answer([], None, "abort"), answer([], None, "abort")]
    out = batch_answer("b1", TRL_BODY, samples, answers)
    # From its sibling, else from the prompt itself (token ids).
    assert [c["prompt_token_ids"] for c in out["choices"]] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]


def test_logprob_tokens_that_came_back_as_text_after_a_failover_are_named_by_their_ids() -> None:
    samples = fan_out(TRL_BODY | {"prompt": [[5, 6, 7]], "n": 1}, "b1")
    continued = answer([10, 11, 12], [5, 6, 7])
    logprobs = continued["choices"][0]["logprobs"]
    # The last two tokens were made by another engine: the continuation route answers text.
    logprobs["tokens"][1:] = ["t11 ", "t12 "]
    logprobs["top_logprobs"][1:] = [{}, {"t12 ": -0.5, "other": -2.0}]
    out = batch_answer("b1", TRL_BODY, samples, [continued])
    fixed = out["choices"][0]["logprobs"]
    assert fixed["tokens"] == ["token_id:10", "token_id:11", "token_id:12"]
    assert fixed["top_logprobs"] == [{"token_id:10": -0.5}, {}, {}] and fixed["token_logprobs"] == [-0.5] * 3


def test_without_logprobs_or_token_id_tokens_the_answer_is_left_as_it_came() -> None:
    body = TRL_BODY | {"prompt": [[5, 6, 7]], "n": 1, "logprobs": None}
    plain = answer([10], [5, 6, 7])
    plain["choices"][0]["logprobs"] = None
    assert batch_answer("b1", body, fan_out(body, "b1"), [plain])["choices"][0]["logprobs"] is None
    text = answer([10], [5, 6, 7])
    text["choices"][0]["logprobs"]["tokens"] = ["hello"]
    body = body | {"return_tokens_as_token_ids": False}
    assert batch_answer("b1", body, fan_out(body, "b1"), [text])["choices"][0]["logprobs"]["tokens"] == ["hello"]


def test_a_failed_sample_fails_the_batch_naming_it() -> None:
    samples = fan_out(TRL_BODY, "b1")
    ok = (200, answer([1], [5, 6, 7]))
    refused = (400, {"error": {"message": "token id 10**9 is out of vocabulary", "type": "x", "code": 400}})
    raw = (404, {"detail": "Not Found"})
    assert batch_failure(samples, [ok] * 4) is None
    assert batch_failure(samples, [ok, refused, raw, ok]) == (
        400,
        "sample b1-p0-s1 (prompt 0, sample 1) failed: token id 10**9 is out of vocabulary (1 more samples failed)",
    )
    assert batch_failure(samples, [ok, ok, raw, ok]) == (
        404,
        'sample b1-p1-s0 (prompt 1, sample 0) failed: {"detail":"Not Found"}',
    )


def test_the_weight_sync_paths_refused_are_the_engines_weight_update_routes() -> None:
    engine_routes = {START_WEIGHT_UPDATE_PATH, UPDATE_WEIGHTS_PATH, FINISH_WEIGHT_UPDATE_PATH}
    assert engine_routes <= set(TRL_WEIGHT_SYNC_PATHS)


# --- the routes' admission, in-process (an engine address that answers nothing) ---------------


@pytest.fixture
def locked() -> Iterator[TestClient]:
    config = GatewayConfig(
        token="admin",
        api_key="key",
        engines=["http://127.0.0.1:9"],
        eject_s=0.0,  # the engine stays routable after each refused connection: every route reaches it
        proxy=ProxyConfig(max_attempts=1),
    )
    with TestClient(build_app(config)) as client:
        yield client


def test_the_trl_routes_keep_the_inference_key_and_refuse_clearly(locked: TestClient) -> None:
    key = {"Authorization": "Bearer key"}
    assert locked.get(TRL_PREFIX + TRL_HEALTH_PATH).status_code == 200  # open, as vLLM's /health is
    for method, path, body in [
        ("POST", COMPLETIONS_PATH, {"prompt": [[1]]}),
        ("GET", TRL_WORLD_SIZE_PATH, None),
        ("POST", TRL_RESET_PREFIX_CACHE_PATH, None),
    ]:
        r = locked.request(method, TRL_PREFIX + path, json=body)
        assert r.status_code == 401 and "token" in r.json()["error"]["message"], path
    # A control call, as the engines' own route is: the inference key does not open it.
    r = locked.post(TRL_PREFIX + TRL_RESET_PREFIX_CACHE_PATH, headers=key)
    assert r.status_code == 401 and "needs the fleet admin token" in r.json()["error"]["message"]
    r = locked.post(TRL_PREFIX + COMPLETIONS_PATH, json={"prompt": [[1]], "stream": True}, headers=key)
    assert r.status_code == 400 and "stream from /v1/completions" in r.json()["error"]["message"]
    r = locked.post(TRL_PREFIX + COMPLETIONS_PATH, json={"prompt": [[1], "a"]}, headers=key)
    assert r.status_code == 400 and "'prompt' must be" in r.json()["error"]["message"]
    # Each sample is admitted with the batch's key, and the engine cannot be reached: which sample, and why.
    r = locked.post(TRL_PREFIX + COMPLETIONS_PATH, json={"prompt": [[1]]}, headers=key | {REQUEST_ID_HEADER: "b"})
    assert r.status_code == 502 and r.json()["error"]["message"].startswith(
        "sample b-p0-s0 (prompt 0, sample 0) failed: gave up after 1 attempts: "
        "http://127.0.0.1:9: cannot connect to 127.0.0.1:9"
    )
    r = locked.get(TRL_PREFIX + TRL_WORLD_SIZE_PATH, headers=key)
    assert r.status_code == 502 and r.json()["error"]["message"].startswith(
        f"{TRL_PREFIX}{TRL_WORLD_SIZE_PATH} failed on http://127.0.0.1:9: ConnectFailed: cannot connect to 127.0.0.1:9"
    )
    for path in TRL_WEIGHT_SYNC_PATHS:
        r = locked.post(TRL_PREFIX + path, headers=key)
        assert r.status_code == 501 and "sync sidecar" in r.json()["error"]["message"], path
