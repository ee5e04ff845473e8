"""Weight sync benchmark: end-to-end pushes through the sidecar to 2 engines, next to raw loopback TCP.

Not a test: prints a table and the ratios, all measured in the same run. Parts:

1. raw loopback TCP (one socket, ``bench_engine.raw_tcp_seconds``), the ceiling, measured
   right before every push (the host is shared: the ceiling moves with its load);
2. the tiny model to 2 REAL vLLM CPU engines, with 4 streams decoding on each: a
   trainer's ``push_dir`` through the sidecar, end to end as the trainer sees it, and
   the pause window the sidecar reports;
3. a synthetic ~1 GiB state dict to 2 STAND-IN receivers: a real tiny engine cannot
   load 1 GiB of foreign tensors, so each receiver is a process that answers the
   engine's control routes and runs the engine's own code without vLLM: its stager
   (prefetch: download and sha256 per tensor into its staging area, in memory) and its
   loader (``fetch_weights``: from the staging area, or pulled in the pause). Both ways a
   trainer pushes: ``push_dir`` (a checkpoint on a shared volume) and ``push`` (tensors
   streamed from the trainer process into the sidecar's spool); ``push_dir`` also with the
   sidecar's ``--no-prefetch``, the baseline of the pause window: engines pull while paused.

Usage: python -m bench.bench_sync [--gib 1.0] [--repeats 3] [--no-engine] [--json PATH]
       python -m bench.bench_sync --receiver HOST:PORT   (one stand-in receiver; used by part 3)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import save_file

from bench.bench_engine import engine_process, raw_tcp_seconds, stream_forever, synthetic_state_dict
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import PushStatus
from rollfleet_engine.tiny_model import WEIGHTS_B_DIR, ensure_tiny_model

MIB = 1 << 20
ENGINE_TOKEN = "bench-token"  # what bench_engine.engine_process starts engines with


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)  # polling a condition: the server is not bound yet
    raise TimeoutError(url)


@contextlib.contextmanager
def process(cmd: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    with log.open("wb") as out:
        environ = {**os.environ, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=environ)
    try:
        wait_http(ready_url, proc)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextlib.contextmanager
def sidecar(engine_urls: list[str], tmp: Path, *flags: str) -> Iterator[SyncClient]:
    tmp.mkdir(parents=True, exist_ok=True)
    token = tmp / "token"
    token.write_text(ENGINE_TOKEN + "\n")
    port = free_port()
    cmd = [sys.executable, "-m", "rollfleet.cli", "sync", "--fleet", "bench", "--engines", ",".join(engine_urls)]
    cmd += ["--token-file", str(token), "--port", str(port), "--weights-port", str(free_port())]
    # The spool in memory, as the manifests' memory-backed emptyDir.
    spool = tempfile.mkdtemp(prefix="bench-spool-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    cmd += ["--spool-dir", spool, "--reconcile-interval", "0.5", *flags]
    url = f"http://127.0.0.1:{port}"
    try:
        with process(cmd, url + "/healthz", tmp / "sidecar.log"), SyncClient(url, timeout_s=600) as client:
            deadline = time.monotonic() + 60
            while client.fleet_version().version is None:  # adopts the engines' version on its first reconcile
                assert time.monotonic() < deadline, "sidecar never adopted the engines' version"
                time.sleep(0.1)  # polling a condition
            yield client
    finally:
        shutil.rmtree(spool, ignore_errors=True)


TCP_SAMPLE_BYTES = 256 * MIB
tcp_samples: list[float] = []  # MiB/s, one per push


def timed(push: Any) -> tuple[float, PushStatus]:
    tcp_samples.append(TCP_SAMPLE_BYTES / MIB / raw_tcp_seconds(TCP_SAMPLE_BYTES))
    start = time.perf_counter()
    status = push()
    return time.perf_counter() - start, status


Row = tuple[str, str, str]


def summarize(label: str, runs: list[tuple[float, PushStatus]], engines: int) -> tuple[list[Row], dict[str, float]]:
    """Table rows, and the figures: throughputs (MiB/s, bytes x engines) for the ratios, and seconds."""
    e2e = statistics.median(t for t, _ in runs)
    nbytes = runs[0][1].bytes
    transfer = statistics.median(s.transfer_s or 0.0 for _, s in runs)
    receive = statistics.median(s.receive_s or 0.0 for _, s in runs)
    staging = statistics.median(s.staging_s or 0.0 for _, s in runs)
    prefetch = statistics.median(s.prefetch_s or 0.0 for _, s in runs)
    pause = statistics.median(s.pause_window_s or 0.0 for _, s in runs)
    moved = nbytes * engines / MIB
    figures = {
        f"{label}, end to end": moved / e2e,
        f"{label}, load phase": moved / max(transfer, 1e-9),
        f"{label}, end to end s": e2e,
        f"{label}, pause window s": pause,
    }
    rows = [
        (f"{label}: end to end", f"{e2e:,.3f} s", f"{nbytes / MIB:,.1f} MiB to {engines} engines, trainer's view"),
        (f"{label}: receive", f"{receive:,.3f} s", "streamed pushes: trainer -> sidecar spool"),
        (f"{label}: staging", f"{staging:,.3f} s", "sidecar hashes and serves, before any pause"),
        (f"{label}: prefetch", f"{prefetch:,.3f} s", "engines download and verify while serving"),
        (f"{label}: load phase", f"{transfer:,.3f} s", "first pause to last engine verified"),
        (f"{label}: pause window", f"{pause * 1e3:,.0f} ms", "first pause sent to last resume answered"),
    ]
    return rows, figures


def tiny_part(repeats: int, tmp: Path) -> tuple[list[Row], dict[str, float]]:
    model = ensure_tiny_model()
    dirs = [model / WEIGHTS_B_DIR, model]
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(2):
            # One core per engine: vLLM's CPU backend binds every engine to core 0 by default.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))
            urls.append(stack.enter_context(engine_process()))
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        stop = threading.Event()
        streams = [threading.Thread(target=stream_forever, args=(u, stop), daemon=True) for u in urls for _ in range(4)]
        for t in streams:
            t.start()
        try:
            client = stack.enter_context(sidecar(urls, tmp))
            runs = [timed(lambda i=i: client.push_dir(dirs[i % 2], f"tiny-{i}")) for i in range(repeats)]
        finally:
            stop.set()
    return summarize("tiny model, real engines", runs, 2)


def big_part(gib: float, repeats: int, tmp: Path) -> tuple[list[Row], dict[str, float]]:
    tmp.mkdir(parents=True, exist_ok=True)
    nbytes = int(gib * 1024 * MIB)
    state_dicts = [synthetic_state_dict(nbytes) for _ in range(2)]
    ckpts = []
    for i, sd in enumerate(state_dicts):
        ckpt = tmp / f"ckpt-{i}"
        ckpt.mkdir()
        save_file(sd, str(ckpt / "model.safetensors"))
        ckpts.append(ckpt)
    rows: list[Row] = []
    rates: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(receivers(2, tmp / "prefetch"))
        client = stack.enter_context(sidecar(urls, tmp / "prefetch"))
        client.push_dir(ckpts[1], "warm-up")  # as a running trainer's: the stand-ins' parameters exist
        for label, push in (
            (f"{gib:g} GiB push_dir, stand-ins", lambda i: client.push_dir(ckpts[i % 2], f"dir-{i}")),
            (f"{gib:g} GiB push (streamed), stand-ins", lambda i: client.push(state_dicts[i % 2], f"stream-{i}")),
        ):
            r, t = summarize(label, [timed(lambda i=i, push=push: push(i)) for i in range(repeats)], 2)
            rows, rates = rows + r, rates | t
    with contextlib.ExitStack() as stack:  # the baseline: engines pull while paused
        urls = stack.enter_context(receivers(2, tmp / "pull"))
        client = stack.enter_context(sidecar(urls, tmp / "pull", "--no-prefetch"))
        client.push_dir(ckpts[1], "warm-up")
        label = f"{gib:g} GiB push_dir, stand-ins, pull in the pause"
        runs = [timed(lambda i=i: client.push_dir(ckpts[i % 2], f"pull-{i}")) for i in range(repeats)]
        r, t = summarize(label, runs, 2)
        rows, rates = rows + r, rates | t
    return rows, rates


@contextlib.contextmanager
def receivers(count: int, tmp: Path, env: dict[int, dict[str, str]] | None = None) -> Iterator[list[str]]:
    """`count` stand-in engines (`env`: extra environment of some, by index)."""
    tmp.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "bench.bench_sync", "--receiver", f"127.0.0.1:{port}"]
            log = tmp / f"receiver-{i}.log"
            stack.enter_context(process(cmd, url + "/rollfleet/v1/state", log, (env or {}).get(i)))
            urls.append(url)
        yield urls


def receiver(address: str) -> None:
    """A stand-in engine: the sidecar's control routes, and the engine's pull, staging and relay code
    without vLLM."""
    from aiohttp import web

    from rollfleet_engine.protocol import (
        STAGE_PATH,
        STAGE_RELAY_PATH,
        WEIGHTS_MANIFEST_PATH,
        EngineState,
        WeightUpdateInfo,
    )
    from rollfleet_engine.runtime import default_stager
    from rollfleet_engine.staging import RelayUnavailable
    from rollfleet_engine.weights_client import fetch_weights

    host, port = address.rsplit(":", 1)
    state = {"version": "initial", "paused": False, "staged": []}
    stager = default_stager()  # the engine's own, in memory (/dev/shm) where the host has it

    async def stage(request: web.Request) -> web.Response:
        started = stager.start(WeightUpdateInfo.model_validate(await request.json()))
        return web.json_response(started.model_dump(mode="json"), status=202)

    async def stage_status(_: web.Request) -> web.Response:
        return web.json_response(stager.status().model_dump(mode="json"))

    async def relay_manifest(_: web.Request) -> web.Response:
        try:
            return web.Response(body=await asyncio.to_thread(stager.relay_manifest), content_type="application/json")
        except RelayUnavailable as err:
            return web.json_response({"error": str(err)}, status=409)

    async def relay_shard(request: web.Request) -> web.StreamResponse:
        try:
            shard, chunks = stager.relay_shard("/" + request.match_info["path"])
        except RelayUnavailable as err:
            return web.json_response({"error": str(err)}, status=409)
        resp = web.StreamResponse(headers={"Content-Length": str(shard.size)})
        await resp.prepare(request)
        with contextlib.suppress(RelayUnavailable):  # the stream breaks off, as the engine's does
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                await resp.write(chunk)
        return resp

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({})

    async def pause(_: web.Request) -> web.Response:
        state["paused"] = True
        return web.json_response({})

    async def resume(_: web.Request) -> web.Response:
        state["paused"] = False
        return web.json_response({})

    async def update(request: web.Request) -> web.Response:
        info = (await request.json())["update_info"]
        state["staged"] = await asyncio.to_thread(fetch_weights, info["url"], info.get("manifest_sha256"), 600)
        return web.json_response({})

    model: dict[str, Any] = {}  # the stand-in's parameters: what load_weights copies into

    def load(tensors: list[tuple[str, Any]]) -> None:
        for name, tensor in tensors:
            if name not in model:
                model[name] = tensor.clone()
            else:
                model[name].copy_(tensor)

    async def finish(request: web.Request) -> web.Response:
        await asyncio.to_thread(load, state["staged"])  # as the engine's finish: into the model
        state["version"], state["staged"] = (await request.json())["weight_version"], []
        stager.release()
        return web.json_response({})

    async def engine_state(_: web.Request) -> web.Response:
        body = EngineState(
            model="stand-in", weight_version=str(state["version"]), paused=bool(state["paused"]), running=0, waiting=0
        )
        return web.json_response(body.model_dump())

    async def requests(_: web.Request) -> web.Response:
        return web.json_response({"in_flight": [], "recently_finished": []})

    app = web.Application()
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/start_weight_update", ok)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/finish_weight_update", finish)
    app.router.add_get("/rollfleet/v1/state", engine_state)
    app.router.add_get("/rollfleet/v1/requests", requests)
    app.router.add_post(STAGE_PATH, stage)
    app.router.add_get(STAGE_PATH, stage_status)
    app.router.add_get(STAGE_RELAY_PATH + WEIGHTS_MANIFEST_PATH, relay_manifest)
    app.router.add_get(STAGE_RELAY_PATH + "/{path:.*}", relay_shard)
    web.run_app(app, host=host, port=int(port), print=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0, help="size of the synthetic state dict")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-engine", action="store_true", help="skip the part with real vLLM engines")
    parser.add_argument("--receiver", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the figures here, with stable names")
    args = parser.parse_args()
    if args.receiver:
        receiver(args.receiver)
        return
    rows: list[Row] = []
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        parts = [] if args.no_engine else [lambda: tiny_part(args.repeats, Path(tmp, "tiny"))]
        parts.append(lambda: big_part(args.gib, args.repeats, Path(tmp, "big")))
        for part in parts:
            r, t = part()
            rows, rates = rows + r, rates | t
    tcp_mibs = statistics.median(tcp_samples)
    spread = f"{min(tcp_samples):,.0f}-{max(tcp_samples):,.0f} MiB/s"
    rows.insert(0, ("raw loopback TCP", f"{tcp_mibs:,.0f} MiB/s", f"one socket, before every push ({spread})"))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>14}  notes  (median of {args.repeats}, {os.cpu_count()} cpus)")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print("\nthroughput (bytes x engines / time) vs raw loopback TCP:")
    for name, mibs in rates.items():
        if not name.endswith(" s"):
            print(f"  {name:<{width}}  {mibs:>9,.0f} MiB/s  ratio {mibs / tcp_mibs:.2f}")
    big = f"{args.gib:g} GiB push_dir, stand-ins"
    report = {
        "raw_tcp_mib_s": tcp_mibs,
        "push_dir_tcp_ratio": rates[f"{big}, end to end"] / tcp_mibs,
        "push_stream_tcp_ratio": rates[f"{args.gib:g} GiB push (streamed), stand-ins, end to end"] / tcp_mibs,
        "pause_window_s": rates[f"{big}, pause window s"],
        "pause_window_pull_in_pause_s": rates[f"{big}, pull in the pause, pause window s"],
        "pause_window_ratio_vs_pull_in_pause": rates[f"{big}, pause window s"]
        / rates[f"{big}, pull in the pause, pause window s"],
        "end_to_end_ratio_vs_pull_in_pause": rates[f"{big}, end to end s"]
        / rates[f"{big}, pull in the pause, end to end s"],
    }
    print("\nprefetch vs pulling in the pause (push_dir, same run):")
    print(f"  pause window ratio {report['pause_window_ratio_vs_pull_in_pause']:.2f} (goal <= 0.25)")
    print(f"  end-to-end ratio   {report['end_to_end_ratio_vs_pull_in_pause']:.2f} (goal <= 1.0)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
