"""``rollfleet sync``: the sidecar process: its localhost API for the trainer, and wiring.

Owns the HTTP surface (routes in ``models``) and the choice of mode: Kubernetes (the
fleet's engine pods, the record in the fleet's ConfigMap ``<fleet>-weights``) or static (``--engines``
URLs, the record in a file). The trainer talks to it on 127.0.0.1; engines pull
weights from its weights server on the pod IP (``--weights-host``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError

from rollfleet.contract import PAUSE_MODES, SYNC_API_PORT, SYNC_HEALTH_PORT, SYNC_WEIGHTS_PORT, TOKEN_FILE
from rollfleet.engine_client import TRANSFER, EngineClient
from rollfleet.errors import RollfleetError
from rollfleet.kube import Kube, load_client
from rollfleet.metrics import METRICS_PATH
from rollfleet.sync.collective import CollectiveDriver, GroupStale
from rollfleet.sync.engines import Discovery, PodDiscovery, StaticDiscovery
from rollfleet.sync.metrics import PushMetrics
from rollfleet.sync.orchestrator import DEFAULT_RELAY_MIN_ENGINES, Orchestrator, Publisher
from rollfleet.sync.protocol import PushRefused
from rollfleet.sync.store import ConfigMapStore, FileStore, RecordStore
from rollfleet_client.sync_protocol import (
    COLLECTIVE_FINISH_PATH,
    COLLECTIVE_INIT_PATH,
    COLLECTIVE_PATH,
    COLLECTIVE_START_PATH,
    COLLECTIVE_UPDATE_PATH,
    GROUP_STALE_STATUS,
    HEALTH_PATH,
    PUSH_SPOOLED_PATH,
    PUSH_STREAM_PATH,
    PUSHES_PATH,
    SYNC_API_HOST,
    VERSION_PATH,
    CollectiveFinish,
    CollectiveInit,
    CollectiveStart,
    CollectiveUpdate,
    PushDirRequest,
    PushSpooledRequest,
    PushStatus,
)
from rollfleet_engine.access import read_token

log = logging.getLogger(__name__)

DEFAULT_SPOOL = "/var/lib/rollfleet-sync"
_CHUNK = 4 << 20
Body = TypeVar("Body", bound=BaseModel)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", required=True, help="RolloutFleet name")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    p.add_argument(
        "--host",
        default=SYNC_API_HOST,
        help="address of the trainer API (default: localhost, the same pod only)",
    )
    p.add_argument("--port", type=int, default=SYNC_API_PORT)
    p.add_argument(
        "--health-port",
        type=int,
        default=SYNC_HEALTH_PORT,
        help="GET /healthz on the pod network, for kubelet's probes (the trainer API stays on localhost)",
    )
    p.add_argument("--token-file", default=TOKEN_FILE, help="the fleet's admin token (engine control routes)")
    p.add_argument(
        "--weights-host",
        default=os.environ.get("POD_IP", "127.0.0.1"),
        help="address engines pull weights from: the pod IP ($POD_IP) by default",
    )
    p.add_argument("--weights-port", type=int, default=SYNC_WEIGHTS_PORT)
    p.add_argument(
        "--spool-dir",
        default=DEFAULT_SPOOL,
        help="where streamed weights are written (an emptyDir: it survives a restart of this container)",
    )
    p.add_argument("--engines", default=None, help="static mode: comma-separated engine URLs instead of the pods")
    p.add_argument(
        "--state-file",
        default=None,
        help="static mode: keep the push record in this file, not in the fleet's ConfigMap",
    )
    p.add_argument("--pause-mode", choices=PAUSE_MODES, default="keep")
    p.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="engines download the weights while paused, as before prefetch (default: they stage them while "
        "serving, and the pause covers only the load)",
    )
    relay = p.add_mutually_exclusive_group()
    relay.add_argument(
        "--relay-min-engines",
        type=int,
        default=DEFAULT_RELAY_MIN_ENGINES,
        help="with prefetch and at least this many engines, engines stage from each other (a chain, or a "
        "binary tree for more engines than the weights have 1 MiB pieces), so this sidecar sends each byte "
        "about once (default: %(default)s)",
    )
    relay.add_argument(
        "--no-relay",
        dest="relay_min_engines",
        action="store_const",
        const=None,
        help="every engine downloads from this sidecar (a star), whatever the fleet's size",
    )
    p.add_argument(
        "--relay-chain-max",
        type=int,
        default=None,
        help="the most engines a relay chains; more form a binary tree (default: as many as the weights have "
        "1 MiB pieces, where a chain stops being the faster)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="abort requests more than N generations behind at a push (the fleet's annotation overrides)",
    )
    p.add_argument("--reconcile-interval", type=float, default=2.0, help="seconds between recovery/catch-up checks")
    p.add_argument(
        "--transfer-timeout", type=float, default=TRANSFER.timeout_s, help="seconds an engine may take to pull"
    )


def build_app(orch: Orchestrator) -> web.Application:
    routes = web.RouteTableDef()

    def refused(err: Exception) -> web.Response:
        return web.json_response({"error": str(err)}, status=409)

    routes.get(HEALTH_PATH)(_healthz)

    async def started(push: Awaitable[PushStatus]) -> web.Response:
        try:
            status = await push
        except PushRefused as err:
            return refused(err)
        return web.json_response(status.model_dump(mode="json"), status=202)

    @routes.post(PUSHES_PATH)
    async def push_dir(request: web.Request) -> web.Response:
        body = await _body(request, PushDirRequest)
        return await started(orch.submit(body.version, Path(body.path)))

    @routes.put(PUSH_STREAM_PATH)
    async def push_stream(request: web.Request) -> web.Response:
        try:
            version = PushDirRequest(version=request.query.get("version", ""), path="-").version
        except ValidationError as err:
            return web.json_response({"error": str(err)}, status=400)

        async def push() -> PushStatus:
            t0 = time.monotonic()
            source = await orch.stage_stream(version, request.content.iter_chunked(_CHUNK), request.content_length)
            return await orch.submit(version, source, time.monotonic() - t0)

        return await started(push())

    @routes.post(PUSH_SPOOLED_PATH)
    async def push_spooled(request: web.Request) -> web.Response:
        body = await _body(request, PushSpooledRequest)

        async def push() -> PushStatus:
            return await orch.submit(body.version, await orch.adopt_spooled(body.version, body.name), body.write_s)

        return await started(push())

    @routes.get(PUSHES_PATH + "/{generation}")
    async def push_status(request: web.Request) -> web.Response:
        generation = int(request.match_info["generation"])
        wait_s = float(request.query.get("wait", "0"))
        status = await orch.wait(generation, wait_s) if wait_s > 0 else orch.status(generation)
        if status is None:
            return web.json_response({"error": f"no push with generation {generation} in this sidecar"}, status=404)
        return web.json_response(status.model_dump(mode="json"))

    @routes.get(VERSION_PATH)
    async def version(_: web.Request) -> web.Response:
        return web.json_response((await orch.fleet_version()).model_dump(mode="json"))

    add_collective_routes(routes, CollectiveDriver(orch))
    app = web.Application(client_max_size=1 << 20, middlewares=[_unavailable_on_failure])
    app.add_routes(routes)
    return app


def add_collective_routes(routes: web.RouteTableDef, driver: CollectiveDriver) -> None:
    """vLLM's weight sync handshake for collective backends, each call fanned out to the fleet's engines."""

    def answer(payload: BaseModel, status: int = 200) -> web.Response:
        return web.json_response(payload.model_dump(mode="json"), status=status)

    def refused(err: PushRefused) -> web.Response:
        status = GROUP_STALE_STATUS if isinstance(err, GroupStale) else 409
        return web.json_response({"error": str(err)}, status=status)

    @routes.get(COLLECTIVE_PATH)
    async def group(_: web.Request) -> web.Response:
        return answer(await driver.group())

    @routes.post(COLLECTIVE_INIT_PATH)
    async def init(request: web.Request) -> web.Response:
        init = await _body(request, CollectiveInit)
        try:
            return answer(await driver.init(init.init_info, init.backend))
        except PushRefused as err:
            return refused(err)

    @routes.post(COLLECTIVE_START_PATH)
    async def start(request: web.Request) -> web.Response:
        version = (await _body(request, CollectiveStart)).version
        try:
            return answer(await driver.start(version), status=202)
        except PushRefused as err:
            return refused(err)

    @routes.post(COLLECTIVE_UPDATE_PATH)
    async def update(request: web.Request) -> web.Response:
        update_info = (await _body(request, CollectiveUpdate)).update_info
        try:
            return answer(await driver.update(update_info))
        except PushRefused as err:
            return refused(err)

    @routes.post(COLLECTIVE_FINISH_PATH)
    async def finish(request: web.Request) -> web.Response:
        version = (await _body(request, CollectiveFinish)).weight_version
        try:
            return answer(await driver.finish(version))
        except PushRefused as err:
            return refused(err)


async def _body(request: web.Request, model: type[Body]) -> Body:
    """The request's JSON body as `model`; 400 with pydantic's reasons when it is not one."""
    try:
        return model.model_validate_json(await request.read())
    except ValidationError as err:
        raise web.HTTPBadRequest(text=json.dumps({"error": str(err)}), content_type="application/json") from err


@web.middleware
async def _unavailable_on_failure(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A failure of the API server or an engine (anything but a refusal, which routes answer
    themselves) is a 503 that says what failed, not aiohttp's bare 500."""
    try:
        return await handler(request)
    except RollfleetError as err:
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response(
            {"error": f"{type(err).__name__}: {err}; retry, or read this sidecar's log"}, status=503
        )


