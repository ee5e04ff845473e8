"""`POST /v1/abort`: stop requests by caller id and say, per id, what the engine saw.

Owns the answer aborted | finished | unknown | pending for each id:

- an id in flight at this replica is stopped through the proxy (which aborts it on its
  engine and lets the engine's stream end it with `finish_reason: "abort"`), and the
  answer is how the request actually ended;
- any other id (served by another gateway replica, or unknown) is aborted by fanning
  out to every engine of the fleet with the engine's truthful abort; the engine that
  knew the id decides the answer, so several gateway replicas need no coordination.

Never trusts an HTTP status for the outcome. Talks to engines through the proxy.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from rollfleet.gateway.inflight import ABORT, InFlight, StopReason
from rollfleet.gateway.proxy import Proxy
from rollfleet_engine.protocol import AbortStatus


class GatewayAbortRequest(BaseModel):
    request_ids: list[str] = Field(min_length=1, max_length=4096)
    timeout_s: float = Field(default=10.0, gt=0, le=120)


async def abort(proxy: Proxy, request_ids: list[str], timeout_s: float) -> dict[str, AbortStatus]:
    ids = list(dict.fromkeys(request_ids))
    local = {rid: e for rid in ids if (e := proxy.inflight.get(rid)) is not None}
    remote = [rid for rid in ids if rid not in local]
    remote_task = asyncio.create_task(_abort_remote(proxy, remote, timeout_s))
    local_results = await asyncio.gather(*(_abort_local(proxy, e, timeout_s) for e in local.values()))
    results = await remote_task
    results.update(zip(local, local_results, strict=True))
    for status in results.values():
        proxy.metrics.aborts.labels(status.value).inc()
    return {rid: results[rid] for rid in ids}


async def _abort_local(proxy: Proxy, entry: InFlight, timeout_s: float) -> AbortStatus:
    proxy.stop(entry, StopReason.ADMIN)
    try:
        await asyncio.wait_for(entry.done.wait(), timeout_s)
    except TimeoutError:
        return AbortStatus.PENDING
    return AbortStatus.ABORTED if entry.finish_reason == ABORT else AbortStatus.FINISHED


async def _abort_remote(proxy: Proxy, ids: list[str], timeout_s: float) -> dict[str, AbortStatus]:
    if not ids:
        return {}
    engines = [e for e in proxy.registry.engines() if e.url]
    answers = await asyncio.gather(*(proxy.abort_on_engine(e, ids, timeout_s) for e in engines))
    results = {}
    for rid in ids:
        status = combine([a[rid] for a in answers])
        finished_here = proxy.inflight.finished(rid)
        if status is AbortStatus.UNKNOWN and finished_here is not None:
            # It ran here and ended; its engine may have forgotten it (or be gone).
            status = AbortStatus.ABORTED if finished_here.finish_reason == ABORT else AbortStatus.FINISHED
        results[rid] = status
    return results


def combine(statuses: list[AbortStatus]) -> AbortStatus:
    """One answer for an id asked of several engines: the engine that knew it wins."""
    for wanted in (AbortStatus.ABORTED, AbortStatus.FINISHED, AbortStatus.PENDING):
        if wanted in statuses:
            return wanted
    return AbortStatus.UNKNOWN
