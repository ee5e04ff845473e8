"""The three request dialects the gateway serves, and the conversions failover needs.

Pure (dicts in, dicts out). Owns:

- whether a request is streamed from the engine (`streams_upstream`): streaming clients'
  always are, and so are non-streaming ones that may generate many tokens, so that the
  gateway knows how far a request got and a failover continues it; short non-streaming
  ones are sent whole (a per-token stream costs the engine and the gateway more than
  a rare restart of a few tokens);
- the upstream body of a first attempt (with token ids);
- the body of a continuation attempt: vLLM's token-in/token-out route
  (`/inference/v1/generate`) with prompt + generated tokens and the remaining budget;
- turning a continuation chunk back into the client's dialect (same id, model,
  created), so the client sees one response;
- assembling one non-streaming response from client-dialect chunks.

Chunk shapes are vLLM 0.32's: completions carry `prompt_token_ids` in the first
choice, chat at the top level of its first chunk; every choice carries `token_ids`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rollfleet.errors import RollfleetError

Json = dict[str, Any]


class Route(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    GENERATE = "/inference/v1/generate"


class BadRequest(RollfleetError, ValueError):
    """The client's body cannot be served; the message says why (answered with 400)."""


# Sampling fields that mean the same in the OpenAI bodies and in vLLM's SamplingParams.
_SHARED_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
)
# vLLM's default max_tokens for /v1/completions when the body sets none.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


