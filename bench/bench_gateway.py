"""Gateway benchmark: added latency (p50/p99) and max throughput next to vllm-router and sglang-router.

All routers run in one run, on the same upstreams: two fast vLLM-compatible simulators
(devtools/rollfleet_dev/sim_engine.py, 16 output tokens per request, no delay), so the numbers measure
the routers, not the engines. Each router uses a policy of the same cost class as the
gateway's default for sessionless traffic (vllm-router: power_of_two; sglang-router:
power_of_two; the gateway: least outstanding requests) and logs at warning level.

All routers run at once; the measurements are interleaved over `--rounds` rounds and
the report takes the median of each metric (the host's other load drifts during a run).
Measured per router and mode (non-streaming, streaming):
- latency: sequential requests (one in flight), p50/p99 in ms; "added" is the router's
  p50/p99 minus the direct-to-engine p50/p99 measured in the same run;
- throughput: closed loop with `--concurrency` clients for `--duration` s after a 1 s warm-up, requests/s;
- CPU time per request (µs): the router's processes' user + system time during the throughput
  measurement, over the requests it answered (what a router costs the host, whatever else runs).
Also the upstream-client choice: the gateway's own client vs aiohttp's, against one simulator.

Everything shares this host's cores (load generator, router, simulators), so the
absolute numbers are small-host numbers; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.deployed_python import Unavailable, deployed_rollfleet
from bench.granian_gateway import ENGINES_ENV, KEY_FILE_ENV, TOKEN_FILE_ENV
from bench.processes import stop
from rollfleet.upstream import Upstream

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BODY = {"model": "sim", "prompt": "benchmark prompt", "max_tokens": 16}
# Auth on: the gateway asks every request for its key (`--api-key-file`, a fleet's default); every target is
# sent it (the Rust routers check none).
KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The gateway on its own server, on granian (both on this venv's interpreter), and on its own server on the Python
# the control-plane image ships (bench/deployed_python.py): the gateway as users run it.
OURS = ("rollfleet-gateway", "rollfleet-gateway-granian", "rollfleet-gateway-deployed")
# Issue 32's floors, against vllm-router in the same run: throughput ratios at least, added p50 ratio at most.
FLOORS = {"json_rps_ratio": 0.85, "stream_rps_ratio": 1.0, "json_added_p50_ratio": 1.5, "stream_added_p50_ratio": 1.5}
BASELINE = "vllm-router"
WARM_UP_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Result:
    name: str
    latency_ms: dict[str, tuple[float, float]] = field(default_factory=dict)  # mode -> (p50, p99)
    rps: dict[str, float] = field(default_factory=dict)
    cpu_us: dict[str, float] = field(default_factory=dict)  # mode -> CPU µs per request (routers only)
    note: str = ""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(session: aiohttp.ClientSession, url: str, stream: bool, auth: Mapping[str, str] = AUTH) -> None:
    async with session.post(url + "/v1/completions", json={**BODY, "stream": stream}, headers=auth) as resp:
        data = await resp.read()
        if resp.status != 200 or (stream and not data.rstrip().endswith(b"[DONE]")):
            raise RuntimeError(f"{url}: {resp.status} {data[:200]!r}")


async def latency(url: str, stream: bool, n: int, auth: Mapping[str, str] = AUTH) -> tuple[float, float]:
    async with aiohttp.ClientSession() as session:
        for _ in range(50):  # warm-up: connections, caches
            await one(session, url, stream, auth)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            await one(session, url, stream, auth)
            samples.append((time.perf_counter() - t0) * 1000)
    return percentile(samples, 0.5), percentile(samples, 0.99)


async def throughput(
    url: str,
    stream: bool,
    concurrency: int,
    duration: float,
    cpu: Callable[[], float],
    auth: Mapping[str, str] = AUTH,
    warm_up_s: float = WARM_UP_S,
) -> tuple[float, float]:
    """Requests/s of a closed loop in its steady state, and the CPU seconds (`cpu()`) per request then."""
    done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop(until: float) -> None:
            nonlocal done
            while time.perf_counter() < until:
                await one(session, url, stream, auth)
                done += 1

        # Warm up first (every connection opened, the router's pools filled), then measure.
        await asyncio.gather(*(loop(time.perf_counter() + warm_up_s) for _ in range(concurrency)))
        done = 0
        cpu_before, t0 = cpu(), time.perf_counter()
        await asyncio.gather(*(loop(t0 + duration) for _ in range(concurrency)))
        return done / (time.perf_counter() - t0), (cpu() - cpu_before) / max(done, 1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and of its descendants alive now (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime: fields 14 and 15
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # it exited meanwhile
            continue
    return total


async def client_choice(url: str, n: int, concurrency: int) -> dict[str, dict[str, float]]:
    """The gateway's upstream client (rollfleet.upstream) vs aiohttp's, same requests to one simulator."""

    async def run_aiohttp() -> Callable[[], Awaitable[None]]:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def call() -> None:
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                await resp.read()

        call.close = session.close  # type: ignore[attr-defined]
        return call

    async def run_upstream() -> Callable[[], Awaitable[None]]:
        client = Upstream()
        body, headers = json.dumps(BODY).encode(), [("Content-Type", "application/json")]

        async def call() -> None:
            resp = await client.request("POST", url + "/v1/completions", body, headers)
            await resp.read()
            resp.close()

        async def close() -> None:
            client.close()

        call.close = close  # type: ignore[attr-defined]
        return call

    out = {}
    # Twice, the numbers of the second time kept: the first one also warms the simulator up.
    for name, make in [("rollfleet upstream", run_upstream), ("aiohttp", run_aiohttp)] * 2:
        call = await make()
        for _ in range(50):
            await call()
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            await call()
            samples.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        per_worker = max(1, (n * 2) // concurrency)

        async def worker(call: Callable[[], Awaitable[None]] = call, per_worker: int = per_worker) -> None:
            for _ in range(per_worker):
                await call()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rps = per_worker * concurrency / (time.perf_counter() - t0)
        await call.close()  # type: ignore[attr-defined]
        out[name] = {"p50_ms": percentile(samples, 0.5), "p99_ms": percentile(samples, 0.99), "rps": rps}
    return out


def wait_serving(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.post(url + "/v1/completions", json=BODY, headers=AUTH, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling a condition: the router is starting
    raise TimeoutError(f"{url} did not serve within {timeout}s: {log.read_text()[-2000:]}")


def start_simulators(n: int, tmp: Path, procs: list[subprocess.Popen[bytes]]) -> list[str]:
    """`n` simulated engines serving (added to `procs`, for the caller to stop); their URLs."""
    engines = []
    for i in range(n):
        port = free_port()
        log = tmp / f"sim-{i}.log"
        with log.open("wb") as out:
            command = [sys.executable, "-m", "rollfleet_dev.sim_engine", "--host", "127.0.0.1", "--port", str(port)]
            procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
        engines.append(f"http://127.0.0.1:{port}")
        wait_serving(engines[-1], procs[-1], log)
    return engines


def router_commands(
    engines: list[str], token_file: Path, key_file: Path, deployed: Path | None = None
) -> dict[str, Callable[[int], list[str]]]:
    """Each router's command line by name; `deployed`: the `rollfleet` of the image's Python (None: not run)."""
    prom = [free_port(), free_port()]  # the Rust routers' Prometheus listeners (they cannot be turned off)

    def gateway(rollfleet: Path, port: int) -> list[str]:
        return [
            str(rollfleet),
            "gateway",
            "--engines",
            ",".join(engines),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--token-file",
            str(token_file),
            "--api-key-file",
            str(key_file),
            "--log-level",
            "warning",
        ]

    commands: dict[str, Callable[[int], list[str]]] = {
        OURS[0]: functools.partial(gateway, BIN / "rollfleet"),
        # The same admission and proxy on granian's RSGI (bench/granian_gateway.py: engines and tokens from the
        # environment main() sets); one worker and uvloop, as the gateway's own server runs.
        OURS[1]: lambda port: [
            sys.executable,
            "-m",
            "granian",
            "--interface",
            "rsgi",
            "--loop",
            "uvloop",
            "--workers",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--factory",
            "bench.granian_gateway:make_app",
        ],
        "vllm-router": lambda port: [
            str(BIN / "vllm-router"),
            "--worker-urls",
            *engines,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "power_of_two",
            "--log-level",
            "warning",
            "--prometheus-port",
            str(prom[0]),
        ],
        "sglang-router": lambda port: [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *engines,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "power_of_two",
            "--log-level",
            "warn",
            "--prometheus-port",
            str(prom[1]),
        ],
    }
    if deployed is not None:
        commands[OURS[2]] = functools.partial(gateway, deployed)
    return commands


def measure(results: dict[str, list[Result]], name: str, url: str, args: argparse.Namespace, pid: int | None) -> None:
    """One round for one target; `pid`: the router's process, whose CPU time is counted (None: direct)."""
    result = Result(name)
    for mode, stream in (("json", False), ("stream", True)):
        result.latency_ms[mode] = asyncio.run(latency(url, stream, args.requests))
        cpu = functools.partial(cpu_seconds, pid) if pid else lambda: 0.0
        result.rps[mode], cpu_s = asyncio.run(throughput(url, stream, args.concurrency, args.duration, cpu))
        if pid:
            result.cpu_us[mode] = cpu_s * 1e6
    print(
        f"  {name:<18} "
        + "  ".join(
            f"{m}: p50 {p50:.2f} ms p99 {p99:.2f} ms {result.rps[m]:.0f} req/s"
            + (f" {result.cpu_us[m]:.0f} CPU µs/req" if m in result.cpu_us else "")
            for m, (p50, p99) in result.latency_ms.items()
        ),
        flush=True,
    )
    results.setdefault(name, []).append(result)


