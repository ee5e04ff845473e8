"""Calls the gateway makes to an engine's own API (not inference): abort by caller id.

The engine's `POST /rollfleet/v1/abort` answers per id from what the engine observed
(aborted | finished | unknown | pending), unlike vLLM's `/abort_requests`, which says
"aborted" for ids it never saw. Talks to engines only, with the fleet admin token.
"""

from __future__ import annotations

import logging

import aiohttp

from rollfleet_engine.protocol import ABORT_PATH, AbortStatus

log = logging.getLogger(__name__)

# Engine answers that say the id was never there (or the engine could not be asked).
NOT_THERE = AbortStatus.UNKNOWN


async def abort_on_engine(
    session: aiohttp.ClientSession, url: str, token: str, request_ids: list[str], timeout_s: float
) -> dict[str, AbortStatus]:
    """Ask one engine to abort caller ids and say how each ended there; unknown when unreachable."""
    try:
        async with session.post(
            url + ABORT_PATH,
            json={"request_ids": request_ids, "timeout_s": timeout_s},
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout_s + 5, sock_connect=2),
        ) as resp:
            if resp.status != 200:
                log.warning("abort on %s answered %s: %s", url, resp.status, (await resp.text())[:200])
                return dict.fromkeys(request_ids, NOT_THERE)
            results = (await resp.json()).get("results", {})
    except (aiohttp.ClientError, OSError, TimeoutError) as err:
        log.info("abort on %s failed: %s", url, err)
        return dict.fromkeys(request_ids, NOT_THERE)
    return {rid: _status(results.get(rid)) for rid in request_ids}


def _status(value: object) -> AbortStatus:
    try:
        return AbortStatus(str(value))
    except ValueError:
        return NOT_THERE


def combine(statuses: list[AbortStatus]) -> AbortStatus:
    """One answer for an id asked of several engines: the engine that knew it wins."""
    for wanted in (AbortStatus.ABORTED, AbortStatus.FINISHED, AbortStatus.PENDING):
        if wanted in statuses:
            return wanted
    return AbortStatus.UNKNOWN
