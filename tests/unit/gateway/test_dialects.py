"""Request shapes, failover continuation bodies and chunks, and non-streaming assembly."""

from __future__ import annotations

import orjson
import pytest

from rollfleet.gateway.dialects import (
    MAX_JSON_DEPTH,
    Assembler,
    BadRequest,
    ContinuationState,
    Route,
    Template,
    check_depth,
    choices_requested,
    closing_chunk,
    continuation_body,
    continuation_chunk,
    first_attempt_body,
    prompt_token_ids,
    streams_upstream,
    validate,
)

TPL = Template("cmpl-r1", 100, "tiny")


@pytest.mark.parametrize(
    ("route", "body", "reason"),
    [
        (Route.COMPLETIONS, [], "JSON object"),
        (Route.COMPLETIONS, {"model": "m"}, "'prompt'"),
        (Route.CHAT, {"messages": []}, "'messages'"),
        (Route.GENERATE, {"token_ids": [1, -2]}, "'token_ids'"),
        (Route.GENERATE, {"token_ids": [1], "sampling_params": 3}, "'sampling_params'"),
        (Route.COMPLETIONS, {"prompt": "x", "n": 0}, "'n'"),
        (Route.COMPLETIONS, {"prompt": "x", "stream": "yes"}, "'stream'"),
        # Bounds (D6), each answer naming its limit.
        (Route.COMPLETIONS, {"prompt": "x", "n": 1_000_000}, "'n' must be an integer from 1 to 1024"),
        (Route.COMPLETIONS, {"prompt": "x", "n": True}, "'n'"),
        (Route.COMPLETIONS, {"prompt": ["a"] * 17, "n": 1000}, "'n' times the prompts is 17000, over .* 16384"),
        (Route.GENERATE, {"token_ids": [1], "sampling_params": {"n": 2000}}, "from 1 to 1024"),
        (Route.COMPLETIONS, {"prompt": "x", "max_tokens": 2**64}, "'max_tokens' must be an integer from 1"),
        (Route.COMPLETIONS, {"prompt": "x", "max_tokens": 1.5}, "'max_tokens'"),
        (Route.CHAT, {"messages": [{}], "max_completion_tokens": 0}, "'max_completion_tokens'"),
        (Route.GENERATE, {"token_ids": [1], "sampling_params": {"max_tokens": "9"}}, "'max_tokens'"),
        (Route.COMPLETIONS, {"prompt": "x", "logprobs": 21}, r"'logprobs' must be an integer from 0 to 20"),
        (Route.CHAT, {"messages": [{}], "logprobs": True, "top_logprobs": 50}, "'top_logprobs'"),
        (Route.CHAT, {"messages": [{}], "logprobs": 3}, "'logprobs' must be true or false"),
        (Route.GENERATE, {"token_ids": [1], "sampling_params": {"logprobs": -1}}, "'logprobs'"),
    ],
)
def test_malformed_bodies_are_refused_with_the_reason(route: Route, body: object, reason: str) -> None:
    with pytest.raises(BadRequest, match=reason):
        validate(route, body)


def test_requests_within_the_bounds_pass_as_they_are() -> None:
    for route, body in (
        (Route.COMPLETIONS, {"prompt": ["a"] * 4, "n": 1024, "max_tokens": 1 << 20, "logprobs": 20}),
        (Route.CHAT, {"messages": [{}], "logprobs": True, "top_logprobs": 0, "max_completion_tokens": 1}),
        (Route.GENERATE, {"token_ids": [1], "sampling_params": {"n": 8, "logprobs": 0, "max_tokens": None}}),
    ):
        assert validate(route, body) is body


def test_max_tokens_past_the_engines_context_is_refused_when_the_gateway_knows_it() -> None:
    for route, body in (
        (Route.COMPLETIONS, {"prompt": "x", "max_tokens": 513}),
        (Route.CHAT, {"messages": [{}], "max_completion_tokens": 513}),
        (Route.GENERATE, {"token_ids": [1], "sampling_params": {"max_tokens": 513}}),
    ):
        with pytest.raises(BadRequest, match=r"from 1 to 512 \(the engines' context\)"):
            validate(route, body, max_model_len=512)
    assert validate(Route.COMPLETIONS, {"prompt": "x", "max_tokens": 512}, max_model_len=512)


def test_choices_count_prompts_and_n() -> None:
    assert choices_requested(Route.COMPLETIONS, {"prompt": ["a", "b"], "n": 2}) == 4
    assert choices_requested(Route.COMPLETIONS, {"prompt": [1, 2, 3]}) == 1
    assert choices_requested(Route.GENERATE, {"token_ids": [1], "sampling_params": {"n": 3}}) == 3


