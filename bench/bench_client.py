"""Trainer client benchmark: samples/s through `rollfleet_client` against the same requests sent straight
to the gateway with httpx, in one run.

The gateway (`rollfleet gateway`, static mode) fronts two fast vLLM-compatible simulators
(devtools/rollfleet_dev/sim_engine.py: 16 tokens per request, no delay), so the numbers measure
what the client adds per request (building the call, reading the answer into a `Generation`),
not the engines. Closed loop with `--concurrency` callers for `--duration` s per measurement;
the two ways interleave over `--rounds` rounds and the report takes medians. Goal: client /
direct >= 0.95.

Usage: python -m bench.bench_client [--concurrency 32] [--duration 3] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from bench.bench_gateway import AUTH, BODY, KEY, free_port, router_commands, start_simulators, stop, wait_serving
from rollfleet_client import AsyncRolloutClient
from rollfleet_client.protocol import COMPLETIONS_PATH, REQUEST_ID_HEADER

Call = Callable[[], Awaitable[object]]


async def closed_loop(call: Call, concurrency: int, duration: float) -> float:
    """Requests/s with `concurrency` callers each sending the next request when the last one answered."""
    done = 0
    end = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await call()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def measure(url: str, concurrency: int, duration: float) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=60, headers=AUTH) as http,
        AsyncRolloutClient(url, model=BODY["model"], inference_token=KEY, max_connections=concurrency) as client,
    ):
        body = {**BODY, "return_token_ids": True, "stream": False}

        async def direct() -> object:
            r = await http.post(COMPLETIONS_PATH, json=body, headers={REQUEST_ID_HEADER: f"d-{uuid.uuid4().hex}"})
            r.raise_for_status()
            return r.json()

        async def through_client() -> object:
            return await client.generate(BODY["prompt"], max_tokens=BODY["max_tokens"])

        return {
            "direct_rps": await closed_loop(direct, concurrency, duration),
            "client_rps": await closed_loop(through_client, concurrency, duration),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-client-"))
    token, key = tmp / "token", tmp / "key"
    token.write_text("bench-token\n")
    key.write_text(KEY + "\n")  # the gateway asks for its key, as a fleet's does
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engines = start_simulators(2, tmp, procs)
        port, log = free_port(), tmp / "gateway.log"
        with log.open("wb") as out:
            gateway = router_commands(engines, token, key)["rollfleet-gateway"](port)
            procs.append(subprocess.Popen(gateway, stdout=out, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, procs[-1], log)
        rounds = []
        for r in range(args.rounds):
            rounds.append(asyncio.run(measure(url, args.concurrency, args.duration)))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.0f}" for k, v in rounds[-1].items()))
    finally:
        for p in procs:
            stop(p)
    direct = statistics.median(r["direct_rps"] for r in rounds)
    client = statistics.median(r["client_rps"] for r in rounds)
    report = {
        "direct_rps": round(direct, 1),
        "client_rps": round(client, 1),
        "client_over_direct": round(client / direct, 3),
    }
    print(
        f"direct to the gateway {direct:.0f} req/s, through the client {client:.0f} req/s: "
        f"ratio {client / direct:.2f} (goal >= 0.95)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
