"""Scale benchmark: one fleet of 200, 1,000 and 2,000 engines, and 100 fleets of 20, on KWOK's fake GPU nodes.

Not a test: prints numbers, and ratios against baselines measured in the same run.

The engines are simulated where the operator cannot tell: KWOK (`rollfleet cluster kwok up`) runs their
pods on fake GPU nodes without processes, and `rollfleet_dev.engine_host` answers at every pod's IP
as the engine the pod describes (the control-plane tier's simulator, with the fleet's tokens). So the
operator, the API server and the scheduler do all of their real work for every engine, and the machine
runs one process for the engines instead of 2,000.

First, unmeasured, `kubectl apply` of the largest size's bare pods (`warm_up`: a cluster creates its first
pods at half the rate of the next ones). Then, per size, each with a fresh `rollfleet operator` (bench_operator's
run):
- apply -> all engine pods created, -> fleet converged (every engine Ready in the status); against
  `kubectl apply` of the same bare pods to all Ready, on the same cluster and nodes (the ratios);
- the operator's RSS (peak) and CPU seconds to converged, its API calls over a minute at rest;
- the bytes of the fleet's status and of its weights record (etcd keeps at most 1.5 MiB an object);
- pause keep: annotation -> each engine paused, as the engine saw it (p50, p99, max), and -> the status
  saying every engine is paused; resume the same way;
- the fleet's gateway, as a process in Kubernetes mode routing to every engine: requests/s of 32 clients and
  the p50 of one, JSON and streamed, against the gateway of a fleet of 2 engines applied beside it, the two
  measured in turns (3 rounds, medians).
And 100 fleets of 20 under one operator: apply -> all created, -> every fleet converged, RSS, API calls
at rest. And a weight push to 2,000 engines against the push to 8, in simulated time (`push_sim`: the
sidecar's own orchestrator, 1 Gbit/s links, its CPU per engine call as measured here).

Usage: python -m bench.bench_scale [--sizes 200 1000 2000] [--fleets 100 --fleet-size 20] [--push-mib 128]
[--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes

from bench import bench_gateway, bench_operator, push_sim
from bench.bench_gateway import percentile
from bench.crds import install_crds
from rollfleet import contract
from rollfleet.api.fleet import KIND, PLURAL
from rollfleet.metrics import GATEWAY_ROUTABLE
from rollfleet_dev import engine_host, kwok
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_dev.localcluster import controlplane

FLEET = "bench"  # bench_operator's fleet name
BASELINE_FLEET = "bench-base"  # beside it: the fleet whose gateway is the baseline of its gateway
GATEWAY_BASELINE = 2  # the baseline fleet's engines
GATEWAY_ROUNDS = 3
GATEWAY_LATENCY_N, GATEWAY_CLIENTS, GATEWAY_SECONDS = 300, 32, 5.0  # as bench_gateway's defaults
# Warm: every engine has had requests (its connection opened, as with 2): the router takes them in turn.
GATEWAY_WARM_UP_S = 4.0
ENGINES_URL = f"http://127.0.0.1:{engine_host.CONTROL_PORT}/engines"
FLOORS = {
    "create_2000_ratio_vs_kubectl": "<= 0.6",
    "ready_2000_ratio_vs_raw": "<= 1.2",
    "operator_rss_2000_mib": "<= 400",
    "api_calls_per_min_at_rest_2000": "== 0",
    "status_2000_bytes": "<= 262144",
    "weights_record_2000_bytes": "<= 262144",
    "pause_2000_p99_s": "<= 2.0",
    "gateway_rps_2000_over_2": ">= 0.9",
    "push_2000_over_8": "<= 2.0",
}


def scale_spec(engines: int) -> dict[str, Any]:
    """A fleet whose engines land on the fake nodes (one GPU each), served by the engine host."""
    return {
        "replicas": engines,
        "model": {"servedName": "sim", "imagePath": "/nonexistent"},
        "engine": {"gpusPerEngine": 1},
        "placement": kwok.placement(),
        "gateway": {"enabled": False},
        "drainTimeoutSeconds": 0,
    }


def create_fleet(custom: kubernetes.client.CustomObjectsApi, ns: str, name: str, engines: int) -> None:
    body = {"apiVersion": contract.API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": scale_spec(engines)}
    custom.create_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, body)


def host_engines(namespace: str) -> list[dict[str, Any]]:
    return [e for e in httpx.get(ENGINES_URL, timeout=30).json() if e["namespace"] == namespace]


def _annotate(custom: kubernetes.client.CustomObjectsApi, ns: str, mode: str | None) -> None:
    body = {"metadata": {"annotations": {contract.ANNOTATION_PAUSE: mode}}}
    custom.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, FLEET, body)


def _status_paused(custom: kubernetes.client.CustomObjectsApi, ns: str, engines: int, paused: bool) -> bool:
    st = custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, FLEET).get("status") or {}
    conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
    if paused:
        return bool((st.get("pause") or {}).get("pausedEngines") == engines and conds.get("Paused") == "True")
    return conds.get("Paused") == "False" and st.get("readyReplicas") == engines


def _engine_latencies(ns: str, engines: int, key: str, since: float, timeout_s: float) -> list[float]:
    """Seconds from `since` to each engine's own `key` time (paused_at, resumed_at), once all have one."""
    deadline = time.monotonic() + timeout_s
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        seen = host_engines(ns)
        times = [e[key] - since for e in seen if e[key] is not None and e[key] >= since]
        if len(times) >= engines:
            return times
        time.sleep(0.2)
    late = [e for e in seen if e[key] is None or e[key] < since]
    raise TimeoutError(f"{key}: {engines - len(late)} of {engines} engines within {timeout_s:.0f}s; not: {late[:5]}")


