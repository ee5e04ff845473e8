"""The gateway's reading of an engine's abort: any failure to ask is "unconfirmed", never an error.

The engine's HTTP API is faked with httpx handlers (`tests.unit.engine_send`); the fan-out and the stop path
run against simulated engines in test_proxy.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from tests.unit.engine_send import handler_send

from rollfleet.engine_client import EngineClient
from rollfleet.gateway.abort import Answer, combine
from rollfleet.gateway.inflight import InFlightTable
from rollfleet.gateway.metrics import Metrics
from rollfleet.gateway.proxy import Proxy, ProxyConfig
from rollfleet.gateway.registry import Engine, static_registry
from rollfleet.gateway.routing import Router, RoutingPolicy
from rollfleet_engine.protocol import AbortStatus

URL = "http://10.0.0.7:8000"
ENGINE = Engine(key="engine-0", url=URL, routable=True)


async def ask(answer: httpx.Response | type[httpx.TransportError]) -> dict[str, AbortStatus]:
    async def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(answer, httpx.Response):
            return answer
        raise answer("down", request=request)

    proxy = Proxy(static_registry([URL]), Router(RoutingPolicy()), InFlightTable(), "token", ProxyConfig(), Metrics())
    await proxy.engines.aclose()
    proxy.engines = EngineClient("token", send=handler_send(handler))
    try:
        return await proxy.abort_on_engine(ENGINE, ["a", "b"], 1.0)
    finally:
        await proxy.close()


@pytest.mark.parametrize(
    "answer",
    [
        httpx.ConnectError,
        httpx.ReadError,
        httpx.Response(503, text="engine is shutting down"),
        httpx.Response(200, text="not json"),
    ],
)
def test_an_engine_that_could_not_be_asked_leaves_every_id_unconfirmed(
    answer: httpx.Response | type[httpx.TransportError],
) -> None:
    assert asyncio.run(ask(answer)) == {"a": AbortStatus.UNCONFIRMED, "b": AbortStatus.UNCONFIRMED}


def test_an_id_the_engine_left_out_of_its_answer_is_unknown() -> None:
    answer = httpx.Response(200, json={"results": {"a": "aborted"}})
    assert asyncio.run(ask(answer)) == {"a": AbortStatus.ABORTED, "b": AbortStatus.UNKNOWN}


def test_the_engine_that_knew_the_id_decides() -> None:
    U, F, P, N = AbortStatus.UNKNOWN, AbortStatus.FINISHED, AbortStatus.PENDING, AbortStatus.UNCONFIRMED
    assert combine({"e0": U, "e1": F, "e2": P}) == Answer(F)
    assert combine({"e0": N, "e1": P}) == Answer(P)
    assert combine({"e0": U, "e1": U}) == Answer(U)  # every engine asked, none knew it


def test_unknown_is_never_claimed_while_an_engine_could_not_be_asked() -> None:
    answer = combine({"e0": AbortStatus.UNKNOWN, "e2": AbortStatus.UNCONFIRMED, "e1": AbortStatus.UNCONFIRMED})
    assert answer.status is AbortStatus.UNCONFIRMED and answer.reason is not None
    assert "e1, e2 could not be asked" in answer.reason
