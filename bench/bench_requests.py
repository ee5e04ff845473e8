"""RolloutRequest benchmark: samples/s of a request vs the same samples sent straight to the gateway,
time to the first sample, and what a 10,000-sample request adds to the operator and to etcd.

Not a test: prints numbers and ratios, all measured in the same run on the local cluster.
The fleet is 2 simulated engines (`rollfleet_dev.sim_engine`: tokens and logprobs at once)
behind a real gateway, so what is measured is the request path: the runner Job's pod, the
gateway, the results on a PersistentVolumeClaim (a hostPath volume made here), the status.

1. memory (`--finished N`): a fresh `rollfleet operator -n <ns>` (RSS from /proc) before and
   after N RolloutRequests reach a terminal phase and stay (no TTL). They name a fleet that
   does not exist, so they finish at once, with no pod: what is measured is what the operator
   keeps per finished request.
2. throughput: as a training loop's steps, a first request of 16 prompts, which starts a runner of its own
   (`apply_to_first_sample_own_runner_s`) and leaves a spare runner waiting for the next (the operator's
   `spares`); then RolloutRequests of P prompts x n samples (by default a GRPO step's batch, 512 x 16
   of 64 tokens, then 2,048 x 16; prompts past the inline limit come from a ConfigMap), each timed from create
   to the runner's terminal status (its completionTime), and the same samples sent straight to the fleet's
   gateway, before it and after it (their mean), with the same bodies, concurrency and HTTP client
   (`samples_per_s_ratio_vs_direct`, goal >= 0.9: the median of `--trials` requests per size, direct runs between
   them; the smallest median over the sizes, each also given by size with its trials' min and max),
   and a part of them with httpx for reference; and the time from create to
   the first sample sent (`apply_to_first_sample_s`: the spare taking the request). Each spare's start is
   waited for before a measured run, so that it runs beside none.
3. a request of 10,000 samples x 256 tokens with logprobs, results on the claim: the
   operator's RSS growth (goal < 50 MiB) and the bytes it adds to etcd (goal < 1 MiB: the
   namespace's objects as stored after it, less before; etcd's own in-use size is printed
   too, which counts revisions not yet compacted).

4. what scraping costs (`--scrape-rounds R --scrape-interval S`): the batch of part 2, R times without and R
   times with (alternating without-with, with-without) a real Prometheus (Debian's, `rollfleet_dev.prometheus`)
   scraping the operator, the gateway and both engines every S seconds (15 by default); the fleet's CPU
   seconds per run (its pods' processes and the operator, from /proc), and the overhead of the median with
   over the median without (`scrape_cpu_overhead_ratio`). Then the CPU one scrape costs, over an idle window
   scraped every second less one not scraped, and that cost every S seconds next to the fleet's CPU under
   load (`scrape_cpu_overhead_ratio_from_cost`, goal <= 0.02): steadier than the runs, which vary by more
   than a 15 s scrape costs.

Usage: python -m bench.bench_requests [--json PATH] [--finished 1000] [--prompts 512 2048 --n 16
       --max-tokens 64 --parallelism 64 --trials 3] [--samples 10000 --tokens 256]
       [--scrape-rounds 2 --scrape-interval 15]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import uvloop

from bench.crds import install_crds
from bench.processes import stop
from rollfleet import jsonl
from rollfleet.api.fleet import PLURAL as FLEET_PLURAL
from rollfleet.api.request import MAX_INLINE_PROMPTS, PLURAL, TERMINAL_PHASES, Prompt, RolloutRequestSpec
from rollfleet.contract import (
    COMPONENT_ENGINE,
    COMPONENT_GATEWAY,
    ENGINE_PORT,
    GATEWAY_PORT,
    GROUP,
    VERSION,
    component_labels,
    selector,
)
from rollfleet.controller.requests import plan
from rollfleet.controller.requests.runner import post_sample, read_fleet
from rollfleet.controller.tokens import OperatorKey
from rollfleet.kube import Kube, load_client
from rollfleet.upstream import Upstream
from rollfleet_dev import prometheus as prom
from rollfleet_dev.localcluster import claims, controlplane
from rollfleet_dev.localcluster.nodeagent.logs import nodes_state_dir
from rollfleet_dev.localcluster.nodeagent.processes import cpu_seconds, process_cpu_seconds
from rollfleet_dev.runners import waiting_spares

BIN = Path(sys.executable).parent
FIRST_PROMPTS = 16  # the first request's prompts (x --n samples): it starts the spare runners


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@contextmanager
def operator(kubeconfig: Path, namespace: str, metrics_port: int = 0) -> Iterator[subprocess.Popen[bytes]]:
    """`rollfleet operator` serving `namespace`; its metrics on loopback at `metrics_port` (0: none)."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    endpoints = ["--health-port", "0", "--metrics-port", str(metrics_port), "--listen", "127.0.0.1"]
    proc = subprocess.Popen(
        [BIN / "rollfleet", "operator", "-n", namespace, "--key-namespace", namespace, *endpoints],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        stop(proc)


def request_body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RolloutRequest", "metadata": {"name": name}, "spec": spec}


def phases(custom: kubernetes.client.CustomObjectsApi, namespace: str) -> dict[str, str]:
    items = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "") for i in items}