def _kubernetes(args: argparse.Namespace) -> tuple[RecordStore, Discovery]:
    kube = Kube(load_client())
    store: RecordStore = (
        FileStore(Path(args.state_file)) if args.state_file else ConfigMapStore(kube, args.namespace, args.fleet)
    )
    return store, PodDiscovery(kube, args.namespace, args.fleet)


def build_orchestrator(args: argparse.Namespace) -> Orchestrator:
    spool = Path(args.spool_dir)
    if args.engines:
        urls = [u.strip() for u in args.engines.split(",") if u.strip()]
        store: RecordStore = FileStore(Path(args.state_file) if args.state_file else spool / "record.json")
        discovery: Discovery = StaticDiscovery(urls)
    else:
        store, discovery = _kubernetes(args)
    return Orchestrator(
        store=store,
        discovery=discovery,
        api=EngineClient(read_token(args.token_file)),
        transfer=dataclasses.replace(TRANSFER, timeout_s=args.transfer_timeout),
        publisher=Publisher(args.weights_host, args.weights_port),
        spool=spool,
        pause_mode=args.pause_mode,
        default_max_staleness=args.max_staleness,
        prefetch=args.prefetch,
        relay_min_engines=args.relay_min_engines,
        relay_chain_max=args.relay_chain_max,
        metrics=PushMetrics(CollectorRegistry()),
    )


