"""What the sidecar reads from engines, in the sync protocol's terms (HTTP faked: `tests.unit.engine_send`)."""

from __future__ import annotations

import asyncio

import httpx
from tests.unit.engine_send import handler_send

from rollfleet.engine_client import EngineClient, EngineRef
from rollfleet.sync.engines import in_flight, observe
from rollfleet.sync.protocol import EngineObservation, InFlight
from rollfleet_engine.protocol import REQUESTS_PATH, STATE_PATH

ENGINE = EngineRef("http://10.0.0.7:8000", "http://10.0.0.7:8000")
ANSWERS = {
    STATE_PATH: {"model": "tiny", "weight_version": "v2", "paused": True, "running": 1, "waiting": 0},
    REQUESTS_PATH: {
        "in_flight": [{"request_id": "r1", "phase": "running", "weight_versions": ["v1", "v2"]}],
        "recently_finished": [{"request_id": "r0", "phase": "finished", "weight_versions": ["v1"]}],
    },
}


async def engine(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=ANSWERS[request.url.path])


async def unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_an_engine_is_observed_by_its_version_and_pause_state() -> None:
    api = EngineClient("token", send=handler_send(engine))
    assert asyncio.run(observe(api, ENGINE)) == EngineObservation(version="v2", paused=True)


def test_an_unreachable_engine_is_observed_as_version_none() -> None:
    api = EngineClient("token", send=handler_send(unreachable))
    assert not asyncio.run(observe(api, ENGINE)).reachable


def test_in_flight_requests_carry_the_versions_that_produced_them() -> None:
    api = EngineClient("token", send=handler_send(engine))
    assert asyncio.run(in_flight(api, ENGINE)) == [InFlight("r1", ("v1", "v2"))]


def test_an_engine_with_mixed_weights_is_on_no_version() -> None:
    async def mixed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**ANSWERS[STATE_PATH], "weights_intact": False})

    api = EngineClient("token", send=handler_send(mixed))
    observed = asyncio.run(observe(api, ENGINE))
    assert observed == EngineObservation(version="v2", paused=True, intact=False)
    assert observed.reachable and observed.served is None
