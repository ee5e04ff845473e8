"""A client can stop only its own requests (issue 32, D4): request ids are the clients', so a stop the
gateway makes (deadline, client gone, failover) names its own attempt at the engine, and an engine ends a
request only for the sender that started it. Two gateway replicas in front of the same simulated engine, on
real sockets; the engine's half is in the engine contract suite (tests/engine/test_contract.py)."""

from __future__ import annotations

import threading

import httpx
import pytest
from tests.unit.gateway.conftest import Stack, serve_gateway, sse_chunks
from tests.unit.gateway.test_proxy import wait_until

from rollfleet.gateway.proxy import ENGINE_HEADER, ProxyConfig
from rollfleet_dev import oneshot

# About 5 s at 5 ms a token: the victim outlasts the second replica's start and the attack on a loaded host.
VICTIM_TOKENS = 1000


@pytest.mark.parametrize("stop", ["deadline", "client gone"])
def test_a_stop_on_another_replica_under_a_victims_id_does_not_stop_the_victim(gw: Stack, stop: str) -> None:
    for sim in gw.sims:
        sim.token_delay_ms = 5
    out: dict[str, str] = {}
    started = threading.Event()

    def victim() -> None:
        body = {"prompt": "x", "max_tokens": VICTIM_TOKENS, "stream": True}
        headers = {"X-Request-Id": "victim-1"}
        with oneshot.stream("POST", gw.url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
            out["engine"] = r.headers[ENGINE_HEADER]  # in static mode, the engine's URL
            started.set()
            out["text"] = r.read().decode()

    thread = threading.Thread(target=victim)
    thread.start()
    assert started.wait(10), "the victim's stream did not start"
    sim = gw.sims[gw.sim_urls.index(out["engine"])]
    # The engine is slow to take new requests: the attacker's deadline fires while its request waits there,
    # before the engine has refused the id (in flight) - the gateway then aborts the id it sent.
    sim.accept_delay_s = 0.5
    # A second replica in front of the victim's engine only: the attacker's request reaches that engine.
    with serve_gateway([], ProxyConfig(queue_timeout_s=1.0, stop_grace_s=0.5), engine_urls=[out["engine"]]) as (
        second,
        _,
    ):
        attack = {"json": {"prompt": "x", "max_tokens": 5, "stream": True}, "url": second + "/v1/completions"}
        if stop == "deadline":
            headers = {"X-Request-Id": "victim-1", "X-Rollfleet-Timeout": "0.1"}
            r = oneshot.post(**attack, headers=headers, timeout=10)
            # Its own stream, ended by its deadline; or the engine's refusal of an id in flight.
            assert r.status_code in (200, 409), r.text
        else:
            with pytest.raises(httpx.ReadTimeout):
                oneshot.post(**attack, headers={"X-Request-Id": "victim-1"}, timeout=0.1)
            # The replica's stop of the request (an abort at the engine, then the engine's 409) is over.
            wait_until(lambda: "rollfleet_gateway_in_flight 0.0" in oneshot.get(second + "/metrics").text)
        assert "victim-1" in sim.running, "the victim was stopped by another caller's deadline"
    sim.token_delay_ms = 0  # the victim runs on to its end, now without waiting
    thread.join(30)
    choices = [c for chunk in sse_chunks(out["text"]) for c in chunk["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    assert sum(len(c.get("token_ids") or []) for c in choices) == VICTIM_TOKENS
    assert sim.finished["victim-1"] == "length"