def test_first_attempt_asks_token_ids_streamed_or_not() -> None:
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    up = first_attempt_body(Route.COMPLETIONS, body, stream=True)
    assert up["stream"] is True and up["return_token_ids"] is True and "stream_options" not in up
    assert "stream" not in body  # the client's body is not changed
    whole = first_attempt_body(Route.COMPLETIONS, body, stream=False)
    assert whole["stream"] is False and whole["return_token_ids"] is True
    assert "return_token_ids" not in first_attempt_body(Route.GENERATE, {"token_ids": [1]}, stream=False)


def test_long_or_streaming_requests_stream_from_the_engine_and_short_ones_are_sent_whole() -> None:
    def streams(route: Route, body: dict) -> bool:  # type: ignore[type-arg]
        return streams_upstream(route, body, continue_min_tokens=256)

    assert streams(Route.COMPLETIONS, {"prompt": "x", "max_tokens": 8, "stream": True})
    assert not streams(Route.COMPLETIONS, {"prompt": "x"})  # vLLM's default: 16 tokens
    assert streams(Route.COMPLETIONS, {"prompt": "x", "max_tokens": 256})
    assert streams(Route.CHAT, {"messages": []})  # no limit: up to the context
    assert not streams(Route.CHAT, {"messages": [], "max_completion_tokens": 64, "max_tokens": 4096})
    assert streams(Route.CHAT, {"messages": [], "max_tokens": 4096})
    assert not streams(Route.GENERATE, {"token_ids": [1], "sampling_params": {"max_tokens": 100}})
    assert streams(Route.GENERATE, {"token_ids": [1], "sampling_params": {}})


def test_chat_continuation_carries_sampling_and_the_remaining_budget() -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 10,
        "temperature": 0.5,
        "stop": ["\n"],
        "logprobs": True,
        "top_logprobs": 2,
        "min_tokens": 5,
    }
    out = continuation_body(Route.CHAT, body, [1, 2], [7, 8, 9])
    assert out["token_ids"] == [1, 2, 7, 8, 9] and out["output_mode"] == "text" and out["model"] == "tiny"
    assert out["sampling_params"] == {
        "temperature": 0.5,
        "stop": ["\n"],
        "max_tokens": 7,
        "logprobs": 2,
        "min_tokens": 2,
        "n": 1,
    }


def test_a_continuation_asks_for_usage_where_the_client_did_and_counts_it_as_the_clients() -> None:
    asked = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    assert continuation_body(Route.COMPLETIONS, asked, [1], [5, 6])["stream_options"] == {"include_usage": True}
    assert "stream_options" not in continuation_body(Route.COMPLETIONS, {"prompt": "x", "stream": True}, [1], [5])
    chunk = {"request_id": "generate-x", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    state = ContinuationState(tokens_before=6, prompt_tokens=3)
    usage = {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    assert continuation_chunk(Route.CHAT, chunk, TPL, state)["usage"] == usage
    assert continuation_chunk(Route.GENERATE, chunk, TPL, state)["usage"] == usage


def test_completions_continuation_uses_vllms_default_budget_when_none_is_set() -> None:
    out = continuation_body(Route.COMPLETIONS, {"prompt": "x"}, [1], [5, 6])
    assert out["sampling_params"]["max_tokens"] == 14


def test_generate_continuation_keeps_the_clients_sampling_params_and_output_mode() -> None:
    body = {"token_ids": [3, 4], "sampling_params": {"max_tokens": 5, "top_k": 3}, "output_mode": "tokens"}
    out = continuation_body(Route.GENERATE, body, [3, 4], [9])
    assert out["token_ids"] == [3, 4, 9] and out["output_mode"] == "tokens"
    assert out["sampling_params"] == {"max_tokens": 4, "top_k": 3, "n": 1}


def test_prompt_ids_come_from_where_each_dialect_puts_them() -> None:
    assert prompt_token_ids(Route.COMPLETIONS, {}, {"choices": [{"prompt_token_ids": [1, 2]}]}) == [1, 2]
    assert prompt_token_ids(Route.CHAT, {}, {"prompt_token_ids": [3]}) == [3]
    assert prompt_token_ids(Route.GENERATE, {"token_ids": [4]}, {}) == [4]
    assert prompt_token_ids(Route.CHAT, {}, {"choices": []}) is None


GEN_TEXT_CHUNK = {
    "request_id": "generate-tokens-x",
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [5, 6],
            "text": "ab",
            "weight_versions": [{"version": "v2", "start": 0, "end": 2}],
            "logprobs": {
                "content": [
                    {"token": "a", "logprob": -1.0, "top_logprobs": [{"token": "a", "logprob": -1.0}]},
                    {"token": "b", "logprob": -2.0, "top_logprobs": []},
                ]
            },
        }
    ],
}