def wait_finished(custom: kubernetes.client.CustomObjectsApi, namespace: str, name: str, timeout: float) -> None:
    """Until the request reaches a terminal phase: a watch of it alone. A poll would list every request, prompts
    and all, beside the run measured."""
    deadline = time.monotonic() + timeout
    watch = kubernetes.watch.Watch()
    while time.monotonic() < deadline:
        for event in watch.stream(
            custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            field_selector=f"metadata.name={name}",
            timeout_seconds=max(1, int(deadline - time.monotonic())),
        ):
            if (event["object"].get("status") or {}).get("phase") in TERMINAL_PHASES:
                watch.stop()
                return
    raise TimeoutError(f"timed out waiting for {name} to finish")


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


def bench_memory(kubeconfig: Path, client: kubernetes.client.ApiClient, count: int) -> dict[str, float]:
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
    return {"operator_rss_idle_mib": idle, "operator_rss_per_finished_request_kib": (kept - idle) * 1024 / count}


async def direct(gateway: str, token: str | None, calls: list[plan.Call], parallelism: int) -> float:
    """The calls sent straight to the gateway as the runner sends them (`runner.post_sample`: its credential,
    the fleet's admin token, and its HTTP client; run on the runner's event loop, uvloop), each answer read whole:
    what a runner costs over the sending itself."""
    sem = asyncio.Semaphore(parallelism)
    client = Upstream(idle_s=60)

    async def one(call: plan.Call) -> None:
        async with sem:
            status, _, _ = await post_sample(client, gateway, call, token)
            assert status == 200, status

    start = time.monotonic()
    try:
        await asyncio.gather(*(one(c) for c in calls))
    finally:
        client.close()
    return time.monotonic() - start


async def direct_httpx(gateway: str, token: str | None, calls: list[plan.Call], parallelism: int) -> float:
    """The same with httpx, as a user's own script would send them (for reference: httpx's pool, not the
    gateway, bounds it on a small machine)."""
    sem = asyncio.Semaphore(parallelism)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=parallelism)
    ) as http:

        async def one(call: plan.Call) -> None:
            async with sem:
                resp = await http.post(gateway + call.path, json=call.body, headers={**call.headers, **auth})
                resp.raise_for_status()

        start = time.monotonic()
        await asyncio.gather(*(one(c) for c in calls))
        return time.monotonic() - start


# --- the stand-in fleet and its results claim ---------------------------------------------

FLEET = "sim"
HTTPX_CALLS = 4096
MODEL = "sim"


def sim_fleet_spec(engines: int) -> dict[str, Any]:
    """A fleet of simulated engines (rollfleet_dev.sim_engine: instant, deterministic tokens and logprobs)
    behind a real gateway: what is measured is the request path, not the engines."""
    return {
        "replicas": engines,
        "model": {"servedName": MODEL, "imagePath": "/nonexistent"},
        "engine": {
            "image": "python:3.12-slim",
            "command": [sys.executable, "-m", "rollfleet_dev.sim_engine"],
            "gpusPerEngine": 0,
            "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        },
        "weightSync": {"initialVersion": "v1"},
        "placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "drainTimeoutSeconds": 0,
    }


def fleet_ready(custom: kubernetes.client.CustomObjectsApi, namespace: str, engines: int) -> bool:
    status = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, FLEET_PLURAL, FLEET).get("status") or {}
    gateway = status.get("gateway") or {}
    return bool(status.get("readyReplicas") == engines and gateway.get("readyReplicas"))


