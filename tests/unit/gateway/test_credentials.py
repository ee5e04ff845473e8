"""Which credential the gateway asks for and which it sends (issue 32, secure by default): with an inference
key (a fleet's default), every route but health, ready and metrics refuses a caller without one; generation
reaches the engines with the inference token, and the admin token goes only to their control routes. On
real sockets, in front of a simulated engine that enforces the engine's own access rule."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from e2e.fleet_helpers import gateway_routes
from tests.unit.gateway.conftest import TOKEN, serve_gateway, sse_chunks
from tests.unit.gateway.test_proxy import wait_until

from rollfleet.gateway.app import OPEN_PATHS
from rollfleet.gateway.proxy import ProxyConfig
from rollfleet_client.protocol import ABORT_PATH, COMPLETIONS_PATH
from rollfleet_dev import oneshot
from rollfleet_dev.sim_engine import SimEngine
from rollfleet_engine.access import AccessPolicy, RouteClass, classify

INFERENCE = "unit-inference-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
KEY = {"Authorization": f"Bearer {INFERENCE}"}


@dataclass(frozen=True)
class RecordingPolicy(AccessPolicy):
    """The engine's rule, remembering who presented what for each route class."""

    seen: list[tuple[RouteClass, str | None]] = field(default_factory=list, compare=False)

    def decide(self, method: str, path: str, authorization: str | None) -> tuple[int, str] | None:
        self.seen.append((classify(method, path), authorization))
        return super().decide(method, path, authorization)


@pytest.fixture(scope="module")
def locked() -> Iterator[tuple[str, RecordingPolicy, SimEngine]]:
    policy = RecordingPolicy(control_token=TOKEN, inference_token=INFERENCE)
    sim = SimEngine("sim-locked", token_delay_ms=5, policy=policy)
    with serve_gateway([sim], ProxyConfig(stop_grace_s=2.0), api_key=INFERENCE) as (url, _):
        yield url, policy, sim


@pytest.mark.parametrize(("method", "path"), gateway_routes(), ids=[f"{m} {p}" for m, p in gateway_routes()])
def test_without_a_credential_every_route_but_health_ready_and_metrics_is_refused(
    locked: tuple[str, RecordingPolicy, SimEngine], method: str, path: str
) -> None:
    url, _, _ = locked
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = oneshot.request(method, url + path, json={}, headers=headers, timeout=10)
        if path in OPEN_PATHS:
            assert r.status_code == 200, (path, r.text)
        else:
            assert r.status_code == 401 and "token" in r.json()["error"]["message"], (path, r.text)


def test_the_token_may_come_as_the_password_of_basic_auth(locked: tuple[str, RecordingPolicy, SimEngine]) -> None:
    """TRL's client carries a credential only in its URL (`http://trl:<token>@host/trl`): requests sends Basic."""
    url, _, _ = locked
    body = {"prompt": "x", "max_tokens": 2}
    assert oneshot.post(url + COMPLETIONS_PATH, json=body, auth=("trl", INFERENCE), timeout=10).status_code == 200
    for auth in (("trl", "wrong"), (INFERENCE, "")):
        assert oneshot.post(url + COMPLETIONS_PATH, json=body, auth=auth, timeout=10).status_code == 401
    assert (
        oneshot.post(url + ABORT_PATH, json={"request_ids": ["x"]}, auth=("trl", TOKEN), timeout=10).status_code == 200
    )


def test_an_unknown_path_is_refused_as_well(locked: tuple[str, RecordingPolicy, SimEngine]) -> None:
    url, _, _ = locked
    assert oneshot.post(url + "/v1/not-a-route", json={}, timeout=10).status_code == 401  # deny by default


def test_generation_carries_the_inference_token_and_only_control_carries_the_admin_token(
    locked: tuple[str, RecordingPolicy, SimEngine],
) -> None:
    url, policy, sim = locked
    policy.seen.clear()
    for caller in (KEY, ADMIN):  # the admin token opens generation at the gateway too
        r = oneshot.post(url + COMPLETIONS_PATH, json={"prompt": "x", "max_tokens": 3}, headers=caller, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    # A stream stopped once it runs at the engine: the gateway aborts it there, a control call.
    out: dict[str, str] = {}

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 100_000, "stream": True}
        headers = KEY | {"X-Request-Id": "creds-1"}
        out["text"] = oneshot.post(url + COMPLETIONS_PATH, json=body, headers=headers, timeout=30).text

    thread = threading.Thread(target=stream)
    thread.start()
    wait_until(lambda: "creds-1" in sim.running)
    r = oneshot.post(url + ABORT_PATH, json={"request_ids": ["creds-1"]}, headers=ADMIN, timeout=30)
    assert r.json()["results"] == {"creds-1": "aborted"}, r.text
    thread.join(30)
    assert sse_chunks(out["text"])[-1]["choices"][0]["finish_reason"] == "abort"
    presented = {(kind, auth) for kind, auth in policy.seen if kind is not RouteClass.OPEN}
    assert presented == {
        (RouteClass.INFERENCE, f"Bearer {INFERENCE}"),
        (RouteClass.CONTROL, f"Bearer {TOKEN}"),
    }, presented
