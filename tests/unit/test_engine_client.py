"""The engine client: token header, answers parsed, one error type, call policies (deadline, retries).

The HTTP boundary is faked with httpx handlers (`tests.unit.engine_send`); the engine's real routes are
exercised by tests/engine and e2e.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine

import httpx
import pytest
from tests.unit.engine_send import handler_send

from rollfleet.engine_client import (
    CONTROL,
    GATEWAY_ABORT,
    PAUSE,
    STATE_POLL,
    TRANSFER,
    VERSIONS_LOOKUP,
    CallPolicy,
    EngineCallError,
    EngineClient,
    EngineRef,
)
from rollfleet.errors import RollfleetError
from rollfleet_engine.protocol import ABORT_PATH, LOAD_PATH, STATE_PATH, AbortStatus

ENGINE = EngineRef("fleet-engine-0", "http://10.0.0.7:8000/")
STATE = {"model": "tiny", "weight_version": "v3", "paused": True, "pause_mode": "keep", "running": 2, "waiting": 0}
Handler = Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]


def client(handler: Handler, token: str | None = "admin-token") -> EngineClient:
    return EngineClient(token, send=handler_send(handler))


def recorder(answer: httpx.Response) -> tuple[list[httpx.Request], Handler]:
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer

    return seen, handler


def test_state_is_parsed_into_the_protocol_model_from_the_engine_url() -> None:
    seen, handler = recorder(httpx.Response(200, json=STATE))
    state = asyncio.run(client(handler).state(ENGINE))
    assert (state.weight_version, state.paused, state.pause_mode, state.running) == ("v3", True, "keep", 2)
    assert str(seen[0].url) == f"http://10.0.0.7:8000{STATE_PATH}" and seen[0].method == "GET"


def test_the_admin_token_goes_on_every_call_and_with_token_switches_it_on_the_same_pool() -> None:
    seen, handler = recorder(httpx.Response(200))
    tokenless = client(handler, token=None)

    async def go() -> None:
        await tokenless.resume(ENGINE)
        fleet = tokenless.with_token("fleet-a")
        await fleet.pause(ENGINE, "keep")
        assert fleet._upstream is tokenless._upstream  # the same connections for every fleet
        await tokenless.resume(ENGINE)

    asyncio.run(go())
    assert [r.headers.get("authorization") for r in seen] == [None, "Bearer fleet-a", None]
    assert seen[1].url.path == "/pause" and seen[1].url.params["mode"] == "keep"


def test_a_refusal_is_an_engine_call_error_with_status_path_and_the_engines_words() -> None:
    _, handler = recorder(httpx.Response(409, text="an update is already in progress"))
    with pytest.raises(EngineCallError) as caught:
        asyncio.run(client(handler).start_weight_update(ENGINE))
    err = caught.value
    assert isinstance(err, RollfleetError)
    assert (err.engine, err.method, err.path, err.status) == (ENGINE, "POST", "/start_weight_update", 409)
    assert str(err) == "fleet-engine-0: POST /start_weight_update: HTTP 409: an update is already in progress"


def test_an_unexpected_answer_is_an_engine_call_error_not_a_validation_error() -> None:
    _, handler = recorder(httpx.Response(200, json={"model": "tiny"}))
    with pytest.raises(EngineCallError, match="unexpected answer") as caught:
        asyncio.run(client(handler).state(ENGINE))
    assert caught.value.status == 200


def test_an_unreachable_engine_is_an_engine_call_error_without_status() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(EngineCallError, match="ConnectFailed: connection refused") as caught:
        asyncio.run(client(handler).state(ENGINE))
    assert caught.value.status is None


def flaky(failures: int, error: type[httpx.TransportError]) -> tuple[list[int], Handler]:
    """A handler failing its first `failures` requests with `error`, then answering 200."""
    calls = [0]

    async def handler(request: httpx.Request) -> httpx.Response:
        calls[0] += 1
        if calls[0] <= failures:
            raise error("down", request=request)
        return httpx.Response(200)

    return calls, handler


def test_only_failed_connections_are_retried_and_only_as_often_as_the_policy_says() -> None:
    patient = CallPolicy(timeout_s=5.0, retries=2, retry_delay_s=0.0)
    calls, handler = flaky(2, httpx.ConnectError)
    asyncio.run(client(handler).resume(ENGINE, patient))
    assert calls == [3]

    calls, handler = flaky(3, httpx.ConnectError)
    with pytest.raises(EngineCallError):
        asyncio.run(client(handler).resume(ENGINE, patient))
    assert calls == [3]

    # The request may have reached the engine: a POST is never sent twice.
    calls, handler = flaky(1, httpx.ReadError)
    with pytest.raises(EngineCallError, match="UpstreamError: down"):
        asyncio.run(client(handler).resume(ENGINE, patient))
    assert calls == [1]

    calls, handler = flaky(1, httpx.ConnectError)
    with pytest.raises(EngineCallError):
        asyncio.run(client(handler).resume(ENGINE))  # today's policies never retry
    assert calls == [1]


def slow(delay_s: float, answer: httpx.Response) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(delay_s)
        return answer

    return handler


def test_the_policy_timeout_bounds_the_whole_call() -> None:
    with pytest.raises(EngineCallError, match=r"no answer within 0\.05s") as caught:
        asyncio.run(client(slow(2.0, httpx.Response(200))).resume(ENGINE, CallPolicy(timeout_s=0.05)))
    assert caught.value.status is None


def test_an_abort_gets_the_wait_it_asks_of_the_engine_on_top_of_its_policy() -> None:
    answer = httpx.Response(200, json={"results": {"a": "aborted"}})
    quick = CallPolicy(timeout_s=0.05)
    results = asyncio.run(client(slow(0.2, answer)).abort(ENGINE, ["a", "b"], wait_s=1.0, policy=quick))
    assert results == {"a": AbortStatus.ABORTED}
    with pytest.raises(EngineCallError, match="no answer"):
        asyncio.run(client(slow(0.2, answer)).abort(ENGINE, ["a"], policy=quick))


def test_abort_sends_the_protocols_body() -> None:
    seen, handler = recorder(httpx.Response(200, json={"results": {"a": "unknown"}}))
    engines = client(handler)
    asyncio.run(engines.abort(ENGINE, ["a"], wait_s=3.0))
    asyncio.run(engines.abort(ENGINE, ["a"]))
    assert seen[0].url.path == ABORT_PATH
    assert [json.loads(r.content) for r in seen] == [
        {"request_ids": ["a"], "timeout_s": 3.0},
        {"request_ids": ["a"], "timeout_s": 10.0},
    ]


def test_weight_update_bodies() -> None:
    seen, handler = recorder(httpx.Response(200))
    engines = client(handler)
    asyncio.run(engines.update_weights(ENGINE, {"url": "http://10.0.0.9:8472", "manifest_sha256": None}))
    asyncio.run(engines.finish_weight_update(ENGINE, "v4"))
    assert [(r.url.path, json.loads(r.content)) for r in seen] == [
        ("/update_weights", {"update_info": {"url": "http://10.0.0.9:8472", "manifest_sha256": None}}),
        ("/finish_weight_update", {"weight_version": "v4"}),
    ]


def test_a_load_in_one_call_sends_the_update_and_the_version_and_reads_the_state_it_answers() -> None:
    state = {"model": "m", "weight_version": "v4", "paused": True, "running": 0, "waiting": 0}
    seen, handler = recorder(httpx.Response(200, json=state | {"weights_manifest_sha256": "aa11"}))
    info = {"url": "file:///dev/shm/staged/aa11", "manifest_sha256": "aa11"}
    answer = asyncio.run(client(handler).load(ENGINE, info, "v4"))
    assert (answer.served_version, answer.weights_manifest_sha256) == ("v4", "aa11")
    assert [(r.url.path, json.loads(r.content)) for r in seen] == [
        (LOAD_PATH, {"update_info": info | {"timeout_s": 300.0}, "weight_version": "v4"}),
    ]
    seen, handler = recorder(httpx.Response(404, json={"detail": "Not Found"}))  # an engine image without it
    with pytest.raises(EngineCallError) as caught:
        asyncio.run(client(handler).load(ENGINE, info, "v4"))
    assert caught.value.status == 404


def test_the_connect_limit_of_a_policy_reaches_the_transport() -> None:
    seen, handler = recorder(httpx.Response(200, json={"results": {}}))
    asyncio.run(client(handler).abort(ENGINE, ["a"], wait_s=1.0, policy=GATEWAY_ABORT))
    assert seen[0].extensions["connect_s"] == 2.0


def test_the_named_policies_keep_each_components_limits() -> None:
    # Operator: state reads every pass; pause by mode (wait lasts as long as requests do).
    assert STATE_POLL.timeout_s == 5.0
    assert {m: p.timeout_s for m, p in PAUSE.items()} == {"keep": 30.0, "abort": 60.0, "wait": 900.0}
    # Sidecar: control calls, and weight transfers (the default of --transfer-timeout).
    assert (CONTROL.timeout_s, TRANSFER.timeout_s) == (30.0, 900.0)
    # Gateway: abort (beyond its wait; a dead engine fails fast), the versions check.
    assert (GATEWAY_ABORT.timeout_s, GATEWAY_ABORT.connect_s, VERSIONS_LOOKUP.timeout_s) == (5.0, 2.0, 2.0)
    all_policies = [STATE_POLL, CONTROL, TRANSFER, GATEWAY_ABORT, VERSIONS_LOOKUP, *PAUSE.values()]
    assert all(p.retries == 0 for p in all_policies)
