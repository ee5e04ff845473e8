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
   (prefetch: download and checksum per tensor into its staging area, in memory) and its
   loader (``fetch_weights``: from the staging area, or pulled in the pause). Every way a
   trainer pushes: ``push_dir`` (a checkpoint on a shared volume), ``push`` (tensors from
   the trainer's memory written into the sidecar's spool, which the trainer container
   mounts) and ``push`` without that mount (streamed to the sidecar over HTTP); ``push_dir``
   also through a second sidecar with ``--no-prefetch``, the baseline: engines pull while
   paused. The two sidecars push to the same stand-ins in turns.
4. fan-out: a 128 MiB ``push_dir`` to 1, 2, 4 and 8 stand-ins on a simulated datacenter
   network (``netsim``: a namespace per node, 1 Gbit/s links shaped with tc), with the
   engines' relay chain and, as the baseline, the star (``--no-relay``: the sidecar sends
   every engine its own copy). Needs root; skipped (and its figures null) without.
5. shard-aware pull (same network): a 128 MiB Llama-shaped checkpoint to one engine whose tensor
   parallel ranks span 2 pods (2 stand-ins on 2 nodes, each pulling only its cut of every tensor in
   the pause, as a group's ranks do: ``tp_slices``), against the same push to a 1-pod engine (one
   stand-in, prefetch then load). Bytes are counted on the nodes' links. Needs root, as part 4.
6. abort by id on a real engine of data parallel 2 over 2 processes started as a group's pods
   (``bench_engine.abort_idle_s``): with part 5, the figures of engines that span pods.

Usage: python -m bench.bench_sync [--gib 1.0] [--repeats 3] [--no-engine] [--no-fanout | --only-fanout]
                                  [--fanout-mib 128] [--no-shards | --only-shards] [--json PATH]
       python -m bench.bench_sync --receiver HOST:PORT   (one stand-in receiver; used by parts 3 and 4)
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch
from safetensors.torch import save_file

