"""RolloutFleet operator benchmark: a 200-engine fleet of stand-in engines, from apply to converged.

Not a test: prints numbers (and a ratio against a baseline measured in the same run).

The engines need not run vLLM: `spec.engine.command` replaces the engine image's
entrypoint with `python3 -c STANDIN`, a stdlib HTTP server that takes the operator's
usual arguments (`serve ... --port 8000 ...`) and answers the routes the
operator and the kubelet use: /health, /rollfleet/v1/ready, /rollfleet/v1/state, /pause,
/resume. Engines request no GPU (`gpusPerEngine: 0`) and tolerate the GPU taint, so 200
pods spread over the local cluster's three nodes.

Measured, with a fresh `rollfleet operator -n <ns>` started from this process:
- apply -> all pods created (ADDED on a pod watch), -> all pods Ready, -> status converged
  (readyReplicas 200, Ready=True, Progressing=False, observedGeneration current);
- the operator's RSS (idle before, peak during, after convergence) from /proc;
- the operator's API calls (its Prometheus counter; kopf's few watch requests excluded);
- baseline (`--baseline`): the same 200 pods created by `kubectl apply` of a pod list, to
  Ready, without the operator; the ratio says what the operator adds over a bulk create.

Usage: python -m bench.bench_operator [--engines 200] [--baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import kubernetes
from prometheus_client.parser import text_string_to_metric_families

from bench.crds import install_crds
from bench.processes import stop
from rollfleet import contract, metrics
from rollfleet.api.fleet import KIND, PLURAL, RolloutFleetSpec
from rollfleet.controller import desired
from rollfleet.controller.owner import FleetRef
from rollfleet_dev.localcluster import controlplane
from rollfleet_dev.localcluster.nodeagent.processes import process_cpu_seconds

BIN = Path(sys.executable).parent

STANDIN = r"""
import asyncio, json, sys
argv = sys.argv[1:]
host = argv[argv.index("--host") + 1] if "--host" in argv else "0.0.0.0"  # each pod has its own address
port = int(argv[argv.index("--port") + 1])
state = {"model": "standin", "weight_version": "v0", "paused": False, "pause_mode": None, "running": 0, "waiting": 0}
async def handle(reader, writer):
    try:
        line = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass
        path, _, query = line.split()[1].decode().partition("?")
        if path == "/pause":
            state.update(paused=True, pause_mode=query.partition("mode=")[2] or "abort")
        elif path == "/resume":
            state.update(paused=False, pause_mode=None)
        body = json.dumps(state if path == "/rollfleet/v1/state" else {"ok": True}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
    finally:
        writer.close()
async def main():
    async with await asyncio.start_server(handle, host, port) as server:
        await server.serve_forever()
asyncio.run(main())
"""


def spec(engines: int) -> dict[str, Any]:
    return {
        "replicas": engines,
        "model": {"servedName": "standin", "imagePath": "/nonexistent"},
        "engine": {
            "image": "python:3.12-slim",
            "command": ["python3", "-c", STANDIN],
            "gpusPerEngine": 0,
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        },
        "placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "gateway": {"enabled": False},
        "drainTimeoutSeconds": 0,
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def operator(kubeconfig: Path, namespace: str, metrics_port: int) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen(
        [
            str(BIN / "rollfleet"),
            "operator",
            "-n",
            namespace,
            "--key-namespace",
            namespace,
            "--no-requests",
            "--listen",
            "127.0.0.1",
            "--health-port",
            "0",
            "--metrics-port",
            str(metrics_port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        stop(proc)


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """A Prometheus scrape's samples: (name, labels, value), as prometheus_client's parser reads them."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value


def _operator_samples(metrics_port: int) -> Iterator[tuple[str, dict[str, str], float]]:
    return samples(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)


def api_calls(metrics_port: int) -> dict[str, float]:
    return {
        labels["call"]: value
        for name, labels, value in _operator_samples(metrics_port)
        if name == "rollfleet_operator_api_calls_total"
    }


def reconcile_passes(metrics_port: int) -> dict[str, float]:
    """The operator's reconcile passes so far, every fleet's: how many, and their seconds in all."""
    wanted = {
        f"{metrics.OPERATOR_PASS_SECONDS.name}_{suffix}": key
        for key, suffix in (("passes", "count"), ("seconds", "sum"))
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for name, _, value in _operator_samples(metrics_port):
        if name in wanted:
            out[wanted[name]] += value
    return out


def apiserver_counts(text: str) -> dict[str, float]:
    """The API server's own count of the requests it served, by verb and resource ("PATCH pods", "PUT
    pods/status"), and of the watch events it sent, by resource ("watch events pods"): every client's, the operator's
    and KWOK's alike, which the operator's own count cannot show."""
    counts: dict[str, float] = {}
    for name, labels, value in samples(text):
        if name == "apiserver_watch_events_total":
            key = f"watch events {labels.get('resource')}"
        elif name == "apiserver_request_total":
            key = f"{labels.get('verb')} {labels.get('resource')}/{labels.get('subresource')}".rstrip("/")
        else:
            continue
        counts[key] = counts.get(key, 0) + value
    return counts


def apiserver_requests(client: kubernetes.client.ApiClient) -> dict[str, float]:
    """`apiserver_counts` of the API server's /metrics now."""
    method, url, headers, _, _ = client.param_serialize("GET", "/metrics", auth_settings=["BearerToken"])
    resp = client.call_api(method, url, headers)
    resp.read()
    return apiserver_counts(resp.data.decode())


def counts_since(before: dict[str, float], after: dict[str, float], least: int = 10) -> dict[str, int]:
    """What each count grew by, the largest first; those under `least` are left out."""
    grew = {k: int(v - before.get(k, 0)) for k, v in after.items()}
    return {k: v for k, v in sorted(grew.items(), key=lambda kv: -kv[1]) if v >= least}


def idle_minute(port: int, pid: int) -> dict[str, Any]:
    """What a converged operator costs a minute at rest: API calls (in all and by kind), CPU seconds (it re-reads
    each settled engine's state now and then), and its RSS after it."""
    before, cpu = api_calls(port), process_cpu_seconds(pid)
    time.sleep(60)
    after = api_calls(port)
    return {
        "api_calls_per_min_idle": int(sum(after.values()) - sum(before.values())),
        "api_calls_idle_by_kind": {k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)},
        "cpu_s_per_min_idle": process_cpu_seconds(pid) - cpu,
        "rss_after_idle_minute_mib": rss_mib(pid),
    }


class PodWatch:
    """When each pod of a selector was first seen and first Ready (watch-stream arrival times)."""

    def __init__(self, core: kubernetes.client.CoreV1Api, namespace: str, selector: str) -> None:
        self.added: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.failed: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(core, namespace, selector), daemon=True)

    def __enter__(self) -> PodWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _run(self, core: kubernetes.client.CoreV1Api, namespace: str, selector: str) -> None:
        while not self._stop.is_set():
            w = kubernetes.watch.Watch()
            try:
                for ev in w.stream(core.list_namespaced_pod, namespace, label_selector=selector, timeout_seconds=30):
                    now, pod = time.monotonic(), ev["object"]
                    self.added.setdefault(pod.metadata.name, now)
                    if any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
                        self.ready.setdefault(pod.metadata.name, now)
                    if pod.status.phase in ("Failed", "Succeeded"):
                        self.failed.setdefault(pod.metadata.name, now)
                    if self._stop.is_set():
                        w.stop()
                        break
            except kubernetes.client.exceptions.ApiException:
                continue  # e.g. 504 "too large resource version" on a busy API server: list and watch again


