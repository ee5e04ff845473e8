"""vLLM's own RL control routes at the gateway: a fleet driven as one `vllm serve` (issue 33).

RL frameworks drive a vLLM server through these routes of vLLM 0.32's own server
(vllm/entrypoints/rl/online/api_router.py, serve/dev/cache/api_router.py): SkyRL's remote
engines, verl's and prime-rl's server clients, and TRL's VLLMClient (under TRL_PREFIX). The
gateway answers them at its root with the same paths, parameters and answers, and the fleet's
meaning:

- `POST /pause?mode=abort|wait|keep` (vLLM's default: abort): the fleet's pause. In Kubernetes mode
  it is the `rollfleet.dev/pause` annotation, the record `kubectl annotate` writes, waited on until
  every engine reports it; with a static engine list (`--engines`), each engine's own /pause.
  `{"status": "paused"}`. `POST /resume` undoes it: `{"status": "resumed"}`.
- `GET /is_paused`: `{"is_paused": true}` once every engine is paused.
- `POST /abort_requests` `{"request_ids": [...]}`: the gateway's abort of those ids (checked at
  the engines, as `POST /v1/abort`); no ids: every request in flight at this replica.
  `{"status": "aborted", "aborted": n}`.
- `GET /get_world_size`: the engines' own, summed. `POST /reset_prefix_cache`: on every routable
  engine. `GET /weight_info`: the fleet's weight version.
- 501, naming what to do instead, for vLLM's NCCL weight transfer and `/update_weight_version`:
  weights reach a fleet through its sync sidecar, which versions them.

Auth as the gateway's own twins: what changes the fleet (pause, resume, abort, cache reset) needs
the admin token; reads need the inference credential (the gate in `app`). Talks to the engines
through the proxy's engine client and to Kubernetes through the gateway's FleetControl.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from rollfleet.engine_client import EngineCallError, EngineRef
from rollfleet.gateway import abort as abort_mod
from rollfleet.gateway.control import NoSuchFleet, PushRunning, caller_name, pause_done
from rollfleet.gateway.proxy import engine_ref
from rollfleet.gateway.refusal import Refused
from rollfleet.gateway.registry import Engine
from rollfleet.kube import ApiError
from rollfleet_client.models import FleetState
from rollfleet_client.protocol import (
    TRL_RESET_PREFIX_CACHE_PATH,
    TRL_WEIGHT_SYNC_PATHS,
    TRL_WORLD_SIZE_PATH,
    VLLM_ABORT_REQUESTS_PATH,
    VLLM_IS_PAUSED_PATH,
    VLLM_PAUSE_PATH,
    VLLM_RESUME_PATH,
    VLLM_UPDATE_WEIGHT_VERSION_PATH,
    VLLM_WEIGHT_INFO_PATH,
)
from rollfleet_engine.protocol import PAUSE_MODES, EngineState, PauseMode, parse_pause_mode

if TYPE_CHECKING:
    from rollfleet.gateway.app import _Gateway

WEIGHT_SYNC_HELP = (
    "Rollfleet does not take weights over vLLM's NCCL weight transfer: it syncs weights through the fleet's "
    "sync sidecar, which versions them. Push the trainer's weights with rollfleet_client's "
    "SyncClient.push(state_dict, version=...) (docs/weight-sync.md) instead"
)
# How long a pause or resume asked through vLLM's routes waits for every engine (vLLM's own answers once done).
CONTROL_WAIT_S = 300.0
CALLER = "vllm-api"  # the field manager's caller when the request names none (X-Rollfleet-Caller)
T = TypeVar("T")


class VllmControl:
    """The routes' handlers, over one gateway replica."""

    def __init__(self, gateway: _Gateway) -> None:
        self.gateway = gateway

    # --- pause -----------------------------------------------------------------------
    async def pause(self, request: Request) -> Response:
        mode = parse_pause_mode(request.query_params.get("mode", "abort"))
        if mode is None:
            return self._refuse(400, f"mode must be one of {list(PAUSE_MODES)}, got {request.query_params['mode']!r}")
        return await self._control(request, mode)

    async def resume(self, request: Request) -> Response:
        return await self._control(request, None)

    async def _control(self, request: Request, mode: PauseMode | None) -> Response:
        gw = self.gateway
        try:
            gw.authorize_admin(request.headers, request.url.path)
            caller = caller_name(request.headers, CALLER)
            if gw.control is not None:  # Kubernetes mode: the fleet's record, as kubectl annotate writes it
                if mode is None:
                    state = await gw.control.resume(caller, CONTROL_WAIT_S)
                else:
                    state = await gw.control.pause(mode, caller, CONTROL_WAIT_S)
                if not pause_done(state, mode):
                    what = f"{request.url.path}: recorded in the fleet's annotation, but not every engine did it"
                    raise Refused(504, f"{what} within {CONTROL_WAIT_S:.0f}s (kubectl get rf shows the engines)")
            elif mode is None:
                await self._each_engine(request.url.path, gw.proxy.engines.resume, every=True)
            else:
                await self._each_engine(request.url.path, lambda e: gw.proxy.engines.pause(e, mode), every=True)
        except Refused as refused:
            return gw.refuse(refused)
        except PushRunning as err:
            return self._refuse(409, str(err))
        except NoSuchFleet as err:
            return self._refuse(404, str(err))
        except ApiError as err:
            return self._refuse(502, f"{request.url.path}: the Kubernetes API answered {err}")
        return JSONResponse({"status": "resumed" if mode is None else "paused"})

    async def is_paused(self, request: Request) -> Response:
        """True once every engine is paused: the fleet's status in Kubernetes mode, else the engines' own state."""
        try:
            fleet, engines = await self._states(request.url.path)
        except Refused as refused:
            return self.gateway.refuse(refused)
        if fleet is not None:
            paused = fleet.pause is not None and pause_done(fleet, fleet.pause.mode)
        else:
            paused = all(s.paused for s in engines)
        return JSONResponse({"is_paused": paused})

    # --- requests ----------------------------------------------------------------------
    async def abort_requests(self, request: Request) -> Response:
        gw = self.gateway
        try:
            gw.authorize_admin(request.headers, request.url.path)
            raw = await gw.read_body(request)
        except Refused as refused:
            return gw.refuse(refused)
        try:
            body = orjson.loads(raw or b"{}")
        except orjson.JSONDecodeError:
            return self._refuse(400, "Invalid JSON format")
        if not isinstance(body, dict):
            return self._refuse(400, "Request body must be a JSON object")
        ids = body.get("request_ids") or gw.inflight.ids()
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return self._refuse(400, "request_ids must be a list of request ids")
        if len(ids) > abort_mod.MAX_ABORT_IDS:
            return self._refuse(400, f"request_ids names {len(ids)} ids; at most {abort_mod.MAX_ABORT_IDS} per call")
        if ids:
            await abort_mod.abort(gw.proxy, ids, abort_mod.GatewayAbortRequest.model_fields["timeout_s"].default)
        return JSONResponse({"status": "aborted", "aborted": len(ids)})

    # --- the engines' own, fleet-wide ----------------------------------------------------
    async def world_size(self, request: Request) -> Response:
        """The engines' world sizes (tensor x data parallel), summed: the fleet as one server."""
        try:
            sizes = await self._each_engine(request.url.path, self.gateway.proxy.engines.world_size)
        except Refused as refused:
            return self.gateway.refuse(refused)
        return JSONResponse({"world_size": sum(sizes.values())})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's answer, for the fleet: success when every routable engine reset its cache. A control call (every
        caller's cache goes): the admin token, as the engines' own route asks."""
        try:
            self.gateway.authorize_admin(request.headers, request.url.path)
            done = await self._each_engine(request.url.path, self.gateway.proxy.engines.reset_prefix_cache)
        except Refused as refused:
            return self.gateway.refuse(refused)
        return JSONResponse({"success": all(done.values()), "engines": done})

    async def weight_info(self, request: Request) -> Response:
        """The fleet's weight version: its status's in Kubernetes mode; with static engines, theirs when they agree
        (None while they serve different versions, as during a sync)."""
        try:
            fleet, engines = await self._states(request.url.path)
        except Refused as refused:
            return self.gateway.refuse(refused)
        if fleet is not None:
            version = fleet.weight_version
        else:
            served = {s.served_version for s in engines}
            version = served.pop() if len(served) == 1 else None
        return JSONResponse({"weight_version": version})

    async def weight_transfer(self, request: Request) -> Response:
        return self._refuse(501, f"{request.url.path}: {WEIGHT_SYNC_HELP}")

    # --- helpers -------------------------------------------------------------------------
    async def _states(self, path: str) -> tuple[FleetState | None, list[EngineState]]:
        """The fleet's state (Kubernetes mode), or every engine's own (a static engine list)."""
        gw = self.gateway
        if gw.control is None:
            return None, list((await self._each_engine(path, gw.proxy.engines.state, every=True)).values())
        try:
            return await gw.control.state(), []
        except (NoSuchFleet, ApiError) as err:
            raise Refused(502, f"{path}: {err}") from None

    def _refuse(self, status: int, message: str) -> Response:
        return self.gateway.refuse(Refused(status, message))

    async def _each_engine(
        self, path: str, call: Callable[[EngineRef], Awaitable[T]], every: bool = False
    ) -> dict[str, T]:
        """`call` on every routable engine (`every`: every engine with an address, paused ones too), by engine;
        Refused 503 when there is none, 502 naming each engine that failed."""
        registry = self.gateway.registry
        engines = [e for e in (registry.engines() if every else registry.routable()) if e.url is not None]
        if not engines:
            raise Refused(503, f"{path}: no routable engine (engines starting, syncing or draining)")

        async def one(engine: Engine) -> T | EngineCallError:
            try:
                return await call(engine_ref(engine))
            except EngineCallError as err:
                return err

        results = await asyncio.gather(*(one(e) for e in engines))
        failed = [f"{r.engine.name}: {r.problem}" for r in results if isinstance(r, EngineCallError)]
        if failed:
            raise Refused(502, f"{path} failed on " + "; ".join(failed))
        return {e.key: r for e, r in zip(engines, results, strict=True) if not isinstance(r, EngineCallError)}


def vllm_routes(control: VllmControl, prefix: str = "") -> list[HttpRoute]:
    """The routes, under `prefix` (the root, or TRL_PREFIX: TRL's client calls a subset of them there)."""
    return [
        HttpRoute(prefix + VLLM_PAUSE_PATH, control.pause, methods=["POST"]),
        HttpRoute(prefix + VLLM_RESUME_PATH, control.resume, methods=["POST"]),
        HttpRoute(prefix + VLLM_IS_PAUSED_PATH, control.is_paused, methods=["GET"]),
        HttpRoute(prefix + VLLM_ABORT_REQUESTS_PATH, control.abort_requests, methods=["POST"]),
        HttpRoute(prefix + TRL_WORLD_SIZE_PATH, control.world_size, methods=["GET"]),
        HttpRoute(prefix + TRL_RESET_PREFIX_CACHE_PATH, control.reset_prefix_cache, methods=["POST"]),
        HttpRoute(prefix + VLLM_WEIGHT_INFO_PATH, control.weight_info, methods=["GET"]),
        *(
            HttpRoute(prefix + p, control.weight_transfer, methods=["GET", "POST"])
            for p in (*TRL_WEIGHT_SYNC_PATHS, VLLM_UPDATE_WEIGHT_VERSION_PATH)
        ),
    ]
