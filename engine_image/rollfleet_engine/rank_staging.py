"""Prefetch for an engine whose ranks span pods: every rank stages its own cut of the weights in its own pod.

A single-pod engine stages the next weights in its pod's memory while it serves (``staging``), and loads
them in a short pause. A group's ranks live in several pods, so the leader's staging area would serve
only its own pod. Here instead the leader's staging route (``GroupStager``, in the API server) asks every
worker of every rank, through vLLM's ``collective_rpc``, to pull its part into its own memory while it
serves (``RankStage``, in each worker: the cuts of ``tp_slices`` for a tensor-parallel rank, the whole set
for a data-parallel one, each tensor verified), and reports them as one staging: staged once every rank
is. The load in the pause (``/update_weights`` with the ``rank-staged://<manifest sha256>`` URL it
answers) then reads each rank's own staged tensors. ``RankStaging`` is the worker extension the launcher
gives a group's pods (``--worker-extension-cls``), through which the leader reaches the workers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from rollfleet_engine.protocol import STAGE_RELAY_PATH, StageState, StageStatus, WeightUpdateInfo
from rollfleet_engine.safetensors_stream import TransferError
from rollfleet_engine.staging import RelayUnavailable, stages_already

RANK_STAGED_SCHEME = "rank-staged"  # rank-staged://<manifest sha256>: each rank's own staged part
WORKER_EXTENSION = "rollfleet_engine.rank_staging.RankStaging"
# Between asking the ranks (a utility call each, run by the workers between steps) while a caller waits for
# the end: what a staging that is done waits for its report, on average half of it.
STATUS_POLL_S = 0.02


def rank_staged_url(manifest_sha256: str | None) -> str:
    """What the load is given for the parts the ranks staged of these weights."""
    return f"{RANK_STAGED_SCHEME}://{manifest_sha256}"


Pull = Callable[[WeightUpdateInfo], list[tuple[str, Any]]]


class RankStage:
    """One worker's staged part: pulled on a thread of its own while the engine serves, taken by the load."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status = StageStatus()
        self._weights: list[tuple[str, Any]] | None = None

    def start(self, info: WeightUpdateInfo, pull: Pull) -> StageStatus:
        if info.manifest_sha256 is None:
            raise ValueError("staging needs manifest_sha256: it names the staged set")
        with self._lock:
            if stages_already(self._status, info.manifest_sha256):
                return self._status.model_copy()
            self._status = StageStatus(state=StageState.STAGING, manifest_sha256=info.manifest_sha256)
            self._weights = None
        threading.Thread(target=self._run, args=(info, pull), name="rollfleet-rank-stage", daemon=True).start()
        return self.status()

    def _run(self, info: WeightUpdateInfo, pull: Pull) -> None:
        t0 = time.monotonic()
        try:
            weights = pull(info)
        except Exception as err:  # any failure is this staging's, reported to the sidecar
            self._end(info, None, StageStatus(state=StageState.FAILED, manifest_sha256=info.manifest_sha256,
                                              error=f"{type(err).__name__}: {err}"))  # fmt: skip
            return
        size = sum(t.numel() * t.element_size() for _, t in weights)
        staged = StageStatus(
            state=StageState.STAGED,
            manifest_sha256=info.manifest_sha256,
            bytes=size,
            staged_url=rank_staged_url(info.manifest_sha256),
            seconds=round(time.monotonic() - t0, 3),
        )
        self._end(info, weights, staged)

    def _end(self, info: WeightUpdateInfo, weights: list[tuple[str, Any]] | None, status: StageStatus) -> None:
        with self._lock:
            if self._status.manifest_sha256 == info.manifest_sha256:  # not replaced by a later staging meanwhile
                self._status, self._weights = status, weights

    def status(self) -> StageStatus:
        with self._lock:
            return self._status.model_copy()

    def take(self, url: str) -> list[tuple[str, Any]]:
        """The staged tensors that `url` (``rank-staged://<sha>``) names, released from here: loaded once."""
        sha = urlsplit(url).netloc
        with self._lock:
            if self._status.state is not StageState.STAGED or self._status.manifest_sha256 != sha:
                raise TransferError(f"this rank has not staged {sha} (it has {self._status.state}); stage again")
            weights, self._weights, self._status = self._weights, None, StageStatus()
        assert weights is not None
        return weights