def wait_until(predicate: Any, timeout: float, what: str, on_tick: Any = None) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if on_tick:
            on_tick()
        if predicate():
            return time.monotonic()
        time.sleep(0.5)
    raise TimeoutError(f"{what} not reached within {timeout:.0f}s")


AtRest = Callable[[str, int], dict[str, Any]]


def fleet_run(
    kubeconfig: Path,
    client: kubernetes.client.ApiClient,
    engines: int,
    fleet_spec: dict[str, Any] | None = None,
    at_rest: AtRest | None = None,
) -> dict[str, Any]:
    """Apply a fleet of `engines` (`fleet_spec`, default `spec(engines)`) to a fresh operator, and time it to
    converged; then `at_rest(namespace, operator pid)` (what else to measure on the converged fleet), and the
    operator's API calls over a minute at rest."""
    core = kubernetes.client.CoreV1Api(client)
    custom = kubernetes.client.CustomObjectsApi(client)
    ns = f"bench-op-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    port = free_port()
    out: dict[str, Any] = {"engines": engines}
    try:
        with operator(kubeconfig, ns, port) as op:
            wait_until(lambda: _up(port), 120, "operator metrics endpoint")
            time.sleep(2)  # let kopf finish its initial listing before the clock starts
            out["rss_idle_mib"] = rss_mib(op.pid)
            peak = [out["rss_idle_mib"]]
            calls_at_start, passes_at_start = api_calls(port), reconcile_passes(port)
            calls_before = sum(calls_at_start.values())
            served_before = apiserver_requests(client)
            cpu_before = process_cpu_seconds(op.pid)
            with PodWatch(core, ns, contract.engine_selector("bench")) as pw:
                t0 = time.monotonic()
                custom.create_namespaced_custom_object(
                    contract.GROUP,
                    contract.VERSION,
                    ns,
                    PLURAL,
                    {
                        "apiVersion": contract.API_VERSION,
                        "kind": KIND,
                        "metadata": {"name": "bench"},
                        "spec": fleet_spec or spec(engines),
                    },
                )

                def sample() -> None:
                    peak.append(rss_mib(op.pid))

                wait_until(lambda: len(pw.added) >= engines, 900, "all pods created", sample)
                out["created_s"] = max(pw.added.values()) - t0

                def converged() -> bool:
                    f = custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, "bench")
                    st = f.get("status") or {}
                    conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
                    return (
                        st.get("readyReplicas") == engines
                        and conds.get("Ready") == "True"
                        and conds.get("Progressing") == "False"
                        and st.get("observedGeneration") == f["metadata"]["generation"]
                    )

                wait_until(converged, 1800, "status converged", sample)
                out["converged_s"] = time.monotonic() - t0
                # What the API server served from apply to converged, and the operator's share of it.
                out["apiserver_requests_to_converged"] = counts_since(served_before, apiserver_requests(client))
                out["operator_calls_to_converged"] = counts_since(calls_at_start, api_calls(port))
                passes = reconcile_passes(port)
                out["reconcile_passes_to_converged"] = {k: round(v - passes_at_start[k], 1) for k, v in passes.items()}
                out["all_ready_s"] = max(pw.ready.values()) - t0 if len(pw.ready) >= engines else None
            # What grows with engines in single objects (etcd takes at most 1.5 MiB an object): the fleet's
            # status, and its weights record when it has one.
            fleet = custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, "bench")
            out["status_bytes"] = len(json.dumps(fleet.get("status") or {}, separators=(",", ":")))
            out["weights_record_bytes"] = _object_bytes(core, ns, contract.weights_record_name("bench"))
            out["rss_peak_mib"] = max(peak)
            out["rss_converged_mib"] = rss_mib(op.pid)
            out["cpu_s_to_converged"] = process_cpu_seconds(op.pid) - cpu_before
            if at_rest is not None:
                out |= at_rest(ns, op.pid)
            calls = api_calls(port)
            out["api_calls"] = int(sum(calls.values()) - calls_before)
            out["api_calls_by_kind"] = {k: int(v) for k, v in sorted(calls.items())}
            out |= idle_minute(port, op.pid)
            custom.delete_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, "bench")
            # Gone before this operator stops: it stops the fleet's loop when the watch reports it.
            wait_until(lambda: not _fleet_exists(custom, ns), 120, "the fleet deleted")
    finally:
        core.delete_namespace(ns)
    return out


