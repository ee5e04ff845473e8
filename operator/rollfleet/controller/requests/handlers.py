"""kopf registration for RolloutRequest: one daemon per request object.

A daemon (not on.create/on.update handlers) because a run is long-lived and must
react within a fraction of a second to annotations on its object: kopf hands the
daemon a live view of the body, which the run loop reads every tick. The daemon
returns once the request is terminal (after its TTL when one is set), and finished
requests without a TTL get no daemon at all; after an operator restart every request gets a daemon again
and a running one is adopted (see `runner`). A failed run ends in `kopf.TemporaryError`, as a
fleet's does (`controller/daemons.py`); the next run adopts what the failed one sent.

The clients the daemons share (the API server's, through `rollfleet.kube`, and the HTTP
client to gateways) live in kopf's memo from startup to cleanup. Talks to nobody itself;
`runner` does the I/O.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import kopf

from rollfleet.api.request import PLURAL, TERMINAL_PHASES
from rollfleet.contract import GROUP, VERSION
from rollfleet.controller.daemons import retry_later
from rollfleet.controller.requests import runner
from rollfleet.kube import Kube, load_client

# Each in-flight sample holds one connection to its gateway; parallelism is per request.
MAX_CONNECTIONS = 4096


@kopf.on.startup()
async def open_clients(memo: kopf.Memo, **_: Any) -> None:
    # Clients of their own, apart from the fleets': a busy request does not queue fleet calls.
    memo.request_kube = Kube(load_client())
    # No read timeout: a sample may wait out a long weight sync on a paused engine; deadlines are ours.
    memo.request_http = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=256),
    )


@kopf.on.cleanup()
async def close_clients(memo: kopf.Memo, **_: Any) -> None:
    await memo.request_http.aclose()
    memo.request_kube.close()


def _needs_daemon(body: kopf.Body, **_: Any) -> bool:
    """Running requests, and finished ones still waiting for their TTL: others cost no task."""
    status = body.get("status") or {}
    return status.get("phase") not in TERMINAL_PHASES or body["spec"].get("ttlSecondsAfterFinished") is not None


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=30.0, when=_needs_daemon)
async def run_request(body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any) -> None:
    kube: Kube = memo.request_kube
    try:
        await _run(kube, memo.request_http, body, stopped)
    except Exception as err:
        memo.failures = memo.get("failures", 0) + 1  # the request's memo: kept across retries
        meta = body["metadata"]
        raise retry_later(f"request {meta['namespace']}/{meta['name']}", err, memo.failures) from err


async def _run(kube: Kube, http: httpx.AsyncClient, body: kopf.Body, stopped: kopf.DaemonStopped) -> None:
    phase = (body.get("status") or {}).get("phase")
    finished_at = None
    if phase not in TERMINAL_PHASES:
        verdict = await runner.Run(kube, http, body, stopping=lambda: bool(stopped)).run()
        if not verdict.terminal or stopped:
            return
        finished_at = time.time()
    await runner.expire(kube, body, stopped.wait, finished_at)
