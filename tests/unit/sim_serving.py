"""Simulated engines (rollfleet_dev.sim_engine) served on loopback ports from a test's own event loop."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from rollfleet_dev.sim_engine import SimEngine


async def serve_sims(sims: Sequence[SimEngine], ports: Sequence[int]) -> list[web.AppRunner]:
    """Each engine on its port of 127.0.0.1; the runners, for `stop_sims`."""
    runners = []
    for sim, port in zip(sims, ports, strict=True):
        runner = web.AppRunner(sim.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    return runners


async def stop_sims(runners: Sequence[web.AppRunner]) -> None:
    for runner in runners:
        await runner.cleanup()
