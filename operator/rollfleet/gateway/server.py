"""`rollfleet gateway`: flags, config, and serving until SIGTERM (`app.serving`: uvloop + httptools, no access log).

The per-fleet Deployment runs `rollfleet gateway --fleet F --namespace NS --port 8080
--token-file /var/run/secrets/rollfleet/token`; `--engines URL,URL` is the static mode
(no Kubernetes) that benchmarks and tests use.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

import uvloop

from rollfleet.gateway.app import GatewayConfig, serving
from rollfleet.gateway.proxy import ProxyConfig
from rollfleet.gateway.routing import RoutingPolicy
from rollfleet.hotpath import settle_gc

DEFAULT_TOKEN_FILE = "/var/run/secrets/rollfleet/token"
log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", help="RolloutFleet name: watch its engine pods (Kubernetes mode)")
    p.add_argument("--namespace", default="default", help="namespace of the fleet (default: %(default)s)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, else ~/.kube/config)")
    p.add_argument("--engines", help="comma-separated engine base URLs: static mode, no Kubernetes")
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to bind (default: every address of the pod)",
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--token-file", default=DEFAULT_TOKEN_FILE, help="fleet admin token (default: %(default)s)")
    p.add_argument("--api-key-file", help="if given, inference routes need this bearer token (or the admin token)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument(
        "--max-model-len",
        type=int,
        help="the engines' context (spec.engine.maxModelLen): a max_tokens past it gets a 400 before any engine",
    )
    p.add_argument("--request-timeout", type=float, default=3600.0, help="default per-request deadline, seconds")
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=60.0,
        help="how long a request waits for a routable engine before 503 (default: %(default)s s)",
    )
    p.add_argument(
        "--eject-seconds",
        type=float,
        default=5.0,
        help="how long an engine that dropped a connection gets no new requests (default: %(default)s)",
    )
    p.add_argument("--max-attempts", type=int, default=3, help="attempts per request, failovers included")
    p.add_argument(
        "--continue-min-tokens",
        type=int,
        default=256,
        help="non-streaming requests that may generate fewer tokens are sent whole to the engine (a failover "
        "restarts them); longer ones are streamed from it, so that a failover continues from their tokens "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=25.0,
        help="on SIGTERM, seconds requests in flight get to finish (default: %(default)s; the pod has 30)",
    )
    p.add_argument("--session-ttl", type=float, default=600.0, help="idle seconds before a sticky session is dropped")
    p.add_argument(
        "--imbalance-abs",
        type=int,
        default=8,
        help="move a session when its engine has this many more outstanding requests than the least loaded",
    )
    p.add_argument("--imbalance-rel", type=float, default=1.5, help="... and this many times its load")
    p.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    from rollfleet_engine.access import read_token

    return GatewayConfig(
        token=read_token(args.token_file),
        engines=[u.strip() for u in (args.engines or "").split(",") if u.strip()],
        fleet=args.fleet,
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        api_key=read_token(args.api_key_file) if args.api_key_file else None,
        max_body_bytes=args.max_body_bytes,
        max_model_len=args.max_model_len,
        eject_s=args.eject_seconds,
        request_timeout_s=args.request_timeout,
        routing=RoutingPolicy(
            session_ttl_s=args.session_ttl, imbalance_abs=args.imbalance_abs, imbalance_rel=args.imbalance_rel
        ),
        shutdown_grace_s=args.shutdown_grace,
        proxy=ProxyConfig(
            max_attempts=args.max_attempts,
            queue_timeout_s=args.queue_timeout,
            continue_min_tokens=args.continue_min_tokens,
        ),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not Path(args.token_file).exists():
        raise SystemExit(f"rollfleet gateway: token file {args.token_file} does not exist")
    uvloop.run(_serve(config_from_args(args), args.host, args.port))
    return 0


async def _serve(config: GatewayConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serving(config, host, port):
        settle_gc()
        log.info("gateway serving on %s:%d", host, port)
        await stop.wait()
        log.info("shutting down: requests in flight get %.0f s to finish", config.shutdown_grace_s)
