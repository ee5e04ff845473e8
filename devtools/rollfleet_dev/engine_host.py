"""One process that is every simulated engine on KWOK's fake nodes (`rollfleet_dev.kwok`): the scale harness.

KWOK gives each engine pod on a fake node an IP and no process. This host watches those pods and,
for each, builds the engine its container's arguments describe (`sim_engine.engine_from_args`: the
simulator the control-plane tier runs, with the pod's own token Secrets) and serves it at the pod's
IP and port. The host routes KWOK's pod range to itself (a `local` route on loopback), so a socket
bound to an address of that range accepts what the operator, the gateway and the tests send to the
pod. A deleted pod's engine stops serving at once.

It also serves, on loopback, `GET /engines`: every engine it serves, with the wall-clock time of its
last pause and resume as the engine saw them (the scale benchmark's pause latency) and its weight
version. Run by `rollfleet cluster kwok up` as a component of the local cluster (stopped with it).
Talks to: kube-apiserver (watch pods, read Secrets), and whoever calls the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import logging
import resource
import shlex
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from aiohttp import web

from rollfleet.contract import COMPONENT_ENGINE, LABEL_COMPONENT
from rollfleet_dev import sim_engine
from rollfleet_dev.localcluster.nodeagent.ipam import KWOK_POD_CIDR
from rollfleet_dev.localcluster.nodeagent.kubeapi import Api, load_kubeconfig
from rollfleet_engine.protocol import PAUSE_PATH, RESUME_PATH

log = logging.getLogger("engine-host")
Obj = dict[str, Any]
CONTROL_PORT = 10248
NODE_PREFIX = "sim-gpu-"  # rollfleet_dev.kwok.NODE_NAME's
ROUTE = ["local", KWOK_POD_CIDR, "dev", "lo"]
FREEZE_EVERY_S = 5.0  # `freeze_survivors`
SECRET_CACHE_S = 10.0  # how long a Secret read serves the engines that mount it (a rotated token: 10 s late at most)


class PodSpecError(ValueError):
    """A pod this host cannot serve as an engine; the message says what is missing."""


def secret_file(pod: Obj, container: Obj, path: str) -> tuple[str, str]:
    """The Secret and key that a file of `container` comes from (pure): its mount, and the volume behind it."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret is not None and PurePosixPath(path).is_relative_to(mount["mountPath"]):
            key = str(PurePosixPath(path).relative_to(mount["mountPath"]))
            for item in secret.get("items", []):
                if item["path"] == key:
                    key = item["key"]
            return secret["secretName"], key
    raise PodSpecError(f"{path}: no Secret volume of pod {pod['metadata']['name']} is mounted there")


def engine_argv(pod: Obj) -> tuple[Obj, list[str]]:
    """The engine container of `pod` and the arguments the simulator reads (pure)."""
    containers = [c for c in pod["spec"]["containers"] if c["name"] == COMPONENT_ENGINE]
    if not containers:
        raise PodSpecError(f"pod {pod['metadata']['name']} has no container named {COMPONENT_ENGINE!r}")
    [container] = containers
    return container, [*container.get("command", [])[1:], *container.get("args", [])]


@dataclass
class Served:
    """One engine being served: its runner, and what the benchmark reads."""

    namespace: str
    pod: str
    runner: web.AppRunner
    engine: sim_engine.SimEngine
    paused_at: float | None = None
    resumed_at: float | None = None

    def view(self, ip: str) -> Obj:
        return {
            "ip": ip,
            "namespace": self.namespace,
            "pod": self.pod,
            "paused": self.engine.pause_mode is not None,
            "paused_at": self.paused_at,
            "resumed_at": self.resumed_at,
            "weight_version": self.engine.weight_version,
            "weights_manifest_sha256": self.engine.weights.manifest_sha256,
        }


