"""kopf registration for RolloutRequest: each request's task.

A long-lived task per request (`tasks.ObjectTasks`, the fleets' idiom), not on.create/on.update
handlers, because a run lasts minutes and must react within a fraction of a second to
annotations on its object: the task holds a live view of the body, which the run loop reads
every tick. The task ends once the request is terminal (after its TTL when one is set), and
finished requests without a TTL get no task at all; after an operator restart every running
request gets a task again and is adopted (see `runner`). A failed run is run again after a
backoff, and adopts what the failed one sent. A deleted request's task aborts its samples at
the engines. No finalizer: deletion never waits for the operator.

The clients the tasks share (the API server's, through `rollfleet.kube`, and the HTTP client
to gateways) live in kopf's memo from startup to cleanup. Talks to nobody itself; `runner`
does the I/O.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import Any

import httpx
import kopf

from rollfleet.api.request import PLURAL, TERMINAL_PHASES
from rollfleet.contract import GROUP, VERSION
from rollfleet.controller.requests import runner
from rollfleet.controller.tasks import LiveBody, ObjectTasks, Stop
from rollfleet.controller.tokens import OperatorKey
from rollfleet.kube import Kube, load_client

# Each in-flight sample holds one connection to its gateway; parallelism is per request.
MAX_CONNECTIONS = 4096
KEEPALIVE = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
]


@kopf.on.startup()
async def open_clients(memo: kopf.Memo, **_: Any) -> None:
    # Clients of their own, apart from the fleets': a busy request does not queue fleet calls.
    memo.request_kube = Kube(load_client())
    # No read timeout: a sample may wait out a long weight sync on a paused engine; deadlines are ours.
    # TCP keepalive instead finds a gateway gone without a word (its node lost): the call fails
    # after about a minute, and the runner stops and resends the sample.
    memo.request_http = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        transport=httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=256),
            socket_options=KEEPALIVE,
        ),
    )
    memo.request_tasks = ObjectTasks("request", wanted=_needs_task)


@kopf.on.cleanup()
async def close_clients(memo: kopf.Memo, **_: Any) -> None:
    await memo.request_tasks.stop_all()
    await memo.request_http.aclose()
    memo.request_kube.close()


def _needs_task(body: Mapping[str, Any]) -> bool:
    """Running requests, and finished ones still waiting for their TTL: others cost no task."""
    status = body.get("status") or {}
    return status.get("phase") not in TERMINAL_PHASES or body["spec"].get("ttlSecondsAfterFinished") is not None


@kopf.on.event(GROUP, VERSION, PLURAL)
async def request_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    tasks: ObjectTasks = memo.request_tasks
    tasks.on_event(
        event.get("type"),
        event["object"],
        lambda body: RequestRun(memo.request_kube, memo.operator_key, memo.request_http, body),
    )


class RequestRun:
    """A request's task: run it to a terminal phase, then delete it once its TTL passed."""

    def __init__(self, kube: Kube, key: OperatorKey, http: httpx.AsyncClient, body: LiveBody) -> None:
        self.kube, self.key, self.http, self.body = kube, key, http, body

    async def run(self, stop: Stop) -> None:
        finished_at = None
        if (self.body.get("status") or {}).get("phase") not in TERMINAL_PHASES:
            verdict = await runner.Run(self.kube, self.key, self.http, self.body, stop).run()
            if not verdict.terminal or stop:
                return
            finished_at = time.time()
        await runner.expire(self.kube, self.body, stop.wait, finished_at)

    async def close(self) -> None:
        return
