"""`POST /v1/abort`: stop requests by caller id and say, per id, what the engine saw.

Owns the answer aborted | finished | pending | unconfirmed | unknown for each id, which
never claims more than an engine confirmed:

- an id in flight at this replica is stopped through the proxy (which aborts it on its
  engine and lets the engine's stream end it with `finish_reason: "abort"`), and the
  answer is how the request actually ended (`unconfirmed`, with the reason, when the
  gateway had to cut a stream its engine did not end);
- any other id (served by another gateway replica, or unknown) is aborted by fanning
  out to every engine of the fleet with the engine's truthful abort; the engine that
  knew the id decides the answer, so several gateway replicas need no coordination;
  `unknown` means every engine was asked and none knew it.

Never trusts an HTTP status for the outcome. Talks to engines through the proxy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, Field

from rollfleet.gateway.inflight import ABORT, InFlight, StopReason
from rollfleet.gateway.proxy import Proxy
from rollfleet_engine.protocol import AbortStatus

MAX_ABORT_IDS = 4096  # per call
T = TypeVar("T")


class GatewayAbortRequest(BaseModel):
    request_ids: list[str] = Field(min_length=1, max_length=MAX_ABORT_IDS)
    timeout_s: float = Field(default=10.0, gt=0, le=120)


@dataclass(frozen=True)
class Answer:
    """What this gateway knows of one id after the abort; `reason` says why an end is unconfirmed."""

    status: AbortStatus
    reason: str | None = None


async def abort(proxy: Proxy, request_ids: list[str], timeout_s: float) -> dict[str, Answer]:
    ids = list(dict.fromkeys(request_ids))
    local = {rid: e for rid in ids if (e := proxy.inflight.get(rid)) is not None}
    remote = [rid for rid in ids if rid not in local]
    started = asyncio.get_running_loop().time()
    remote_task = asyncio.create_task(_timed(_abort_remote(proxy, remote, timeout_s)))
    local_results = await asyncio.gather(*(_timed(_abort_local(proxy, e, timeout_s)) for e in local.values()))
    remote_results, remote_done = await remote_task
    answered = {rid: (answer, remote_done) for rid, answer in remote_results.items()}
    answered.update(zip(local, local_results, strict=True))
    for answer, done in answered.values():
        proxy.metrics.of(proxy.metrics.aborts, answer.status.value).inc()
        if answer.status is AbortStatus.ABORTED:  # its engine said it stopped: the time until the engine is free
            proxy.metrics.abort_seconds.observe(done - started)
    return {rid: answered[rid][0] for rid in ids}


async def _timed(call: Awaitable[T]) -> tuple[T, float]:
    """The call's result, and the loop's time when it came."""
    result = await call
    return result, asyncio.get_running_loop().time()


async def _abort_local(proxy: Proxy, entry: InFlight, timeout_s: float) -> Answer:
    proxy.stop(entry, StopReason.ADMIN)
    try:
        await asyncio.wait_for(asyncio.shield(entry.ended), timeout_s)  # shielded: others wait on it too
    except TimeoutError:
        return Answer(AbortStatus.PENDING)
    return ended(entry.finish_reason, entry.unconfirmed)


def ended(finish_reason: str | None, unconfirmed: str | None) -> Answer:
    """The answer for a request that ended at this replica: as its engine's stream said, unless it never did."""
    if unconfirmed is not None:
        return Answer(AbortStatus.UNCONFIRMED, unconfirmed)
    return Answer(AbortStatus.ABORTED if finish_reason == ABORT else AbortStatus.FINISHED)


async def _abort_remote(proxy: Proxy, ids: list[str], timeout_s: float) -> dict[str, Answer]:
    if not ids:
        return {}
    engines = [e for e in proxy.registry.engines() if e.url]
    answers = await asyncio.gather(*(proxy.abort_on_engine(e, ids, timeout_s) for e in engines))
    results = {}
    for rid in ids:
        per_engine = {e.key: a[rid] for e, a in zip(engines, answers, strict=True)}
        answer = combine(per_engine)
        finished_here = proxy.inflight.finished(rid)
        if answer.status in (AbortStatus.UNKNOWN, AbortStatus.UNCONFIRMED) and finished_here is not None:
            # It ran here and ended; its engine may have forgotten it (or be gone).
            answer = ended(finished_here.finish_reason, finished_here.unconfirmed)
        results[rid] = answer
    return results


def combine(per_engine: Mapping[str, AbortStatus]) -> Answer:
    """One answer for an id asked of several engines: the engine that knew it wins.

    `unknown` only when every engine was asked and none knew the id; when some could not be
    asked, the id may be running there: `unconfirmed`, naming them.
    """
    statuses = set(per_engine.values())
    for wanted in (AbortStatus.ABORTED, AbortStatus.FINISHED, AbortStatus.PENDING):
        if wanted in statuses:
            return Answer(wanted)
    silent = sorted(k for k, s in per_engine.items() if s is AbortStatus.UNCONFIRMED)
    if silent:
        return Answer(
            AbortStatus.UNCONFIRMED,
            f"no engine that answered knew the id, and {', '.join(silent)} could not be asked (see the gateway log)",
        )
    return Answer(AbortStatus.UNKNOWN)
