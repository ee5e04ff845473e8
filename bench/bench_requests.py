"""RolloutRequest benchmark: samples/s through the operator vs the same gateway used directly,
and the operator's memory with 1,000 finished requests kept.

Not a test: prints numbers and ratios, all measured in the same run on the same cluster.

1. memory: a fresh `rollfleet operator -n <ns>` (RSS from /proc) before and after 1,000
   RolloutRequests reach a terminal phase and stay (no TTL). They name a fleet that does
   not exist, so they finish at once: what is measured is what the operator keeps per
   finished request (kopf's per-object state; a finished request's run is gone).
2. throughput (with `--fleet NS/NAME`, a Ready fleet): one RolloutRequest of P prompts x n
   samples through the operator, timed from create to Succeeded, then the same number of
   samples sent straight to the fleet's gateway with the same bodies and concurrency.

Usage: python -m bench.bench_requests [--requests 1000] [--fleet NS/NAME --prompts 64 --n 4
       --max-tokens 64 --parallelism 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import kubernetes

from rollfleet.api.request import PLURAL, TERMINAL_PHASES, Prompt, RolloutRequestSpec
from rollfleet.contract import GROUP, OPERATOR_NAMESPACE, VERSION
from rollfleet.controller.requests import plan
from rollfleet.controller.requests.runner import read_fleet
from rollfleet.controller.tokens import OperatorKey
from rollfleet.kube import Kube, load_client
from rollfleet_dev.localcluster import controlplane

BIN = Path(sys.executable).parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


NO_ENDPOINTS = ["--health-port", "0", "--metrics-port", "0"]


@contextmanager
def operator(kubeconfig: Path, namespace: str) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen(
        [BIN / "rollfleet", "operator", "-n", namespace, "--key-namespace", namespace, *NO_ENDPOINTS],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def request_body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RolloutRequest", "metadata": {"name": name}, "spec": spec}


def phases(custom: kubernetes.client.CustomObjectsApi, namespace: str) -> dict[str, str]:
    items = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "") for i in items}


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


def bench_memory(kubeconfig: Path, client: kubernetes.client.ApiClient, count: int) -> None:
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    ns = f"rr-bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        with operator(kubeconfig, ns) as proc:
            time.sleep(8)  # kopf started, watches open, nothing to do
            idle = rss_mib(proc.pid)
            spec = {"fleet": "nosuch", "prompts": [{"text": "hello"}], "samplesPerPrompt": 4}
            start = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                list(
                    pool.map(
                        lambda i: custom.create_namespaced_custom_object(
                            GROUP, VERSION, ns, PLURAL, request_body(f"r{i:04d}", spec)
                        ),
                        range(count),
                    )
                )
            wait_until(
                lambda: sum(p in TERMINAL_PHASES for p in phases(custom, ns).values()) == count,
                timeout=600,
                what=f"{count} requests finished",
            )
            took = time.monotonic() - start
            time.sleep(5)  # let daemons exit and their state go
            after_run = rss_mib(proc.pid)
        # A fresh operator that finds them: the steady cost, without the peak of 1,000 runs at once.
        with operator(kubeconfig, ns) as proc:
            time.sleep(15)
            kept = rss_mib(proc.pid)
        print(f"operator RSS idle (no requests)          {idle:8.1f} MiB")
        print(f"after running {count} (peak stays in RSS)  {after_run:8.1f} MiB  (+{after_run - idle:.1f} MiB)")
        print(
            f"restarted, {count} finished kept          {kept:8.1f} MiB  (+{kept - idle:.1f} MiB, "
            f"{(kept - idle) * 1024 / count:.1f} KiB per request)"
        )
        print(f"create -> terminal for {count}       {took:8.1f} s    ({count / took:.1f} requests/s)")
    finally:
        core.delete_namespace(ns)


async def direct(gateway: str, calls: list[plan.Call], parallelism: int) -> float:
    sem = asyncio.Semaphore(parallelism)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=parallelism)
    ) as http:

        async def one(call: plan.Call) -> None:
            async with sem:
                resp = await http.post(gateway + call.path, json=call.body, headers=call.headers)
                resp.raise_for_status()

        start = time.monotonic()
        await asyncio.gather(*(one(c) for c in calls))
        return time.monotonic() - start


def bench_throughput(
    client: kubernetes.client.ApiClient, fleet: str, prompts: int, n: int, max_tokens: int, parallelism: int
) -> None:
    ns, name = fleet.split("/", 1)
    custom = kubernetes.client.CustomObjectsApi(client)
    texts = [f"Question {i}: what comes after {i}?" for i in range(prompts)]
    spec = {
        "fleet": name,
        "prompts": [{"text": t} for t in texts],
        "samplesPerPrompt": n,
        "sampling": {"maxTokens": max_tokens, "minTokens": max_tokens, "temperature": 1.0, "ignoreEos": True},
        "parallelism": parallelism,
        "ttlSecondsAfterFinished": 60,
    }
    rr = f"bench-{uuid.uuid4().hex[:6]}"
    start = time.monotonic()
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, request_body(rr, spec))
    wait_until(lambda: phases(custom, ns).get(rr) in TERMINAL_PHASES, timeout=1800, what=f"{rr} finished")
    via_operator = time.monotonic() - start
    phase = phases(custom, ns)[rr]

    view = asyncio.run(read_fleet(Kube(client), OperatorKey(OPERATOR_NAMESPACE), ns, name))
    assert view.gateway and view.model, f"fleet {fleet} has no gateway yet"
    parsed = RolloutRequestSpec.model_validate(spec)
    uid = f"direct-{uuid.uuid4().hex[:8]}"
    calls = [
        plan.build_call(parsed, view.model, uid, (p, s), Prompt(text=texts[p]))
        for p in range(prompts)
        for s in range(n)
    ]
    via_gateway = asyncio.run(direct(view.gateway, calls, parallelism))
    total = prompts * n
    print(
        f"operator path   {total} samples in {via_operator:6.1f} s = {total / via_operator:7.1f} samples/s "
        f"(phase {phase}; includes create, watch and status latency)"
    )
    print(f"gateway direct  {total} samples in {via_gateway:6.1f} s = {total / via_gateway:7.1f} samples/s")
    print(f"operator / direct: {via_gateway / via_operator:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="finished requests for the memory part")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--fleet", help="NS/NAME of a Ready fleet for the throughput part")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--parallelism", type=int, default=64)
    args = parser.parse_args()
    kubeconfig = controlplane.up().kubeconfig
    client = load_client(str(kubeconfig))
    if not args.no_memory:
        bench_memory(kubeconfig, client, args.requests)
    if args.fleet:
        bench_throughput(client, args.fleet, args.prompts, args.n, args.max_tokens, args.parallelism)
    else:
        print("throughput: skipped (pass --fleet NS/NAME of a Ready fleet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