@contextmanager
def results_claim(core: kubernetes.client.CoreV1Api, namespace: str) -> Iterator[tuple[str, Path]]:
    """A claim bound to a hostPath volume at a fresh directory of this machine (the local cluster's nodes)."""
    with tempfile.TemporaryDirectory(prefix="rr-bench-results-") as directory:
        pv, pvc = claims.host_path_claim(namespace, "results", Path(directory), size="10Gi")
        core.create_persistent_volume(pv)
        try:
            core.create_namespaced_persistent_volume_claim(namespace, pvc)
            wait_until(
                lambda: core.read_namespaced_persistent_volume_claim("results", namespace).status.phase == "Bound",
                timeout=60,
                what="the results claim bound",
            )
            yield "results", Path(directory)
        finally:
            core.delete_persistent_volume(pv["metadata"]["name"])


# --- what is measured ----------------------------------------------------------------------


def etcd_in_use_bytes() -> float:
    """etcd's own count of the bytes its database holds (live keys and revisions not yet compacted)."""
    text = httpx.get(f"http://127.0.0.1:{controlplane.PORTS['etcd']}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("etcd_mvcc_db_total_size_in_use_in_bytes "):
            return float(line.split()[1])
    raise RuntimeError("etcd exports no etcd_mvcc_db_total_size_in_use_in_bytes")


def live_object_bytes(client: kubernetes.client.ApiClient, namespace: str) -> int:
    """Bytes of JSON of every object in the namespace: what its objects hold in etcd now."""
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    batch = kubernetes.client.BatchV1Api(client)
    lists = [
        core.list_namespaced_config_map(namespace, _preload_content=False),
        core.list_namespaced_pod(namespace, _preload_content=False),
        core.list_namespaced_event(namespace, _preload_content=False),
        batch.list_namespaced_job(namespace, _preload_content=False),
        custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _preload_content=False),
    ]
    return sum(len(json.dumps(item)) for resp in lists for item in json.loads(resp.data)["items"])


