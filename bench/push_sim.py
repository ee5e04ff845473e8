"""A weight push to thousands of engines in simulated time (bench_scale's push part).

The sync sidecar's own orchestrator (`rollfleet.sync.orchestrator`: its relay plan, the order and concurrency of its
calls, its waits, commit and resume) drives simulated engines on an event loop whose clock jumps from one event to
the next (`VirtualLoop`), so 2,000 engines take seconds here whatever the push would take there. What the
simulation charges for:

- the network: every engine's link is `LINK_BYTES_PER_S` each way (netsim's 1 Gbit/s, as bench_sync's fan-out part),
  the sidecar's too; a stream moves the weights in relay pieces (`PIECE_BYTES`, the engine's receive piece: a relay
  forwards a piece once it has landed), an uplink shared evenly by the streams it feeds and a downlink by the streams
  into it (two, from two relay trees), at each piece; each call costs a round trip (`RTT_S`);
- the sidecar's CPU: each call to an engine holds the sidecar's one event loop for `call_cpu_s`, measured in the
  same run on this machine with the real engine client against a real simulated engine (`measure_call_cpu`);
- the load in the pause: a copy from the staging area at `LOAD_BYTES_PER_S` (1 GiB in 0.11 s, docs/weight-sync.md).

What it leaves out: the engines' own CPU (each has its own machine), the sidecar's checksums (once per push,
whatever the fleet's size), losses and stragglers.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.engine_client import CONTROL, EngineCallError, EngineClient, EngineRef
from rollfleet.sync.engines import StaticDiscovery
from rollfleet.sync.orchestrator import Orchestrator, Publisher
from rollfleet.sync.store import FileStore
from rollfleet_client.sync_protocol import PushState
from rollfleet_engine.protocol import (
    STAGE_PATH,
    STAGE_RELAY_PATH,
    EngineState,
    RequestsView,
    StageState,
    StageStatus,
)
from rollfleet_engine.safetensors_stream import PIECE_BYTES, second_half

MIB = 1 << 20
LINK_BYTES_PER_S = 1e9 / 8  # netsim's "1gbit"
RTT_S = 100e-6  # one round trip inside a datacenter
LOAD_BYTES_PER_S = (1 << 30) / 0.11  # the load in the pause: a memory copy from the staging area
SIDECAR_URL = "http://sidecar:8472"
MANIFEST = "0" * 64


class _VirtualSelector(selectors.DefaultSelector):
    """Polls the real sockets without blocking; where the loop would wait for a timer, the clock jumps to it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer: only a thread or a socket can wake the loop
            return super().select(None)
        self.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: no callback takes any, every sleep and timeout takes exactly its own."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


@dataclass
class Node:
    """A machine with a link: an engine, or the sidecar (which has every piece from the start)."""

    pieces: int
    received: set[int] = field(default_factory=set)
    streams_out: int = 0
    streams_in: int = 0
    staging: bool = False
    _waiters: dict[int, list[asyncio.Future[None]]] = field(default_factory=dict)

    async def has(self, piece: int) -> None:
        if piece in self.received:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(piece, []).append(future)
        await future

    def landed(self, piece: int) -> None:
        self.received.add(piece)
        for future in self._waiters.pop(piece, []):
            future.set_result(None)


@dataclass
class SimEngine:
    node: Node
    version: str = "v1"
    manifest: str | None = None
    paused: bool = False
    stage: StageStatus = field(default_factory=StageStatus)
    staged: asyncio.Event = field(default_factory=asyncio.Event)


