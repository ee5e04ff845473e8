"""The trainer client against a faked gateway (httpx's MockTransport): what it sends, what it returns,
the typed error of every failure, and the abort sent when the caller gives up. The real gateway and
engines are the e2e suite's (e2e/test_client.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from typing import Any, get_args

import httpx
import pytest

from rollfleet.sync import server as sync_server
from rollfleet_client import (
    AsyncRolloutClient,
    EngineFailed,
    GatewayUnreachable,
    GenerateTimeout,
    NotSettled,
    PushInProgress,
    RequestIdInUse,
    RequestRefused,
    RolloutClient,
    Unauthorized,
    protocol,
)
from rollfleet_client.models import PauseMode
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import SYNC_API_PORT
from rollfleet_engine import protocol as engine_protocol

Handler = Callable[[httpx.Request], httpx.Response]
ANSWER = {
    "choices": [
        {
            "text": "ab",
            "token_ids": [7, 8],
            "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5, -1.0], "tokens": ["a", "b"], "top_logprobs": [{}, {}]},
        }
    ],
    "prompt_token_ids": [1, 2, 3],
    "rollfleet": {"attempts": 2, "engines": ["e0", "e1"]},
}


def client(handler: Handler, **kwargs: Any) -> AsyncRolloutClient:
    return AsyncRolloutClient("http://gw:8080", model="tiny", transport=httpx.MockTransport(handler), **kwargs)


def test_the_headers_shared_with_the_engine_are_spelled_alike() -> None:
    # The client depends on nothing of Rollfleet's, so it spells them itself.
    assert protocol.REQUEST_ID_HEADER == engine_protocol.REQUEST_ID_HEADER
    assert protocol.WEIGHT_VERSION_HEADER == engine_protocol.WEIGHT_VERSION_HEADER
    assert protocol.MAX_WEIGHT_LAG_HEADER == engine_protocol.MAX_WEIGHT_LAG_HEADER
    assert get_args(PauseMode) == engine_protocol.PAUSE_MODES


def test_generate_sends_token_ids_and_sampling_and_returns_tokens_logprobs_and_versions() -> None:
    seen: list[httpx.Request] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=ANSWER, headers={protocol.WEIGHT_VERSION_HEADER: "v3,v4"})

    async def go() -> None:
        async with client(gateway) as fleet:
            g = await fleet.generate(
                [1, 2, 3], request_id="r-1", session_id="s", timeout_s=30, max_tokens=2, logprobs=0
            )
        assert (g.request_id, g.token_ids, g.logprobs, g.finish_reason) == ("r-1", [7, 8], [-0.5, -1.0], "length")
        assert (g.weight_version, g.weight_versions, g.engines) == ("v3", ["v3", "v4"], ["e0", "e1"])
        assert g.prompt_token_ids == [1, 2, 3]

    asyncio.run(go())
    [request] = seen
    assert request.url.path == protocol.COMPLETIONS_PATH
    body = json.loads(request.content)
    assert body == {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "return_token_ids": True,
        "max_tokens": 2,
        "logprobs": 0,
        "stream": False,
    }
    assert request.headers[protocol.REQUEST_ID_HEADER] == "r-1"
    assert request.headers[protocol.SESSION_HEADER] == "s"
    assert request.headers[protocol.TIMEOUT_HEADER] == "30.000"


@pytest.mark.parametrize(
    ("status", "error"),
    [(400, RequestRefused), (401, Unauthorized), (409, RequestIdInUse), (502, EngineFailed), (503, EngineFailed)],
)
def test_every_refusal_is_a_typed_error_carrying_the_servers_message(status: int, error: type[Exception]) -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": f"the reason {status}"}})

    async def go() -> None:
        async with client(gateway) as fleet:
            with pytest.raises(error, match=f"the reason {status}"):
                await fleet.generate("hi", max_tokens=1)

    asyncio.run(go())


def test_no_gateway_at_the_url_says_where_it_looked() -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> None:
        async with client(gateway) as fleet:
            with pytest.raises(GatewayUnreachable, match="http://gw:8080"):
                await fleet.generate("hi")

    asyncio.run(go())


def test_a_cancelled_generate_aborts_its_id_at_the_gateway_with_the_token() -> None:
    aborts: list[httpx.Request] = []
    started = asyncio.Event()

    async def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == protocol.ABORT_PATH:
            aborts.append(request)
            return httpx.Response(200, json={"results": {"r-9": "aborted"}, "reasons": {}})
        started.set()
        await asyncio.sleep(3600)  # a long generation
        raise AssertionError("unreachable")

    async def go() -> None:
        fleet = AsyncRolloutClient("http://gw:8080", model="tiny", token="t0k", transport=httpx.MockTransport(gateway))
        task = asyncio.create_task(fleet.generate("hi", request_id="r-9"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await fleet.aclose()

    asyncio.run(go())
    [abort] = aborts
    assert json.loads(abort.content)["request_ids"] == ["r-9"]
    assert abort.headers["Authorization"] == "Bearer t0k"


def test_a_timed_out_generate_is_aborted_and_raises() -> None:
    aborted: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == protocol.ABORT_PATH:
            aborted.extend(json.loads(request.content)["request_ids"])
            return httpx.Response(200, json={"results": {"r-t": "aborted"}})
        raise httpx.ReadTimeout("timed out", request=request)

    async def go() -> None:
        async with client(gateway, token="t") as fleet:
            with pytest.raises(GenerateTimeout, match="r-t"):
                await fleet.generate("hi", request_id="r-t", timeout_s=0.5)

    asyncio.run(go())
    assert aborted == ["r-t"]


def test_abort_without_a_token_says_where_the_token_comes_from(tmp_path: Any) -> None:
    async def go() -> None:
        async with client(lambda r: httpx.Response(200), token_file=str(tmp_path / "none")) as fleet:
            with pytest.raises(Unauthorized, match="admin-token"):
                await fleet.abort(["x"])

    asyncio.run(go())


def test_a_fleet_name_and_namespace_find_its_gateway_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    fleet = AsyncRolloutClient(fleet="tiny", namespace="team")
    assert fleet.gateway_url == "http://tiny-gateway.team.svc:8080" and fleet.model == "tiny"
    asyncio.run(fleet.aclose())
    # In a pod of the fleet's namespace: the Service's address from the environment kubelet sets.
    monkeypatch.setenv("POD_NAMESPACE", "team")
    monkeypatch.setenv("TINY_GATEWAY_SERVICE_HOST", "10.96.0.9")
    monkeypatch.setenv("TINY_GATEWAY_SERVICE_PORT", "8080")
    for fleet in (AsyncRolloutClient(fleet="tiny"), AsyncRolloutClient(fleet="tiny", namespace="team")):
        assert fleet.gateway_url == "http://10.96.0.9:8080"
        asyncio.run(fleet.aclose())
    other = AsyncRolloutClient(fleet="tiny", namespace="elsewhere")  # another namespace's: by DNS
    assert other.gateway_url == "http://tiny-gateway.elsewhere.svc:8080"
    asyncio.run(other.aclose())


def test_the_sync_client_runs_the_same_calls() -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == protocol.ABORT_PATH:
            return httpx.Response(200, json={"results": {"a": "unknown"}, "reasons": {}})
        return httpx.Response(200, json=ANSWER)

    with RolloutClient("http://gw:8080", model="tiny", token="t", transport=httpx.MockTransport(gateway)) as fleet:
        assert fleet.generate("hi", max_tokens=2).token_ids == [7, 8]
        assert fleet.abort(["a"]).results == {"a": "unknown"}


STATE = {
    "fleet": "tiny",
    "namespace": "team",
    "replicas": 2,
    "ready_replicas": 2,
    "weight_version": "v4",
    "weight_generation": 4,
    "generations": {"v3": 3, "v4": 4},
    "pause": {"mode": "keep", "since": "2026-11-24T10:00:00Z", "paused_engines": 2, "requested_by": "x"},
    "engines": [{"name": "e0", "phase": "Paused"}, {"name": "e1", "phase": "Paused"}],
}


def test_pause_sends_the_mode_the_caller_and_the_token_and_returns_the_fleets_state() -> None:
    seen: list[httpx.Request] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=STATE)

    async def go() -> None:
        async with client(gateway, token="t", caller="trainer-0") as fleet:
            state = await fleet.pause("wait", wait_s=30)
        assert state.pause is not None and state.pause.mode == "keep" and state.generations["v4"] == 4

    asyncio.run(go())
    (request,) = seen
    assert request.url.path == protocol.FLEET_PAUSE_PATH and json.loads(request.content) == {
        "mode": "wait",
        "wait_s": 30,
    }
    assert request.headers["authorization"] == "Bearer t" and request.headers[protocol.CALLER_HEADER] == "trainer-0"


def test_a_pause_during_a_push_or_not_done_in_time_is_a_typed_error() -> None:
    def pushing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": {"message": "a weight push to version v5 is in progress"}})

    def slow(request: httpx.Request) -> httpx.Response:
        return httpx.Response(202, json=STATE)

    async def go() -> None:
        async with client(pushing, token="t") as fleet:
            with pytest.raises(PushInProgress, match="v5"):
                await fleet.resume()
        async with client(slow, token="t") as fleet:
            with pytest.raises(NotSettled, match="e0 Paused") as late:
                await fleet.pause("keep", wait_s=1)
            assert late.value.state.fleet == "tiny"

    asyncio.run(go())


def test_a_generation_carries_the_generation_number_of_each_weight_version() -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == protocol.FLEET_PATH:
            return httpx.Response(200, json=STATE)
        return httpx.Response(200, json=ANSWER, headers={protocol.WEIGHT_VERSION_HEADER: "v3,v4"})

    async def go() -> None:
        async with client(gateway, token="t") as fleet:
            g = await fleet.generate([1], max_tokens=2)
        assert g.weight_generations == [3, 4] and g.weight_generation == 3

    asyncio.run(go())


def test_a_generation_tells_which_tokens_came_from_which_version_when_the_gateway_knows() -> None:
    segments = [{"version": "v3", "start": 0, "end": 1}, {"version": "v4", "start": 1, "end": 2}]
    told = {**ANSWER, "rollfleet": {**ANSWER["rollfleet"], "weight_segments": segments}}  # type: ignore[dict-item]

    def gateway(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=told, headers={protocol.WEIGHT_VERSION_HEADER: "v3,v4"})

    async def go() -> None:
        async with client(gateway) as fleet:
            g = await fleet.generate([1], max_tokens=2)
        assert [(s.version, s.start, s.end) for s in g.weight_segments] == [("v3", 0, 1), ("v4", 1, 2)]
        assert sum(s.end - s.start for s in g.weight_segments) == len(g.token_ids)

    asyncio.run(go())


def test_the_client_finds_the_sidecar_where_the_sidecar_binds() -> None:
    parser = argparse.ArgumentParser()
    sync_server.add_arguments(parser)
    args = parser.parse_args(["--fleet=f"])
    with SyncClient() as sidecar:
        assert sidecar.url == f"http://{args.host}:{args.port}" == f"http://127.0.0.1:{SYNC_API_PORT}"