MAX_JSON_DEPTH = 128  # nesting of a request body; orjson serializes at most 254 levels (a 500 past that)
# Admission bounds: what one request may ask for. The gateway builds a closing choice per choice and
# keeps each sequence's tokens for failover, so these bound its memory per request (D6).
MAX_N = 1024
MAX_CHOICES = 16384  # n times the prompts of a batched completions request (a TRL batch: its samples)
MAX_TOKENS = 1 << 20  # above any context vLLM serves; the engine refuses past its own (400)
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def check_depth(raw: bytes, body: Any) -> None:
    """BadRequest if `body` (parsed from `raw`) nests deeper than MAX_JSON_DEPTH. Walked only when
    `raw` holds that many brackets at all, which no request of a usual shape does."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    level: list[Any] = [body]
    for depth in range(1, MAX_JSON_DEPTH + 2):
        level = [
            child
            for item in level
            if isinstance(item, dict | list)
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
        if not level:
            return
        if depth > MAX_JSON_DEPTH - 1:
            raise BadRequest(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")


def validate(route: Route, body: Any, max_model_len: int | None = None) -> Json:
    """The body, if it is one the gateway can route; BadRequest with a clear reason otherwise. With
    `max_model_len` (the engines' context, when the gateway is told it), no request asks for more tokens."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if route is Route.COMPLETIONS and not isinstance(body.get("prompt"), str | list):
        raise BadRequest("'prompt' is required: a string, a list of strings or a list of token ids")
    if route is Route.CHAT and (not isinstance(body.get("messages"), list) or not body["messages"]):
        raise BadRequest("'messages' is required: a non-empty list of chat messages")
    if route is Route.GENERATE:
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise BadRequest("'token_ids' is required: a non-empty list of non-negative token ids")
        if not isinstance(body.get("sampling_params", {}), dict):
            raise BadRequest("'sampling_params' must be an object")
    sampling = body if route is not Route.GENERATE else body.get("sampling_params", {})
    n = sampling.get("n", 1)
    if not _int(n) or not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' must be an integer from 1 to {MAX_N}")
    if (choices := choices_requested(route, body)) > MAX_CHOICES:
        raise BadRequest(f"'n' times the prompts is {choices}, over the gateway's limit of {MAX_CHOICES} choices")
    most, whose = (MAX_TOKENS, "") if max_model_len is None else (max_model_len, " (the engines' context)")
    for name in ("max_tokens", "max_completion_tokens"):
        if sampling.get(name) is not None and not (_int(sampling[name]) and 1 <= sampling[name] <= most):
            raise BadRequest(f"'{name}' must be an integer from 1 to {most}{whose}")
    logprobs = sampling.get("top_logprobs") if route is Route.CHAT else sampling.get("logprobs")
    if route is Route.CHAT and not isinstance(sampling.get("logprobs", False), bool):
        raise BadRequest("'logprobs' must be true or false")
    if logprobs is not None and not (_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        what = "top_logprobs" if route is Route.CHAT else "logprobs"
        raise BadRequest(f"'{what}' must be an integer from 0 to {MAX_LOGPROBS} (vLLM's max_logprobs)")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false")
    return body


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choices_requested(route: Route, body: Json) -> int:
    if route is Route.GENERATE:
        return int(body.get("sampling_params", {}).get("n", 1))
    prompts = body.get("prompt")
    # A list of prompts (strings or token lists) yields n choices per prompt.
    many = route is Route.COMPLETIONS and isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
    return int(body.get("n", 1)) * (len(prompts) if many and isinstance(prompts, list) else 1)


def max_new_tokens(route: Route, body: Json) -> int | None:
    """The most tokens one sequence of this request may generate; None: up to the model's context."""
    if route is Route.GENERATE:
        limit = body.get("sampling_params", {}).get("max_tokens")
    elif route is Route.CHAT:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
    else:
        limit = body.get("max_tokens", _COMPLETIONS_DEFAULT_MAX_TOKENS)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def streams_upstream(route: Route, body: Json, continue_min_tokens: int) -> bool:
    """Whether the engine streams this request to the gateway: when the client streams, and when a
    failover should continue it from its tokens (it may generate `continue_min_tokens` or more)."""
    if body.get("stream"):
        return True
    limit = max_new_tokens(route, body)
    return limit is None or limit >= continue_min_tokens


def first_attempt_body(route: Route, body: Json, stream: bool) -> Json:
    """What the engine gets on the first attempt: the client's body with token ids, streamed or not."""
    upstream = dict(body)
    if not body.get("stream"):
        upstream.pop("stream_options", None)
    upstream["stream"] = stream
    if route is not Route.GENERATE:
        upstream["return_token_ids"] = True
    return upstream


def continuation_body(route: Route, body: Json, prompt_ids: list[int], generated: list[int]) -> Json:
    """A generate-route body that continues one sequence from the tokens it already has."""
    if route is Route.GENERATE:
        params = dict(body.get("sampling_params", {}))
        output_mode = body.get("output_mode", "tokens")
    else:
        params = {k: body[k] for k in _SHARED_SAMPLING if body.get(k) is not None}
        if route is Route.COMPLETIONS:
            params["max_tokens"] = body.get("max_tokens") or _COMPLETIONS_DEFAULT_MAX_TOKENS
            if body.get("logprobs") is not None:
                params["logprobs"] = body["logprobs"]
        else:
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            if limit is not None:
                params["max_tokens"] = limit
            if body.get("logprobs"):
                params["logprobs"] = body.get("top_logprobs") or 0
        output_mode = "text"
    if params.get("max_tokens") is not None:
        params["max_tokens"] = max(1, int(params["max_tokens"]) - len(generated))
    if params.get("min_tokens"):
        params["min_tokens"] = max(0, int(params["min_tokens"]) - len(generated))
    params["n"] = 1
    out: Json = {
        "token_ids": [*prompt_ids, *generated],
        "sampling_params": params,
        "stream": True,
        "output_mode": output_mode,
    }
    if body.get("stream") and (body.get("stream_options") or {}).get("include_usage"):
        # The stream the client asked for ends with its usage: the continuation's, counted as the client's.
        out["stream_options"] = {"include_usage": True}
    if body.get("model") is not None:
        out["model"] = body["model"]
    return out


def prompt_token_ids(route: Route, body: Json, chunk: Json) -> list[int] | None:
    """The prompt's token ids, if this upstream chunk (or the body) says them."""
    if route is Route.GENERATE:
        return list(body["token_ids"])
    if route is Route.CHAT:
        ids = chunk.get("prompt_token_ids")
    else:
        choices = chunk.get("choices") or [{}]
        ids = choices[0].get("prompt_token_ids")
    return list(ids) if ids else None


@dataclass
class Template:
    """What every chunk the client sees shares, taken from the first upstream chunk."""

    id: str
    created: int
    model: str | None

    @classmethod
    def fallback(cls, route: Route, request_id: str, body: Json) -> Template:
        prefix = {Route.COMPLETIONS: "cmpl-", Route.CHAT: "chatcmpl-", Route.GENERATE: ""}[route]
        return cls(prefix + request_id, int(time.time()), body.get("model"))

    @classmethod
    def of(cls, route: Route, chunk: Json, fallback: Template) -> Template:
        key = "request_id" if route is Route.GENERATE else "id"
        return cls(
            chunk.get(key) or fallback.id,
            chunk.get("created") or fallback.created,
            chunk.get("model") or fallback.model,
        )


@dataclass
class ContinuationState:
    """Per-sequence state for converting continuation chunks: offsets in the client's output."""

    tokens_before: int
    text_offset: int = 0
    prompt_tokens: int = 0  # the client's prompt: the continuation's own counts it with the tokens before


def continued_usage(usage: Json, state: ContinuationState) -> Json:
    """A continuation's usage as the client's request's: its prompt, and every token generated for it."""
    completion = state.tokens_before + int(usage.get("completion_tokens") or 0)
    return {"prompt_tokens": state.prompt_tokens, "completion_tokens": completion,
            "total_tokens": state.prompt_tokens + completion}  # fmt: skip


def continuation_chunk(route: Route, chunk: Json, tpl: Template, state: ContinuationState) -> Json:
    """A generate-route chunk (text or tokens mode) as a chunk of the client's dialect."""
    choices = []
    for c in chunk.get("choices") or []:
        if route is Route.GENERATE:
            choice = dict(c)
            choice["index"] = 0
            if c.get("weight_versions"):
                choice["weight_versions"] = [
                    {**span, "start": span["start"] + state.tokens_before, "end": span["end"] + state.tokens_before}
                    for span in c["weight_versions"]
                ]
        else:
            text = c.get("text") or ""
            base: Json = {
                "index": 0,
                "finish_reason": c.get("finish_reason"),
                "stop_reason": c.get("stop_reason"),
                "token_ids": c.get("token_ids"),
            }
            if route is Route.CHAT:
                choice = {**base, "delta": {"content": text}, "logprobs": c.get("logprobs")}
            else:
                choice = {**base, "text": text, "logprobs": _completion_logprobs(c.get("logprobs"), state)}
            state.text_offset += len(text)
        choices.append(choice)
    if route is Route.GENERATE:
        out = dict(chunk)
        out["request_id"] = tpl.id
        out["choices"] = choices
    else:
        obj = "chat.completion.chunk" if route is Route.CHAT else "text_completion"
        out = {"id": tpl.id, "object": obj, "created": tpl.created, "model": tpl.model, "choices": choices}
    if chunk.get("usage") is not None:
        out["usage"] = continued_usage(chunk["usage"], state)
    return out


def closing_chunk(route: Route, tpl: Template, indexes: list[int], finish_reason: str) -> Json:
    """A chunk that ends the given choices with no new output (e.g. abort when the engine could not say it)."""
    base: Json = {"finish_reason": finish_reason, "stop_reason": None, "token_ids": [], "logprobs": None}
    if route is Route.GENERATE:
        return {"request_id": tpl.id, "choices": [{**base, "index": i} for i in indexes]}
    if route is Route.CHAT:
        choices = [{**base, "index": i, "delta": {}} for i in indexes]
        return {
            "id": tpl.id,
            "object": "chat.completion.chunk",
            "created": tpl.created,
            "model": tpl.model,
            "choices": choices,
        }
    choices = [{**base, "index": i, "text": ""} for i in indexes]
    return {"id": tpl.id, "object": "text_completion", "created": tpl.created, "model": tpl.model, "choices": choices}


def _completion_logprobs(chat_logprobs: Json | None, state: ContinuationState) -> Json | None:
    """Chat-format logprobs (what the generate route returns in text mode) in completions format."""
    if not chat_logprobs or not chat_logprobs.get("content"):
        return None
    out: Json = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = state.text_offset
    for entry in chat_logprobs["content"]:
        out["text_offset"].append(offset)
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in entry.get("top_logprobs") or []})
        offset += len(entry["token"])
    return out


