"""The gateway's own logic against simulated engines: dialects, failover, stop, admission.

Fake upstreams (devtools/rollfleet_dev/sim_engine.py); the same behaviours on real vLLM engines are the
acceptance tests in e2e/test_gateway.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.unit.gateway.conftest import TOKEN, Stack, sse_chunks

from rollfleet.gateway.dialects import MAX_JSON_DEPTH
from rollfleet.gateway.proxy import trace_context
from rollfleet_dev import oneshot
from rollfleet_dev.sim_engine import SimEngine
from rollfleet_engine.protocol import TrackedRequest

ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def wait_until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("tokens", [5, 10])  # sent whole to the engine / streamed from it and assembled
def test_non_streaming_answer_has_token_ids_and_a_report(gw: Stack, path: str, tokens: int) -> None:
    body = {"model": "m", "max_tokens": tokens}
    body |= {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    rid = f"whole-{path[-5:]}-{tokens}"
    r = oneshot.post(gw.url + path, json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == tokens
    assert out["usage"]["completion_tokens"] == tokens
    prompt_ids = choice["prompt_token_ids"] if path == "/v1/completions" else out["prompt_token_ids"]
    assert prompt_ids and out["usage"]["prompt_tokens"] == len(prompt_ids)
    assert out["rollfleet"]["weight_versions"] == ["v1"] and out["rollfleet"]["attempts"] == 1
    assert r.headers["x-rollfleet-weight-version"] == "v1" and r.headers["x-request-id"] == rid
    assert any(rid in sim.streamed for sim in gw.sims) == (tokens >= 8)


def test_a_short_non_streaming_request_whose_engine_dies_starts_over_on_the_other(gw: Stack) -> None:
    probe = oneshot.post(gw.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 1}).json()
    # A request without a session goes to the idle engine freed last: the probe's.
    victim = next(s for s, u in zip(gw.sims, gw.sim_urls, strict=True) if u == probe["rollfleet"]["engines"][0])
    victim.die_after = {"/v1/completions": 2}
    r = oneshot.post(
        gw.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5}, headers={"X-Request-Id": "short"}
    )
    assert r.status_code == 200, r.text
    choice, report = r.json()["choices"][0], r.json()["rollfleet"]
    assert choice["token_ids"] == [(3 + i) % 97 + 3 for i in range(5)] and choice["finish_reason"] == "length"
    assert report["attempts"] == 2 and len(set(report["engines"])) == 2
    assert not any("short" in sim.streamed for sim in gw.sims)  # sent whole both times: nothing to continue from


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_dying_mid_stream_is_continued_on_the_other_from_its_tokens(gw: Stack, stream: bool) -> None:
    for sim in gw.sims:
        sim.die_after = {"/v1/completions": 4}  # first attempts die; continuations (generate route) do not
    r = oneshot.post(
        gw.url + "/v1/completions",
        json={"prompt": "abc", "max_tokens": 10, "stream": stream},
        headers={"X-Request-Id": f"failover-{stream}"},
    )
    assert r.status_code == 200, r.text
    if stream:
        chunks = sse_chunks(r.text)
        ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        assert {c["id"] for c in chunks} == {"cmpl-failover-True"}
        report, finish = chunks[-1]["rollfleet"], chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        ids, report, finish = choice["token_ids"], r.json()["rollfleet"], choice["finish_reason"]
    # Exactly the sequence one engine would have produced: 4 tokens, then 6 continued.
    assert ids == [(3 + i) % 97 + 3 for i in range(10)]
    assert finish == "length" and report["attempts"] == 2 and len(set(report["engines"])) == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_continued_stream_ends_with_the_usage_of_the_whole_request(gw: Stack, path: str) -> None:
    for sim in gw.sims:
        sim.die_after = {path: 4}  # first attempts die; continuations (generate route) do not
    body = {"model": "m", "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"prompt": "abc"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = oneshot.post(gw.url + path, json=body, headers={"X-Request-Id": f"usage-{path[-5:]}"})
    assert r.status_code == 200, r.text
    chunks = sse_chunks(r.text)
    assert chunks[-1]["choices"] == [] and all("usage" not in c for c in chunks[:-1])
    prompt = next(
        c for c in chunks if c.get("prompt_token_ids") or (c["choices"] and c["choices"][0].get("prompt_token_ids"))
    )
    prompt_ids = prompt.get("prompt_token_ids") or prompt["choices"][0]["prompt_token_ids"]
    # As one engine would have counted it: the client's prompt, and all 10 tokens (4, then 6 continued).
    assert chunks[-1]["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 10,
        "total_tokens": len(prompt_ids) + 10,
    }
    assert [c["rollfleet"]["attempts"] for c in chunks if "rollfleet" in c] == [2]


def test_without_the_generate_route_a_non_streaming_request_starts_over_on_the_other_engine(gw: Stack) -> None:
    probe = oneshot.post(gw.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 1}).json()
    # A request without a session goes to the idle engine freed last: the probe's.
    victim = next(s for s, u in zip(gw.sims, gw.sim_urls, strict=True) if u == probe["rollfleet"]["engines"][0])
    victim.die_after = {"/v1/completions": 4}
    for sim in gw.sims:
        sim.refuse = {"/inference/v1/generate"}
    r = oneshot.post(
        gw.url + "/v1/completions",
        json={"prompt": "abc", "max_tokens": 10},
        headers={"X-Request-Id": "no-generate-route"},
    )
    assert r.status_code == 200, r.text
    choice, report = r.json()["choices"][0], r.json()["rollfleet"]
    assert choice["token_ids"] == [(3 + i) % 97 + 3 for i in range(10)] and choice["finish_reason"] == "length"
    assert report["attempts"] == 3 and len(set(report["engines"])) == 2


def test_failover_is_bounded_and_answers_a_clear_error(gw: Stack) -> None:
    for sim in gw.sims:
        sim.die_after = {"/v1/completions": 0, "/inference/v1/generate": 0}
    r = oneshot.post(gw.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 10}, timeout=10)
    assert r.status_code == 503 and "no routable engine" in r.json()["error"]["message"]
    r = oneshot.get(gw.url + "/metrics")
    assert "rollfleet_gateway_failovers_total" in r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_spanning_a_weight_update_reports_both_versions(gw: Stack, stream: bool) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5
    out: dict = {}

    def run() -> None:
        out["r"] = oneshot.post(
            gw.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 120, "stream": stream},
            headers={"X-Request-Id": f"span-{stream}"},
            timeout=30,
        )

    thread = threading.Thread(target=run)
    thread.start()
    # Tokens under v1 first: an id only admitted may still answer its headers after the update.
    wait_until(lambda: any(t.output_tokens > 0 for s in gw.sims for t in _in_flight(s, f"span-{stream}")))
    for sim in gw.sims:
        sim.weight_version = "v2"
    thread.join(30)
    r = out["r"]
    report = sse_chunks(r.text)[-1]["rollfleet"] if stream else r.json()["rollfleet"]
    assert report["weight_versions"] == ["v1", "v2"]
    # Which tokens came from which: two segments, end to end, whose counts add up to the answer's.
    (v1, v2) = report["weight_segments"]
    assert (v1["version"], v1["start"], v2["version"], v2["end"]) == ("v1", 0, "v2", 120)
    assert v1["end"] == v2["start"] > 0


def _in_flight(sim: SimEngine, rid: str) -> list[TrackedRequest]:
    return [t for t in sim.tracker.view(recent=0).in_flight if t.request_id == rid]


def test_short_requests_trust_the_engines_header(gw: Stack) -> None:
    r = oneshot.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.json()["rollfleet"]["weight_versions"] == ["v1"]


def _start_stream(gw: Stack, rid: str, out: dict) -> threading.Thread:
    def run() -> None:
        with oneshot.stream(
            "POST",
            gw.url + "/v1/completions",
            headers={"X-Request-Id": rid},
            json={"prompt": "x", "max_tokens": 2000, "stream": True},
            timeout=30,
        ) as r:
            out["text"] = r.read().decode()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def scraped(gw: Stack, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """One metric's samples at the gateway's /metrics, by their labels."""
    text = oneshot.get(gw.url + "/metrics").text
    return {
        frozenset(s.labels.items()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_abort_by_id_ends_the_stream_with_abort_at_the_engine_and_answers_per_id(gw: Stack) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5
    timed_before = sum(scraped(gw, "rollfleet_gateway_abort_seconds_count").values())
    out: dict = {}
    thread = _start_stream(gw, "ab-1", out)
    wait_until(lambda: any("ab-1" in s.running for s in gw.sims))
    r = oneshot.post(gw.url + "/v1/abort", json={"request_ids": ["ab-1", "never-seen"]}, headers=ADMIN)
    assert r.json() == {"results": {"ab-1": "aborted", "never-seen": "unknown"}, "reasons": {}}
    thread.join(10)
    chunks = sse_chunks(out["text"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert any(s.finished.get("ab-1") == "abort" for s in gw.sims)
    r = oneshot.post(gw.url + "/v1/abort", json={"request_ids": ["ab-1"]}, headers=ADMIN)
    assert r.json() == {"results": {"ab-1": "aborted"}, "reasons": {}}  # remembered after the end
    # Each `aborted` answer is timed, from the call to the engine's word; `unknown` is not.
    assert sum(scraped(gw, "rollfleet_gateway_abort_seconds_count").values()) == timed_before + 2


def test_tokens_served_are_counted_by_engine_and_weight_lag(gw: Stack) -> None:
    before = scraped(gw, "rollfleet_gateway_tokens_total")
    r = oneshot.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "ignore_eos": True})
    [engine] = r.json()["rollfleet"]["engines"]
    after = scraped(gw, "rollfleet_gateway_tokens_total")
    # A static gateway knows no engine's weight generation: its lag is unknown, not 0.
    key = frozenset({("engine", engine), ("lag", "unknown")})
    assert after[key] - before.get(key, 0.0) == 5, after


def test_abort_of_an_id_served_elsewhere_fans_out_to_the_engines(gw: Stack) -> None:
    gw.sims[1].token_delay_ms = 5
    out: dict = {}

    def run() -> None:  # straight to an engine, as another gateway replica would have sent it
        r = oneshot.post(
            gw.sim_urls[1] + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2000, "stream": True},
            headers={"X-Request-Id": "elsewhere-1"},
            timeout=30,
        )
        out["text"] = r.text

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: "elsewhere-1" in gw.sims[1].running)
    r = oneshot.post(gw.url + "/v1/abort", json={"request_ids": ["elsewhere-1"]}, headers=ADMIN)
    assert r.json() == {"results": {"elsewhere-1": "aborted"}, "reasons": {}}
    thread.join(10)
    assert sse_chunks(out["text"])[-1]["choices"][0]["finish_reason"] == "abort"


def test_an_abort_the_engines_do_not_confirm_is_answered_unconfirmed_with_the_reason(gw: Stack) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5
        sim.refuse = {"/rollfleet/v1/abort"}
    out: dict = {}
    thread = _start_stream(gw, "deaf-1", out)
    wait_until(lambda: any("deaf-1" in s.running for s in gw.sims))
    r = oneshot.post(gw.url + "/v1/abort", json={"request_ids": ["deaf-1", "nowhere-1"]}, headers=ADMIN)
    body = r.json()
    assert body["results"] == {"deaf-1": "unconfirmed", "nowhere-1": "unconfirmed"}, body
    # In flight here: its engine refused the abort and the gateway cut the stream after the grace.
    assert "did not end within" in body["reasons"]["deaf-1"]
    # Not in flight here: no engine could be asked, so it may run on any.
    assert "could not be asked" in body["reasons"]["nowhere-1"]
    thread.join(10)
    assert sse_chunks(out["text"])[-1]["choices"][0]["finish_reason"] == "abort"
    # The cut connection stopped it at the engine all the same (as vLLM does when its client leaves).
    wait_until(lambda: not any("deaf-1" in s.running for s in gw.sims))
    again = oneshot.post(gw.url + "/v1/abort", json={"request_ids": ["deaf-1"]}, headers=ADMIN).json()
    assert again["results"] == {"deaf-1": "unconfirmed"}  # remembered as unconfirmed, not as aborted


# A long non-streaming request is streamed from its engine; a short one (under continue_min_tokens) is sent
# whole: either way, the engine must stop it.
STREAMED_OR_WHOLE = pytest.mark.parametrize(
    ("max_tokens", "delay_ms"), [(2000, 5), (7, 200)], ids=["streamed", "whole"]
)


@STREAMED_OR_WHOLE
def test_a_non_streaming_client_that_disconnects_frees_the_engine_request(
    gw: Stack, max_tokens: int, delay_ms: float
) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = delay_ms
    rid = f"gone-{max_tokens}"
    with pytest.raises(httpx.ReadTimeout):
        oneshot.post(
            gw.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": max_tokens},
            headers={"X-Request-Id": rid},
            timeout=0.5,
        )
    wait_until(lambda: any(s.finished.get(rid) == "abort" for s in gw.sims))
    assert not any(rid in s.running for s in gw.sims)


@STREAMED_OR_WHOLE
def test_a_request_past_its_deadline_returns_its_partial_output_with_abort(
    gw: Stack, max_tokens: int, delay_ms: float
) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = delay_ms
    rid = f"late-{max_tokens}"
    r = oneshot.post(
        gw.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": max_tokens},
        headers={"X-Request-Id": rid, "X-Rollfleet-Timeout": "0.3"},
        timeout=10,
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < max_tokens
    assert any(s.finished.get(rid) == "abort" for s in gw.sims)


def test_an_id_still_in_flight_is_refused_not_resent(gw: Stack) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5
    out: dict = {}
    thread = _start_stream(gw, "dup-1", out)
    wait_until(lambda: any("dup-1" in s.running for s in gw.sims))
    r = oneshot.post(gw.url + "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "dup-1"})
    assert r.status_code == 409 and "still in flight" in r.json()["error"]["message"]
    oneshot.post(gw.url + "/v1/abort", json={"request_ids": ["dup-1"]}, headers=ADMIN)
    thread.join(10)


@pytest.mark.parametrize(
    ("path", "content", "headers", "status", "needle"),
    [
        ("/v1/completions", b"{not json", {}, 400, "not valid JSON"),
        ("/v1/completions", b'{"model": "m"}', {}, 400, "'prompt' is required"),
        ("/v1/chat/completions", b'{"messages": "hi"}', {}, 400, "'messages' is required"),
        ("/v1/completions", b'{"prompt": "' + b"x" * 70000 + b'"}', {}, 413, "exceeds"),
        ("/v1/completions", b'{"prompt": "x"}', {"X-Rollfleet-Timeout": "soon"}, 400, "number of seconds"),
        ("/v1/completions", b'{"prompt": "x"}', {"X-Request-Id": "bad id!"}, 400, "request id"),
        ("/v1/abort", b'{"request_ids": ["a"]}', {}, 401, "admin token"),
        ("/v1/abort", b'{"request_ids": ["a"]}', {"Authorization": "Bearer wrong"}, 401, "admin token"),
        ("/v1/abort", b'{"request_ids": []}', ADMIN, 400, "bad abort request"),
    ],
)
def test_bad_requests_get_clear_4xx_and_the_gateway_keeps_serving(
    gw: Stack, path: str, content: bytes, headers: dict, status: int, needle: str
) -> None:
    r = oneshot.post(gw.url + path, content=content, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    ok = oneshot.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_health_ready_models_and_metrics(gw: Stack) -> None:
    assert oneshot.get(gw.url + "/health").json() == {"status": "ok"}
    assert oneshot.get(gw.url + "/ready").json() == {"ready": True, "routable_engines": 2}
    assert oneshot.get(gw.url + "/v1/models").json()["data"][0]["id"].startswith("sim-")
    oneshot.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    oneshot.post(gw.url + "/v1/completions", content=b"x" * 70000)
    text = oneshot.get(gw.url + "/metrics").text
    assert 'rollfleet_gateway_requests_total{outcome="length",route="/v1/completions"}' in text
    assert 'rollfleet_gateway_request_seconds_count{route="/v1/completions"}' in text
    assert 'rollfleet_gateway_rejected_total{status="413"}' in text


def test_an_api_key_guards_inference_routes_and_the_admin_token_passes_too() -> None:
    from starlette.testclient import TestClient

    from rollfleet.gateway.app import GatewayConfig, build_app

    app = build_app(GatewayConfig(token=TOKEN, api_key="inference-key", engines=["http://127.0.0.1:9"]))
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic inference-key"}):
            r = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and "bearer token" in r.json()["error"]["message"]
        # Past authentication, a malformed body is judged: both tokens are accepted.
        for token in ("inference-key", TOKEN):
            r = client.post("/v1/completions", json={}, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 400
        # The inference key is not the admin token.
        r = client.post("/v1/abort", json={"request_ids": ["a"]}, headers={"Authorization": "Bearer inference-key"})
        assert r.status_code == 401


def test_a_deep_body_gets_a_400_from_the_gateway(gw: Stack) -> None:
    deep = b'{"prompt": "x", "max_tokens": 1, "extra": ' + b"[" * 299 + b"]" * 299 + b"}"
    r = oneshot.post(f"{gw.url}/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and f"deeper than {MAX_JSON_DEPTH} levels" in r.json()["error"]["message"], r.text


def test_a_session_key_longer_than_the_limit_is_refused(gw: Stack) -> None:
    from rollfleet.gateway.app import MAX_SESSION_KEY

    body = {"prompt": "x", "max_tokens": 1}
    r = oneshot.post(f"{gw.url}/v1/completions", json=body, headers={"X-Session-Id": "s" * (MAX_SESSION_KEY + 1)})
    assert r.status_code == 400 and f"longer than {MAX_SESSION_KEY} characters" in r.json()["error"]["message"]
    r = oneshot.post(f"{gw.url}/v1/completions", json=body, headers={"X-Session-Id": "s" * MAX_SESSION_KEY})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_requests_on_an_engine_whose_pod_goes_move_to_the_other_from_their_tokens(gw: Stack, stream: bool) -> None:
    """An eviction or a drain: the engine still serves, the gateway moves what runs there (aborts it there, goes on
    elsewhere from the tokens its client has); the client sees one whole answer."""
    for sim in gw.sims:
        sim.token_delay_ms = 5
    rid, out = f"move-{stream}", {}

    def run() -> None:
        body = {"prompt": "abc", "max_tokens": 300, "stream": stream}
        out["r"] = oneshot.post(gw.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=30)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: any(rid in s.running and s.tracker.get(rid).output_tokens >= 20 for s in gw.sims))  # type: ignore[union-attr]
    leaving = next(i for i, s in enumerate(gw.sims) if rid in s.running)
    key = gw.sim_urls[leaving]
    engine = gw.on_gateway_loop(lambda proxy: proxy.registry.get(key))
    try:
        gw.on_gateway_loop(lambda proxy: proxy.registry.upsert(replace(engine, routable=False, leaving=True)))
        thread.join(30)
    finally:
        gw.on_gateway_loop(lambda proxy: proxy.registry.upsert(engine))
    r = out["r"]
    assert r.status_code == 200, r.text
    if stream:
        chunks = sse_chunks(r.text)
        ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        report, finish = chunks[-1]["rollfleet"], chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        ids, report, finish = choice["token_ids"], r.json()["rollfleet"], choice["finish_reason"]
    # Exactly the sequence one engine would have produced, from the two engines in turn.
    assert ids == [(3 + i) % 97 + 3 for i in range(300)]
    assert finish == "length" and report["engines"] == [key, gw.sim_urls[1 - leaving]]
    assert gw.sims[leaving].finished[rid] == "abort"  # freed where it left, not run to its end there
    metrics = oneshot.get(gw.url + "/metrics").text
    assert "rollfleet_gateway_moves_total" in metrics


def test_a_stopped_request_whose_engine_ends_the_stream_unsaid_ends_with_abort(gw: Stack) -> None:
    """The engine ended the stream of an aborted request without the chunk that says so: the client still gets
    its tokens and finish_reason abort, not a 502."""
    for sim in gw.sims:
        sim.token_delay_ms = 5
        sim.silent_abort = True
    out: dict = {}
    thread = _start_stream(gw, "silent-1", out)
    wait_until(lambda: any("silent-1" in s.running for s in gw.sims))
    r = oneshot.post(gw.url + "/v1/abort", json={"request_ids": ["silent-1"]}, headers=ADMIN)
    assert r.status_code == 200, r.text
    thread.join(10)
    chunks = sse_chunks(out["text"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and "error" not in out["text"]
    assert chunks[-1]["rollfleet"]["attempts"] == 1


def _complete(gw: Stack, headers: dict[str, str], timeout: float = 30) -> httpx.Response:
    return oneshot.post(
        gw.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers=headers, timeout=timeout
    )


def test_a_request_with_a_weight_lag_bound_goes_only_to_engines_within_it_and_the_engine_gets_the_bound(
    gw: Stack,
) -> None:
    """The generations are what the operator's rollfleet.dev/weight-generation annotations say, as the gateway's
    pod watch would pass them on."""
    keys = gw.sim_urls
    engines = [gw.on_gateway_loop(lambda proxy, k=k: proxy.registry.get(k)) for k in keys]

    def generations(*gens: int | None) -> None:
        for e, g in zip(engines, gens, strict=True):
            gw.on_gateway_loop(lambda proxy, e=e, g=g: proxy.registry.upsert(replace(e, generation=g)))

    try:
        generations(3, 2)
        for i in range(4):
            r = _complete(gw, {"X-Rollfleet-Max-Weight-Lag": "0", "X-Request-Id": f"lag0-{i}"})
            assert r.status_code == 200, r.text
            assert r.json()["rollfleet"]["engines"] == [keys[0]]  # never the engine a generation behind
            tracked = gw.sims[0].tracker.get(f"lag0-{i}")
            assert tracked is not None and tracked.max_weight_lag == 0  # the engine's pause checks it at a push
        served = {  # new sessions, which spread over the engines the bound admits
            _complete(gw, {"X-Rollfleet-Max-Weight-Lag": "1", "X-Session-Id": f"lag1-{i}"}).json()["rollfleet"][
                "engines"
            ][0]
            for i in range(6)
        }
        assert served == set(keys)  # a bound of 1 takes the engine a generation behind too
        generations(None, 2)  # an engine of unknown weights is out; the bound counts from the newest known
        assert _complete(gw, {"X-Rollfleet-Max-Weight-Lag": "0"}).json()["rollfleet"]["engines"] == [keys[1]]
        # The engine within the bound fails mid-request: the other is a generation behind, so the request is not
        # continued there; it is held for an engine within the bound, then refused saying why.
        generations(3, 2)
        gw.sims[0].die_after = {"/v1/completions": 1}
        r = _complete(gw, {"X-Rollfleet-Max-Weight-Lag": "0", "X-Request-Id": "lag-held"})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "X-Rollfleet-Max-Weight-Lag 0" in message and f"{keys[1]} at 2" in message, message
        assert "lag-held" not in gw.sims[1].finished  # never sent to the engine outside the bound
    finally:
        for e in engines:
            gw.on_gateway_loop(lambda proxy, e=e: proxy.registry.upsert(e))


@pytest.mark.parametrize("value", ["-1", "one", "2.5", "1000001"])
def test_a_bad_weight_lag_bound_is_refused_naming_the_header(gw: Stack, value: str) -> None:
    r = _complete(gw, {"X-Rollfleet-Max-Weight-Lag": value})
    assert r.status_code == 400 and "X-Rollfleet-Max-Weight-Lag" in r.json()["error"]["message"], r.text


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    ("traceparent", "forwarded"),
    [
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01", True),
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01-{'x' * 4000}", False),  # trailing bytes: never reach the engine
        (f"ff-{TRACE_ID}-00f067aa0ba902b7-01", False),  # version ff is invalid
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", False),  # an all-zero trace id is invalid
        (f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01", False),  # W3C ids are lowercase hex
        (None, False),
    ],
)
def test_a_callers_trace_context_reaches_the_engine_only_when_well_formed(
    gw: Stack, traceparent: str | None, forwarded: bool
) -> None:
    rid = f"trace-{abs(hash(traceparent))}"
    headers = {"X-Request-Id": rid} | ({"traceparent": traceparent} if traceparent else {})
    r = oneshot.post(gw.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
    assert r.status_code == 200, r.text  # a malformed trace context is ignored, as W3C says, not refused
    seen = next(sim.traces[rid] for sim in gw.sims if rid in sim.traces)
    assert seen == (traceparent if forwarded else None)


def test_trace_context_keeps_a_tracestate_only_beside_a_valid_traceparent_and_within_w3cs_bounds() -> None:
    parent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    assert trace_context(parent, "vendor=abc") == (("traceparent", parent), ("tracestate", "vendor=abc"))
    assert trace_context(parent, "x" * 513) == (("traceparent", parent),)
    assert trace_context(parent, "a=\x01") == (("traceparent", parent),)
    assert trace_context("garbage", "vendor=abc") == ()
