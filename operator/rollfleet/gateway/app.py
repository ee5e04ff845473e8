"""The gateway's HTTP surface (Starlette on uvicorn with uvloop + httptools).

Owns request admission: authentication, body size, JSON and field validation (clear
4xx in OpenAI's error shape, before anything is routed), caller id, session key and
deadline; then hands the request to the proxy. Also `/v1/models`, `/v1/abort`, the
trainer's fleet control (`/v1/fleet`, `/v1/fleet/pause`, `/v1/fleet/resume`),
`/health` (live), `/ready` (engine list synced), `/metrics` (Prometheus).

Talks to the proxy, the abort module and the registry; engines only through them. Fleet
control goes to the API server through `control`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute
from starlette.types import ASGIApp, Receive, Scope

from rollfleet.contract import PAUSE_MODES, PauseMode, parse_pause_mode
from rollfleet.gateway import abort as abort_mod
from rollfleet.gateway.control import FleetControl, NoSuchFleet, PushRunning, caller_name, pause_done
from rollfleet.gateway.dialects import BadRequest, Route, check_depth, validate
from rollfleet.gateway.httpserver import Client, Direct, HttpServer, Limits, Send
from rollfleet.gateway.inflight import IdInUse, InFlight, InFlightTable, StopReason
from rollfleet.gateway.metrics import Metrics
from rollfleet.gateway.proxy import ClientRequest, Proxy, ProxyConfig, error_body, send_json, trace_context
from rollfleet.gateway.refusal import Refused, credential_ok
from rollfleet.gateway.registry import Registry, follow_pods, static_registry
from rollfleet.gateway.routing import Router, RoutingPolicy
from rollfleet.gateway.trl import trl_routes
from rollfleet.gateway.vllm_api import VllmControl, vllm_routes
from rollfleet.kube import ApiError, Kube, load_client
from rollfleet.metrics import METRICS_PATH
from rollfleet.upstream import UpstreamError
from rollfleet_client.protocol import (
    ABORT_PATH,
    FLEET_PATH,
    FLEET_PAUSE_PATH,
    FLEET_RESUME_PATH,
    GROUP_HEADER,
    SESSION_END_HEADER,
    SESSION_HEADER,
    TIMEOUT_HEADER,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    TRL_HEALTH_PATH,
    TRL_PREFIX,
)
from rollfleet_engine.protocol import MAX_WEIGHT_LAG_HEADER, REQUEST_ID_HEADER, parse_max_weight_lag

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
# Header names as looked up: lowercase (the HTTP server's are; Starlette's lookups ignore case).
_REQUEST_ID, _TIMEOUT, _MAX_LAG = REQUEST_ID_HEADER.lower(), TIMEOUT_HEADER.lower(), MAX_WEIGHT_LAG_HEADER.lower()
_GROUP, _SESSION, _SESSION_END = GROUP_HEADER.lower(), SESSION_HEADER.lower(), SESSION_END_HEADER.lower()
MAX_SESSION_KEY = 256  # characters; the session table keeps every key for its TTL
MAX_CONTROL_WAIT_S = 600  # a pause or resume waits at most this long for the status to show it done
# The routes that ask for no credential: liveness, readiness, metrics, and TRL's health check (which
# TRL's client polls without its session's headers). Every other route asks for one.
OPEN_PATHS = frozenset({"/health", "/ready", METRICS_PATH, TRL_PREFIX + TRL_HEALTH_PATH})


@dataclass
class GatewayConfig:
    token: str
    engines: list[str] = field(default_factory=list)  # static mode when non-empty
    fleet: str | None = None
    namespace: str = "default"
    kubeconfig: str | None = None
    # When set, inference routes need it (or the admin token), and it is what the gateway sends engines with
    # each generation (the fleet's inference token: the engines ask for it too).
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_model_len: int | None = None  # the engines' context, when known: max_tokens past it is refused here
    eject_s: float = 5.0  # how long an engine that dropped a connection gets no new requests
    request_timeout_s: float = 3600.0
    max_timeout_s: float = 24 * 3600.0
    shutdown_grace_s: float = 25.0  # on SIGTERM, requests in flight get this long (the pod has 30 s)
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)


def _error(status: int, message: str, metrics: Metrics, headers: dict[str, str] | None = None) -> Response:
    metrics.refused(status)
    return Response(orjson.dumps(error_body(message, status)), status, headers, media_type="application/json")


class _ProxyResponse(Response):
    """Hands the raw ASGI channel to the proxy: it decides status and body as the engine answers."""

    def __init__(self, proxy: Proxy, req: ClientRequest, entry: InFlight) -> None:
        self.proxy, self.req, self.entry = proxy, req, entry
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.proxy.serve(self.req, self.entry, send, receive)


# Ids the gateway gives requests that come without one: unique per process (a random prefix), and cheap.
_ID_PREFIX = f"gw-{secrets.token_hex(6)}-"
_ids = itertools.count()


def _request_id(headers: Mapping[str, str], body: dict[str, Any]) -> str:
    request_id = headers.get(_REQUEST_ID) or body.get("request_id") or f"{_ID_PREFIX}{next(_ids)}"
    if not isinstance(request_id, str) or not _ID_RE.match(request_id):
        raise Refused(400, "request id must be 1-200 characters of [A-Za-z0-9._:@/+=-]")
    return request_id


def _timeout_s(headers: Mapping[str, str], default_s: float, max_s: float) -> float:
    value = headers.get(_TIMEOUT)
    if value is None:
        return default_s
    try:
        timeout = float(value)
    except ValueError:
        raise Refused(400, f"{TIMEOUT_HEADER} must be a number of seconds") from None
    if not 0 < timeout <= max_s:
        raise Refused(400, f"{TIMEOUT_HEADER} must be in (0, {max_s:.0f}]")
    return timeout


@dataclass
class _Gateway:
    """The parts of one gateway replica, and its endpoints."""

    config: GatewayConfig
    metrics: Metrics
    registry: Registry
    router: Router
    inflight: InFlightTable
    proxy: Proxy
    control: FleetControl | None = None  # Kubernetes mode only: set while the app runs

    @classmethod
    def build(cls, config: GatewayConfig) -> _Gateway:
        if not config.engines and not config.fleet:
            raise ValueError("the gateway needs --engines (static mode) or --fleet (Kubernetes mode)")
        metrics = Metrics()
        registry = static_registry(config.engines, config.eject_s) if config.engines else Registry(config.eject_s)
        router = Router(config.routing)
        registry.on_removed.append(router.forget_engine)
        inflight = InFlightTable()
        proxy = Proxy(registry, router, inflight, config.token, config.proxy, metrics, config.api_key)
        registry.on_leaving.append(proxy.move_off)
        return cls(config, metrics, registry, router, inflight, proxy)

    def refuse(self, refused: Refused) -> Response:
        return _error(refused.status, str(refused), self.metrics)

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Refused(413, f"request body of {declared} bytes exceeds {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused(413, f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def admit(self, route: Route, headers: Mapping[str, str], raw: bytes) -> tuple[ClientRequest, InFlight]:
        """Everything checked before routing: token, JSON, fields, id, deadline; the id reserved.
        `headers` are looked up by lowercase name; the body's size was checked as it was read."""
        config = self.config
        self.authorize_inference(headers)
        try:
            parsed = orjson.loads(raw)
            check_depth(raw, parsed)
            body = validate(route, parsed, config.max_model_len)
        except orjson.JSONDecodeError as err:
            raise Refused(400, f"the request body is not valid JSON: {err}") from None
        except BadRequest as err:
            raise Refused(400, str(err)) from None
        session = headers.get(_GROUP) or headers.get(_SESSION)
        if session is not None and len(session) > MAX_SESSION_KEY:
            raise Refused(400, f"{GROUP_HEADER} or {SESSION_HEADER} is longer than {MAX_SESSION_KEY} characters")
        request_id = _request_id(headers, body)
        timeout = _timeout_s(headers, config.request_timeout_s, config.max_timeout_s)
        try:
            max_lag = parse_max_weight_lag(headers.get(_MAX_LAG))
        except ValueError as err:
            raise Refused(400, str(err)) from None
        loop = asyncio.get_running_loop()
        try:
            entry = self.inflight.open(request_id, loop)
        except IdInUse:
            raise Refused(409, f"request id {request_id!r} is still in flight; ids must not be reused") from None
        req = ClientRequest(
            route=route,
            body=body,
            request_id=request_id,
            session=session,
            end_session=headers.get(_SESSION_END, "").lower() in ("1", "true", "yes"),
            deadline=loop.time() + timeout,
            max_weight_lag=max_lag,
            trace=trace_context(headers.get(TRACEPARENT_HEADER), headers.get(TRACESTATE_HEADER)),
        )
        return req, entry

    def authorize_inference(self, headers: Mapping[str, str]) -> None:
        """The inference routes' rule: the api key (the fleet's inference token) or the admin token, when an api
        key is set (a fleet's default; an open fleet has none)."""
        config = self.config
        if config.api_key is not None and not credential_ok(headers, config.api_key, config.token):
            raise Refused(
                401,
                "missing or wrong bearer token: generation needs the fleet's inference token (Secret "
                "<fleet>-inference-token) or its admin token, as Authorization: Bearer ...",
            )

    def authorize_admin(self, headers: Mapping[str, str], what: str) -> None:
        """Control routes' rule: the fleet's admin token, always."""
        if not credential_ok(headers, self.config.token):
            raise Refused(401, f"{what} needs the fleet admin token (Authorization: Bearer ...)")

    def generation(self, route: Route) -> Callable[[Request], Awaitable[Response]]:
        """A generation route as a Starlette endpoint (in-process callers: the TRL routes, tests)."""

        async def endpoint(request: Request) -> Response:
            try:
                req, entry = self.admit(route, request.headers, await self.read_body(request))
            except Refused as refused:
                return self.refuse(refused)
            return _ProxyResponse(self.proxy, req, entry)

        return endpoint

    def direct(self, route: Route) -> Direct:
        """A generation route as the HTTP server's direct handler: the hot path, no framework."""

        async def handle(client: Client, send: Send) -> None:
            try:
                req, entry = self.admit(route, client.headers, client.body)
            except Refused as refused:
                self.metrics.refused(refused.status)
                await send_json(send, refused.status, error_body(str(refused), refused.status))
                return
            client.on_leave = lambda: self.proxy.stop(entry, StopReason.DISCONNECT)
            await self.proxy.serve(req, entry, send)

        return handle

    def refusal(self, status: int, message: str) -> bytes:
        """The body of a request the HTTP server turns away itself (too large, malformed)."""
        self.metrics.refused(status)
        return orjson.dumps(error_body(message, status))

    async def models(self, request: Request) -> Response:
        assert self.proxy.upstream is not None
        for engine in self.registry.routable():
            try:
                resp = await self.proxy.upstream.request("GET", f"{engine.url}/v1/models")
                try:
                    if resp.status == 200:
                        return Response(await resp.read(), 200, media_type="application/json")
                finally:
                    resp.close()
            except UpstreamError:
                continue
        return _error(503, "no routable engine to list models from", self.metrics)

    async def abort(self, request: Request) -> Response:
        try:
            self.authorize_admin(request.headers, f"POST {ABORT_PATH}")
            raw = await self.read_body(request)
        except Refused as refused:
            return self.refuse(refused)
        try:
            parsed = abort_mod.GatewayAbortRequest.model_validate_json(raw)
        except ValidationError as err:
            return _error(400, f"bad abort request: {err.errors(include_url=False)}", self.metrics)
        results = await abort_mod.abort(self.proxy, parsed.request_ids, parsed.timeout_s)
        reasons = {k: a.reason for k, a in results.items() if a.reason is not None}
        return JSONResponse({"results": {k: a.status.value for k, a in results.items()}, "reasons": reasons})

    async def fleet(self, request: Request) -> Response:
        return await self._control(request, None)

    async def pause(self, request: Request) -> Response:
        return await self._control(request, "pause")

    async def resume(self, request: Request) -> Response:
        return await self._control(request, "resume")

    async def _control(self, request: Request, action: str | None) -> Response:
        """The fleet's state; with an action, asked for first and waited on (200 done, 202 still going)."""
        path = request.url.path
        try:
            self.authorize_admin(request.headers, path)
        except Refused as refused:
            return self.refuse(refused)
        if self.control is None:
            return _error(404, f"{path}: this gateway serves a static engine list (--engines), no fleet", self.metrics)
        try:
            if action is None:
                state = await self.control.state()
                return JSONResponse(state.model_dump(mode="json"))
            ask = _ControlAsk.read(request, orjson.loads(await self.read_body(request) or b"{}"), action)
            if ask.mode is None:
                state = await self.control.resume(ask.caller, ask.wait_s)
            else:
                state = await self.control.pause(ask.mode, ask.caller, ask.wait_s)
        except Refused as refused:
            return self.refuse(refused)
        except orjson.JSONDecodeError as err:
            return _error(400, f"the request body is not valid JSON: {err}", self.metrics)
        except PushRunning as err:
            return _error(409, str(err), self.metrics)
        except NoSuchFleet as err:
            return _error(404, str(err), self.metrics)
        except ApiError as err:  # the API server refused or failed: say which call, and why
            return _error(502, f"{path}: the Kubernetes API answered {err}", self.metrics)
        return JSONResponse(state.model_dump(mode="json"), 200 if pause_done(state, ask.mode) else 202)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if not self.registry.synced:
            return JSONResponse({"ready": False, "reason": "engine list not synced yet"}, 503)
        return JSONResponse({"ready": True, "routable_engines": len(self.registry.routable())})

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.in_flight.set(len(self.inflight))
        self.metrics.sessions.set(len(self.router.sessions))
        self.metrics.routable.set(len(self.registry.routable()))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.proxy.open()
        config = self.config
        watch, kube = None, None
        if config.fleet:  # Kubernetes mode: engines come from a watch of the fleet's pods
            # One API client: the watch holds one of its threads, the trainer's control calls use the others.
            kube = Kube(load_client(config.kubeconfig), concurrency=4)
            watch = asyncio.create_task(follow_pods(self.registry, kube, config.namespace, config.fleet))
            self.control = FleetControl(kube, config.namespace, config.fleet)
        try:
            yield
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            if kube is not None:
                kube.close()
            await self.proxy.close()

    def routes(self) -> list[HttpRoute]:
        return [
            *(HttpRoute(r.value, self.generation(r), methods=["POST"]) for r in Route),
            HttpRoute("/v1/models", self.models, methods=["GET"]),
            HttpRoute(ABORT_PATH, self.abort, methods=["POST"]),
            HttpRoute(FLEET_PATH, self.fleet, methods=["GET"]),
            HttpRoute(FLEET_PAUSE_PATH, self.pause, methods=["POST"]),
            HttpRoute(FLEET_RESUME_PATH, self.resume, methods=["POST"]),
            HttpRoute("/health", self.health, methods=["GET"]),
            HttpRoute("/ready", self.ready, methods=["GET"]),
            HttpRoute(METRICS_PATH, self.metrics_endpoint, methods=["GET"]),
            *vllm_routes(VllmControl(self)),
            *trl_routes(self),
        ]