@dataclass
class Host:
    api: Api
    engines: dict[str, Served] = field(default_factory=dict)  # pod IP -> engine
    # Secrets read lately, by (namespace, name): (when, data). A fleet's engines all mount the same two. KWOK makes a
    # pod Ready at once, where a real one is Ready once its engine answers, so this host must keep up with KWOK. Read
    # for each pod, one pod after the other, 2,000 pods were 4,000 reads on a busy API server: the host fell behind,
    # the operator's state reads of engines not served yet failed and were tried again each pass, and the fleet
    # converged 60.5 s after the apply (44 passes, 26.5 operator CPU-seconds); with the reads shared, 48.8 s (17
    # passes, 16.9 CPU-seconds), against 43.5 s for kubectl's bare pods (bench_scale, docs/architecture.md "Scale").
    _secrets: dict[tuple[str, str], tuple[float, Obj]] = field(default_factory=dict)

    async def on_pod(self, kind: str, pod: Obj) -> None:
        meta = pod["metadata"]
        ip = (pod.get("status") or {}).get("podIP")
        node = pod["spec"].get("nodeName") or ""
        served = self.engines.get(ip) if ip else None
        gone = kind == "DELETED" or bool(meta.get("deletionTimestamp"))
        if ip and served is not None and (served.namespace, served.pod) != (meta["namespace"], meta["name"]):
            if not gone:
                # KWOK gave one address to two pods (it recycles deleted pods' addresses): this pod's callers reach
                # the other's engine, so its fleet's figures would be wrong.
                log.warning(
                    "pod %s/%s not served: %s is %s/%s's",
                    meta["namespace"],
                    meta["name"],
                    ip,
                    served.namespace,
                    served.pod,
                )
        elif ip and served is not None and gone:
            await self._stop(ip)
        elif ip and node.startswith(NODE_PREFIX) and served is None and kind != "DELETED":
            try:
                await self._start(pod, ip)
            except (PodSpecError, SystemExit, OSError, KeyError) as err:
                log.warning("pod %s/%s not served: %s", meta["namespace"], meta["name"], err)

    async def _read_secret_file(self, pod: Obj, container: Obj, path: str) -> str:
        name, key = secret_file(pod, container, path)
        namespace = pod["metadata"]["namespace"]
        read = self._secrets.get((namespace, name))
        if read is None or time.monotonic() - read[0] > SECRET_CACHE_S:
            secret = await self.api.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
            read = self._secrets[namespace, name] = (time.monotonic(), secret["data"])
        return base64.b64decode(read[1][key]).decode().strip()

    async def _start(self, pod: Obj, ip: str) -> None:
        container, argv = engine_argv(pod)
        args = sim_engine.parse_args(argv)
        if args.port is None:
            raise PodSpecError("no --port: a headless rank serves nothing")
        files = {}
        for path in (args.token_file, args.inference_token_file):
            if path:
                files[path] = await self._read_secret_file(pod, container, path)
        engine = sim_engine.engine_from_args(args, files.__getitem__)
        app = engine.app()
        # No access log: 2,000 engines' requests, a line each, were an eighth of this process's CPU (py-spy).
        runner = web.AppRunner(app, access_log=None)
        served = Served(pod["metadata"]["namespace"], pod["metadata"]["name"], runner, engine)
        app.middlewares.append(_timestamps(served))
        await served.runner.setup()
        await web.TCPSite(served.runner, ip, args.port, reuse_address=True).start()
        self.engines[ip] = served

    async def _stop(self, ip: str) -> None:
        served = self.engines.pop(ip)
        await served.runner.cleanup()
        served.engine.weights.close()
        gc.unfreeze()

    async def view(self, _: web.Request) -> web.Response:
        return web.json_response([s.view(ip) for ip, s in self.engines.items()])

    @staticmethod
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _timestamps(served: Served) -> Any:
    """Middleware: when the engine last took a pause and a resume (after the engine's own checks passed)."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        resp = await handler(request)
        if request.method == "POST" and resp.status < 300:
            if request.path == PAUSE_PATH:
                served.paused_at = time.time()
            elif request.path == RESUME_PATH:
                served.resumed_at = time.time()
        return resp

    return record


async def freeze_survivors() -> None:
    """Every FREEZE_EVERY_S, put what survived out of the cyclic collector's reach (gc.freeze): the engines' apps
    and servers, and each engine's tracker of its last 4,096 requests. A process of 2,000 engines keeps up to 2,000
    times the history one engine does, and each full collection scanned it all, on whichever request allocated
    then: under the gateway's load the host spent more per request at 2,000 engines than at 2, and the gateway's
    ratio measured the host (py-spy: the tracker's update, where collections land, 26% of the host's samples at
    2,000 engines, 8% at 2). A stopped engine thaws everything (`Host._stop`), so that its cycles are collected."""
    while True:
        await asyncio.sleep(FREEZE_EVERY_S)
        gc.freeze()


def route(action: str) -> None:
    """Add (`replace`) or delete (`del`) the route that makes KWOK's pod range this machine's own."""
    cmd = ["ip", "route", action, *ROUTE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed: {proc.stderr.strip()}")


async def serve(kubeconfig: Path, control_port: int) -> None:
    """Serve until SIGTERM or SIGINT (the local cluster stops its components with SIGTERM)."""
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    api = Api(load_kubeconfig(kubeconfig))
    host = Host(api)
    control = web.Application()
    control.router.add_get("/engines", host.view)
    control.router.add_get("/healthz", host.healthz)
    runner = web.AppRunner(control, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control_port).start()
    freezer = asyncio.create_task(freeze_survivors())
    try:
        await api.informer("/api/v1/pods", host.on_pod, labelSelector=f"{LABEL_COMPONENT}={COMPONENT_ENGINE}")
    finally:
        freezer.cancel()
        for ip in list(host.engines):
            await host._stop(ip)
        await runner.cleanup()
        await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--control-port", type=int, default=CONTROL_PORT)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Each engine is a listening socket, and each of its callers' connections one more.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    route("replace")
    try:
        with contextlib.suppress(asyncio.CancelledError):
            uvloop.run(serve(args.kubeconfig, args.control_port))
    finally:
        route("del")


if __name__ == "__main__":
    main()
