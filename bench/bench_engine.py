"""Engine benchmark: portable weight-update throughput vs raw loopback TCP; pause/resume latency; abort to idle.

Not a test: prints a table and the ratios. Everything is measured in the same run, so
the ratios hold on whatever machine runs it. Four parts:

1. raw loopback TCP: one socket, sender thread -> ``recv_into`` a preallocated buffer;
2. portable pull: ``WeightsServer`` -> ``fetch_weights`` (manifest, safetensors stream,
   XXH3-128 per tensor, tensors built), the engine's data path without the model copy;
3. a real engine (vLLM on CPU, tiny model): end-to-end ``/start_weight_update`` +
   ``/update_weights`` + ``/finish_weight_update``, and ``/pause?mode=keep`` /
   ``/resume`` latency with streams decoding.

4. abort by id to idle (vLLM's running count 0), one engine core against data parallel 2 over two
   processes run as a group's pods are (the launcher's group flags): one request per rank, one call.

Usage: python -m bench.bench_engine [--mib 256] [--repeats 5] [--no-engine] [--no-group] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from bench.processes import stop
from rollfleet_dev.engine_metrics import engine_metric_by
from rollfleet_engine.tiny_model import WEIGHTS_B_DIR, ensure_tiny_model
from rollfleet_engine.weights_client import fetch_weights
from rollfleet_engine.weights_server import WeightsServer

MIB = 1 << 20


def best_of(repeats: int, run: Callable[[], float]) -> float:
    """Median seconds of ``repeats`` runs."""
    return statistics.median(run() for _ in range(repeats))


def raw_tcp_seconds(nbytes: int) -> float:
    payload = memoryview(bytearray(nbytes))
    sink = bytearray(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def send() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(payload)

        sender = threading.Thread(target=send)
        sender.start()
        with socket.create_connection(("127.0.0.1", port)) as client:
            view, got = memoryview(sink), 0
            start = time.perf_counter()
            while got < nbytes:
                got += client.recv_into(view[got:])
            elapsed = time.perf_counter() - start
        sender.join()
    return elapsed


def portable_pull_seconds(weights_dir: Path) -> float:
    server = WeightsServer(weights_dir, host="127.0.0.1")
    url = server.start()
    info = server.update_info()
    try:
        start = time.perf_counter()
        fetch_weights(url, info["manifest_sha256"], 300)
        return time.perf_counter() - start
    finally:
        server.stop()


def synthetic_state_dict(nbytes: int, tensor_mib: int = 4) -> dict[str, torch.Tensor]:
    per = tensor_mib * MIB // 4
    return {f"model.layers.{i}.weight": torch.randn(per) for i in range(max(1, nbytes // (tensor_mib * MIB)))}


def engine_command(host: str, port: int, token: Path, *vllm_args: str) -> list[str]:
    """The launcher's command for an engine of the tiny model on CPU (what a fleet's engine pod runs)."""
    cmd = [sys.executable, "-m", "rollfleet_engine", "serve", "--model", str(ensure_tiny_model())]
    cmd += ["--served-model-name", "tiny", "--host", host, "--port", str(port), "--token-file", str(token)]
    return [*cmd, "--", "--dtype", "float32", "--max-model-len", "2048", "--disable-uvicorn-access-log", *vllm_args]


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/rollfleet/v1/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"engine did not start; log in {log}")


def pod_cpus(rank: int, pods: int) -> list[str]:
    """A group's pods run on nodes of their own: on one host, each rank's processes get their own share of its
    CPUs (as a node's), else every rank's engine core, worker and OpenMP threads contend for all of them (on two
    cores, a DP 2 engine decoded at a fifth of its pinned speed, and its API server starved)."""
    cpus = sorted(os.sched_getaffinity(0))
    if pods < 2 or len(cpus) < pods:
        return []
    share = cpus[rank * len(cpus) // pods : (rank + 1) * len(cpus) // pods]
    return ["taskset", "--cpu-list", ",".join(map(str, share))]


@contextmanager
def engine_process(*vllm_args: str, group_pods: int = 1) -> Iterator[str]:
    """An engine (its URL), of one process or of `group_pods` processes as the pods of a group: the leader
    serves, the other ranks run `serve --headless` with the flags the operator gives a group's pods, each on its
    own share of the host's CPUs (`pod_cpus`)."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        token = Path(tmp) / "token"
        token.write_text("bench-token\n")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = engine_command("127.0.0.1", port, token, *vllm_args)
        split = base.index("--")
        procs = []
        for rank in reversed(range(group_pods)):  # the other ranks first, as LWS may start them
            ours = base[:split]
            if group_pods > 1:
                ours += ["--group-leader", "127.0.0.1", "--group-pods", str(group_pods), "--pod-rank", str(rank)]
            if rank:  # a headless rank serves no routes: no token
                at = ours.index("--token-file")
                ours = [*ours[:at], *ours[at + 2 :], "--headless"]
            log = stack.enter_context((Path(tmp) / f"engine-{rank}.log").open("wb"))
            cmd = pod_cpus(rank, group_pods) + ours + base[split:]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            stack.callback(stop, procs[-1])
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, procs[-1], Path(tmp) / "engine-0.log")
        yield url


