"""Engine benchmark: portable weight-update throughput vs raw loopback TCP; pause/resume latency.

Not a test: prints a table and the ratios. Everything is measured in the same run, so
the ratios hold on whatever machine runs it. Three parts:

1. raw loopback TCP: one socket, sender thread -> ``recv_into`` a preallocated buffer;
2. portable pull: ``WeightsServer`` -> ``fetch_weights`` (manifest, safetensors stream,
   XXH3-128 per tensor, tensors built), the engine's data path without the model copy;
3. a real engine (vLLM on CPU, tiny model): end-to-end ``/start_weight_update`` +
   ``/update_weights`` + ``/finish_weight_update``, and ``/pause?mode=keep`` /
   ``/resume`` latency with streams decoding.

Usage: python -m bench.bench_engine [--mib 256] [--repeats 5] [--no-engine]
"""

from __future__ import annotations

import argparse
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


@contextmanager
def engine_process() -> Iterator[str]:
    model = ensure_tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_text("bench-token\n")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = (Path(tmp) / "engine.log").open("wb")
        cmd = [sys.executable, "-m", "rollfleet_engine", "serve", "--model", str(model)]
        cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--token-file", str(token)]
        cmd += ["--", "--dtype", "float32", "--max-model-len", "2048", "--disable-uvicorn-access-log"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url + "/rollfleet/v1/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError(f"engine did not start; log in {log.name}")
            yield url
        finally:
            stop(proc)
            log.close()


def stream_forever(url: str, stop: threading.Event) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break


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
    parser.add_argument("--no-engine", action="store_true", help="skip the part that needs a vLLM engine")
    args = parser.parse_args()
    nbytes = args.mib * MIB

    tcp_s = best_of(args.repeats, lambda: raw_tcp_seconds(nbytes))
    with tempfile.TemporaryDirectory() as weights_dir:
        # A safetensors directory, as a trainer checkpoint is served (sendfile, no Python copy).
        save_file(synthetic_state_dict(nbytes), str(Path(weights_dir) / "model.safetensors"))
        pull_s = best_of(args.repeats, lambda: portable_pull_seconds(Path(weights_dir)))
    tcp_mbs, pull_mbs = args.mib / tcp_s, args.mib / pull_s

    rows = [
        ("raw loopback TCP", f"{tcp_mbs:,.0f} MiB/s", f"{args.mib} MiB, median of {args.repeats}"),
        ("portable pull (http backend)", f"{pull_mbs:,.0f} MiB/s", "manifest + stream + XXH3-128 + tensors"),
    ]
    if not args.no_engine:
        with engine_process() as url:
            e = engine_numbers(url, args.repeats)
        rows += [
            (
                "engine weight update (tiny B)",
                f"{e['update_s'] * 1e3:,.0f} ms",
                f"{e['update_bytes'] / MIB:.1f} MiB: start + update + finish, end to end",
            ),
            ("pause (keep), 4 streams", f"{e['pause_ms']:,.1f} ms", "POST /pause?mode=keep round trip"),
            ("resume", f"{e['resume_ms']:,.1f} ms", "POST /resume round trip"),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>14}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print(f"\nratio portable pull / raw TCP: {pull_mbs / tcp_mbs:.2f}")


if __name__ == "__main__":
    main()