def _object_bytes(core: kubernetes.client.CoreV1Api, ns: str, config_map: str) -> int | None:
    """A ConfigMap's data in bytes, as JSON; None when there is none."""
    try:
        data = core.read_namespaced_config_map(config_map, ns).data or {}
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            return None
        raise
    return len(json.dumps(data, separators=(",", ":")))


def _fleet_exists(custom: kubernetes.client.CustomObjectsApi, ns: str) -> bool:
    try:
        custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, "bench")
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            return False
        raise
    return True


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def baseline_run(
    kubeconfig: Path, client: kubernetes.client.ApiClient, engines: int, fleet_spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The same pods, created by one `kubectl apply` of a list, timed to all Ready: no operator."""
    core = kubernetes.client.CoreV1Api(client)
    ns = f"bench-raw-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    ref = FleetRef("bench", ns, "00000000-0000-0000-0000-000000000000")
    model = RolloutFleetSpec.model_validate(fleet_spec or spec(engines))
    pods = []
    for i in range(engines):
        pod = desired.engine_pod(ref, model, i)
        del pod["metadata"]["ownerReferences"]  # nothing owns them here
        del pod["spec"]["serviceAccountName"]  # the namespace's default: no ServiceAccount to wait for
        pods.append(pod)
    # The pods mount the token Secrets the operator would have created (unowned: the garbage
    # collector deletes objects whose owner does not exist).
    for secret in (desired.admin_secret(ref, "bench"), desired.inference_secret(ref, "bench")):
        del secret["metadata"]["ownerReferences"]
        core.create_namespaced_secret(ns, secret)
    out: dict[str, Any] = {}
    served_before = apiserver_requests(client)
    try:
        with PodWatch(core, ns, contract.engine_selector("bench")) as pw:
            t0 = time.monotonic()
            proc = subprocess.run(
                [str(BIN / "kubectl"), f"--kubeconfig={kubeconfig}", "apply", "-f", "-"],
                input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}),
                text=True,
                capture_output=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"kubectl apply failed: {proc.stderr[-2000:]}")
            wait_until(lambda: len(pw.added) >= engines, 900, "all pods created")
            out["created_s"] = max(pw.added.values()) - t0
            # Without an operator nothing replaces a pod that fails: count those apart.
            wait_until(lambda: len(pw.ready.keys() | pw.failed.keys()) >= engines, 1800, "all pods Ready or failed")
            out["all_ready_or_failed_s"] = max([*pw.ready.values(), *pw.failed.values()]) - t0
            out["ready"], out["failed"] = len(pw.ready), len(pw.failed.keys() - pw.ready.keys())
            out["apiserver_requests_to_ready"] = counts_since(served_before, apiserver_requests(client))
    finally:
        core.delete_namespace(ns)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--baseline", action="store_true", help="also time a bulk create without the operator")
    args = parser.parse_args()
    kubeconfig = controlplane.up().kubeconfig
    install_crds(kubeconfig)
    client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    result: dict[str, Any] = {"fleet": fleet_run(kubeconfig, client, args.engines)}
    print(json.dumps(result, indent=2), flush=True)
    if args.baseline:
        result["baseline_kubectl_apply"] = baseline_run(kubeconfig, client, args.engines)
        result["ratio_created"] = result["fleet"]["created_s"] / result["baseline_kubectl_apply"]["created_s"]
        result["ratio_converged_vs_raw_ready"] = (
            result["fleet"]["converged_s"] / result["baseline_kubectl_apply"]["all_ready_or_failed_s"]
        )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
