"""Abort that tells the truth: abort by caller id, then check how each request ended.

vLLM's own ``/abort_requests`` answers "aborted" for ids it does not know. Here the
answer per id comes from what the engine's output stream actually said afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from rollfleet_engine.protocol import AbortStatus, RequestPhase
from rollfleet_engine.tracker import ABORT, RequestTracker

# Abort is re-sent at this interval while a request has not ended: a request that is
# still being tokenized reaches the engine only after the first abort was sent.
_RESEND_S = 0.05


def settled_status(tracker: RequestTracker, request_id: str) -> AbortStatus | None:
    """The final answer for an id if it has one already, else None (still in flight)."""
    tracked = tracker.get(request_id)
    if tracked is None:
        return AbortStatus.UNKNOWN
    if tracked.phase is not RequestPhase.FINISHED:
        return None
    return AbortStatus.ABORTED if tracked.finish_reason == ABORT else AbortStatus.FINISHED


async def abort_requests(
    tracker: RequestTracker,
    engine_abort: Callable[[list[str]], Awaitable[None]],
    request_ids: Iterable[str],
    timeout_s: float,
    attempt: str | None = None,
) -> dict[str, AbortStatus]:
    """Abort the caller ids and wait (up to ``timeout_s``) until each has ended. With ``attempt``, only
    requests sent with it: a request of another sender under the same id is not this caller's to end."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    ids = list(dict.fromkeys(request_ids))
    results: dict[str, AbortStatus] = {}
    targets = []
    for rid in ids:
        if attempt is not None and not tracker.sent_with(rid, attempt):
            results[rid] = AbortStatus.UNKNOWN
            continue
        status = settled_status(tracker, rid)
        if status is None:
            targets.append(rid)
        else:
            results[rid] = status
    next_send = loop.time()
    while targets:
        now = loop.time()
        if now >= deadline:
            results.update(dict.fromkeys(targets, AbortStatus.PENDING))
            break
        if now >= next_send:
            engine_ids = [eid for rid in targets for eid in tracker.unfinished_engine_ids(rid)]
            if engine_ids:
                await engine_abort(engine_ids)
            next_send = now + _RESEND_S
        await tracker.wait_changed(max(0.0, min(next_send, deadline) - loop.time()))
        still = []
        for rid in targets:
            status = settled_status(tracker, rid)
            if status is None:
                still.append(rid)
            else:
                results[rid] = status
        targets = still
    return {rid: results[rid] for rid in ids}
