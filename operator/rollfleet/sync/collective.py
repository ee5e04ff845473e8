"""Collective pushes: the trainer broadcasts the tensors itself, and the sidecar drives the engines' side.

With a collective backend (vLLM's ``nccl``, or its CPU twin ``gloo`` from the engine package)
the trainer process holds vLLM's trainer engine, whose ``VLLMWeightSyncClient`` is
``rollfleet_client.collective.FleetWeightSync``. Each of that client's four calls arrives
here and is fanned out to the fleet's engines, inside the same record, pause and commit as
an HTTP push (``orchestrator``):

- ``init``: every engine leaves its previous group and joins the new one, engine i at its
  own rank offset after the trainer's rank 0.
- ``start(version)``: record InProgress, abort requests too stale, pause every member
  (keep), open every member's update. From here a member loads tensors as they arrive: its
  weights are no one version until it finishes (``EngineState.weights_intact``).
- ``update(update_info)``: every member receives the broadcast. A member that fails breaks
  the group; the push is then ended here: the members that received everything are
  finished and committed, the others stay PendingSync.
- ``finish(version)``: label, verify, commit (failed members PendingSync) or roll back,
  resume the members on the fleet's version.

Catching up is by re-forming the group: ``start`` refuses with GROUP_STALE when the
engines are not the group last formed (one restarted, was added, or failed a transfer),
and the client forms it again; the engine that was behind then receives that push in full.
Between pushes no one holds the weights to send it, so it stays out of routing until then.
A trainer that never calls ``finish`` is given up on after the transfer timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollfleet.engine_client import CONTROL, EngineCallError, EngineRef
from rollfleet.sync.orchestrator import Orchestrator, StaleCheck, _gather
from rollfleet.sync.protocol import (
    PushRefused,
    WeightsRef,
    begin_push,
)
from rollfleet.sync.store import read_record, update
from rollfleet_client.sync_protocol import (
    CollectiveGroup,
    CollectiveMember,
    EngineProgress,
    EngineStep,
    PushState,
    PushStatus,
)

log = logging.getLogger(__name__)


class GroupStale(PushRefused):
    """The engines are not the group last formed: the trainer must form it again (init)."""


def layout(engines: Sequence[EngineRef], instances: Sequence[str], ranks: Sequence[int]) -> list[CollectiveMember]:
    """Rank offsets: the trainer is rank 0, then each engine's workers in order. Pure."""
    members, offset = [], 1
    for engine, instance, n in zip(engines, instances, ranks, strict=True):
        members.append(CollectiveMember(name=engine.name, instance=instance, rank_offset=offset, ranks=n))
        offset += n
    return members


def world_size(members: Sequence[CollectiveMember]) -> int:
    return 1 + sum(m.ranks for m in members)


@dataclass
class _Push:
    status: PushStatus
    target: WeightsRef
    engines: list[EngineRef]
    progress: dict[str, EngineProgress]
    t_pause: float
    updated: list[EngineRef] | None = None  # the members that received every tensor (after update)
    expiry: asyncio.Task[None] | None = None