def median_result(rounds: list[Result]) -> Result:
    """Per metric, the median over rounds: the host's other load drifts during a run."""
    out = Result(rounds[0].name)
    for mode in rounds[0].rps:
        out.latency_ms[mode] = (
            statistics.median(r.latency_ms[mode][0] for r in rounds),
            statistics.median(r.latency_ms[mode][1] for r in rounds),
        )
        out.rps[mode] = statistics.median(r.rps[mode] for r in rounds)
        if mode in rounds[0].cpu_us:
            out.cpu_us[mode] = statistics.median(r.cpu_us[mode] for r in rounds)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per latency measurement")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per throughput measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the report takes medians")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    import uvloop

    uvloop.install()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    token, key = tmp / "token", tmp / "key"
    token.write_text("bench-token\n")
    key.write_text(KEY + "\n")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engines = start_simulators(2, tmp, procs)
        print(f"upstreams: {engines} (simulated, 16 tokens per request)")
        print("upstream client for the gateway (one simulator, non-streaming):")
        choice = asyncio.run(client_choice(engines[0], args.requests, args.concurrency))
        for name, c in choice.items():
            print(f"  {name:<18} p50 {c['p50_ms']:.2f} ms p99 {c['p99_ms']:.2f} ms {c['rps']:.0f} req/s")
        targets = {"direct (engine)": engines[0]}
        pids: dict[str, int | None] = {"direct (engine)": None}
        failed: list[Result] = []
        os.environ |= {ENGINES_ENV: ",".join(engines), TOKEN_FILE_ENV: str(token), KEY_FILE_ENV: str(key)}
        try:
            deployed: Path | None = deployed_rollfleet()
        except Unavailable as err:
            deployed = None
            failed.append(Result(OURS[2], note=f"could not run: {err}"))
            print(f"{OURS[2]} could not run: {err}")
        for name, command in router_commands(engines, token, key, deployed).items():
            port = free_port()
            log = tmp / f"{name}.log"
            url = f"http://127.0.0.1:{port}"
            with log.open("wb") as out:
                procs.append(subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
            try:
                wait_serving(url, procs[-1], log)
                targets[name] = url
                pids[name] = procs[-1].pid
            except (RuntimeError, TimeoutError) as err:
                failed.append(Result(name, note=f"could not run: {str(err)[-300:]}"))
                print(f"{name} could not run: {str(err)[-300:]}")
        # Interleaved rounds, medians: every router sees the same drift of the host's load.
        rounds: dict[str, list[Result]] = {}
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}:")
            for name, url in targets.items():
                measure(rounds, name, url, args, pids[name])
    finally:
        for p in procs:
            stop(p, 10)
    results = [median_result(rounds[name]) for name in targets] + failed
    report = summarize(results)
    floors = floor_verdicts(report)
    if args.json:
        out = {"client_choice": choice, "routers": report, "floors": floors}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def summarize(results: list[Result]) -> dict[str, dict[str, float | str]]:
    direct = results[0]
    report: dict[str, dict[str, float | str]] = {}
    print("\nadded latency over direct (ms) and max throughput (req/s); ratios are gateway / other")
    for r in results[1:]:
        row: dict[str, float | str] = {}
        if r.note:
            row["note"] = r.note
            report[r.name] = row
            continue
        for mode in ("json", "stream"):
            (p50, p99), (d50, d99) = r.latency_ms[mode], direct.latency_ms[mode]
            row[f"{mode}_added_p50_ms"] = round(p50 - d50, 3)
            row[f"{mode}_added_p99_ms"] = round(p99 - d99, 3)
            row[f"{mode}_rps"] = round(r.rps[mode], 1)
            row[f"{mode}_cpu_us_per_request"] = round(r.cpu_us[mode], 1)
        report[r.name] = row
    for ours in (r for r in results if r.name in OURS and not r.note):
        for r in results[1:]:
            if r.name in OURS or r.note:
                continue
            o, t = report[ours.name], report[r.name]
            for mode in ("json", "stream"):
                o[f"{mode}_rps_ratio_vs_{r.name}"] = round(float(o[f"{mode}_rps"]) / float(t[f"{mode}_rps"]), 3)
                o[f"{mode}_cpu_per_request_ratio_vs_{r.name}"] = round(
                    float(o[f"{mode}_cpu_us_per_request"]) / float(t[f"{mode}_cpu_us_per_request"]), 2
                )
                theirs = float(t[f"{mode}_added_p50_ms"])
                # An added latency within the noise of the direct measurement has no meaningful ratio.
                o[f"{mode}_added_p50_ratio_vs_{r.name}"] = (
                    round(float(o[f"{mode}_added_p50_ms"]) / theirs, 2) if theirs >= 0.05 else "n/a"
                )
    for name, row in report.items():
        print(f"  {name:<18} " + ", ".join(f"{k}={v}" for k, v in row.items()))
    return report


def floor_verdicts(report: dict[str, dict[str, float | str]]) -> dict[str, dict[str, Any]]:
    """Per server the gateway may run on: each floor's ratio against the baseline, and whether it holds."""
    out: dict[str, dict[str, Any]] = {}
    for name in OURS:
        row = report.get(name, {})
        checks: dict[str, Any] = {}
        for floor, limit in FLOORS.items():
            mode, metric = floor.split("_", 1)
            ratio = row.get(f"{mode}_{metric.removesuffix('_ratio')}_ratio_vs_{BASELINE}")
            if not isinstance(ratio, float):
                checks[floor] = {"ratio": ratio, "limit": limit, "holds": None}  # not measured, or within noise
                continue
            holds = ratio >= limit if metric.endswith("rps_ratio") else ratio <= limit
            checks[floor] = {"ratio": ratio, "limit": limit, "holds": holds}
        out[name] = {"checks": checks, "all_hold": all(c["holds"] is not False for c in checks.values()) and bool(row)}
        shown = ", ".join(f"{f} {c['ratio']} ({'ok' if c['holds'] else c['holds']})" for f, c in checks.items())
        print(f"  floors, {name}: {shown}")
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