def pause_round(client: kubernetes.client.ApiClient, ns: str, engines: int) -> dict[str, Any]:
    """Pause keep, then resume: each engine's latency as it saw it, and the status's."""
    custom = kubernetes.client.CustomObjectsApi(client)
    out: dict[str, Any] = {}
    for mode, key in (("keep", "paused_at"), (None, "resumed_at")):
        label = "pause" if mode else "resume"
        t0 = time.time()
        _annotate(custom, ns, mode)
        latencies = _engine_latencies(ns, engines, key, t0, 300)
        out[f"{label}_p50_s"] = statistics.median(latencies)
        out[f"{label}_p99_s"] = percentile(latencies, 0.99)
        out[f"{label}_max_s"] = max(latencies)
        bench_operator.wait_until(lambda m=mode: _status_paused(custom, ns, engines, m is not None), 300, label)
        out[f"{label}_status_s"] = time.time() - t0
    return out


@contextlib.contextmanager
def fleet_gateway(
    kubeconfig: Path, core: kubernetes.client.CoreV1Api, ns: str, fleet: str, engines: int
) -> Iterator[tuple[str, dict[str, str], Callable[[], float]]]:
    """The fleet's gateway as a process in Kubernetes mode (its own watch of the fleet's pods, its own tokens from the
    fleet's Secrets), once it routes to every engine: its URL, the headers it asks for, and its CPU seconds."""
    with tempfile.TemporaryDirectory(prefix="bench-scale-gw-") as tmp:
        files = {}
        for name, secret in (("token", contract.secret_name(fleet)), ("key", contract.inference_secret_name(fleet))):
            files[name] = Path(tmp) / name
            files[name].write_text(contract.secret_token(core.read_namespaced_secret(secret, ns).data) or "")
        port = bench_operator.free_port()
        cmd = [sys.executable, "-m", "rollfleet.gateway", "--fleet", fleet, "--namespace", ns]
        cmd += ["--kubeconfig", str(kubeconfig), "--token-file", str(files["token"])]
        cmd += ["--api-key-file", str(files["key"]), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warning"]
        url = f"http://127.0.0.1:{port}"
        with open(Path(tmp) / "gateway.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:

                def routes_all() -> bool:
                    with contextlib.suppress(httpx.HTTPError):
                        return engine_metric(url, GATEWAY_ROUTABLE.name) == engines
                    return False

                bench_operator.wait_until(routes_all, 300, f"the gateway routes to {engines} engines")
                auth = {"Authorization": f"Bearer {files['key'].read_text()}"}
                yield url, auth, functools.partial(bench_gateway.cpu_seconds, proc.pid)
            finally:
                proc.terminate()
                proc.wait(30)


def gateway_measure(url: str, auth: dict[str, str], cpu: Callable[[], float]) -> dict[str, float]:
    """bench_gateway's latency (p50 of one client) and closed loop (32 clients) through a gateway, JSON and streamed,
    and its CPU per request."""
    out: dict[str, float] = {}
    for mode, stream in (("json", False), ("stream", True)):
        out[f"{mode}_p50_ms"], _ = asyncio.run(bench_gateway.latency(url, stream, GATEWAY_LATENCY_N, auth))
        rps, cpu_s = asyncio.run(
            bench_gateway.throughput(url, stream, GATEWAY_CLIENTS, GATEWAY_SECONDS, cpu, auth, GATEWAY_WARM_UP_S)
        )
        out[f"{mode}_rps"], out[f"{mode}_cpu_us"] = rps, cpu_s * 1e6
    return out


def gateway_rounds(kubeconfig: Path, client: kubernetes.client.ApiClient, ns: str, engines: int) -> dict[str, Any]:
    """The gateway of the fleet of `engines` against the gateway of a fleet of GATEWAY_BASELINE engines applied beside
    it (same operator, cluster and engine host): GATEWAY_ROUNDS rounds, the two measured in turn (the order swapped
    each round), each figure the median of its rounds. In turns, because this machine's speed drifts over minutes:
    measured minutes apart, on its own fleet, the same 2-engine baseline served 752 and 1,992 requests/s in two
    runs of one day."""
    core = kubernetes.client.CoreV1Api(client)
    custom = kubernetes.client.CustomObjectsApi(client)
    create_fleet(custom, ns, BASELINE_FLEET, GATEWAY_BASELINE)

    def baseline_ready() -> bool:
        f = custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, BASELINE_FLEET)
        return (f.get("status") or {}).get("readyReplicas") == GATEWAY_BASELINE

    bench_operator.wait_until(baseline_ready, 300, f"the fleet of {GATEWAY_BASELINE} engines Ready")
    rounds: dict[str, list[dict[str, float]]] = {"gateway": [], "gateway_baseline": []}
    with (
        fleet_gateway(kubeconfig, core, ns, FLEET, engines) as big,
        fleet_gateway(kubeconfig, core, ns, BASELINE_FLEET, GATEWAY_BASELINE) as base,
    ):
        for r in range(GATEWAY_ROUNDS):
            turns = (("gateway_baseline", base), ("gateway", big))
            for key, gateway in turns if r % 2 == 0 else reversed(turns):
                rounds[key].append(gateway_measure(*gateway))
    custom.delete_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, BASELINE_FLEET)
    # Gone before the operator's minute at rest is counted.
    pods_gone(client, "the baseline fleet's pods gone", contract.engine_selector(BASELINE_FLEET), 300)
    return {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in rounds.items()}