class CollectiveDriver:
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self._formed: list[CollectiveMember] | None = None
        self._push: _Push | None = None

    async def group(self) -> CollectiveGroup:
        members = (await self._members())[1]
        return CollectiveGroup(members=members, world_size=world_size(members), formed=members == self._formed)

    async def init(self, init_info: Mapping[str, Any], backend: str) -> CollectiveGroup:
        """Form the group: every engine joins the trainer's rendezvous (answers once all ranks joined)."""
        self.orch.refuse_if_running()
        engines, members, backends = await self._members()
        others = [f"{e.name} ({b})" for e, b in zip(engines, backends, strict=True) if b != backend]
        if others:
            raise PushRefused(
                f"the trainer sends with {backend!r}, but these engines receive with another weight backend: "
                f"{', '.join(others)}; use the fleet's spec.weightSync.backend"
            )
        expected = world_size(members)
        if init_info.get("world_size") != expected:
            raise PushRefused(
                f"init_info.world_size is {init_info.get('world_size')!r}; this fleet's group has {expected} ranks "
                f"(the trainer and {expected - 1} engine ranks): GET /v1/collective says so"
            )
        self._formed = None
        api, policy = self.orch.api, self.orch.transfer
        for engine in engines:  # best effort: an engine that was never in a group has nothing to leave
            with contextlib.suppress(EngineCallError):
                await api.shutdown_weight_transfer(engine)
        joined = await asyncio.gather(
            *(
                api.init_weight_transfer(e, {**init_info, "rank_offset": m.rank_offset}, policy)
                for e, m in zip(engines, members, strict=True)
            ),
            return_exceptions=True,
        )
        failed = [f"{e.name}: {r}" for e, r in zip(engines, joined, strict=True) if isinstance(r, BaseException)]
        if failed:
            raise PushRefused("engines did not join the group: " + "; ".join(failed))
        self._formed = members
        return CollectiveGroup(members=members, world_size=expected, formed=True)

    async def start(self, version: str) -> PushStatus:
        """Record the push, pause every member and open its update."""
        orch = self.orch
        orch.refuse_if_running()
        engines, members, _ = await self._members()
        if members != self._formed:
            raise GroupStale("the fleet's engines changed since the group was formed; form it again (init)")
        try:
            bound = await orch.staleness_bound()
        except ValueError as err:
            raise PushRefused(str(err)) from err
        await orch.lock.acquire()
        try:
            record = await read_record(orch.store)
            target = WeightsRef(version, record.generation + 1)
            record = await update(orch.store, lambda r: begin_push(r, target, time.time()))
        except BaseException:
            orch.lock.release()
            raise
        status = PushStatus(generation=target.generation, version=version)
        status.engines = [EngineProgress(name=e.name) for e in engines]
        push = _Push(status, target, engines, {p.name: p for p in status.engines}, orch.clock())
        self._push = push
        orch.remember(status)
        push.expiry = asyncio.create_task(self._expire(push))
        orch.hold(push.expiry)
        stale = StaleCheck(record, target, bound)
        stale.aborted = sum(await _gather([orch.abort_stale(e, record, target, bound) for e in engines]))
        opened = await _gather([self._open(e, push.progress[e.name], stale) for e in engines])
        status.aborted_stale = stale.aborted
        if not all(opened):
            self._formed = None  # a member that cannot take part breaks the collective
            status.message = "not every engine could be paused and opened for the update; form the group again"
            await self._end(push, [])
            raise PushRefused(status.message)
        await orch.notify()
        return status

    async def update(self, update_info: Mapping[str, Any]) -> PushStatus:
        """Every member receives the trainer's broadcast (which runs meanwhile) and loads it."""
        push = self._active()
        for p in push.progress.values():
            p.step = EngineStep.TRANSFERRING
        await self.orch.notify()
        t0 = self.orch.clock()
        received = await _gather([self._receive(e, update_info, push.progress[e.name], t0) for e in push.engines])
        push.updated = [e for e, ok in zip(push.engines, received, strict=True) if ok]
        if len(push.updated) < len(push.engines):
            self._formed = None  # the group is broken: the next push forms it again
            await self._end(push, push.updated)
            raise PushRefused(f"the transfer failed on some engines; {push.status.message or 'rolled back'}")
        return push.status

    async def finish(self, version: str) -> PushStatus:
        push = self._active()
        if version != push.target.version:
            raise PushRefused(f"finish names {version!r}, but the push under way is {push.target.version!r}")
        if push.updated is None:
            raise PushRefused("no update was received in this push; call update_weights before finishing")
        return await self._end(push, push.updated)

    # --- helpers ---------------------------------------------------------------------------

    async def _members(self) -> tuple[list[EngineRef], list[CollectiveMember], list[str | None]]:
        """The fleet's engines, the group they form, and the weight backend each receives with."""
        api = self.orch.api
        engines = await self.orch.discovery.engines()
        states = await _gather([api.state(e, CONTROL) for e in engines])
        ranks = await _gather([api.world_size(e) for e in engines])
        return engines, layout(engines, [s.instance for s in states], ranks), [s.weight_backend for s in states]

    def _active(self) -> _Push:
        if self._push is None:
            raise PushRefused("no collective push is under way; start one first")
        return self._push

    async def _open(self, engine: EngineRef, progress: EngineProgress, stale: StaleCheck) -> bool:
        if not await self.orch.pause_engine(engine, progress, stale):
            return False
        try:
            await self.orch.api.start_weight_update(engine)
        except EngineCallError as err:
            progress.step, progress.error = EngineStep.FAILED, str(err)
            return False
        return True

    async def _receive(
        self, engine: EngineRef, update_info: Mapping[str, Any], progress: EngineProgress, t0: float
    ) -> bool:
        try:
            await self.orch.api.update_weights(engine, update_info, self.orch.transfer)
        except EngineCallError as err:
            progress.step, progress.error = EngineStep.FAILED, str(err)
            return False
        progress.transfer_s = self.orch.clock() - t0
        return True

    async def _finish_one(self, engine: EngineRef, version: str, progress: EngineProgress) -> bool:
        try:
            await self.orch.finish_and_verify(engine, version)
        except EngineCallError as err:
            progress.step, progress.error = EngineStep.FAILED, str(err)
            return False
        progress.step = EngineStep.VERIFIED
        return True

    async def _end(self, push: _Push, updated: Sequence[EngineRef]) -> PushStatus:
        """Finish the members that received everything; commit or roll back; resume; release the fleet."""
        if self._push is not push:
            return push.status
        self._push = None
        orch, status, target = self.orch, push.status, push.target
        try:
            verified = await _gather([self._finish_one(e, target.version, push.progress[e.name]) for e in updated])
            succeeded = [e.name for e, ok in zip(updated, verified, strict=True) if ok]
            status.transfer_s = orch.clock() - push.t_pause
            await orch.conclude(target, push.engines, push.progress, succeeded, status, push.t_pause, status.message)
        except Exception as err:
            log.exception("collective push %s failed", target.version)
            status.state = PushState.FAILED
            status.message = f"{type(err).__name__}: {err}; engines stay paused until the next reconcile recovers"
        finally:
            status.total_s = orch.clock() - push.t_pause
            orch.lock.release()
            if push.expiry is not None and push.expiry is not asyncio.current_task():
                push.expiry.cancel()
            await orch.notify()
        return status

    async def _expire(self, push: _Push) -> None:
        """Give the push up when the trainer does not finish it in time (it died, or lost its group)."""
        await asyncio.sleep(self.orch.transfer.timeout_s)
        if self._push is push:
            self._formed = None
            push.status.message = f"the trainer did not finish the push within {self.orch.transfer.timeout_s:g} s"
            log.warning("collective push %s: %s", push.target.version, push.status.message)
            await self._end(push, push.updated or [])
