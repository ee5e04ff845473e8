"""Runs the protocol: pushes, recovery after a restart, and catching late engines up.

Every decision comes from ``protocol``; this module does the I/O around it, in the
order that keeps the fleet consistent:

1. stage: the weights are in a directory (the trainer's shared volume, or the spool
   the client streamed into) and the weights server serves it (checksummed, pinned by the
   manifest's sha256). Nothing is paused yet.
2. record InProgress in the fleet's weights record, abort requests that would become too stale,
   pause every engine (``keep``: in-flight requests are held, not lost).
   Before the pause, with prefetch (the default), every engine stages the weights while it
   serves: it downloads and verifies them into its staging area (memory); an engine whose
   staging fails is not paused and ends PendingSync. With relay (the default) the engines
   form a chain, each staging from the one before it as its bytes arrive, so the sidecar
   sends each byte about once; a failed relay falls back to the sidecar.
3. every paused engine loads in parallel: start_weight_update, update_weights (from its
   staging area, or, without prefetch, downloaded and verified now), finish_weight_update
   (version), then its reported version is checked.
4. commit if at least one engine verified (else roll back), then resume exactly the
   engines on the fleet's version; the others are PendingSync (left paused; the operator,
   which reads the record, takes their pods out of routing) and the reconcile loop
   catches them up, or they are replaced. The sidecar writes no pod: a trainer that could
   patch engine pods could change what they run.

The spool sits on an emptyDir, which survives a restart of the sidecar container, so
a restarted sidecar can finish a push from it. Talks to engines and the record store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from rollfleet.contract import COLLECTIVE_BACKENDS, STATE_PATH, PauseMode
from rollfleet.engine_client import CONTROL, TRANSFER, CallPolicy, EngineCallError, EngineClient, EngineRef
from rollfleet.sync.engines import Discovery, flights, in_flight, observe
from rollfleet.sync.fleetversion import fleet_weight_version
from rollfleet.sync.metrics import PushMetrics
from rollfleet.sync.protocol import (
    EngineObservation,
    FleetRecord,
    PushRefused,
    RecoveryAction,
    WeightsRef,
    adopt_initial,
    begin_push,
    commit,
    complete,
    layout_change,
    max_staleness,
    needs_catch_up,
    plan_recovery,
    roll_back,
    should_commit,
    stale_requests,
)
from rollfleet.sync.relay import relay_fanout, relay_parents, second_parents
from rollfleet.sync.store import RecordStore, read_record, update
from rollfleet_client.spool import keep_as_spare, open_over_spare
from rollfleet_client.sync_protocol import (
    SPOOL_ENV,
    SPOOL_INCOMING_DIR,
    SPOOL_SPARE_FILE,
    EngineProgress,
    EngineStep,
    FleetVersionView,
    PushState,
    PushStatus,
)
from rollfleet_engine.protocol import STAGE_PATH, STAGE_RELAY_PATH, EngineState, RequestsView, StageState
from rollfleet_engine.safetensors_stream import PIECE_BYTES, read_layout
from rollfleet_engine.weights_server import WeightsServer

log = logging.getLogger(__name__)

_STREAM_FILE = "model.safetensors"
_KEPT_PUSHES = 32
# A write into the spool's incoming/ idle this long was abandoned (its trainer died mid-write).
ABANDONED_WRITE_S = 600.0


@dataclass
class StaleCheck:
    """What a push aborts in each engine once it is paused: the requests past the fleet's bound or their own
    (``stale_requests``); ``aborted`` counts them."""

    record: FleetRecord
    target: WeightsRef
    bound: int | None
    aborted: int = 0


class Publisher:
    """The one weights server engines pull from (fixed address: it is recorded on the fleet)."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._server: WeightsServer | None = None
        self.source: Path | None = None
        self.url: str | None = None
        self.total_bytes = 0

    async def serve(self, source: Path) -> tuple[str, str, int]:
        """Serve ``source`` from now on; returns (url, manifest sha256, bytes). Hashes every tensor, unless it
        serves those files already and none was written since (a trainer may write each checkpoint into
        the same directory)."""

        def load() -> WeightsServer:
            if self._server is None:
                server = WeightsServer(source, self._host, self._port)
                server.start()
                return server
            if not self._server.serves(source):
                self._server.replace(source)
            return self._server

        self._server = await asyncio.to_thread(load)
        self.source = source
        info = self._server.update_info()
        self.url, self.total_bytes = info["url"], self._server.manifest.total_bytes
        return info["url"], info["manifest_sha256"], self.total_bytes

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


STAGE_WAIT_S = 10.0  # one wait for the end of an engine's staging (GET ...?wait=)
STAGE_POLL_S = 0.1  # between asks, for an engine image that does not wait
RELAY_BEGIN_S = 10.0  # an engine that has not begun staging by then is passed over as an upstream
# A chain costs every engine a second copy of the bytes and a hop; it saves the sidecar's uplink a copy per
# engine. With a couple of engines the uplink is seldom the limit (and on one host, never): a star, then.
DEFAULT_RELAY_MIN_ENGINES = 3