ENGINE_PODS = contract.selector({contract.LABEL_COMPONENT: contract.COMPONENT_ENGINE})


def fresh_kwok(client: kubernetes.client.ApiClient, nodes: int) -> None:
    """KWOK and the engine host started anew, with `nodes` fake nodes, once the last run's engine pods are gone. KWOK
    recycles the addresses of deleted pods, and after a fleet of 2,000 was deleted it gave 8 addresses of the next one
    to two pods each: the engine host served one engine for both, and the fleet's figures were the wrong engines'."""
    pods_gone(client, "the last run's engine pods gone")
    kwok.down()
    kwok.up(nodes)


def pods_gone(
    client: kubernetes.client.ApiClient, what: str, selector: str = ENGINE_PODS, timeout_s: float = 600
) -> None:
    """Wait until no pod that `selector` matches (by default every engine pod) is left, in any namespace: a run that
    starts while thousands are still being deleted shares the API server with their deletions."""
    core = kubernetes.client.CoreV1Api(client)
    bench_operator.wait_until(
        lambda: not core.list_pod_for_all_namespaces(label_selector=selector, limit=1).items, timeout_s, what
    )


def warm_up(kubeconfig: Path, client: kubernetes.client.ApiClient, engines: int, nodes: int) -> float:
    """One unmeasured `kubectl apply` of `engines` bare pods, before anything is measured; the seconds to create
    them. A fresh cluster's first fleet is created at about half the rate of the next: fresh operators made 4
    fleets of 2,000 in turn, the first in 90.7 s and the next in 39.3-43.8 s; after this warm-up, the first took
    48.6-50.0 s (docs/architecture.md, "Scale", runs I and J). The first size's fleet, measured before its
    baseline, paid that alone."""
    fresh_kwok(client, nodes)
    created_s = float(bench_operator.baseline_run(kubeconfig, client, engines, scale_spec(engines))["created_s"])
    print(json.dumps({f"warm_up_kubectl_{engines}_created_s": round(created_s, 1)}), flush=True)
    return created_s