@dataclass
class _Sequence:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, Json] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: Json | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    weight_versions: list[Json] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None


class Assembler:
    """Builds the one JSON response of a non-streaming client from client-dialect chunks."""

    def __init__(self, route: Route, output_mode: str = "tokens", n: int = 1) -> None:
        self.route = route
        self.output_mode = output_mode
        self.n = n  # choices per prompt: choice i answers prompt i // n
        self.seqs: dict[int, _Sequence] = {}
        self.prompt_token_ids: list[int] | None = None
        self.system_fingerprint: str | None = None  # vLLM's build and config (its last chunk says it)

    def reset(self) -> None:
        self.seqs.clear()

    def add(self, chunk: Json) -> None:
        if self.route is not Route.COMPLETIONS and chunk.get("prompt_token_ids") and self.prompt_token_ids is None:
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("system_fingerprint"):
            self.system_fingerprint = chunk["system_fingerprint"]
        for c in chunk.get("choices") or []:
            seq = self.seqs.setdefault(int(c.get("index", 0)), _Sequence())
            if self.route is Route.CHAT:
                delta = c.get("delta") or {}
                if delta.get("content"):
                    seq.text.append(delta["content"])
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    seq.reasoning.append(reasoning)
                for call in delta.get("tool_calls") or []:
                    _merge_tool_call(seq.tool_calls, call)
            elif c.get("text"):
                seq.text.append(c["text"])
            if self.route is Route.COMPLETIONS and c.get("prompt_token_ids") and seq.prompt_token_ids is None:
                seq.prompt_token_ids = list(c["prompt_token_ids"])
            seq.token_ids.extend(c.get("token_ids") or [])
            seq.logprobs = _merge_logprobs(seq.logprobs, c.get("logprobs"))
            seq.weight_versions.extend(c.get("weight_versions") or [])
            if c.get("finish_reason") is not None:
                seq.finish_reason = c["finish_reason"]
                seq.stop_reason = c.get("stop_reason")

    def response(self, tpl: Template, prompt_tokens: int | None, extra: Json) -> Json:
        """The answer; `prompt_tokens` is the one prompt's length, where the choices do not say each prompt's."""
        completion_tokens = sum(len(s.token_ids) for s in self.seqs.values())
        per_prompt = [s.prompt_token_ids for i, s in self.seqs.items() if i % self.n == 0]
        if self.route is Route.COMPLETIONS and per_prompt and all(ids is not None for ids in per_prompt):
            # Several prompts (a batch): vLLM counts each prompt's tokens once, whatever n.
            prompt_tokens = sum(len(ids) for ids in per_prompt if ids is not None)
        usage = {
            "prompt_tokens": prompt_tokens or 0,
            "completion_tokens": completion_tokens,
            "total_tokens": (prompt_tokens or 0) + completion_tokens,
        }
        choices = [self._choice(i, s) for i, s in sorted(self.seqs.items())]
        if self.route is Route.GENERATE:
            out: Json = {
                "request_id": tpl.id,
                "model": tpl.model,
                "created": tpl.created,
                "output_mode": self.output_mode,
                "choices": choices,
                "usage": usage,
            }
        else:
            obj = "chat.completion" if self.route is Route.CHAT else "text_completion"
            out = {
                "id": tpl.id,
                "object": obj,
                "created": tpl.created,
                "model": tpl.model,
                "choices": choices,
                "usage": usage,
            }
            if self.system_fingerprint is not None:
                out["system_fingerprint"] = self.system_fingerprint
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        out.update(extra)
        return out

    def _choice(self, index: int, s: _Sequence) -> Json:
        base: Json = {
            "index": index,
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
            "token_ids": s.token_ids,
            "logprobs": s.logprobs,
        }
        if self.route is Route.CHAT:
            message: Json = {"role": "assistant", "content": "".join(s.text) if s.text or not s.tool_calls else None}
            if s.reasoning:
                message["reasoning_content"] = "".join(s.reasoning)
            if s.tool_calls:
                message["tool_calls"] = [s.tool_calls[i] for i in sorted(s.tool_calls)]
            return {**base, "message": message}
        if self.route is Route.COMPLETIONS:
            return {**base, "text": "".join(s.text), "prompt_token_ids": s.prompt_token_ids}
        choice = {**base, "weight_versions": s.weight_versions or None}
        if self.output_mode == "text":
            choice["text"] = "".join(s.text)
        return choice


def _merge_tool_call(calls: dict[int, Json], delta: Json) -> None:
    """OpenAI streams a tool call as deltas by index: id/name once, arguments in pieces."""
    index = int(delta.get("index", 0))
    call = calls.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


def _merge_logprobs(acc: Json | None, new: Json | None) -> Json | None:
    """Concatenate per-token logprob lists (chat/generate: `content`; completions: four lists)."""
    if not new:
        return acc
    if acc is None:
        return copy.deepcopy(new)
    for key, value in new.items():
        if isinstance(value, list):
            acc.setdefault(key, [])
            acc[key] = (acc[key] or []) + value
    return acc
