"""A gateway in static mode in front of two simulated engines, on a background event loop.

The simulator (devtools/rollfleet_dev/sim_engine.py) is a fake upstream: allowed here, for the
gateway's own logic (failover bookkeeping, cancellation, admission). Acceptance on
real vLLM engines lives in e2e/test_gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop
from tests.unit.sim_serving import serve_sims, stop_sims

from rollfleet.gateway.app import GatewayConfig, serving
from rollfleet.gateway.httpserver import HttpServer
from rollfleet.gateway.proxy import Proxy, ProxyConfig
from rollfleet_dev.sim_engine import SimEngine

TOKEN = "unit-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON events of an SSE body that ends with [DONE]."""
    lines = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(ln) for ln in lines[:-1]]


# The gateway served at each URL, and its event loop: a test that plays the Kubernetes watch (an engine's pod
# starts to go) changes the gateway's engine table there, on its loop.
SERVED: dict[str, tuple[HttpServer, asyncio.AbstractEventLoop]] = {}


@dataclass
class Stack:
    url: str
    sims: list[SimEngine]
    sim_urls: list[str]

    def on_gateway_loop(self, call: Callable[[Proxy], Any]) -> Any:
        """Run `call(proxy)` on the gateway's event loop and return its result."""
        server, loop = SERVED[self.url]

        async def run() -> Any:
            return call(server.app.state.proxy)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(10)

    def reset(self) -> None:
        for sim in self.sims:
            sim.token_delay_ms = 0.0
            sim.die_after = {}
            sim.refuse = set()
            sim.max_choices = None
            sim.accept_delay_s = 0.0
            sim.silent_abort = False
            sim.weight_version = "v1"


@contextlib.contextmanager
def serve_gateway(
    sims: list[SimEngine], proxy: ProxyConfig, engine_urls: Sequence[str] = (), **config: Any
) -> Iterator[tuple[str, list[str]]]:
    """The simulated engines and a static-mode gateway in front of them (and of `engine_urls`, engines
    served already: another replica's), served from a background event loop; yields the gateway's URL
    and the URLs of the engines it started."""
    loop = uvloop.new_event_loop()  # as the gateway runs
    ports = [free_port() for _ in sims]
    gw_port = free_port()
    ready = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        runners = await serve_sims(sims, ports)
        engines = [f"http://127.0.0.1:{p}" for p in ports] + list(engine_urls)
        gateway = GatewayConfig(**{"token": TOKEN, **config}, engines=engines, proxy=proxy)
        async with serving(gateway, "127.0.0.1", gw_port) as server:
            SERVED[f"http://127.0.0.1:{gw_port}"] = (server, loop)
            ready.set()
            await stop.wait()
        await stop_sims(runners)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "gateway did not start"
    try:
        yield f"http://127.0.0.1:{gw_port}", [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    sims = [SimEngine("sim-a"), SimEngine("sim-b")]
    # continue_min_tokens 8: non-streaming requests of 8 tokens or more are streamed from the engine
    # (and continued on failover), shorter ones are sent whole; the tests use both.
    proxy = ProxyConfig(queue_timeout_s=1.0, stop_grace_s=2.0, version_check_after_s=0.3, continue_min_tokens=8)
    # eject_s 0: failover tests run back to back; exclusion per request is what they check.
    with serve_gateway(sims, proxy, max_body_bytes=64 * 1024, eject_s=0.0) as (url, sim_urls):
        yield Stack(url, sims, sim_urls)


@pytest.fixture
def gw(stack: Stack) -> Iterator[Stack]:
    stack.reset()
    yield stack
    stack.reset()
