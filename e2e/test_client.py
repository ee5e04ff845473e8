"""The trainer client (`rollfleet_client`) against the live fleet's gateway and REAL vLLM engines.

Token ids in, token ids and logprobs out; a cancelled or timed-out generate is aborted at the
engine (its tracker says so); every failure is a typed error carrying the server's message.
"""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest

from e2e.live_fleet import LiveFleet
from e2e.provider import wait_for
from rollfleet_client import AsyncRolloutClient, GatewayUnreachable, RequestRefused, Unauthorized
from rollfleet_engine.tiny_model import LONG_GENERATION as LONG

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


@pytest.fixture
def fleet(live: LiveFleet) -> LiveFleet:
    live.ready()
    return live


def connect(fleet: LiveFleet, token: str | None = None) -> AsyncRolloutClient:
    return AsyncRolloutClient(fleet.gateways[0].url, model="tiny", token=token or fleet.token)


def stopped_at_engine(fleet: LiveFleet, rid: str) -> bool:
    seen = fleet.tracked(rid)
    running = {r for ids in fleet.in_flight().values() for r in ids}
    return seen is not None and seen.get("finish_reason") == "abort" and rid not in running


def test_generate_returns_token_ids_logprobs_and_the_weight_version(fleet: LiveFleet) -> None:
    async def go() -> None:
        async with connect(fleet) as client:
            g = await client.generate([5, 6, 7], max_tokens=12, ignore_eos=True, logprobs=0, temperature=1.0)
            text = await client.generate("once upon a time", max_tokens=4, ignore_eos=True)
        assert len(g.token_ids) == 12 and g.logprobs is not None and len(g.logprobs) == 12
        assert all(lp <= 0 for lp in g.logprobs) and g.finish_reason == "length"
        assert g.prompt_token_ids == [5, 6, 7] and g.weight_version is not None and g.engines
        assert len(text.token_ids) == 4 and text.logprobs is None and text.text

    asyncio.run(go())


def test_cancelling_or_timing_out_a_generate_aborts_it_at_the_engine(fleet: LiveFleet) -> None:
    cancelled, waited, deadline = (f"cl-{what}-{uuid.uuid4().hex[:6]}" for what in ("cancel", "wait-for", "deadline"))

    def on_engine() -> bool:
        return any(cancelled in ids for ids in fleet.in_flight().values())

    async def go() -> None:
        async with connect(fleet) as client:
            task = asyncio.create_task(client.generate("long", request_id=cancelled, max_tokens=LONG, ignore_eos=True))
            await asyncio.to_thread(wait_for, on_engine, 60, 0.05, f"{cancelled} on an engine")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The caller's own timeout is a cancellation too.
            with pytest.raises(TimeoutError):
                long = client.generate("long", request_id=waited, max_tokens=LONG, ignore_eos=True)
                await asyncio.wait_for(long, timeout=2.0)
            # timeout_s: the gateway stops it at the engine at the deadline and answers with what was made.
            partial = await client.generate(
                "long", request_id=deadline, timeout_s=1.0, max_tokens=LONG, ignore_eos=True
            )
            assert partial.finish_reason == "abort" and len(partial.token_ids) < LONG, partial

    asyncio.run(go())
    for rid in (cancelled, waited, deadline):
        wait_for(lambda rid=rid: stopped_at_engine(fleet, rid), 30, what=f"{rid} aborted at its engine")


def test_failures_are_typed_errors_with_the_servers_message(fleet: LiveFleet) -> None:
    async def go() -> None:
        async with connect(fleet) as client:
            with pytest.raises(RequestRefused, match=r"(?i)vocab") as refused:
                await client.generate([1, 10**9], max_tokens=2)
            assert refused.value.status == 400
        async with connect(fleet, token="not-the-fleet-token") as client:
            with pytest.raises(Unauthorized, match="admin-token"):
                await client.abort(["anything"])
        async with AsyncRolloutClient("http://127.0.0.1:9", model="tiny") as nowhere:
            with pytest.raises(GatewayUnreachable, match=re.escape("127.0.0.1:9")):
                await nowhere.generate("hi", max_tokens=1)

    asyncio.run(go())