def one_fleet(kubeconfig: Path, client: kubernetes.client.ApiClient, engines: int) -> dict[str, Any]:
    def at_rest(ns: str, _pid: int) -> dict[str, Any]:
        return pause_round(client, ns, engines) | gateway_rounds(kubeconfig, client, ns, engines)

    fleet = bench_operator.fleet_run(kubeconfig, client, engines, scale_spec(engines), at_rest)
    print(json.dumps({f"fleet_{engines}": fleet}), flush=True)
    pods_gone(client, "the fleet's pods gone")  # the baseline was measured beside their deletion until run J
    raw = bench_operator.baseline_run(kubeconfig, client, engines, scale_spec(engines))
    print(json.dumps({f"kubectl_{engines}": raw}), flush=True)
    return {
        "fleet": fleet,
        "kubectl": raw,
        "create_ratio_vs_kubectl": fleet["created_s"] / raw["created_s"],
        "ready_ratio_vs_raw": fleet["converged_s"] / raw["all_ready_or_failed_s"],
    }


def many_fleets(kubeconfig: Path, client: kubernetes.client.ApiClient, count: int, size: int) -> dict[str, Any]:
    """`count` fleets of `size` engines in one namespace, under one operator: apply -> created, -> all converged."""
    core = kubernetes.client.CoreV1Api(client)
    custom = kubernetes.client.CustomObjectsApi(client)
    ns = f"bench-many-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    port = bench_operator.free_port()
    names = [f"f{i}" for i in range(count)]
    out: dict[str, Any] = {"fleets": count, "engines_each": size}
    try:
        with bench_operator.operator(kubeconfig, ns, port) as op:
            bench_operator.wait_until(lambda: bench_operator._up(port), 120, "operator metrics endpoint")
            time.sleep(2)  # kopf's initial listing, as in bench_operator
            peak = [bench_operator.rss_mib(op.pid)]
            selector = f"{contract.LABEL_COMPONENT}={contract.COMPONENT_ENGINE}"
            with bench_operator.PodWatch(core, ns, selector) as pw:
                t0 = time.monotonic()
                for name in names:
                    create_fleet(custom, ns, name, size)

                def sample() -> None:
                    peak.append(bench_operator.rss_mib(op.pid))

                bench_operator.wait_until(lambda: len(pw.added) >= count * size, 900, "all pods created", sample)
                out["created_s"] = max(pw.added.values()) - t0

                def converged() -> bool:
                    items = custom.list_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL)["items"]
                    return sum((f.get("status") or {}).get("readyReplicas") == size for f in items) == count

                bench_operator.wait_until(converged, 1800, "every fleet converged", sample)
                out["converged_s"] = time.monotonic() - t0
            out["rss_peak_mib"] = max(peak)
            out |= bench_operator.idle_minute(port, op.pid)
            for name in names:
                custom.delete_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL, name)
            bench_operator.wait_until(
                lambda: not custom.list_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, PLURAL)["items"],
                300,
                "the fleets deleted",
            )
    finally:
        core.delete_namespace(ns)
    return out