def test_continuation_chunk_as_a_completions_chunk_with_completions_logprobs() -> None:
    state = ContinuationState(tokens_before=3, text_offset=4)
    out = continuation_chunk(Route.COMPLETIONS, GEN_TEXT_CHUNK, TPL, state)
    assert out["id"] == "cmpl-r1" and out["object"] == "text_completion" and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["text"] == "ab" and choice["token_ids"] == [5, 6] and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "text_offset": [4, 5],
        "token_logprobs": [-1.0, -2.0],
        "tokens": ["a", "b"],
        "top_logprobs": [{"a": -1.0}, {}],
    }
    assert state.text_offset == 6


def test_continuation_chunk_as_chat_and_as_generate() -> None:
    chat = continuation_chunk(Route.CHAT, GEN_TEXT_CHUNK, TPL, ContinuationState(0))
    assert chat["object"] == "chat.completion.chunk" and chat["choices"][0]["delta"] == {"content": "ab"}
    gen = continuation_chunk(Route.GENERATE, GEN_TEXT_CHUNK, TPL, ContinuationState(tokens_before=3))
    assert gen["request_id"] == "cmpl-r1"
    # Weight-version spans count output tokens from the start of the client's response.
    assert gen["choices"][0]["weight_versions"] == [{"version": "v2", "start": 3, "end": 5}]


def test_assembled_chat_response_merges_content_tool_calls_and_logprobs() -> None:
    asm = Assembler(Route.CHAT)
    asm.add({"prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    asm.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "he"},
                    "token_ids": [7],
                    "logprobs": {"content": [{"token": "he", "logprob": -1}]},
                }
            ]
        }
    )
    asm.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "id": "call1", "function": {"name": "f", "arguments": '{"a"'}}]
                    },
                    "token_ids": [8],
                }
            ]
        }
    )
    asm.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "token_ids": [9],
                    "finish_reason": "tool_calls",
                    "logprobs": {"content": [{"token": "x", "logprob": -2}]},
                }
            ]
        }
    )
    out = asm.response(Template("chatcmpl-r", 1, "tiny"), 2, {"rollfleet": {"attempts": 1}})
    choice = out["choices"][0]
    assert choice["message"]["content"] == "he" and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"] == [
        {"id": "call1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert choice["token_ids"] == [7, 8, 9] and [e["logprob"] for e in choice["logprobs"]["content"]] == [-1, -2]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert out["prompt_token_ids"] == [1, 2] and out["rollfleet"] == {"attempts": 1}


def test_closing_chunk_ends_open_choices_in_each_dialect() -> None:
    for route in Route:
        chunk = closing_chunk(route, TPL, [0, 2], "abort")
        assert [c["index"] for c in chunk["choices"]] == [0, 2]
        assert all(c["finish_reason"] == "abort" for c in chunk["choices"])
    asm = Assembler(Route.COMPLETIONS)
    asm.add({"choices": [{"index": 0, "text": "ab", "token_ids": [1, 2]}]})
    asm.add(closing_chunk(Route.COMPLETIONS, TPL, [0], "abort"))
    choice = asm.response(TPL, 1, {})["choices"][0]
    assert choice["text"] == "ab" and choice["finish_reason"] == "abort"


def test_a_batch_answer_counts_each_prompts_tokens_once_and_says_vllms_fingerprint() -> None:
    """As vLLM's own answer: usage.prompt_tokens sums the prompts (not n times each), and system_fingerprint (in
    vLLM's last chunk of each choice) is kept."""
    asm = Assembler(Route.COMPLETIONS, n=2)
    for index, prompt in ((0, [1, 2, 3]), (1, [1, 2, 3]), (2, [4, 5]), (3, [4, 5])):
        asm.add({"choices": [{"index": index, "text": "a", "token_ids": [9], "prompt_token_ids": prompt}]})
    asm.add({"system_fingerprint": "vllm-x", "choices": [{"index": 3, "text": "", "finish_reason": "length"}]})
    out = asm.response(TPL, 3, {})
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert out["system_fingerprint"] == "vllm-x"


def test_json_deeper_than_the_limit_is_a_bad_request_not_a_server_error() -> None:
    """D8: 254-1023 levels parsed, then failed to serialize for the engine (a 500 with a traceback)."""

    def nested(depth: int) -> bytes:
        return b'{"prompt": "x", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    for depth in (2, MAX_JSON_DEPTH):
        raw = nested(depth)
        check_depth(raw, orjson.loads(raw))
        orjson.dumps(orjson.loads(raw))  # what the gateway sends on must serialize
    for depth in (MAX_JSON_DEPTH + 1, 300, 1000):
        raw = nested(depth)
        with pytest.raises(BadRequest, match=f"deeper than {MAX_JSON_DEPTH} levels"):
            check_depth(raw, orjson.loads(raw))
    # Many brackets side by side are not depth.
    wide = b'{"prompt": [' + b",".join([b"[1]"] * 1000) + b"]}"
    check_depth(wide, orjson.loads(wide))