def stream_forever(url: str, stop: threading.Event) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break


DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's: the data parallel rank that serves a request
AUTH = {"Authorization": "Bearer bench-token"}


def abort_idle_s(url: str, ranks: int, repeats: int) -> float:
    """Median seconds from an abort-by-id call to every rank idle (vLLM's running count, which a data parallel
    engine's leader reports per rank), with one long request decoding on each rank."""
    runs = []
    for i in range(repeats):
        ids = [f"bench-abort-{i}-{rank}" for rank in range(ranks)]
        threads = [
            threading.Thread(
                target=lambda rid=rid, rank=rank: httpx.post(
                    url + "/v1/completions",
                    json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True},
                    headers=AUTH | {"X-Request-Id": rid, DP_RANK_HEADER: str(rank)},
                    timeout=300,
                ),
                daemon=True,
            )
            for rank, rid in enumerate(ids)
        ]
        for t in threads:
            t.start()
        wait_until(lambda: running(url, ranks) == [1] * ranks, "every rank decoding")
        start = time.perf_counter()
        httpx.post(url + "/rollfleet/v1/abort", json={"request_ids": ids}, headers=AUTH, timeout=60).raise_for_status()
        wait_until(lambda: running(url, ranks) == [0] * ranks, "every rank idle")
        runs.append(time.perf_counter() - start)
        for t in threads:
            t.join(60)
    return statistics.median(runs)


def running(url: str, ranks: int) -> list[float | None]:
    """Each rank's running count, from one scrape: read one rank after another, the second reading would come
    a scrape later than the first (about 0.1 s on two loaded cores), and the idle time with it."""
    per = engine_metric_by(url, "vllm:num_requests_running", "engine")
    return [per.get(str(rank)) for rank in range(ranks)]


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {timeout_s:g} s")
        time.sleep(0.01)  # polling the engine's counters: the measure's resolution