def headline(sizes: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The floors' keys, from the largest size measured (named by it)."""
    n = max(sizes)
    one = sizes[n]
    gateway, baseline = one["fleet"]["gateway"], one["fleet"]["gateway_baseline"]
    return {
        f"create_{n}_ratio_vs_kubectl": one["create_ratio_vs_kubectl"],
        f"ready_{n}_ratio_vs_raw": one["ready_ratio_vs_raw"],
        f"operator_rss_{n}_mib": one["fleet"]["rss_peak_mib"],
        f"api_calls_per_min_at_rest_{n}": one["fleet"]["api_calls_per_min_idle"],
        f"status_{n}_bytes": one["fleet"]["status_bytes"],
        f"weights_record_{n}_bytes": one["fleet"]["weights_record_bytes"] or 0,
        f"pause_{n}_p99_s": one["fleet"]["pause_p99_s"],
        f"gateway_rps_{n}_over_{GATEWAY_BASELINE}": gateway["json_rps"] / baseline["json_rps"],
        f"gateway_stream_rps_{n}_over_{GATEWAY_BASELINE}": gateway["stream_rps"] / baseline["stream_rps"],
        f"gateway_added_p50_ms_{n}_minus_{GATEWAY_BASELINE}": gateway["json_p50_ms"] - baseline["json_p50_ms"],
        # The requests a core of the gateway serves, against the baseline's: the requests/s above are those of this
        # machine's 2 cores, which the gateway shares with the load's clients and with the one process that is every
        # engine (whose cost per request grows as traffic spreads over 2,000 engines, where real ones have a machine
        # each).
        f"gateway_per_core_{n}_over_{GATEWAY_BASELINE}": baseline["json_cpu_us"] / gateway["json_cpu_us"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 1000, 2000], help="engines of the one fleet")
    parser.add_argument("--fleets", type=int, default=100, help="fleets of the many-fleets part (0: skip it)")
    parser.add_argument("--fleet-size", type=int, default=20)
    parser.add_argument("--push-mib", type=int, default=128, help="weights pushed in the push part (0: skip it)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    kubeconfig = controlplane.up().kubeconfig
    biggest = max([*args.sizes, args.fleets * args.fleet_size])
    per_node = int(kwok.node_manifest(0)["status"]["capacity"]["pods"])
    nodes = min(kwok.max_nodes(), biggest // per_node + 2)
    install_crds(kubeconfig)
    client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    warm_up_s = warm_up(kubeconfig, client, max(args.sizes), nodes)
    sizes = {}
    for n in sorted(set(args.sizes)):
        fresh_kwok(client, nodes)
        sizes[n] = one_fleet(kubeconfig, client, n)
    result: dict[str, Any] = {"warm_up_created_s": warm_up_s, "sizes": {str(n): v for n, v in sizes.items()}}
    if args.fleets:
        fresh_kwok(client, nodes)
        result["many_fleets"] = many_fleets(kubeconfig, client, args.fleets, args.fleet_size)
    result["headline"] = headline(sizes)
    if args.push_mib:
        result["push"] = push_sim.push_part((8, 2000), args.push_mib)
        result["headline"]["push_2000_over_8"] = result["push"]["push_2000_over_8"]
    result["floors"] = FLOORS
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