class RankStaging:
    """vLLM worker extension: what the group's leader calls on every worker (``collective_rpc``)."""

    def rollfleet_stage(self, info: dict[str, Any]) -> dict[str, Any]:
        started: StageStatus = self._http_backend().stage(WeightUpdateInfo.model_validate(info))
        return started.model_dump(mode="json")

    def rollfleet_stage_status(self) -> dict[str, Any]:
        status: StageStatus = self._http_backend().stage_status()
        return status.model_dump(mode="json")

    def _http_backend(self) -> Any:
        backend = getattr(self, "weight_transfer_engine", None)
        if backend is None or not hasattr(backend, "stage"):
            raise RuntimeError("ranks stage only with the http weight backend (--weight-transfer-config)")
        return backend


def merge_rank_status(ranks: Sequence[StageStatus]) -> StageStatus:
    """The group's staging as one: failed if any rank failed (naming it), staging while any is, staged once
    all are, on one set (the bytes are all ranks' together: the model about once for tensor parallel)."""
    failed = [(i, r) for i, r in enumerate(ranks) if r.state is StageState.FAILED]
    sha = next((r.manifest_sha256 for r in ranks if r.manifest_sha256), None)
    if failed:
        said = "; ".join(f"rank {i}: {r.error}" for i, r in failed)
        return StageStatus(state=StageState.FAILED, manifest_sha256=sha, error=said)
    if not ranks or any(r.state is StageState.IDLE for r in ranks):
        return StageStatus()
    if any(r.state is StageState.STAGING for r in ranks) or len({r.manifest_sha256 for r in ranks}) > 1:
        return StageStatus(state=StageState.STAGING, manifest_sha256=sha)
    return StageStatus(
        state=StageState.STAGED,
        manifest_sha256=sha,
        bytes=sum(r.bytes for r in ranks),
        staged_url=rank_staged_url(sha),
        seconds=max(r.seconds or 0.0 for r in ranks),
    )


class GroupStager:
    """The leader's staging route for a group (the API server's side): every rank of every engine core."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine  # vLLM's AsyncLLM

    async def _ranks(self, method: str, *args: Any) -> list[StageStatus]:
        # Every engine core (data parallel ranks too), every worker of each; vLLM's collective_rpc answers
        # the first engine core's only.
        per_core = await self._engine.engine_core.call_utility_all_async("collective_rpc", method, None, args, None)
        return [StageStatus.model_validate(worker) for core in per_core for worker in core]

    async def start(self, info: WeightUpdateInfo) -> StageStatus:
        if urlsplit(info.url).path.endswith(STAGE_RELAY_PATH):
            raise ValueError("a group's ranks pull their parts from the weights server, not from a relay")
        return merge_rank_status(await self._ranks("rollfleet_stage", info.model_dump(mode="json")))

    async def status(self, wait_s: float = 0.0) -> StageStatus:
        deadline = time.monotonic() + wait_s
        while True:
            merged = merge_rank_status(await self._ranks("rollfleet_stage_status"))
            if merged.state is not StageState.STAGING or time.monotonic() >= deadline:
                return merged
            await asyncio.sleep(STATUS_POLL_S)  # the ranks are other processes: asked again, not woken

    def release(self) -> None:
        """Each rank released its part when it loaded it."""

    def relay_manifest(self, manifest_sha256: str | None = None) -> bytes:
        raise RelayUnavailable("a group's ranks stage their parts in their own pods: nothing here to relay")