class SimApi(EngineClient):
    """The engine client's calls, answered by simulated engines: each costs the sidecar `call_cpu_s` of its one
    event loop, then a round trip; a staging moves the weights piece by piece from its source."""

    def __init__(self, engines: dict[str, SimEngine], sidecar: Node, total_bytes: int, call_cpu_s: float) -> None:
        super().__init__("token")
        self.engines, self.sidecar, self.total_bytes, self.call_cpu_s = engines, sidecar, total_bytes, call_cpu_s
        self.calls = 0
        self._cpu_free_at = 0.0

    async def _exchange(self) -> None:
        loop = asyncio.get_running_loop()
        self.calls += 1
        self._cpu_free_at = max(self._cpu_free_at, loop.time()) + self.call_cpu_s  # one loop: calls queue for it
        await asyncio.sleep(self._cpu_free_at - loop.time() + RTT_S)

    async def state(self, engine: EngineRef, policy: Any = CONTROL) -> EngineState:
        await self._exchange()
        return self._state(self.engines[engine.url])

    @staticmethod
    def _state(e: SimEngine) -> EngineState:
        return EngineState(
            model="sim",
            weight_version=e.version,
            paused=e.paused,
            running=0,
            waiting=0,
            weights_manifest_sha256=e.manifest,
        )

    async def requests(self, engine: EngineRef, policy: Any = CONTROL) -> RequestsView:
        await self._exchange()
        return RequestsView(in_flight=[], recently_finished=[])

    def _node(self, url: str) -> Node:
        return self.sidecar if url == SIDECAR_URL else self.engines[url.removesuffix(STAGE_RELAY_PATH)].node

    async def stage(self, engine: EngineRef, update_info: Any, policy: Any = CONTROL) -> StageStatus:
        """The engine's staging: every piece from `url`, or the first half of them from it and the second half
        from `second_url` at once (`safetensors_stream.second_half`). A second upstream not staging yet is waited
        for, as the engine's relay waits for its staging to begin."""
        await self._exchange()
        e, source = self.engines[engine.url], self._node(str(update_info["url"]))
        if source is not self.sidecar and not source.staging:
            raise EngineCallError(engine, "POST", STAGE_PATH, "HTTP 409: the upstream is not staging", status=409)
        e.stage = StageStatus(state=StageState.STAGING, manifest_sha256=MANIFEST, bytes=self.total_bytes)
        e.node.staging = True
        pieces = e.node.pieces
        if update_info.get("second_url"):
            middle = min(-(-second_half(self.total_bytes) // PIECE_BYTES), pieces)
            halves = [(source, range(middle)), (self._node(update_info["second_url"]), range(middle, pieces))]
        else:
            halves = [(source, range(pieces))]
        asyncio.get_running_loop().create_task(self._transfer(e, halves))
        return e.stage.model_copy()

    async def _transfer(self, e: SimEngine, halves: list[tuple[Node, range]]) -> None:
        await asyncio.gather(*(self._stream(e.node, source, pieces) for source, pieces in halves))
        e.stage = StageStatus(
            state=StageState.STAGED, manifest_sha256=MANIFEST, bytes=self.total_bytes, staged_url="file:///staged"
        )
        e.staged.set()

    async def _stream(self, node: Node, source: Node, pieces: range) -> None:
        """`pieces` from `source`, each once the source has it, at the rate of the busier of the two links: the
        source's uplink and the node's downlink are shared evenly by their streams."""
        piece_bytes = self.total_bytes / node.pieces
        for piece in pieces:
            await source.has(piece)
            source.streams_out += 1
            node.streams_in += 1
            await asyncio.sleep(piece_bytes * max(source.streams_out, node.streams_in) / LINK_BYTES_PER_S)
            source.streams_out -= 1
            node.streams_in -= 1
            node.landed(piece)

    async def stage_status(self, engine: EngineRef, wait_s: float = 0.0) -> StageStatus:
        await self._exchange()
        e = self.engines[engine.url]
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(e.staged.wait(), wait_s)
        return e.stage.model_copy()

    async def pause(self, engine: EngineRef, mode: Any, policy: Any = None) -> None:
        await self._exchange()
        self.engines[engine.url].paused = True

    async def pause_and_look(self, engine: EngineRef, mode: Any, policy: Any = None) -> RequestsView:
        await self.pause(engine, mode, policy)
        return RequestsView(in_flight=[], recently_finished=[])

    async def resume(self, engine: EngineRef, policy: Any = CONTROL) -> None:
        await self._exchange()
        self.engines[engine.url].paused = False

    async def start_weight_update(self, engine: EngineRef, policy: Any = CONTROL) -> None:
        await self._exchange()

    async def update_weights(self, engine: EngineRef, update_info: Any, policy: Any = CONTROL) -> None:
        await self._exchange()
        await asyncio.sleep(self.total_bytes / LOAD_BYTES_PER_S)
        self.engines[engine.url].manifest = update_info.get("manifest_sha256")

    async def finish_weight_update(self, engine: EngineRef, version: str, policy: Any = CONTROL) -> None:
        await self._exchange()
        self.engines[engine.url].version = version

    async def load(self, engine: EngineRef, update_info: Any, version: str, policy: Any = CONTROL) -> EngineState:
        await self._exchange()
        await asyncio.sleep(self.total_bytes / LOAD_BYTES_PER_S)
        e = self.engines[engine.url]
        e.manifest, e.version = update_info.get("manifest_sha256"), version
        return self._state(e)


class SimPublisher(Publisher):
    """The sidecar's weights server, as engines see it: its URL and the weights' size (nothing is served)."""

    def __init__(self, total_bytes: int) -> None:
        super().__init__("sidecar", 0)
        self._bytes = total_bytes

    async def serve(self, source: Path) -> tuple[str, str, int]:
        self.source, self.url, self.total_bytes = source, SIDECAR_URL, self._bytes
        return SIDECAR_URL, MANIFEST, self._bytes


@dataclass
class PushResult:
    engines: int
    push_s: float  # simulated: the push's total_s
    prefetch_s: float
    pause_window_s: float
    calls: int
    wall_s: float  # what simulating it took here


def simulated_push(engines: int, total_bytes: int, call_cpu_s: float, relay_chain_max: int | None = None) -> PushResult:
    """One push of `total_bytes` to `engines` simulated engines, through the sidecar's orchestrator."""
    loop = VirtualLoop()
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="push-sim-") as tmp:
            weights = Path(tmp) / "weights"
            weights.mkdir()
            (weights / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # an empty set
            return loop.run_until_complete(_push(engines, total_bytes, call_cpu_s, relay_chain_max, Path(tmp), t0))
    finally:
        loop.close()


async def _push(
    engines: int, total_bytes: int, call_cpu_s: float, relay_chain_max: int | None, tmp: Path, t0: float
) -> PushResult:
    pieces = max(1, -(-total_bytes // PIECE_BYTES))
    sims = {f"http://engine-{i}:8000": SimEngine(Node(pieces)) for i in range(engines)}
    sidecar = Node(pieces, received=set(range(pieces)))
    api = SimApi(sims, sidecar, total_bytes, call_cpu_s)
    orch = Orchestrator(
        store=FileStore(tmp / "record.json"),
        discovery=StaticDiscovery(list(sims)),
        api=api,
        publisher=SimPublisher(total_bytes),
        spool=tmp / "spool",
        clock=asyncio.get_running_loop().time,
        relay_chain_max=relay_chain_max,
    )
    await orch.reconcile_once()  # adopts the engines' version, as a sidecar does at its start
    api.calls = 0
    status = await orch.submit("v2", tmp / "weights")
    ended = await orch.wait(status.generation, 1e6)
    assert ended is not None and ended.state is PushState.DONE, ended
    assert {e.version for e in sims.values()} == {"v2"} and not any(e.paused for e in sims.values())
    return PushResult(
        engines=engines,
        push_s=ended.total_s or 0.0,
        prefetch_s=ended.prefetch_s or 0.0,
        pause_window_s=ended.pause_window_s or 0.0,
        calls=api.calls,
        wall_s=time.monotonic() - t0,
    )


def measure_call_cpu(calls: int = 2000, concurrent: int = 200, repeats: int = 3) -> float:
    """The sidecar's CPU per engine call, here: the real engine client's state reads of a real simulated engine on
    loopback, `concurrent` at a time (as the orchestrator fans out), the client process's CPU seconds per call; the
    least of `repeats` measurements, each against an engine of its own. One measurement varied by 2x on an idle
    machine (0.044-0.099 ms; the push of 2,000 then went from 1.5 to 2.1 of the push of 8, the code unchanged)."""
    return min(_measure_call_cpu(calls, concurrent) for _ in range(repeats))


def _measure_call_cpu(calls: int, concurrent: int) -> float:
    from bench.bench_sync import free_port, wait_http

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rollfleet_dev.sim_engine", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(url + "/health", proc)
        return asyncio.run(_call_cpu(url, calls, concurrent))
    finally:
        proc.terminate()
        proc.wait(30)


async def _call_cpu(url: str, calls: int, concurrent: int) -> float:
    api = EngineClient("token")
    engine = EngineRef("sim", url)
    try:
        await api.state(engine, CONTROL)  # connected and warm
        cpu0 = time.process_time()
        for _ in range(calls // concurrent):
            await asyncio.gather(*(api.state(engine, CONTROL) for _ in range(concurrent)))
        return (time.process_time() - cpu0) / (calls // concurrent * concurrent)
    finally:
        await api.aclose()


def push_part(sizes: Sequence[int] = (8, 2000), mib: int = 128) -> dict[str, Any]:
    """Push `mib` MiB to each fleet size, in simulated time; the ratio of the largest to the smallest."""
    call_cpu_s = measure_call_cpu()
    results = {n: simulated_push(n, mib * MIB, call_cpu_s) for n in sizes}
    small, large = min(sizes), max(sizes)
    return {
        "mib": mib,
        "call_cpu_ms": call_cpu_s * 1e3,
        "pushes": {str(n): vars(r) for n, r in results.items()},
        f"push_{large}_over_{small}": results[large].push_s / results[small].push_s,
    }