def run_request(custom: kubernetes.client.CustomObjectsApi, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Create a request and wait for its end: its status, the seconds to its end, and to its first sample."""
    rr = f"bench-{uuid.uuid4().hex[:6]}"
    created = time.time()
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, request_body(rr, spec))
    wait_finished(custom, namespace, rr, timeout=3600)
    status = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rr)["status"]
    # The runner's own times (this host's clock): the end is when it wrote the terminal status, not when a
    # poll here saw it.
    first = datetime.fromisoformat(status["startTime"]).timestamp() - created
    took = datetime.fromisoformat(status["completionTime"]).timestamp() - created
    return {"name": rr, "status": status, "created": created, "seconds": took, "first_sample_s": first}


def batch_texts(prompts: int) -> list[str]:
    return [f"Question {i}: what comes after {i}?" for i in range(prompts)]


def prompts_config_map(core: kubernetes.client.CoreV1Api, namespace: str, name: str, texts: list[str]) -> None:
    """A ConfigMap of text prompts for `spec.promptsFrom` (its default key), made once: one that exists is kept."""
    try:
        jsonl_text = "".join(jsonl.dumps({"text": t}) + "\n" for t in texts)
        core.create_namespaced_config_map(
            namespace, {"metadata": {"name": name}, "data": {"prompts.jsonl": jsonl_text}}
        )
    except kubernetes.client.ApiException as err:
        if err.status != 409:
            raise


def batch_spec(
    core: kubernetes.client.CoreV1Api, namespace: str, claim: str, args: argparse.Namespace, prompts: int
) -> dict[str, Any]:
    """A RolloutRequest of `prompts` x `args.n` samples of `args.max_tokens` tokens, its results on `claim`.
    Its prompts are inline up to the schema's limit, in a ConfigMap (made here, once) past it."""
    spec: dict[str, Any] = {
        "fleet": FLEET,
        "samplesPerPrompt": args.n,
        "sampling": {"maxTokens": args.max_tokens, "ignoreEos": True},
        "parallelism": args.parallelism,
        "results": {"persistentVolumeClaim": {"claimName": claim}},
    }
    texts = batch_texts(prompts)
    if len(texts) <= MAX_INLINE_PROMPTS:
        return spec | {"prompts": [{"text": t} for t in texts]}
    name = f"batch-prompts-{len(texts)}"
    prompts_config_map(core, namespace, name, texts)
    return spec | {"promptsFrom": [{"name": name}]}


def wait_for_spare(client: kubernetes.client.ApiClient, namespace: str, claim: str) -> None:
    """Until a spare runner of the fleet and claim waits for the next request (the operator starts one as a
    request ends), so that its start runs beside no measured run."""
    kube = Kube(client)
    wait_until(
        lambda: asyncio.run(waiting_spares(kube, namespace, FLEET, claim)), timeout=120, what="a spare runner waiting"
    )


def bench_first_request(
    client: kubernetes.client.ApiClient, namespace: str, claim: str, args: argparse.Namespace
) -> dict[str, float]:
    """A training loop's first step: its request has no spare runner yet, and starts a runner of its own."""
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    run = run_request(custom, namespace, batch_spec(core, namespace, claim, args, FIRST_PROMPTS))
    assert run["status"]["phase"] == "Succeeded", run["status"]
    wait_for_spare(client, namespace, claim)
    print(f"first request (a runner of its own): apply -> first sample in flight {run['first_sample_s']:.2f} s")
    return {"apply_to_first_sample_own_runner_s": run["first_sample_s"]}


def send_span(run: dict[str, Any], directory: Path) -> tuple[float, float]:
    """From the request's results file: the seconds from its first sample sent to its last one answered, and
    from that answer to the request's terminal status (the last write, the status)."""
    lines = [json.loads(line) for line in (directory / run["status"]["results"]["path"]).read_text().splitlines()]
    first, last = min(r["started_at"] for r in lines), max(r["finished_at"] for r in lines)
    return last - first, run["created"] + run["seconds"] - last


def bench_throughput(
    client: kubernetes.client.ApiClient, namespace: str, claim: tuple[str, Path], args: argparse.Namespace, prompts: int
) -> dict[str, float]:
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    n, parallelism = args.n, args.parallelism
    spec = batch_spec(core, namespace, claim[0], args, prompts)
    texts = batch_texts(prompts)
    view = asyncio.run(read_fleet(Kube(client), OperatorKey(namespace), namespace, FLEET))
    assert view.gateway and view.model, f"fleet {namespace}/{FLEET} has no gateway yet"
    gateway, parsed = view.gateway, RolloutRequestSpec.model_validate(spec)

    def calls_of(uid: str) -> list[plan.Call]:
        keys = [(p, s) for p in range(prompts) for s in range(n)]
        return [plan.build_call(parsed, view.model or "", uid, key, Prompt(text=texts[key[0]])) for key in keys]

    def send_direct() -> float:
        return uvloop.run(direct(gateway, view.token, calls_of(f"direct-{uuid.uuid4().hex[:8]}"), parallelism))

    # Each request runs between two direct runs and counts against their mean: the machine's pace drifts by more
    # than the goal's margin over a minute. A request is measured `--trials` times (each in the spare its
    # predecessor left, started before it), and the median counts: one run of a few seconds on a shared machine
    # moves by +-0.05.
    directs, runs = [send_direct()], []
    for _ in range(args.trials):
        run = run_request(custom, namespace, spec)
        assert run["status"]["phase"] == "Succeeded", run["status"]
        run["sending"], run["ending"] = send_span(run, claim[1])
        runs.append(run)
        wait_for_spare(client, namespace, claim[0])  # the next one starts now: not beside the direct run
        directs.append(send_direct())
    some = calls_of(f"httpx-{uuid.uuid4().hex[:8]}")[:HTTPX_CALLS]  # a reference only: httpx takes minutes
    via_httpx = asyncio.run(direct_httpx(gateway, view.token, some, parallelism))
    total = prompts * n
    around = [(before + after) / 2 for before, after in itertools.pairwise(directs)]  # the direct runs around each
    ratios = [d / r["seconds"] for d, r in zip(around, runs, strict=True)]
    after_start = [d / (r["seconds"] - r["first_sample_s"]) for d, r in zip(around, runs, strict=True)]
    mid = sorted(range(len(runs)), key=lambda i: ratios[i])[len(runs) // 2]  # the median trial, reported whole
    run, via_gateway = runs[mid], around[mid]
    out = {
        "samples": total,
        "trials": len(runs),
        "samples_per_s_request": total / run["seconds"],
        "samples_per_s_direct": total / via_gateway,
        "samples_per_s_direct_min": total / max(directs),
        "samples_per_s_direct_max": total / min(directs),
        "samples_per_s_direct_httpx": len(some) / via_httpx,
        "samples_per_s_ratio_vs_direct": ratios[mid],
        "samples_per_s_ratio_vs_direct_min": min(ratios),
        "samples_per_s_ratio_vs_direct_max": max(ratios),
        # Without the runner's start: what the runner's sending costs next to sending directly.
        "samples_per_s_ratio_vs_direct_after_start": statistics.median(after_start),
        "apply_to_first_sample_s": run["first_sample_s"],  # in a spare runner, started before
        "first_to_last_sample_s": run["sending"],
        "last_sample_to_end_s": run["ending"],
    }
    print(f"-- {prompts} prompts x {n} samples of {args.max_tokens} tokens, {parallelism} in flight")
    print(
        f"RolloutRequest  {total} samples in {run['seconds']:6.1f} s = {out['samples_per_s_request']:7.1f} samples/s "
        f"(the median of {len(runs)}; from create to Succeeded: sending, results on the claim, status)"
    )
    print(
        f"gateway direct  {total} samples in {via_gateway:6.1f} s = {out['samples_per_s_direct']:7.1f} samples/s "
        f"(the mean of the runs before and after it; all {len(directs)}: "
        + ", ".join(f"{d:.1f}" for d in directs)
        + " s)"
    )
    print(
        f"  with httpx    {len(some)} samples in {via_httpx:6.1f} s = "
        f"{out['samples_per_s_direct_httpx']:7.1f} samples/s (reference: a script's usual client)"
    )
    print(
        f"request / direct: {ratios[mid]:.2f}, the median of "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f"   (goal >= 0.9; from the first sample on: {out['samples_per_s_ratio_vs_direct_after_start']:.2f})"
    )
    print(
        f"apply -> first sample in flight: {run['first_sample_s']:.2f} s; first sample sent -> last answered: "
        f"{run['sending']:.2f} s; -> the request's end: {run['ending']:.2f} s"
    )
    return out


def bench_big_request(
    client: kubernetes.client.ApiClient,
    namespace: str,
    claim: tuple[str, Path],
    operator_pid: int,
    samples: int,
    tokens: int,
) -> dict[str, float]:
    """One request of `samples` samples of `tokens` tokens with logprobs, results on the claim: what it adds to
    the operator's memory and to etcd."""
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    per_prompt = 8
    prompts_config_map(core, namespace, "big-prompts", [f"Problem {i}:" for i in range(samples // per_prompt)])
    spec = {
        "fleet": FLEET,
        "promptsFrom": [{"name": "big-prompts"}],
        "samplesPerPrompt": per_prompt,
        "sampling": {"maxTokens": tokens, "ignoreEos": True, "logprobs": 0},
        "parallelism": 256,
        "results": {"persistentVolumeClaim": {"claimName": claim[0]}},
    }
    rss_before, live_before, etcd_before = (
        rss_mib(operator_pid),
        live_object_bytes(client, namespace),
        etcd_in_use_bytes(),
    )
    run = run_request(custom, namespace, spec)
    rss_after, live_after, etcd_after = rss_mib(operator_pid), live_object_bytes(client, namespace), etcd_in_use_bytes()
    status = run["status"]
    assert status["phase"] == "Succeeded" and status["results"]["samples"] == samples, status
    results_bytes = (claim[1] / status["results"]["path"]).stat().st_size
    out = {
        "big_request_samples": samples,
        "big_request_tokens_per_sample": tokens,
        "big_request_seconds": run["seconds"],
        "big_request_results_bytes": results_bytes,
        "operator_rss_growth_mib": rss_after - rss_before,
        "etcd_bytes_added": live_after - live_before,
        "etcd_db_in_use_bytes_added": etcd_after - etcd_before,
    }
    print(
        f"{samples} samples x {tokens} tokens with logprobs in {run['seconds']:.1f} s; "
        f"results file {results_bytes / 2**20:.1f} MiB"
    )
    print(f"operator RSS growth   {out['operator_rss_growth_mib']:7.1f} MiB   (goal < 50)")
    print(
        f"etcd bytes added      {out['etcd_bytes_added'] / 2**10:7.1f} KiB   "
        "(goal < 1024; the namespace's objects as stored now)"
    )
    print(
        f"etcd db in use added  {out['etcd_db_in_use_bytes_added'] / 2**10:7.1f} KiB   "
        "(with revisions not yet compacted)"
    )
    return out


# --- what scraping costs the fleet ----------------------------------------------------------------------------


def fleet_cpu_seconds(namespace: str, operator_pid: int) -> float:
    """CPU seconds the fleet's pods (its gateway and engines: every process of their containers) and the operator
    have used so far. Runner pods are left out: each request has its own, gone before its end is seen."""
    pods = nodes_state_dir() / "pods"
    return process_cpu_seconds(operator_pid) + sum(cpu_seconds(f) for f in pods.glob(f"{namespace}_{FLEET}-*/*.pid"))


def scrape_targets(core: kubernetes.client.CoreV1Api, namespace: str, operator_port: int) -> list[prom.Target]:
    """The fleet's components as its PodMonitors select them (pod IPs: the local cluster's pods are this machine's
    processes), and the operator."""
    targets = [prom.Target("rollfleet-operator", f"http://127.0.0.1:{operator_port}", honor_labels=True)]
    ports = {COMPONENT_GATEWAY: GATEWAY_PORT, COMPONENT_ENGINE: ENGINE_PORT}
    for component, port in ports.items():
        pods = core.list_namespaced_pod(namespace, label_selector=selector(component_labels(FLEET, component)))
        for pod in pods.items:
            labels = {"namespace": namespace, "fleet": FLEET, "pod": pod.metadata.name}
            targets.append(prom.Target(f"rollfleet-{component}s", f"http://{pod.status.pod_ip}:{port}", labels))
    return targets


def all_up(scraper: prom.Prometheus) -> bool:
    return all(scraper.targets_up().values())


def bench_scrape_overhead(
    client: kubernetes.client.ApiClient,
    namespace: str,
    operator_pid: int,
    operator_port: int,
    spec: dict[str, Any],
    rounds: int,
    interval_s: float,
) -> dict[str, float]:
    """What a real Prometheus scraping every component of the fleet costs the fleet's CPU.

    1. Under load: the same RolloutRequest, in rounds of one run without and one with Prometheus scraping every
       `interval_s`: the fleet's CPU seconds per run, and the overhead of the median with over the median without.
    2. Per scrape, where nothing else runs: the fleet's CPU over an idle window with Prometheus scraping every
       second, less the same window without, per scrape; and what that cost comes to at `interval_s` next to the
       fleet's CPU per second under load (runs of part 1 vary by tens of percent, far more than a 15 s scrape
       costs)."""
    custom, core = kubernetes.client.CustomObjectsApi(client), kubernetes.client.CoreV1Api(client)
    targets = scrape_targets(core, namespace, operator_port)
    cpu: dict[bool, list[float]] = {False: [], True: []}
    busy_s: list[float] = []

    def run() -> float:
        before, started = fleet_cpu_seconds(namespace, operator_pid), time.monotonic()
        done = run_request(custom, namespace, spec)
        assert done["status"]["phase"] == "Succeeded", done["status"]
        busy_s.append(time.monotonic() - started)
        return fleet_cpu_seconds(namespace, operator_pid) - before

    for i in range(rounds):
        # Without, with; then with, without: a drift of the machine over the rounds weighs on both alike.
        for scraped in (False, True) if i % 2 == 0 else (True, False):
            with contextlib.ExitStack() as stack:
                if scraped:
                    scraper = stack.enter_context(prom.running(targets, interval_s))
                    wait_until(functools.partial(all_up, scraper), timeout=60, what="every target scraped")
                cpu[scraped].append(run())
            print(f"  fleet CPU of a run {'with' if scraped else 'without'} scraping: {cpu[scraped][-1]:.2f} s")
    without, with_ = statistics.median(cpu[False]), statistics.median(cpu[True])
    load_cores = statistics.median(c / s for c, s in zip(cpu[False] + cpu[True], busy_s, strict=True))

    window = 30.0
    idle = fleet_cpu_seconds(namespace, operator_pid)
    time.sleep(window)  # the window measured: nothing to wait for
    idle = fleet_cpu_seconds(namespace, operator_pid) - idle
    with prom.running(targets, 1) as scraper:
        wait_until(functools.partial(all_up, scraper), timeout=60, what="every target scraped")
        scrapes, before = scraper.scrapes(), fleet_cpu_seconds(namespace, operator_pid)
        time.sleep(window)
        scrapes, spent = scraper.scrapes() - scrapes, fleet_cpu_seconds(namespace, operator_pid) - before
    per_scrape_s = max(0.0, spent - idle) / scrapes
    projected = len(targets) / interval_s * per_scrape_s / load_cores
    out = {
        "scrape_interval_s": interval_s,
        "scrape_targets": len(targets),
        "scrape_fleet_cpu_s_without": without,
        "scrape_fleet_cpu_s_with": with_,
        "scrape_cpu_overhead_ratio": with_ / without - 1,
        "scrape_cpu_ms_per_scrape": per_scrape_s * 1000,
        "scrape_fleet_cores_under_load": load_cores,
        "scrape_cpu_overhead_ratio_from_cost": projected,
    }
    print(
        f"scraping {len(targets)} targets every {interval_s:g} s under load: fleet CPU {with_:.2f} s vs "
        f"{without:.2f} s without (medians of {rounds}) = {out['scrape_cpu_overhead_ratio']:+.1%}"
    )
    print(
        f"one scrape costs the fleet {per_scrape_s * 1000:.2f} ms of CPU ({scrapes:.0f} scrapes in {window:.0f} s, "
        f"idle otherwise); every {interval_s:g} s that is {projected:+.2%} of the {load_cores:.2f} cores the fleet "
        "uses under load (goal <= +2%)"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--finished", type=int, default=1000, help="finished requests for the memory part (0: skip)")
    parser.add_argument("--engines", type=int, default=2, help="simulated engines in the fleet")
    # A GRPO step's batch: 512 prompts x 16 samples.
    parser.add_argument(
        "--prompts", type=int, nargs="+", default=[512, 2048], help="one throughput run per size (x --n samples)"
    )
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--parallelism", type=int, default=64)
    parser.add_argument(
        "--trials", type=int, default=3, help="requests per size, each between two direct runs (the median counts)"
    )
    parser.add_argument("--samples", type=int, default=10_000, help="samples of the large request (0: skip)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample of the large request")
    parser.add_argument(
        "--scrape-rounds", type=int, default=2, help="runs of the batch without and with scraping, each (0: skip)"
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=15.0, help="seconds between scrapes under load (default: %(default)s)"
    )
    args = parser.parse_args()
    kubeconfig = controlplane.up().kubeconfig
    install_crds(kubeconfig)
    client = load_client(str(kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    report: dict[str, float] = {}
    if args.finished:
        report |= bench_memory(kubeconfig, client, args.finished)
    ns = f"rr-bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        operator_port = prom.free_port()
        with operator(kubeconfig, ns, operator_port) as proc, results_claim(core, ns) as claim:
            fleet = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RolloutFleet", "metadata": {"name": FLEET}}
            custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, FLEET_PLURAL, fleet | {"spec": sim_fleet_spec(args.engines)}
            )
            wait_until(lambda: fleet_ready(custom, ns, args.engines), timeout=300, what="the simulated fleet Ready")
            report |= bench_first_request(client, ns, claim[0], args)
            for prompts in args.prompts:
                figures = bench_throughput(client, ns, claim, args, prompts)
                report |= {f"{k}_{prompts}x{args.n}": v for k, v in figures.items()}
            # The headline: the smallest ratio over the sizes (each is reported by size too).
            for key in ("samples_per_s_ratio_vs_direct", "samples_per_s_ratio_vs_direct_after_start"):
                report[key] = min(report[f"{key}_{p}x{args.n}"] for p in args.prompts)
            if args.samples:
                report |= bench_big_request(client, ns, claim, proc.pid, args.samples, args.tokens)
            if args.scrape_rounds:
                spec = batch_spec(core, ns, claim[0], args, args.prompts[0])
                report |= bench_scrape_overhead(
                    client, ns, proc.pid, operator_port, spec, args.scrape_rounds, args.scrape_interval
                )
    finally:
        core.delete_namespace(ns)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
