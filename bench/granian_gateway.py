"""The gateway's hot path on granian (RSGI), a well-kept Rust HTTP server: the candidate bench_gateway.py
measures beside the gateway's own HTTP server (issue 32: choose the server on evidence).

The same admission and proxy as `rollfleet gateway` (`rollfleet.gateway.app`): token, JSON, bounds, id and
deadline, then `Proxy.serve`, whose ASGI-style messages are written through RSGI's response calls. Only the
generation routes (the hot path); static engines from the environment:

    ROLLFLEET_BENCH_ENGINES=http://127.0.0.1:8001,... ROLLFLEET_BENCH_TOKEN_FILE=... ROLLFLEET_BENCH_KEY_FILE=...
    python -m granian --interface rsgi --loop uvloop --workers 1 --factory bench.granian_gateway:make_app
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orjson

from rollfleet.gateway.app import GatewayConfig, _Gateway
from rollfleet.gateway.dialects import Route
from rollfleet.gateway.inflight import StopReason
from rollfleet.gateway.proxy import error_body
from rollfleet.gateway.refusal import Refused
from rollfleet_engine.access import read_token

ENGINES_ENV = "ROLLFLEET_BENCH_ENGINES"
TOKEN_FILE_ENV = "ROLLFLEET_BENCH_TOKEN_FILE"
KEY_FILE_ENV = "ROLLFLEET_BENCH_KEY_FILE"
_ROUTES = {r.value: r for r in Route}


class _Send:
    """The proxy's ASGI messages as RSGI responses: one whole body, or a stream of them."""

    def __init__(self, proto: Any) -> None:
        self.proto = proto
        self.status = 200
        self.headers: list[tuple[str, str]] = []
        self.transport: Any = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            # The server frames the body itself (a length, or chunks).
            self.headers = [
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"] if k != b"content-length"
            ]
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        if self.transport is None:
            if not more:
                self.proto.response_bytes(self.status, self.headers, body)
                return
            self.transport = self.proto.response_stream(self.status, self.headers)
        if body:
            await self.transport.send_bytes(body)


class App:
    def __init__(self) -> None:
        key = os.environ.get(KEY_FILE_ENV)
        config = GatewayConfig(
            token=read_token(os.environ[TOKEN_FILE_ENV]),
            engines=os.environ[ENGINES_ENV].split(","),
            api_key=read_token(key) if key else None,
        )
        self.gateway = _Gateway.build(config)
        self.opened = False

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        route = _ROUTES.get(scope.path) if scope.method == "POST" else None
        if route is None:
            proto.response_bytes(404, [("content-type", "application/json")], orjson.dumps(error_body("not here", 404)))
            return
        if not self.opened:
            await self.gateway.proxy.open()
            self.opened = True
        try:
            req, entry = self.gateway.admit(route, scope.headers, await proto())
        except Refused as refused:
            body = orjson.dumps(error_body(str(refused), refused.status))
            proto.response_bytes(refused.status, [("content-type", "application/json")], body)
            return
        gone = asyncio.ensure_future(proto.client_disconnect())
        gone.add_done_callback(lambda f: f.cancelled() or self.gateway.proxy.stop(entry, StopReason.DISCONNECT))
        try:
            await self.gateway.proxy.serve(req, entry, _Send(proto))
        finally:
            gone.cancel()


def make_app() -> App:
    """The app, made in granian's worker (`--factory`): importing this module builds nothing."""
    return App()