@dataclass(frozen=True)
class _ControlAsk:
    """A pause or resume request: `{"mode": "keep"|"wait"|"abort", "wait_s": 120}` (resume: wait_s only)."""

    mode: PauseMode | None
    caller: str
    wait_s: float

    @classmethod
    def read(cls, request: Request, body: Any, action: str) -> _ControlAsk:
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        allowed = {"mode", "wait_s"} if action == "pause" else {"wait_s"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise Refused(400, f"unknown field(s) {unknown}; a {action} takes {sorted(allowed)}")
        mode = None
        if action == "pause":
            mode = parse_pause_mode(body.get("mode"))
            if mode is None:
                raise Refused(400, f"mode must be one of {list(PAUSE_MODES)}, got {body.get('mode')!r}")
        wait_s = body.get("wait_s", 0)
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 <= wait_s <= MAX_CONTROL_WAIT_S:
            raise Refused(400, f"wait_s must be a number of seconds in [0, {MAX_CONTROL_WAIT_S}], got {wait_s!r}")
        caller = caller_name(request.headers, "anonymous")
        return cls(mode, caller, float(wait_s))


class _CredentialGate:
    """Deny by default, as the engines' access rule: a request to any path but OPEN_PATHS needs the inference
    rule's credential (the api key or the admin token, when an api key is set) before any route runs, so a
    route added later is guarded without anyone listing it. Control routes then ask for the admin token."""

    def __init__(self, app: ASGIApp, gateway: _Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            try:
                self.gateway.authorize_inference(headers)
            except Refused as refused:
                self.gateway.metrics.refused(refused.status)
                await send_json(send, refused.status, error_body(str(refused), refused.status))
                return
        await self.app(scope, receive, send)


def _app(gateway: _Gateway, **kwargs: Any) -> Starlette:
    app = Starlette(routes=gateway.routes(), middleware=[Middleware(_CredentialGate, gateway=gateway)], **kwargs)
    app.state.proxy = gateway.proxy  # for in-process callers: the engine table and the requests in flight
    return app


def build_app(config: GatewayConfig) -> Starlette:
    """Every route as one ASGI app, for in-process clients (Starlette's TestClient)."""
    gateway = _Gateway.build(config)
    return _app(gateway, lifespan=gateway.lifespan)


@asynccontextmanager
async def serving(config: GatewayConfig, host: str, port: int) -> AsyncIterator[HttpServer]:
    """The gateway serving on host:port until the block ends, then shut down as on SIGTERM: requests in flight
    get `shutdown_grace_s` to finish. The generation routes are the server's direct routes; the rest is
    the Starlette app."""
    gateway = _Gateway.build(config)
    app = _app(gateway)
    direct = {("POST", r.value): gateway.direct(r) for r in Route}
    limits = Limits(max_body_bytes=config.max_body_bytes, shutdown_grace_s=config.shutdown_grace_s)
    server = HttpServer(app, direct, limits, refusal=gateway.refusal)
    async with gateway.lifespan(app):
        await server.start(host, port)
        try:
            yield server
        finally:
            await server.shutdown()