async def _gather(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*calls))


class Orchestrator:
    def __init__(
        self,
        store: RecordStore,
        discovery: Discovery,
        api: EngineClient,
        publisher: Publisher,
        spool: Path,
        pause_mode: PauseMode = "keep",
        default_max_staleness: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        transfer: CallPolicy = TRANSFER,
        prefetch: bool = True,
        relay_min_engines: int | None = DEFAULT_RELAY_MIN_ENGINES,
        relay_chain_max: int | None = None,
        metrics: PushMetrics | None = None,
    ) -> None:
        self.store, self.discovery, self.api, self.publisher = store, discovery, api, publisher
        self.metrics = metrics or PushMetrics(CollectorRegistry())  # the server passes the one it serves
        self.transfer = transfer  # update_weights and finish_weight_update: the engine pulls the weights
        self.prefetch = prefetch  # engines stage the weights while serving; the pause covers only the load
        # With prefetch and at least this many engines (None: never), engines stage from each other (`relay`).
        self.relay_min_engines, self.relay_chain_max = relay_min_engines, relay_chain_max
        self.spool = spool
        self._pushes_dir = spool / "pushes"  # streamed weights, one directory per version
        self._incoming_dir = spool / SPOOL_INCOMING_DIR  # the trainer's writes (it mounts the spool too)
        self.pause_mode: PauseMode = pause_mode
        self.default_max_staleness = default_max_staleness
        self.clock = clock
        # One actor on the engines at a time: a push, a recovery or a catch-up.
        self.lock = asyncio.Lock()
        self._push_task: asyncio.Task[None] | None = None
        self._pushes: dict[int, PushStatus] = {}
        self._counted: set[int] = set()  # generations of ended pushes the metrics have counted
        self._changed = asyncio.Condition()

    # --- the trainer's API -------------------------------------------------------------

    async def stage_stream(self, version: str, chunks: AsyncIterator[bytes], expected: int | None = None) -> Path:
        """Write a streamed safetensors shard (`expected` bytes, when the trainer said) into the spool; returns
        its directory. A stream that breaks off or ends short leaves nothing behind and changes nothing."""
        await self._refuse_version(version)
        # A directory of its own: a stream that broke off may not have noticed yet when the trainer sends again.
        partial = self._pushes_dir / f".{version}.{uuid.uuid4().hex[:8]}.partial"
        partial.mkdir(parents=True)
        # No fsync: the spool's job is to survive a restart of this container, and the
        # page cache does; fsyncing a gigabyte would add seconds to every push.
        loop = asyncio.get_running_loop()
        received = 0
        try:
            with open_over_spare(self._incoming_dir, partial / _STREAM_FILE) as f:
                writing: asyncio.Future[int] | None = None
                async for chunk in chunks:
                    if writing is not None:  # double-buffered: a chunk is written while the next one arrives
                        await writing
                    writing = loop.run_in_executor(None, f.write, chunk)
                    received += len(chunk)
                if writing is not None:
                    await writing
                f.truncate()
            if expected is not None and received != expected:
                raise PushRefused(f"the stream ended after {received} of {expected} bytes")
        except Exception as err:
            shutil.rmtree(partial, ignore_errors=True)
            why = err if isinstance(err, PushRefused) else f"the stream broke off after {received} bytes ({err!r})"
            raise PushRefused(f"{why}: the trainer stopped sending; nothing was pushed") from err
        return self._into_pushes(version, partial)

    async def adopt_spooled(self, version: str, name: str) -> Path:
        """Take over the shard the trainer wrote into the spool's ``incoming/<name>``; returns its directory."""
        await self._refuse_version(version)
        written = self._incoming_dir / name
        if not written.is_dir():
            raise PushRefused(
                f"no directory {name!r} in {self._incoming_dir}: the trainer container must mount "
                f"this sidecar's spool volume (${SPOOL_ENV}; see manifests/sync/trainer-job.yaml)"
            )
        return self._into_pushes(version, written)

    async def _refuse_version(self, version: str) -> None:
        self.refuse_if_running()
        record = await read_record(self.store)
        if record.generation_of(version) is not None:
            raise PushRefused(f"version {version!r} was already pushed; every push needs a new version label")

    def _into_pushes(self, version: str, written: Path) -> Path:
        """Move a trainer's shard to ``pushes/<version>``, where the spool's collection finds it."""
        final = self._pushes_dir / version
        shutil.rmtree(final, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        written.rename(final)
        return final

    async def submit(self, version: str, source: Path, receive_s: float | None = None) -> PushStatus:
        """Stage ``source`` and record the push; the fleet is then driven in the background."""
        self.refuse_if_running()
        try:
            has_weights = _has_weights(str(source))
        except OSError as err:
            raise PushRefused(
                f"cannot read {source} ({err.strerror}): the sidecar runs as uid {os.getuid()}; "
                "make the directory readable to it"
            ) from err
        if not has_weights:
            raise PushRefused(f"no .safetensors files in {source}")
        try:
            await self.staleness_bound()  # a bad annotation refuses the push before anything changes
        except ValueError as err:
            raise PushRefused(str(err)) from err
        await self._refuse_collective_engines()
        async with self.lock:
            t0 = self.clock()
            record = await read_record(self.store)
            generation = record.generation + 1
            begin_push(record, WeightsRef(version, generation), time.time())  # refuse early, before hashing
            await asyncio.to_thread(_refuse_another_layout, source, record.committed)
            url, sha, nbytes = await self.publisher.serve(source)
            target = WeightsRef(version, generation, url=url, manifest_sha256=sha, source=str(source))
            try:
                record = await update(self.store, lambda r: begin_push(r, target, time.time()))
            except PushRefused:
                await self._serve_committed(record)
                raise
            status = PushStatus(generation=generation, version=version, bytes=nbytes)
            status.receive_s, status.staging_s = receive_s, self.clock() - t0
            self.remember(status)
        self._push_task = asyncio.create_task(self._run(status, record, t0))
        return status

    async def _refuse_collective_engines(self) -> None:
        """Engines of a collective backend receive from the trainer's broadcast, not from this weights server. A state
        read (STATE_POLL): an engine that does not answer in time is not refused here, and a hung one holds the
        trainer's push back seconds, not the 30 s of a control call (the push itself then leaves it out)."""
        engines = await self.discovery.engines()
        states = await asyncio.gather(*(self.api.state(e) for e in engines), return_exceptions=True)
        collective = [
            f"{e.name} ({s.weight_backend})"
            for e, s in zip(engines, states, strict=True)
            if isinstance(s, EngineState) and s.weight_backend in COLLECTIVE_BACKENDS
        ]
        if collective:
            raise PushRefused(
                f"these engines receive weights with a collective backend: {', '.join(collective)}; push from "
                "the trainer process with rollfleet_client.collective.CollectivePusher"
            )

    async def _bound_now(self) -> int | None:
        """The fleet's staleness bound for a push under way: a bad annotation (changed since the push was
        accepted) does not stop it, the flag's bound holds instead."""
        try:
            return await self.staleness_bound()
        except ValueError as err:
            log.warning("%s; using --max-staleness (%s)", err, self.default_max_staleness)
            return self.default_max_staleness

    async def staleness_bound(self) -> int | None:
        return max_staleness(await self.store.fleet_annotations(), self.default_max_staleness)

    def refuse_if_running(self) -> None:
        if self._push_running():
            raise PushRefused("a push is running; wait for it (GET /v1/pushes/<generation>?wait=...)")

    def status(self, generation: int) -> PushStatus | None:
        return self._pushes.get(generation)

    async def wait(self, generation: int, timeout_s: float) -> PushStatus | None:
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._finished(generation)), timeout=max(timeout_s, 0.0)
                )
        return self._pushes.get(generation)

    async def fleet_version(self) -> FleetVersionView:
        data, _ = await self.store.read()
        engines = await self.discovery.engines()
        observed = await _gather([observe(self.api, e) for e in engines])
        fv = fleet_weight_version(data, {e.name: o for e, o in zip(engines, observed, strict=True)})
        last = self._pushes[max(self._pushes)] if self._pushes else None
        return FleetVersionView(
            version=fv.version,
            generation=fv.generation,
            routable=list(fv.routable),
            pending_sync=list(fv.pending_sync),
            syncing_to=fv.syncing_to,
            last_push=last,
        )

    # --- the push ------------------------------------------------------------------------

    async def _run(self, status: PushStatus, record: FleetRecord, t0: float) -> None:
        try:
            async with self.lock:
                await self._drive(record, status)
        except Exception as err:
            log.exception("push %s failed", status.version)
            status.state = PushState.FAILED
            status.message = f"{type(err).__name__}: {err}; engines stay paused until the next reconcile recovers"
        finally:
            status.total_s = self.clock() - t0
            await self.notify()

    async def _drive(self, record: FleetRecord, status: PushStatus) -> None:
        """Pause, transfer, commit or roll back, resume: the body of a push and of a roll-forward."""
        assert record.push is not None
        target = replace(record.push.target, url=await self._serve_ref(record.push.target))
        status.bytes = self.publisher.total_bytes
        engines = await self.discovery.engines()
        status.engines = [EngineProgress(name=e.name) for e in engines]
        progress = {p.name: p for p in status.engines}
        await self.notify()

        # Staging first: the engines serve meanwhile, so requests too stale are looked for after it, and again
        # in each engine's pause (tokens made in between; before it, for pause=wait, which lets them run out).
        refs = await self._stage_all(engines, target, progress, status)
        bound = await self._bound_now()
        stale = StaleCheck(record, target, bound)
        stale.aborted = sum(await _gather([self.abort_stale(e, record, target, bound) for e in engines]))

        t_pause = self.clock()
        ok = await self._load_all(engines, refs, progress, stale)
        status.transfer_s = self.clock() - t_pause
        status.aborted_stale = stale.aborted
        succeeded = [e.name for e, good in zip(engines, ok, strict=True) if good]
        transferred = sum(1 for p in progress.values() if p.transfer_s is not None)
        if status.transfer_s > 0 and transferred:
            status.throughput_bytes_per_s = status.bytes * transferred / status.transfer_s

        record = await self.conclude(target, engines, progress, succeeded, status, t_pause)
        if status.state is PushState.ROLLED_BACK:
            await self._serve_committed(record)
        self._collect_spool(record)

    async def conclude(
        self,
        target: WeightsRef,
        engines: Sequence[EngineRef],
        progress: dict[str, EngineProgress],
        succeeded: Sequence[str],
        status: PushStatus,
        t_pause: float,
        reason: str = "",
    ) -> FleetRecord:
        """The end of a push, HTTP or collective: commit if an engine verified the target (the others are
        left out) or roll back, resume exactly the engines on the fleet's version, complete. `reason` is
        the status message when nothing is left out (on a roll back: when there is no better one)."""
        failed = sorted({e.name for e in engines} - set(succeeded))
        committing = should_commit(succeeded)
        if committing:
            status.message = f"left out of routing: {', '.join(failed)}" if failed else reason
            record = await update(self.store, lambda r: commit(_ours(r, target), failed, status.message))
        else:
            status.message = reason or "no engine verified the new weights"
            record = await update(self.store, lambda r: roll_back(_ours(r, target), status.message))
        await self.settle(record, engines, progress, verified=succeeded if committing else ())
        status.pause_window_s = self.clock() - t_pause
        if committing:
            record = await update(self.store, lambda r: complete(_ours(r, target)))
        status.state = PushState.DONE if committing else PushState.ROLLED_BACK
        return record

    async def abort_stale(
        self,
        engine: EngineRef,
        record: FleetRecord,
        target: WeightsRef,
        bound: int | None,
        view: RequestsView | None = None,
    ) -> int:
        """Abort the engine's requests past the bound; how many. From `view`, its requests as the pause answered
        them, else as it answers now."""
        try:
            held = flights(view) if view is not None else await in_flight(self.api, engine)
            ids = stale_requests(held, record, target.generation, bound)
            if ids:
                await self.api.abort(engine, ids)
        except EngineCallError as err:  # an unreachable engine fails in the transfer, with its reason
            log.warning("staleness check on %s: %s", engine.name, err)
            return 0
        return len(ids)

    async def _stage_all(
        self, engines: Sequence[EngineRef], target: WeightsRef, progress: dict[str, EngineProgress], status: PushStatus
    ) -> list[WeightsRef | None]:
        """What each engine loads in the pause: with prefetch, its staged copy of `target` (None: it could not
        stage, and is left out); without, `target` itself, pulled in the pause.

        With relay (`relay_min_engines` or more engines), each engine stages from its upstream in the relay plan
        (`relay.relay_parents`: a chain, or a binary tree for more engines than the weights have receive pieces,
        `relay.relay_fanout`), from what that one has received so far; the sidecar serves the first, so it sends
        each byte about once. An engine is asked once its upstream has begun (it can relay from then on), so the
        stagings begin a level of the tree at a time, then run together. An upstream that does not begin within
        RELAY_BEGIN_S, or fails to, is passed over for its own upstream (the sidecar at the top). Down a tree, the
        second half of every shard comes down a second tree (`relay.second_parents`), whose upstream the engine
        asks itself: a relay asked before its engine begins waits for it (the two trees' orders differ)."""
        if not self.prefetch:
            return [target] * len(engines)
        t0 = self.clock()
        relay = self.relay_min_engines is not None and len(engines) >= self.relay_min_engines
        fanout = relay_fanout(len(engines), status.bytes, self.relay_chain_max)
        parents = relay_parents(len(engines), fanout) if relay else [None] * len(engines)
        # Weights of under two pieces have no second half to send.
        halves = relay and fanout > 1 and status.bytes >= 2 * PIECE_BYTES
        seconds = second_parents(len(engines), fanout) if halves else None
        loop = asyncio.get_running_loop()
        begun: list[asyncio.Future[bool]] = [loop.create_future() for _ in engines]

        async def upstream_of(i: int) -> EngineRef | None:
            parent = parents[i]
            while parent is not None:
                with contextlib.suppress(TimeoutError):  # slow to answer: passed over, as one that failed
                    if await asyncio.wait_for(asyncio.shield(begun[parent]), RELAY_BEGIN_S):
                        return engines[parent]
                parent = parents[parent]
            return None

        async def one(i: int) -> WeightsRef | None:
            engine = engines[i]
            above = None if seconds is None else seconds[i]
            second = None if above is None else engines[above]
            return await self._stage(
                engine, target, progress[engine.name], await upstream_of(i), begun[i], halves, second
            )

        refs = list(await asyncio.gather(*(one(i) for i in range(len(engines)))))
        status.prefetch_s = self.clock() - t0
        return refs

    async def _load_all(
        self,
        engines: Sequence[EngineRef],
        refs: Sequence[WeightsRef | None],
        progress: dict[str, EngineProgress],
        stale: StaleCheck,
    ) -> list[bool]:
        """Pause and load every engine that has weights to load; each as soon as it is paused, so that a slow or
        hung engine delays only the commit. One that could not stage is not paused at all (PendingSync)."""

        async def one(engine: EngineRef, ref: WeightsRef | None) -> bool:
            return ref is not None and await self._pause_and_sync(engine, ref, progress[engine.name], stale)

        return await _gather([one(e, ref) for e, ref in zip(engines, refs, strict=True)])

    async def _stage(
        self,
        engine: EngineRef,
        ref: WeightsRef,
        progress: EngineProgress,
        upstream: EngineRef | None = None,
        begun: asyncio.Future[bool] | None = None,
        halves: bool = False,
        second: EngineRef | None = None,
    ) -> WeightsRef | None:
        """Have the engine stage `ref` while it serves, relayed by `upstream` if given, else (or if that
        relay fails) from the sidecar; with `halves`, the second half of every shard relayed by `second` (None:
        the sidecar). The ref to load from (its staging area), or None."""
        progress.step = EngineStep.STAGING
        await self.notify()
        t0 = self.clock()
        relayed = upstream is not None or second is not None
        try:
            try:
                progress.source = upstream.name if upstream is not None else None
                progress.second_source = second.name if second is not None else None
                url = relay_url(upstream) if upstream else ref.url
                second_url = (relay_url(second) if second else ref.url) if halves else None
                staged = await self._staged(engine, ref, url, begun, second_url)
            except EngineCallError as err:
                if not relayed or err.status == 404:
                    raise
                relays = " and ".join(e.name for e in (upstream, second) if e is not None)
                log.warning("relay from %s to %s failed, staging from the sidecar: %s", relays, engine.name, err)
                progress.source, progress.second_source, progress.relay_error = None, None, str(err)
                staged = await self._staged(engine, ref, ref.url)
        except EngineCallError as err:
            if err.status == 404:  # an engine image without prefetch: it pulls in the pause, as before
                progress.step = EngineStep.WAITING
                return ref
            progress.step, progress.error = EngineStep.FAILED, f"staging failed, not paused: {err}"
            return None
        finally:
            if begun is not None and not begun.done():
                begun.set_result(False)
        progress.step, progress.stage_s = EngineStep.STAGED, self.clock() - t0
        return replace(ref, url=staged)

    async def _staged(
        self,
        engine: EngineRef,
        ref: WeightsRef,
        url: str | None,
        begun: asyncio.Future[bool] | None = None,
        second_url: str | None = None,
    ) -> str:
        """Stage `ref` from `url` (and the second half of every shard from `second_url`, if given) on the engine;
        the staged URL it loads from. Raises EngineCallError. `begun` is resolved once the engine has begun (it can
        relay from then on)."""
        t0 = self.clock()
        info = {"url": url, "manifest_sha256": ref.manifest_sha256}
        staged = await self.api.stage(engine, info | ({"second_url": second_url} if second_url else {}))
        if begun is not None and not begun.done():
            begun.set_result(staged.state in (StageState.STAGING, StageState.STAGED))
        while staged.state is StageState.STAGING:
            if self.clock() - t0 > self.transfer.timeout_s:
                raise EngineCallError(engine, "GET", STAGE_PATH, f"still staging after {self.transfer.timeout_s} s")
            asked = self.clock()
            staged = await self.api.stage_status(engine, STAGE_WAIT_S)  # answers once staging has ended
            if staged.state is StageState.STAGING and self.clock() - asked < STAGE_WAIT_S / 2:
                await asyncio.sleep(STAGE_POLL_S)  # an engine image that answers at once: polling a condition
        if staged.manifest_sha256 != ref.manifest_sha256 or staged.staged_url is None:
            raise EngineCallError(engine, "GET", STAGE_PATH, f"staging {staged.state}: {staged.error}")
        return staged.staged_url

    async def pause_engine(self, engine: EngineRef, progress: EngineProgress, stale: StaleCheck) -> bool:
        """Pause the engine, then abort what it holds past a staleness bound: paused, it produces no token, so
        the versions it reports for each request are final for the old weights."""
        try:
            view = await self._pause(engine)
        except EngineCallError as err:
            progress.step, progress.error = EngineStep.FAILED, str(err)
            return False
        progress.step = EngineStep.PAUSED
        stale.aborted += await self.abort_stale(engine, stale.record, stale.target, stale.bound, view)
        return True

    async def _pause(self, engine: EngineRef) -> RequestsView | None:
        """Pause the engine (PAUSE[mode]: wait may take minutes); its requests as it stands paused, in the same call
        (`EngineClient.pause_and_look`), or None from an engine image older than that route."""
        try:
            return await self.api.pause_and_look(engine, self.pause_mode)
        except EngineCallError as err:
            if err.status != 404:
                raise
        await self.api.pause(engine, self.pause_mode)
        return None

    async def _pause_and_sync(
        self, engine: EngineRef, ref: WeightsRef, progress: EngineProgress, stale: StaleCheck
    ) -> bool:
        # A set this engine staged in this push is loaded without a look first: it cannot serve it yet, or (a
        # roll-forward of a push it had loaded) serves these very bytes, and loading them again changes nothing.
        staged = ref.url != stale.target.url
        return await self.pause_engine(engine, progress, stale) and await self._sync_engine(
            engine, ref, progress, look_first=not staged
        )

    async def _sync_engine(
        self, engine: EngineRef, ref: WeightsRef, progress: EngineProgress, look_first: bool = True
    ) -> bool:
        """Bring one paused engine to ``ref``; True once it reports that version. `look_first`: one that
        serves it already is not loaded again."""
        if look_first and (await observe(self.api, engine)).serves(ref):
            progress.step = EngineStep.VERIFIED
            return True
        progress.step = EngineStep.TRANSFERRING
        await self.notify()
        t0 = self.clock()
        try:
            await self._load(engine, ref)
        except EngineCallError as err:
            progress.step, progress.error = EngineStep.FAILED, str(err)
            return False
        progress.step, progress.transfer_s = EngineStep.VERIFIED, self.clock() - t0
        await self.notify()
        return True

    async def _load(self, engine: EngineRef, ref: WeightsRef) -> None:
        """Load `ref` on the paused engine and verify it: in one call (`EngineClient.load`), or, on an engine image
        older than that route, in vLLM's three and a state read. EngineCallError if it does not serve `ref` then."""
        info = {"url": ref.url, "manifest_sha256": ref.manifest_sha256}
        try:
            state = await self.api.load(engine, info, ref.version, self.transfer)
        except EngineCallError as err:
            if err.status != 404:
                raise
        else:
            _verify(engine, state, ref.version, ref.manifest_sha256)
            return
        # A sidecar that died mid-push may have left an update session open; then start
        # is refused and update/finish continue that session with verified weights.
        with contextlib.suppress(EngineCallError):
            await self.api.start_weight_update(engine)
        await self.api.update_weights(engine, info, self.transfer)
        await self.finish_and_verify(engine, ref.version, ref.manifest_sha256)

    async def finish_and_verify(self, engine: EngineRef, version: str, manifest_sha256: str | None = None) -> None:
        """Finish the engine's update as `version`, then check it serves that version, and the bytes of
        `manifest_sha256` where the push pinned them (the proof of the bytes); EngineCallError if not."""
        await self.api.finish_weight_update(engine, version, self.transfer)
        _verify(engine, await self.api.state(engine, CONTROL), version, manifest_sha256)

    async def settle(
        self,
        record: FleetRecord,
        engines: Sequence[EngineRef],
        progress: dict[str, EngineProgress],
        verified: Collection[str] = (),
    ) -> None:
        """Resume exactly the engines on the fleet's version; take the others out of routing. The engines named
        in `verified` were just seen serving the committed version (the state read that verified their load):
        they are resumed without another look, one call fewer each in the pause window."""
        committed = record.committed.version if record.committed else None
        verified = frozenset(verified)

        async def one(engine: EngineRef) -> None:
            p = progress.setdefault(engine.name, EngineProgress(name=engine.name))
            if engine.name in verified:
                on_committed = True
            else:
                obs = await observe(self.api, engine)
                on_committed = obs.reachable and obs.intact and (committed is None or obs.version == committed)
            if on_committed:
                try:
                    await self.api.resume(engine)
                    p.step = EngineStep.RESUMED
                    return
                except EngineCallError as err:
                    p.error = str(err)
            p.step = EngineStep.PENDING_SYNC

        await _gather([one(e) for e in engines])

    # --- restart recovery and late engines -----------------------------------------------

    async def reconcile_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.reconcile_once()
            except Exception:
                log.exception("reconcile failed; retrying in %.1fs", interval_s)
            await asyncio.sleep(interval_s)

    async def reconcile_once(self) -> None:
        """Finish or undo an interrupted push; adopt a new fleet's version; catch late engines up."""
        if self._push_running() or self.lock.locked():
            return
        # Observe without the lock (busy engines answer slowly): a push must not wait on it.
        record = await read_record(self.store)
        engines = await self.discovery.engines()
        observed = dict(zip(engines, await _gather([observe(self.api, e) for e in engines]), strict=True))
        active = record.push is not None and record.push.phase.active
        behind = [e for e, o in observed.items() if needs_catch_up(o, record)]
        if not (active or behind or record.committed is None):
            return
        async with self.lock:
            if self._push_running() or await read_record(self.store) != record:
                return  # a push started meanwhile: look again next round
            if active:
                await self._recover(record, engines, observed)
            elif record.committed is None:
                versions, templates = [o.served for o in observed.values()], await self.discovery.templates()
                await update(self.store, lambda r: adopt_initial(r, versions, templates))
            else:
                for engine in behind:
                    await self._catch_up(engine, record)

    def hold(self, push: asyncio.Task[None]) -> None:
        """Count `push` as the push in progress: a collective push, which the trainer's calls drive."""
        self._push_task = push

    def _push_running(self) -> bool:
        return self._push_task is not None and not self._push_task.done()

    async def _recover(
        self, record: FleetRecord, engines: list[EngineRef], observed: dict[EngineRef, EngineObservation]
    ) -> None:
        push = record.push
        assert push is not None
        target_ok = await self._servable(push.target)
        previous_ok = push.previous is not None and _has_weights(push.previous.source)
        by_name = {e.name: o for e, o in observed.items()}
        action = plan_recovery(record, by_name, target_ok, previous_ok)
        log.warning("recovering push %s (generation %d): %s", push.target.version, push.target.generation, action)
        status = self._pushes.get(push.target.generation) or PushStatus(
            generation=push.target.generation, version=push.target.version
        )
        status.state, status.message = PushState.RUNNING, f"recovering after an interrupted push: {action.value}"
        self.remember(status)
        t0 = self.clock()
        progress = {e.name: EngineProgress(name=e.name) for e in engines}
        status.engines = list(progress.values())
        try:
            if action is RecoveryAction.ROLL_FORWARD:
                await self._drive(record, status)
                return
            if action is RecoveryAction.REPUSH_PREVIOUS:
                assert push.previous is not None
                previous = replace(push.previous, url=await self._serve_ref(push.previous))
                behind = [e for e, o in observed.items() if o.served == push.target.version]
                await _gather([self._sync_engine(e, previous, progress[e.name]) for e in behind])
            if action in (RecoveryAction.ROLL_BACK, RecoveryAction.REPUSH_PREVIOUS):
                record = await update(self.store, lambda r: roll_back(_ours(r, push.target), status.message))
                await self._serve_committed(record)
                status.state = PushState.ROLLED_BACK
            elif action is RecoveryAction.COMMIT_PARTIAL:
                failed = [e.name for e, o in observed.items() if not o.serves(push.target)]
                record = await update(self.store, lambda r: commit(_ours(r, push.target), failed, status.message))
            await self.settle(record, engines, progress)
            if record.push is not None and record.push.phase.active:  # RESUME or COMMIT_PARTIAL
                await update(self.store, lambda r: complete(_ours(r, push.target)))
                status.state = PushState.DONE
            self._collect_spool(record)
        finally:
            status.total_s = self.clock() - t0
            await self.notify()

    async def _catch_up(self, engine: EngineRef, record: FleetRecord) -> None:
        """PendingSync -> pull the fleet's version -> Ready, for an engine that started late or failed a push."""
        assert record.committed is not None
        if not await self._servable(record.committed):
            log.warning("%s is behind, but the source of %s is gone", engine.name, record.committed.version)
            return
        ref = replace(record.committed, url=self.publisher.url)
        progress = EngineProgress(name=engine.name)
        # What it still holds (from before it fell behind) runs on the fleet's weights next: bounds apply.
        stale = StaleCheck(record, ref, await self._bound_now())
        if await self._pause_and_sync(engine, ref, progress, stale):
            await self.settle(record, [engine], {engine.name: progress}, verified=[engine.name])
            log.info("caught %s up to %s in %.2fs", engine.name, ref.version, progress.transfer_s or 0.0)
        else:
            log.warning("catching %s up failed: %s", engine.name, progress.error)

    # --- helpers ---------------------------------------------------------------------------

    async def _serve_ref(self, ref: WeightsRef) -> str:
        """Serve ``ref`` and return the URL engines pull it from."""
        if not await self._servable(ref) or self.publisher.url is None:
            raise RuntimeError(f"weights of {ref.version} are no longer at {ref.source}")
        return self.publisher.url

    async def _servable(self, ref: WeightsRef) -> bool:
        """Serve ``ref``'s directory if it still holds exactly those weights."""
        if not _has_weights(ref.source):
            return False
        assert ref.source is not None
        _, sha, _ = await self.publisher.serve(Path(ref.source))
        return ref.manifest_sha256 is None or sha == ref.manifest_sha256

    async def _serve_committed(self, record: FleetRecord) -> None:
        """Serve the fleet's version again (for late engines), after a refused or undone push."""
        if record.committed is not None:
            await self._servable(record.committed)

    def open_incoming(self) -> None:
        """Let the trainer container write into the spool's ``incoming/``: it runs as a user of its own."""
        self._incoming_dir.mkdir(parents=True, exist_ok=True)
        # The volume is the pod's own (an emptyDir): only its containers see it.
        with contextlib.suppress(PermissionError):  # created by the trainer first: it chose the mode
            self._incoming_dir.chmod(0o777)

    def _collect_spool(self, record: FleetRecord) -> None:
        """Delete spooled weights other than the fleet's version (kept for late engines), and writes into
        ``incoming/`` that a trainer gave up long ago (it died mid-write: the spool is in memory)."""
        sources = [record.committed.source if record.committed else None, self.publisher.source]
        keep = {Path(s).resolve() for s in sources if s is not None}
        if self._pushes_dir.is_dir():
            for entry in self._pushes_dir.iterdir():
                if entry.is_dir() and entry.resolve() not in keep:
                    for file in entry.glob("*.safetensors"):
                        keep_as_spare(self._incoming_dir, file)
                    shutil.rmtree(entry, ignore_errors=True)
        if self._incoming_dir.is_dir():
            for entry in abandoned_writes(self._incoming_dir, time.time()):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _finished(self, generation: int) -> bool:
        s = self._pushes.get(generation)
        return s is None or s.state.terminal

    def remember(self, status: PushStatus) -> None:
        self._pushes[status.generation] = status
        for old in sorted(self._pushes)[:-_KEPT_PUSHES]:
            del self._pushes[old]
            self._counted.discard(old)

    async def notify(self) -> None:
        """Wake whoever waits on a push; count each push that ended, once (every end notifies)."""
        for generation, status in self._pushes.items():
            if status.state.terminal and generation not in self._counted:
                self._counted.add(generation)
                self.metrics.ended(status)
        async with self._changed:
            self._changed.notify_all()