from bench import netsim
from bench.bench_engine import abort_idle_s, engine_process, raw_tcp_seconds, stream_forever, synthetic_state_dict
from bench.processes import stop
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import PushStatus
from rollfleet_engine.protocol import ENGINE_PORT, STATE_PATH
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
def started(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`cmd` running, its output in `log`; stopped on exit."""
    with log.open("wb") as out:
        environ = {**os.environ, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=environ)
    try:
        yield proc
    finally:
        stop(proc)


@contextlib.contextmanager
def process(cmd: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    with started(cmd, log, env) as proc:
        wait_http(ready_url, proc)
        yield


@contextlib.contextmanager
def sidecar(
    engine_urls: list[str], tmp: Path, *flags: str, weights_host: str = "127.0.0.1", record: Path | None = None
) -> Iterator[SyncClient]:
    """A sidecar in static mode on `engine_urls`, its record in `record` (default: its spool)."""
    tmp.mkdir(parents=True, exist_ok=True)
    token = tmp / "token"
    token.write_text(ENGINE_TOKEN + "\n")
    port = free_port()
    cmd = [sys.executable, "-m", "rollfleet.cli", "sync", "--fleet", "bench", "--engines", ",".join(engine_urls)]
    cmd += ["--token-file", str(token), "--port", str(port), "--weights-host", weights_host]
    cmd += ["--weights-port", str(free_port(weights_host))]
    # Its health port too: a local cluster's sidecars on this host hold the default one.
    cmd += ["--health-port", str(free_port(weights_host))]
    # The spool in memory, as the manifests' memory-backed emptyDir.
    spool = tempfile.mkdtemp(prefix="bench-spool-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    cmd += ["--spool-dir", spool, "--reconcile-interval", "0.5", *flags]
    cmd += ["--state-file", str(record)] if record is not None else []
    url = f"http://127.0.0.1:{port}"
    try:
        # The trainer's container mounts the spool, as in manifests/sync/trainer-job.yaml.
        with process(cmd, url + "/healthz", tmp / "sidecar.log"), SyncClient(url, 600, spool) as client:
            deadline = time.monotonic() + 60
            while client.fleet_version().version is None:  # adopts the engines' version on its first reconcile
                assert time.monotonic() < deadline, "sidecar never adopted the engines' version"
                time.sleep(0.1)  # polling a condition
            yield client
    finally:
        shutil.rmtree(spool, ignore_errors=True)


TCP_SAMPLE_BYTES = 256 * MIB
tcp_samples: list[float] = []  # MiB/s, one per push
Run = tuple[float, PushStatus, float]  # seconds, the push's status, raw TCP (MiB/s) measured right before it


def timed(push: Any) -> Run:
    tcp = TCP_SAMPLE_BYTES / MIB / raw_tcp_seconds(TCP_SAMPLE_BYTES)
    tcp_samples.append(tcp)
    start = time.perf_counter()
    status = push()
    return time.perf_counter() - start, status, tcp


Row = tuple[str, str, str]


THROUGHPUTS = (", end to end", ", load phase")  # the figures compared with raw TCP
CEILING = ", raw TCP"


def summarize(label: str, runs: list[Run], engines: int) -> tuple[list[Row], dict[str, float]]:
    """Table rows, and the figures: throughputs (MiB/s, bytes x engines) for the ratios, the raw TCP they are
    compared with (the median of the samples taken before these pushes: the host's load moves it, and
    while real engines decode, it falls), and seconds."""
    e2e = statistics.median(t for t, _, _ in runs)
    nbytes = runs[0][1].bytes
    transfer = statistics.median(s.transfer_s or 0.0 for _, s, _ in runs)
    receive = statistics.median(s.receive_s or 0.0 for _, s, _ in runs)
    staging = statistics.median(s.staging_s or 0.0 for _, s, _ in runs)
    prefetch = statistics.median(s.prefetch_s or 0.0 for _, s, _ in runs)
    pause = statistics.median(s.pause_window_s or 0.0 for _, s, _ in runs)
    moved = nbytes * engines / MIB
    figures = {
        f"{label}, end to end": moved / e2e,
        f"{label}, load phase": moved / max(transfer, 1e-9),
        f"{label}{CEILING}": statistics.median(tcp for _, _, tcp in runs),
        f"{label}, end to end s": e2e,
        f"{label}, pause window s": pause,
    }
    rows = [
        (f"{label}: end to end", f"{e2e:,.3f} s", f"{nbytes / MIB:,.1f} MiB to {engines} engines, trainer's view"),
        (f"{label}: receive", f"{receive:,.3f} s", "push(state_dict): trainer memory -> sidecar spool"),
        (f"{label}: staging", f"{staging:,.3f} s", "sidecar checksums and serves, before any pause"),
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


WARM_UPS = 2  # pushes before the timed ones: the second supersedes the first, whose file becomes the spare


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
        urls = stack.enter_context(receivers(2, tmp / "stand-ins"))
        record = tmp / "record.json"
        client = stack.enter_context(sidecar(urls, tmp / "prefetch", *SHARED_RECORD, record=record))
        http_only = stack.enter_context(SyncClient(client.url, 600))  # a trainer without the spool mounted
        rows, rates = prefetch_against_pull(gib, repeats, tmp / "pull", client, urls, ckpts, record)
        for label, push in (
            (f"{gib:g} GiB push (spool), stand-ins", lambda i, v: client.push(state_dicts[i % 2], f"spool-{v}")),
            (f"{gib:g} GiB push (HTTP), stand-ins", lambda i, v: http_only.push(state_dicts[i % 2], f"http-{v}")),
        ):
            # As a running trainer's: the spool holds a superseded push's file to write over
            # (``rollfleet_client.spool``).
            for i in range(WARM_UPS):
                push(i, f"warm-up-{i}")
            r, t = summarize(label, [timed(lambda i=i, push=push: push(i, str(i))) for i in range(repeats)], 2)
            rows, rates = rows + r, rates | t
    return rows, rates


# Two sidecars on the same engines, one record: each would take a push of the other's in progress for one
# interrupted by a restart, and drive it. So they push in turns, and neither reconciles after its first look.
SHARED_RECORD = ("--reconcile-interval", "86400")


def prefetch_against_pull(
    gib: float, repeats: int, tmp: Path, client: SyncClient, urls: list[str], ckpts: list[Path], record: Path
) -> tuple[list[Row], dict[str, float]]:
    """``push_dir`` with prefetch (`client`), and the baseline: a second sidecar on the same stand-ins
    with ``--no-prefetch`` (they pull while paused). The two push in turns, so that a drift of the host's
    speed in the run falls on both alike (measured one after the other, on two sets of stand-ins, the end
    to end ratio moved between 0.86 and 1.03 from run to run)."""
    prefetch = f"{gib:g} GiB push_dir, stand-ins"
    pull = f"{prefetch}, pull in the pause"
    with sidecar(urls, tmp, "--no-prefetch", *SHARED_RECORD, record=record) as pulling:
        # Each sidecar's pushes alternate between the two checkpoints, so that it hashes every push's files, as
        # it does a trainer's new checkpoint. Warm-ups first, as in a running trainer's fleet: the stand-ins'
        # parameters and staging area exist.
        runs: dict[str, list[Run]] = {prefetch: [], pull: []}
        for i in range(-WARM_UPS, repeats):
            pushes = (
                (prefetch, lambda i=i: client.push_dir(ckpts[i % 2], f"dir-{i}")),
                (pull, lambda i=i: pulling.push_dir(ckpts[(i + 1) % 2], f"pull-{i}")),
            )
            for label, push in pushes:
                if i < 0:
                    push()
                else:
                    runs[label].append(timed(push))
    rows: list[Row] = []
    rates: dict[str, float] = {}
    for label, timed_runs in runs.items():
        r, t = summarize(label, timed_runs, 2)
        rows, rates = rows + r, rates | t
    return rows, rates


FANOUT_COUNTS = (1, 2, 4, 8)


def network_checkpoints(part: str, tmp: Path, state_dict: Callable[[], dict[str, torch.Tensor]]) -> list[Path] | None:
    """Two checkpoints (pushed in turns) for a part on the simulated network; None, said why, where it cannot run."""
    why = netsim.unavailable()
    if why is not None:
        print(f"{part} part skipped: {why}", file=sys.stderr)
        return None
    ckpts = [tmp / f"ckpt-{i}" for i in range(2)]
    for ckpt in ckpts:
        ckpt.mkdir(parents=True)
        save_file(state_dict(), str(ckpt / "model.safetensors"))
    return ckpts


def fanout_part(mib: int, repeats: int, tmp: Path) -> tuple[list[Row], dict[str, float]]:
    """Push time to 1, 2, 4 and 8 stand-ins on a simulated network (``netsim``: 1 Gbit/s links), with the
    relay chain and with the star (``--no-relay``), each measured in this run."""
    ckpts = network_checkpoints("fan-out", tmp, lambda: synthetic_state_dict(mib * MIB))
    if ckpts is None:
        return [], {}
    rows: list[Row] = []
    figures: dict[str, float] = {}
    with netsim.network(1 + max(FANOUT_COUNTS)) as nodes:
        trainer, hosts = nodes[0], nodes[1:]
        for relay in (True, False):
            mode = "relay" if relay else "star"
            for count in FANOUT_COUNTS:
                spec = {
                    "receivers": [[n.netns, n.address] for n in hosts[:count]],
                    "trainer": trainer.address,
                    "ckpts": [str(c) for c in ckpts],
                    "relay": relay,
                    "repeats": repeats,
                    "tmp": str(tmp / f"{mode}-{count}"),
                }
                argv = [sys.executable, "-m", "bench.bench_sync", "--fanout-trainer", json.dumps(spec)]
                done = subprocess.run(trainer.command(argv), check=True, capture_output=True, text=True)
                phases = json.loads(done.stdout.strip().splitlines()[-1])
                figures[f"fan-out {mode} {count} s"] = phases["push_s"]
                note = (
                    f"{mib} MiB push_dir to {count} stand-ins, 1 Gbit/s links; checksums {phases['staging_s']:.2f} s, "
                    f"prefetch {phases['prefetch_s']:.2f} s, pause {phases['pause_window_s']:.2f} s"
                )
                rows.append((f"fan-out, {mode}, {count} receivers: end to end", f"{phases['push_s']:,.3f} s", note))
    return rows, figures


# The Llama-shaped checkpoint of the shard part: key-value heads and vocabulary that every rule of
# tp_slices splits (the stand-ins plan their cuts with them, as an engine with this config).
SHARD_HIDDEN, SHARD_FFN, SHARD_KV_HEADS, SHARD_HEAD_DIM, SHARD_VOCAB = 1024, 2816, 2, 128, 8000
GROUP_PEER_ENV = "STANDIN_GROUP_PEER"  # a stand-in group's leader: its other rank's URL
TP_RANK_ENV = "STANDIN_TP_RANK"  # a stand-in that is one of 2 tensor-parallel ranks


def llama_state_dict(nbytes: int) -> dict[str, torch.Tensor]:
    """About `nbytes` of float32 tensors named and shaped as a Llama checkpoint's (embeddings, then layers)."""
    h, f, kv = SHARD_HIDDEN, SHARD_FFN, SHARD_KV_HEADS * SHARD_HEAD_DIM
    out = {"model.embed_tokens.weight": torch.randn(SHARD_VOCAB, h), "lm_head.weight": torch.randn(SHARD_VOCAB, h)}
    per_layer = 4 * (2 * h * h + 2 * kv * h + 3 * f * h + h)
    for i in range(max(1, (nbytes - 8 * SHARD_VOCAB * h) // per_layer)):
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
                  "input_layernorm": (h,)}  # fmt: skip
        out |= {f"model.layers.{i}.{name}.weight": torch.randn(*shape) for name, shape in shapes.items()}
    return out


def group_abort_part() -> tuple[list[Row], dict[str, float]]:
    """Abort by id on a real engine of data parallel 2 over 2 processes started as a group's pods: one request
    decoding on each rank, one call, until both ranks' running counts are 0 (median of 5, as the floor says)."""
    with engine_process("--data-parallel-size", "2", group_pods=2) as url:
        idle_s = abort_idle_s(url, 2, 5)
    row = ("abort by id to idle, DP 2 over 2 pods", f"{idle_s * 1e3:,.0f} ms", "both ranks' running counts 0")
    return [row], {"dp2 abort idle s": idle_s}


def shard_part(mib: int, repeats: int, tmp: Path) -> tuple[list[Row], dict[str, float]]:
    """Push time and bytes into one engine of 2 tensor-parallel pods, against a 1-pod engine, on a simulated
    network (engines' links 1 Gbit/s), each measured in this run."""
    ckpts = network_checkpoints("shard", tmp, lambda: llama_state_dict(mib * MIB))
    if ckpts is None:
        return [], {}
    rows: list[Row] = []
    figures: dict[str, float] = {}
    # The trainer's link first as fast as two engine pods' together (a trainer node's uplink is not slower
    # than the engines it feeds: then each pod's own link is the limit), then as slow as one pod's (there the
    # trainer's link is the limit whatever each rank pulls: the bytes count, not the time).
    for trainer_link, tag in (("2gbit", ""), ("1gbit", " uniform")):
        with netsim.network(3, first_rate=trainer_link) as nodes:
            for pods in (1, 2):
                spec = {
                    "receivers": [[n.netns, n.address] for n in nodes[1 : 1 + pods]],
                    "trainer": nodes[0].address,
                    "ckpts": [str(c) for c in ckpts],
                    "relay": False,
                    "group": pods > 1,
                    "repeats": repeats,
                    "tmp": str(tmp / f"{trainer_link}-{pods}"),
                }
                argv = [sys.executable, "-m", "bench.bench_sync", "--fanout-trainer", json.dumps(spec)]
                done = subprocess.run(nodes[0].command(argv), check=True, capture_output=True, text=True)
                phases = json.loads(done.stdout.strip().splitlines()[-1])
                figures[f"shards{tag} {pods}-pod s"] = phases["push_s"]
                figures[f"shards{tag} {pods}-pod bytes"] = phases["rx_bytes"]
                how = "TP=2 ranks each stage their cuts in their own pod" if pods > 1 else "prefetch"
                note = (
                    f"{phases['bytes'] / MIB:,.1f} MiB Llama-shaped push_dir, {how}; "
                    f"{phases['rx_bytes'] / MIB:,.1f} MiB in, pause {phases['pause_window_s']:.2f} s"
                )
                label = f"shard-aware pull, {pods}-pod engine, trainer link {trainer_link}: end to end"
                rows.append((label, f"{phases['push_s']:,.3f} s", note))
    return rows, figures


def rx_bytes(node: netsim.Node) -> int:
    """Bytes received on the node's link so far."""
    out = subprocess.run(["ip", "-j", "-s", "-n", node.netns, "link", "show", "dev", "eth0"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def fanout_trainer(spec_json: str) -> None:
    """Inside the trainer's namespace: a sidecar and the stand-ins (with `group`: one engine whose 2 tensor
    parallel ranks are the 2 stand-ins), a warm-up push, then timed pushes; prints the median push time, and
    the bytes the stand-ins' nodes received per push, as JSON."""
    spec = json.loads(spec_json)
    nodes = [netsim.Node(netns, address) for netns, address in spec["receivers"]]
    tmp, ckpts = Path(spec["tmp"]), [Path(c) for c in spec["ckpts"]]
    flags = ("--relay-min-engines", "2") if spec["relay"] else ("--no-relay",)
    env: dict[int, dict[str, str]] = {}
    if spec.get("group"):
        peer = f"http://{nodes[1].address}:{ENGINE_PORT}"
        env = {0: {TP_RANK_ENV: "0", GROUP_PEER_ENV: peer}, 1: {TP_RANK_ENV: "1"}}
    with receivers(len(nodes), tmp, env=env, nodes=nodes) as urls:
        engines = urls[:1] if spec.get("group") else urls  # the sidecar sees the group's leader only
        with sidecar(engines, tmp, *flags, weights_host=spec["trainer"]) as client:
            client.push_dir(ckpts[1], "warm-up")  # as a running trainer's: the stand-ins' parameters exist
            runs, moved = [], []
            for i in range(spec["repeats"]):
                before = sum(rx_bytes(n) for n in nodes)
                start = time.perf_counter()
                status = client.push_dir(ckpts[i % 2], f"fanout-{i}")
                runs.append((time.perf_counter() - start, status))
                moved.append(sum(rx_bytes(n) for n in nodes) - before)
    phases = {
        "rx_bytes": statistics.median(moved),
        "bytes": runs[0][1].bytes,
        "push_s": statistics.median(t for t, _ in runs),
        "staging_s": statistics.median(s.staging_s or 0.0 for _, s in runs),
        "prefetch_s": statistics.median(s.prefetch_s or 0.0 for _, s in runs),
        "pause_window_s": statistics.median(s.pause_window_s or 0.0 for _, s in runs),
    }
    print(json.dumps(phases))


# A test's fault for a stand-in: it dies (its process exits at once) once it has relayed this many bytes.
RELAY_DIES_AFTER_ENV = "STANDIN_RELAY_DIES_AFTER_BYTES"


@contextlib.contextmanager
def receivers(
    count: int, tmp: Path, env: dict[int, dict[str, str]] | None = None, nodes: list[netsim.Node] | None = None
) -> Iterator[list[str]]:
    """`count` stand-in engines (`env`: extra environment of some, by index), on loopback or one on each
    of `nodes` (a simulated network's namespaces).

    Each gets its share of the host's cores for torch's threads: engines run on machines of their own,
    and here stand-ins whose OpenMP threads outnumber the cores spin against each other (a 1 GiB
    load from the staging area took 0.4-2.0 s instead of 0.24 s)."""
    tmp.mkdir(parents=True, exist_ok=True)
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // count))}
    with contextlib.ExitStack() as stack:
        urls, procs = [], []
        for i in range(count):
            address = f"{nodes[i].address}:{ENGINE_PORT}" if nodes else f"127.0.0.1:{free_port()}"
            while not nodes and f"http://{address}" in urls:  # not bound yet: the next free port may be its own
                address = f"127.0.0.1:{free_port()}"
            cmd = [sys.executable, "-m", "bench.bench_sync", "--receiver", address]
            extra = threads | (env or {}).get(i, {})
            procs.append(
                stack.enter_context(started(nodes[i].command(cmd) if nodes else cmd, tmp / f"receiver-{i}.log", extra))
            )
            urls.append(f"http://{address}")
        # Started together, then waited for: each spends its first seconds importing torch, one core each.
        for url, proc in zip(urls, procs, strict=True):
            wait_http(url + STATE_PATH, proc)
        yield urls


def receiver(address: str) -> None:
    """A stand-in engine: the sidecar's control routes, and the engine's pull, staging and relay code
    without vLLM."""
    from aiohttp import web

    from rollfleet_engine.middleware import one_manifest, verified_manifest
    from rollfleet_engine.protocol import (
        RELAY_MANIFEST_HEADER,
        STAGE_PATH,
        STAGE_RELAY_PATH,
        WEIGHTS_MANIFEST_PATH,
        EngineState,
        StageState,
        StageStatus,
        WeightUpdateInfo,
    )
    from rollfleet_engine.rank_staging import RANK_STAGED_SCHEME, STATUS_POLL_S, RankStage, merge_rank_status
    from rollfleet_engine.runtime import default_stager
    from rollfleet_engine.staging import RelayUnavailable
    from rollfleet_engine.tp_slices import RankShard, rank_plan
    from rollfleet_engine.weights_client import fetch_slices, fetch_weights
    from rollfleet_engine.weights_server import content_range

    host, port = address.rsplit(":", 1)
    tp_rank = os.environ.get(TP_RANK_ENV)
    peer = os.environ.get(GROUP_PEER_ENV)

    rank_stage = RankStage()  # as the engine's worker: its part staged in its own memory (rank_staging)

    def pull(info: WeightUpdateInfo) -> list[tuple[str, Any]]:
        """As the engine's worker: the whole set, or, as one of 2 tensor-parallel ranks, its cuts; or the part
        it staged."""
        if urlsplit(info.url).scheme == RANK_STAGED_SCHEME:
            return rank_stage.take(info.url)
        if tp_rank is None:
            return fetch_weights(info.url, info.manifest_sha256, 600)
        shard = RankShard(2, int(tp_rank), SHARD_KV_HEADS, SHARD_VOCAB)
        return fetch_slices(info.url, info.manifest_sha256, 600, lambda m: rank_plan(m, shard))

    state: dict[str, Any] = {"version": "initial", "paused": False, "staged": [], "loads": [], "manifest": None}
    dies_after = int(os.environ.get(RELAY_DIES_AFTER_ENV, "0")) or None
    stager = default_stager()  # the engine's own, in memory (/dev/shm) where the host has it

    peer_client: list[httpx.AsyncClient] = []  # one, kept (as vLLM's channel to its workers is)

    def http() -> httpx.AsyncClient:
        if not peer_client:
            peer_client.append(httpx.AsyncClient(timeout=600))
        return peer_client[0]

    async def group_status() -> StageStatus:
        """As a group's leader (GroupStager): its own rank's staging and its peer's, as one."""
        theirs = StageStatus.model_validate((await http().get(f"{peer}/standin/stage")).raise_for_status().json())
        return merge_rank_status([rank_stage.status(), theirs])

    async def stage(request: web.Request) -> web.Response:
        info = WeightUpdateInfo.model_validate(await request.json())
        if peer is None:
            started = stager.start(info)
        else:  # as a group's leader: every rank stages its part in its own pod, all at once
            theirs = asyncio.create_task(http().post(f"{peer}/standin/stage", json=info.model_dump(mode="json")))
            rank_stage.start(info, pull)
            (await theirs).raise_for_status()
            started = await group_status()
        return web.json_response(started.model_dump(mode="json"), status=202)

    async def stage_status(request: web.Request) -> web.Response:
        wait = float(request.query.get("wait", 0))
        if peer is None:
            status = await asyncio.to_thread(stager.status, wait)
        else:
            deadline = time.monotonic() + wait
            while True:
                status = await group_status()
                if status.state is not StageState.STAGING or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(STATUS_POLL_S)  # as GroupStager: the ranks are other processes, asked again
        return web.json_response(status.model_dump(mode="json"))

    async def rank_stage_start(request: web.Request) -> web.Response:
        started = rank_stage.start(WeightUpdateInfo.model_validate(await request.json()), pull)
        return web.json_response(started.model_dump(mode="json"))

    async def rank_stage_status(_: web.Request) -> web.Response:
        return web.json_response(rank_stage.status().model_dump(mode="json"))

    async def relay_manifest(request: web.Request) -> web.Response:
        try:
            pinned = request.headers.get(RELAY_MANIFEST_HEADER)
            raw = await asyncio.to_thread(stager.relay_manifest, pinned)
            return web.Response(body=raw, content_type="application/json")
        except RelayUnavailable as err:
            return web.json_response({"error": str(err)}, status=409)

    async def relay_shard(request: web.Request) -> web.StreamResponse:
        asked = request.headers.get("Range")
        try:
            path = "/" + request.match_info["path"]
            pinned = request.headers.get(RELAY_MANIFEST_HEADER)
            shard, (begin, end), chunks = await asyncio.to_thread(stager.relay_shard, path, asked, pinned)
        except RelayUnavailable as err:
            return web.json_response({"error": str(err)}, status=409)
        except ValueError as err:  # a Range past the shard
            return web.json_response({"error": str(err)}, status=416)
        headers = {"Content-Length": str(end - begin)}
        if asked is not None:
            headers["Content-Range"] = content_range(begin, end, shard.size)
        resp = web.StreamResponse(status=200 if asked is None else 206, headers=headers)
        await resp.prepare(request)
        relayed = 0
        with contextlib.suppress(RelayUnavailable):  # the stream breaks off, as the engine's does
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                if dies_after is not None and relayed + len(chunk) > dies_after:
                    await resp.write(chunk[: dies_after - relayed])
                    os._exit(1)  # mid-chunk, closing nothing first: as a process killed
                relayed += len(chunk)
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

    async def start(_: web.Request) -> web.Response:
        state["loads"] = []
        return web.json_response({})

    async def update(request: web.Request) -> web.Response:
        raw = await request.read()
        info = WeightUpdateInfo.model_validate(json.loads(raw)["update_info"])
        ours = asyncio.to_thread(pull, info)
        if peer is None:
            state["staged"] = await ours
        else:  # the group's other rank loads its part at the same time
            body = info.model_dump(mode="json")
            state["staged"], answer = await asyncio.gather(ours, http().post(f"{peer}/standin/pull", json=body))
            answer.raise_for_status()
        state["loads"].append(verified_manifest(raw))  # as the engine's middleware: the proof of the bytes
        return web.json_response({})

    async def rank_pull(request: web.Request) -> web.Response:
        state["staged"] = await asyncio.to_thread(pull, WeightUpdateInfo.model_validate(await request.json()))
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
        state["manifest"], state["loads"] = one_manifest(state["loads"]), []
        stager.release()
        return web.json_response({})

    async def engine_state(_: web.Request) -> web.Response:
        body = EngineState(
            model="stand-in",
            weight_version=str(state["version"]),
            paused=bool(state["paused"]),
            running=0,
            waiting=0,
            weights_manifest_sha256=state["manifest"],
        )
        return web.json_response(body.model_dump())

    async def requests(_: web.Request) -> web.Response:
        return web.json_response({"in_flight": [], "recently_finished": []})

    app = web.Application()
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/start_weight_update", start)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/standin/pull", rank_pull)
    app.router.add_post("/standin/stage", rank_stage_start)
    app.router.add_get("/standin/stage", rank_stage_status)
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
    parser.add_argument("--no-fanout", action="store_true", help="skip the fan-out part (simulated network)")
    parser.add_argument("--only-fanout", action="store_true", help="run the fan-out part alone")
    parser.add_argument("--fanout-mib", type=int, default=128, help="size pushed in the fan-out and shard parts")
    parser.add_argument("--no-shards", action="store_true", help="skip parts 5 and 6 (engines across pods)")
    parser.add_argument("--only-shards", action="store_true", help="run parts 5 and 6 alone")
    parser.add_argument("--receiver", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fanout-trainer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the figures here, with stable names")
    args = parser.parse_args()
    if args.receiver:
        receiver(args.receiver)
        return
    if args.fanout_trainer:
        fanout_trainer(args.fanout_trainer)
        return
    rows: list[Row] = []
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        parts = []
        if not (args.only_fanout or args.only_shards):
            parts += [] if args.no_engine else [lambda: tiny_part(args.repeats, Path(tmp, "tiny"))]
            parts.append(lambda: big_part(args.gib, args.repeats, Path(tmp, "big")))
        if not (args.no_fanout or args.only_shards):
            parts.append(lambda: fanout_part(args.fanout_mib, args.repeats, Path(tmp, "fanout")))
        if not (args.no_shards or args.only_fanout):
            parts.append(lambda: shard_part(args.fanout_mib, args.repeats, Path(tmp, "shards")))
            parts += [] if args.no_engine else [group_abort_part]
        for part in parts:
            r, t = part()
            rows, rates = rows + r, rates | t
    tcp_mibs = statistics.median(tcp_samples) if tcp_samples else None
    if tcp_samples:
        spread = f"{min(tcp_samples):,.0f}-{max(tcp_samples):,.0f} MiB/s"
        rows.insert(0, ("raw loopback TCP", f"{tcp_mibs:,.0f} MiB/s", f"one socket, before every push ({spread})"))
    width = max((len(r[0]) for r in rows), default=10)
    print(f"{'measure':<{width}}  {'value':>14}  notes  (median of {args.repeats}, {os.cpu_count()} cpus)")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    if tcp_mibs:
        print("\nthroughput (bytes x engines / time) vs raw loopback TCP measured before the same pushes:")
        for name, mibs in rates.items():
            if name.endswith(THROUGHPUTS):
                ceiling = rates[name.rsplit(", ", 1)[0] + CEILING]
                print(f"  {name:<{width}}  {mibs:>9,.0f} MiB/s  ratio {mibs / ceiling:.2f} (of {ceiling:,.0f})")
    report = _report(rates, args.gib)
    for name, goal in REPORTED_GOALS.items():
        if report.get(name) is not None:
            print(f"  {name:<40} {report[name]:.2f}  (goal {goal})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


# The figures the issue names, with their goals (printed next to them; not checked: a benchmark).
REPORTED_GOALS = {
    "pause_window_ratio_vs_pull_in_pause": "<= 0.25",
    "end_to_end_ratio_vs_pull_in_pause": "<= 1.0",
    "push_dir_tcp_ratio": ">= 0.6",
    "push_stream_tcp_ratio": ">= 0.5",
    "fanout_8_over_1": "<= 1.5",
    "fanout_8_over_1_star_baseline": "about 8",
    "shard_pull_bytes_ratio": "<= 1.05",
    "shard_push_time_ratio": "<= 0.65",
    "dp2_abort_idle_s": "<= 0.5",
}


def _report(rates: dict[str, float], gib: float) -> dict[str, float | None]:
    """Every figure under a stable name; None for a part not run."""
    big = f"{gib:g} GiB push_dir, stand-ins"
    pull = f"{big}, pull in the pause"

    def ratio(a: str, b: str) -> float | None:
        return rates[a] / rates[b] if a in rates and b in rates else None

    def of_tcp(label: str) -> float | None:
        end_to_end, ceiling = f"{label}, end to end", f"{label}{CEILING}"
        return rates[end_to_end] / rates[ceiling] if end_to_end in rates and rates.get(ceiling) else None

    report: dict[str, float | None] = {
        "raw_tcp_mib_s": rates.get(f"{big}{CEILING}"),  # before the push_dir pushes: push_dir_tcp_ratio's
        "push_dir_tcp_ratio": of_tcp(big),
        # push(state_dict) as deployed (the trainer writes into the sidecar's spool), and over HTTP.
        "push_stream_tcp_ratio": of_tcp(f"{gib:g} GiB push (spool), stand-ins"),
        "push_stream_http_tcp_ratio": of_tcp(f"{gib:g} GiB push (HTTP), stand-ins"),
        "pause_window_s": rates.get(f"{big}, pause window s"),
        "pause_window_pull_in_pause_s": rates.get(f"{pull}, pause window s"),
        "pause_window_ratio_vs_pull_in_pause": ratio(f"{big}, pause window s", f"{pull}, pause window s"),
        "end_to_end_ratio_vs_pull_in_pause": ratio(f"{big}, end to end s", f"{pull}, end to end s"),
        "fanout_8_over_1": ratio("fan-out relay 8 s", "fan-out relay 1 s"),
        "fanout_8_over_1_star_baseline": ratio("fan-out star 8 s", "fan-out star 1 s"),
        # Into one engine of 2 tensor-parallel pods, over into a 1-pod engine: bytes on the links, push time.
        "shard_pull_bytes_ratio": ratio("shards 2-pod bytes", "shards 1-pod bytes"),
        "shard_push_time_ratio": ratio("shards 2-pod s", "shards 1-pod s"),
        "dp2_abort_idle_s": rates.get("dp2 abort idle s"),
        "shard_push_1pod_s": rates.get("shards 1-pod s"),
        "shard_push_2pod_s": rates.get("shards 2-pod s"),
        # The same with the trainer's link as slow as one pod's: there it is the limit for both.
        "shard_push_time_ratio_uniform_links": ratio("shards uniform 2-pod s", "shards uniform 1-pod s"),
    }
    for mode in ("relay", "star"):
        for count in FANOUT_COUNTS:
            report[f"fanout_{mode}_{count}_s"] = rates.get(f"fan-out {mode} {count} s")
    return report


if __name__ == "__main__":
    main()
