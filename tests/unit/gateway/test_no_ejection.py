"""An engine is never ejected for what a client's input or the gateway's own limits caused (issue 32):
an answer short of the choices asked for, and connects that fail for want of the gateway's own file
descriptors. One simulated engine behind a gateway that ejects for 10 minutes: were the engine ejected,
the next request would find no engine to route to (503)."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import httpx
import pytest
from tests.unit.gateway.conftest import serve_gateway, sse_chunks

from rollfleet.gateway.proxy import ProxyConfig
from rollfleet_dev import oneshot
from rollfleet_dev.sim_engine import SimEngine

EJECT_S = 600.0


@pytest.fixture(scope="module")
def one() -> Iterator[tuple[str, SimEngine]]:
    sim = SimEngine("only")
    proxy = ProxyConfig(queue_timeout_s=1.0, continue_min_tokens=8)
    with serve_gateway([sim], proxy, eject_s=EJECT_S) as (url, _):
        yield url, sim


def _still_served(url: str) -> None:
    r = oneshot.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, f"the engine was ejected: {r.status_code} {r.text}"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [3, 12])  # sent whole to the engine, and streamed from it
def test_an_answer_short_of_the_choices_asked_fails_the_request_and_ejects_no_engine(
    one: tuple[str, SimEngine], stream: bool, max_tokens: int
) -> None:
    url, sim = one
    sim.max_choices = 2
    try:
        served = sim.served
        body = {"prompt": "x", "max_tokens": max_tokens, "n": 4, "stream": stream}
        r = oneshot.post(url + "/v1/completions", json=body, timeout=30)
        assert sim.served == served + 1  # no other attempt
        if stream:
            error = sse_chunks(r.text)[-1]["error"]  # the stream had begun: its last event says why it ended
            assert r.status_code == 200 and "2 of the 4 choices asked for finished" in error["message"], r.text
        else:
            assert r.status_code == 502 and "2 of the 4 choices asked for finished" in r.json()["error"]["message"]
    finally:
        sim.max_choices = None
    _still_served(url)


def test_a_gateway_out_of_file_descriptors_answers_503_and_ejects_no_engine() -> None:
    sim = SimEngine("only")
    proxy = ProxyConfig(queue_timeout_s=1.0, continue_min_tokens=8)
    # A gateway of its own: its pool of connections to the engine is empty, the request must connect.
    with serve_gateway([sim], proxy, eject_s=EJECT_S) as (url, _):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with httpx.Client(timeout=30) as client:
            assert client.get(url + "/health").status_code == 200  # the connection to the gateway, open
            lowest_free = os.dup(0)  # a new descriptor takes the lowest free number
            os.close(lowest_free)
            try:
                # Not one descriptor more for this process: the gateway's connect to the engine gets EMFILE.
                resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
                r = client.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 2})
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert r.status_code == 503, r.text
        assert "this gateway cannot open a connection" in r.json()["error"]["message"], r.text
        assert sim.served == 0
        _still_served(url)
