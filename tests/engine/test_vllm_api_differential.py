"""A gateway answers as vLLM's own server does (issue 33): every request of a corpus (vllm_api_corpus.jsonl, one
case per line: add cases there) goes to a real vLLM engine and to a gateway in front of that same engine, and the
two answers must agree: the status always, and for answers that are not errors every field but ids and the
differences in DELIBERATE, each with its reason. Each case runs on the engine, then through the gateway, with the
engine's prefix cache reset before each, so both see the same engine; cases that pause and resume come in order,
so both see the same pause state."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollfleet.gateway.proxy import ProxyConfig
from tests.engine.conftest import Engine
from tests.unit.gateway.conftest import serve_gateway

pytestmark = pytest.mark.engine

CORPUS = Path(__file__).with_name("vllm_api_corpus.jsonl")
CASES: list[dict[str, Any]] = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
IDS = {"id", "request_id", "created"}  # made per request (ids) or per second (created): never equal
# What the gateway answers on purpose that vLLM does not, and why (docs/gateway.md).
DELIBERATE = {
    "rollfleet": "what produced the answer (weight versions, engines, attempts): the body's or the last chunk's",
    "engines": "/reset_prefix_cache: each engine's own answer, next to vLLM's success",
}
# Errors agree on the status; the message is the gateway's own where it refuses before the engine (OpenAI's
# error shape, naming the limit), and vLLM's FastAPI validation answers {"detail": ...}.
# Cases the gateway answers otherwise on purpose: (why, the gateway's status).
DELIBERATE_CASES = {
    "completions-max-tokens-as-a-string": (
        "vLLM's pydantic takes '5' as 5; the gateway takes max_tokens only as an integer it can bound (issue 32)",
        400,
    ),
    "completions-stream-as-a-string": (
        "vLLM's pydantic takes 'yes' as true; the gateway decides streaming from a JSON boolean only (issue 32)",
        400,
    ),
}


def normalize(value: Any) -> Any:
    """Without ids and DELIBERATE fields; a field that is null is as one left out (vLLM's models default every
    optional field to None; the gateway's answer assembled from a stream has no place for most of them)."""
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in IDS and k not in DELIBERATE and v is not None}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def merged(a: Any, b: Any) -> Any:
    """Two chunks of one choice as one: text joined, lists extended, dicts merged key by key, else the later
    value unless it is null."""
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: merged(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a.keys() | b.keys()}
    return a if b is None else b


def by_choice(events: list[Any]) -> dict[str, Any]:
    """A stream's events by choice, each choice's chunks merged into one (with the fields of the events that
    carried them): how vLLM cuts a choice into chunks depends on its pace (a busy engine puts two tokens in
    one chunk), and the chunks of several choices (n, or several prompts) interleave in the engine's order of
    the moment. Events with no choice (usage) in order."""
    choices: dict[int, Any] = {}
    for event in events:
        fields = {k: v for k, v in event.items() if k != "choices"}
        for choice in event.get("choices") or ():
            index = choice.get("index", 0)
            if index in choices:  # the event's own fields (id, model, object) are the same in every chunk
                choices[index] = {**choices[index], **fields, "choice": merged(choices[index]["choice"], choice)}
            else:
                choices[index] = {**fields, "choice": choice}
    return {"choices": choices, "other": [e for e in events if not e.get("choices")]}


def comparable(response: httpx.Response) -> Any:
    body = answer(response)
    return normalize(by_choice(body) if isinstance(body, list) else body)


def differences(a: Any, b: Any, at: str = "") -> list[str]:
    """Where two normalized answers differ; floats (logprobs) to float32's precision."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{at}.{k}: only in {'vLLM' if k in a else 'the gateway'}" for k in sorted(a.keys() ^ b.keys())]
        return out + [d for k in sorted(a.keys() & b.keys()) for d in differences(a[k], b[k], f"{at}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{at}: {len(a)} items from vLLM, {len(b)} from the gateway"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{at}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6):
        return []
    return [] if a == b else [f"{at}: {a!r} from vLLM, {b!r} from the gateway"]


def answer(response: httpx.Response) -> Any:
    """The JSON of an answer, or of each event of a stream (ending with [DONE])."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [ln[6:] for ln in response.text.split("\n") if ln.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]", response.text[-300:]
        return [json.loads(ln) for ln in lines[:-1]]
    return response.json() if response.content else None


def call(client: httpx.Client, url: str, case: dict[str, Any], admin: dict[str, str]) -> httpx.Response:
    headers = {**admin} if case.get("admin") else {}
    content = case["raw"].encode() if "raw" in case else None
    body = case.get("body") if content is None and "body" in case else None
    if body is not None or content is not None:
        headers["Content-Type"] = "application/json"
    return client.request(
        case["method"], url + case["path"], params=case.get("query"), json=body, content=content, headers=headers
    )


@pytest.fixture(scope="module")
def gateway(real_engine: Engine) -> Iterator[str]:
    # continue_min_tokens 4: requests of 4 tokens or more are streamed from the engine and assembled, shorter
    # ones sent whole: the corpus meets both of the gateway's ways to a non-streamed answer.
    with serve_gateway(
        [], ProxyConfig(continue_min_tokens=4), engine_urls=[real_engine.url], token=real_engine.token
    ) as (
        url,
        _,
    ):
        yield url


def test_the_corpus_has_sixty_cases_or_more_with_errors_among_them() -> None:
    names = [c["name"] for c in CASES]
    assert len(names) >= 60 and len(set(names)) == len(names)
    assert sum("error" in n for n in names) >= 15


def test_the_gateway_answers_each_case_as_vllm_does(real_engine: Engine, gateway: str) -> None:
    failures = []
    with httpx.Client(timeout=60) as client:
        for case in CASES:
            got = {}
            for target, url in (("vLLM", real_engine.url), ("gateway", gateway)):
                client.post(real_engine.url + "/reset_prefix_cache", headers=real_engine.auth).raise_for_status()
                got[target] = call(client, url, case, real_engine.auth)
            direct, through = got["vLLM"], got["gateway"]
            if case["name"] in DELIBERATE_CASES:
                why, status = DELIBERATE_CASES[case["name"]]
                if through.status_code != status:
                    failures.append(f"{case['name']}: {through.status_code} from the gateway, not {status} ({why})")
            elif direct.status_code != through.status_code:
                failures.append(
                    f"{case['name']}: status {direct.status_code} from vLLM ({direct.text[:200]}), "
                    f"{through.status_code} from the gateway ({through.text[:200]})"
                )
            elif direct.status_code < 400:
                found = differences(comparable(direct), comparable(through))
                failures += [f"{case['name']}: {d}" for d in found[:5]]
    assert not failures, f"{len(failures)} difference(s):\n" + "\n".join(failures)