def engine_numbers(url: str, repeats: int) -> dict[str, float]:
    auth = {"Authorization": "Bearer bench-token"}
    model = ensure_tiny_model()

    def post(path: str, **kw: object) -> float:
        start = time.perf_counter()
        httpx.post(url + path, headers=auth, timeout=300, **kw).raise_for_status()  # type: ignore[arg-type]
        return time.perf_counter() - start

    server = WeightsServer(model / WEIGHTS_B_DIR, host="127.0.0.1")
    server.start()
    try:

        def update() -> float:
            return (
                post("/start_weight_update")
                + post("/update_weights", json={"update_info": server.update_info()})
                + post("/finish_weight_update", json={"weight_version": "bench"})
            )

        update_s = best_of(repeats, update)
    finally:
        server.stop()

    stop = threading.Event()
    streams = [threading.Thread(target=stream_forever, args=(url, stop), daemon=True) for _ in range(4)]
    for t in streams:
        t.start()
    time.sleep(1.0)  # let the streams reach the decode phase
    pauses, resumes = [], []
    try:
        for _ in range(repeats):
            pauses.append(post("/pause?mode=keep"))
            resumes.append(post("/resume"))
    finally:
        stop.set()
    return {
        "update_s": update_s,
        "update_bytes": float(sum(f.stat().st_size for f in (model / WEIGHTS_B_DIR).glob("*.safetensors"))),
        "pause_ms": statistics.median(pauses) * 1e3,
        "resume_ms": statistics.median(resumes) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256, help="bytes moved by the throughput runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-engine", action="store_true", help="skip the parts that need vLLM engines")
    parser.add_argument("--no-group", action="store_true", help="skip the data parallel engine of two processes")
    parser.add_argument("--json", type=Path, help="also write the figures here, with stable names")
    args = parser.parse_args()
    nbytes = args.mib * MIB

    tcp_s = best_of(args.repeats, lambda: raw_tcp_seconds(nbytes))
    with tempfile.TemporaryDirectory() as weights_dir:
        # A safetensors directory, as a trainer checkpoint is served (sendfile, no Python copy).
        save_file(synthetic_state_dict(nbytes), str(Path(weights_dir) / "model.safetensors"))
        pull_s = best_of(args.repeats, lambda: portable_pull_seconds(Path(weights_dir)))
    tcp_mbs, pull_mbs = args.mib / tcp_s, args.mib / pull_s
    figures: dict[str, float] = {
        "raw_tcp_mib_s": tcp_mbs,
        "portable_pull_mib_s": pull_mbs,
        "portable_pull_ratio": pull_mbs / tcp_mbs,
    }

    rows = [
        ("raw loopback TCP", f"{tcp_mbs:,.0f} MiB/s", f"{args.mib} MiB, median of {args.repeats}"),
        ("portable pull (http backend)", f"{pull_mbs:,.0f} MiB/s", "manifest + stream + XXH3-128 + tensors"),
    ]
    if not args.no_engine:
        with engine_process() as url:
            e = engine_numbers(url, args.repeats)
            figures |= e | {"abort_idle_s": abort_idle_s(url, 1, args.repeats)}
        rows += [
            (
                "engine weight update (tiny B)",
                f"{e['update_s'] * 1e3:,.0f} ms",
                f"{e['update_bytes'] / MIB:.1f} MiB: start + update + finish, end to end",
            ),
            ("pause (keep), 4 streams", f"{e['pause_ms']:,.1f} ms", "POST /pause?mode=keep round trip"),
            ("resume", f"{e['resume_ms']:,.1f} ms", "POST /resume round trip"),
            (
                "abort by id to idle",
                f"{figures['abort_idle_s'] * 1e3:,.0f} ms",
                f"one request decoding, vLLM's running count 0, median of {args.repeats}",
            ),
        ]
    if not args.no_engine and not args.no_group:
        # Data parallel 2 over two processes, as over the two pods of a group (the launcher's group flags).
        with engine_process("--data-parallel-size", "2", group_pods=2) as url:
            figures["dp2_abort_idle_s"] = abort_idle_s(url, 2, args.repeats)
        figures["dp2_abort_idle_ratio"] = figures["dp2_abort_idle_s"] / figures["abort_idle_s"]
        rows.append(
            (
                "abort by id to idle, DP 2 over 2 pods",
                f"{figures['dp2_abort_idle_s'] * 1e3:,.0f} ms",
                f"one request per rank, one call, both ranks' running counts 0, median of {args.repeats}",
            )
        )
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>14}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print(f"\nratio portable pull / raw TCP: {pull_mbs / tcp_mbs:.2f}")
    if "dp2_abort_idle_ratio" in figures:
        print(f"ratio DP 2 abort-to-idle / one engine core's: {figures['dp2_abort_idle_ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