def abandoned_writes(incoming: Path, now: float, idle_s: float = ABANDONED_WRITE_S) -> list[Path]:
    """Entries of ``incoming`` (a trainer's directory, or anything else put there) where nothing was written
    for ``idle_s``."""
    out = []
    for entry in incoming.iterdir():
        if entry.name == SPOOL_SPARE_FILE:  # kept on purpose, for the next push
            continue
        with contextlib.suppress(FileNotFoundError):  # taken over or deleted by its trainer meanwhile
            inside = list(entry.iterdir()) if entry.is_dir() else []
            last = max([entry.stat().st_mtime, *(f.stat().st_mtime for f in inside)])
            if now - last > idle_s:
                out.append(entry)
    return out


def _ours(record: FleetRecord, target: WeightsRef) -> FleetRecord:
    """The record, if its active push is still the one this sidecar drives."""
    push = record.push
    if push is None or not push.phase.active or push.target.generation != target.generation:
        raise PushRefused(f"the fleet's record no longer shows push {target.version} as active")
    return record


def _refuse_another_layout(source: Path, committed: WeightsRef | None) -> None:
    """Weights whose tensors differ (names, dtypes, shapes) from the fleet's current ones would fail in the
    engines' load, midway: refused before anything changes. Only known when the current version was pushed
    (its files are kept); the engines' initial weights are checked by the engines' load alone."""
    if committed is None or not _has_weights(committed.source):
        return
    assert committed.source is not None
    change = layout_change(read_layout(Path(committed.source)), read_layout(source))
    if change is not None:
        raise PushRefused(
            f"these weights do not match the fleet's current ones ({committed.version}): {change}; "
            "push weights of the model the engines serve"
        )


def relay_url(engine: EngineRef) -> str:
    """Where the next engine of a relay chain stages from: what `engine` is staging, as it arrives."""
    return engine.url.rstrip("/") + STAGE_RELAY_PATH


def _has_weights(source: str | None) -> bool:
    return source is not None and any(Path(source).glob("*.safetensors"))


def _verify(engine: EngineRef, state: EngineState, version: str, manifest_sha256: str | None) -> None:
    """EngineCallError unless the engine's state after a load says it serves `version`, and the bytes of
    `manifest_sha256` where the push pinned them (the proof of the bytes)."""
    if state.served_version != version:
        raise EngineCallError(
            engine, "GET", STATE_PATH, f"reports version {state.served_version!r} after finishing {version!r}"
        )
    if manifest_sha256 is not None and state.weights_manifest_sha256 != manifest_sha256:
        raise EngineCallError(
            engine,
            "GET",
            STATE_PATH,
            f"loaded {version!r} verified against manifest {state.weights_manifest_sha256!r}, not the pushed "
            f"{manifest_sha256!r}",
        )
