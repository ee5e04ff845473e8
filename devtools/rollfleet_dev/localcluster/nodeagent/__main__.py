"""`python -m rollfleet_dev.localcluster.nodeagent`: run the node agent until SIGTERM.

Started by `rollfleet cluster up`; stopped by `rollfleet cluster down` (SIGTERM: every
pod process is stopped, SIGKILL after a few seconds, then the agent exits).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from rollfleet_dev.localcluster.nodeagent import config
from rollfleet_dev.localcluster.nodeagent.agent import Agent, install_signal_handlers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollfleet_dev.localcluster.nodeagent", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--pools", type=Path, default=config.DEFAULT_POOLS)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    agent = Agent(args.kubeconfig, config.load(args.pools), args.state_dir)

    async def run() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await agent.run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