async def _healthz(_: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _health_app(registry: CollectorRegistry) -> web.Application:
    """/healthz and /metrics, on the pod network: kubelet's probes and Prometheus cannot reach the trainer API
    on localhost. Neither says anything secret: the metrics are counts and durations (docs/metrics.md)."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get(HEALTH_PATH, _healthz)
    app.router.add_get(METRICS_PATH, metrics)
    return app


async def serve(args: argparse.Namespace) -> None:
    orch = build_orchestrator(args)
    orch.open_incoming()
    runner = web.AppRunner(build_app(orch), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    health = web.AppRunner(_health_app(orch.metrics.registry), access_log=None)
    await health.setup()
    health_host = "0.0.0.0"  # kubelet probes the pod IP
    await web.TCPSite(health, health_host, args.health_port).start()
    log.info(
        "rollfleet sync for fleet %s on http://%s:%d (health: http://%s:%d/healthz)",
        args.fleet,
        args.host,
        args.port,
        health_host,
        args.health_port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reconcile = asyncio.create_task(orch.reconcile_forever(args.reconcile_interval))
    try:
        await stop.wait()
    finally:
        reconcile.cancel()
        await health.cleanup()
        await runner.cleanup()
        await orch.api.aclose()
        orch.publisher.stop()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per engine call every reconcile interval would bury the pushes.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(serve(args))
    return 0
