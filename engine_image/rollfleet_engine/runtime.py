"""What the launcher shares with the middleware and the routes: the engine and our state.

Owns the few facts vLLM does not keep for us: the mode of the last pause, a cached
weight version (read on every inference response, so it must not cost an RPC), whether
the weights are one version (not so during an in-place update), and the weights staged
for the next update; and the one step vLLM leaves to its callers after a load: dropping the
caches the old weights computed.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollfleet_engine.access import AccessPolicy
from rollfleet_engine.protocol import COLLECTIVE_BACKENDS, STAGING_MAX_BYTES_ENV, PauseMode
from rollfleet_engine.rank_staging import GroupStager
from rollfleet_engine.staging import Stager
from rollfleet_engine.tracker import RequestTracker
from rollfleet_engine.weights_client import staging_root


def default_stager() -> Stager:
    """This engine's directory in the staging area, by process: engines run outside pods too (several on
    one host, sharing its /dev/shm); in a pod, /dev/shm is the pod's memory-backed emptyDir."""
    limit = os.environ.get(STAGING_MAX_BYTES_ENV)
    return Stager(staging_root() / f"engine-{os.getpid()}", int(limit) if limit else None)


@dataclass
class Runtime:
    engine: Any  # vllm.engine.protocol.EngineClient (AsyncLLM); Any keeps this module vLLM-free
    policy: AccessPolicy
    model_name: str
    weight_backend: str | None
    tracker: RequestTracker = field(default_factory=RequestTracker)
    # None: no prefetch. An engine whose ranks run in other pods has each rank stage its own part in its own
    # pod (rank_staging.GroupStager): a staged copy in the leader's pod would serve that pod only.
    stager: Stager | GroupStager | None = field(default_factory=default_stager)
    weight_version: str = "default"
    pause_mode: PauseMode | None = None
    weights_intact: bool = True  # see EngineState.weights_intact
    weights_manifest_sha256: str | None = None  # see EngineState.weights_manifest_sha256
    # The manifest each load of the open update was verified against (None: a load not pinned to one).
    loading_manifests: list[str | None] = field(default_factory=list)
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def loads_in_place(self) -> bool:
        return self.weight_backend in COLLECTIVE_BACKENDS

    async def refresh_weight_version(self) -> str:
        self.weight_version = await self.engine.get_weight_version()
        return self.weight_version

    async def drop_old_weights_caches(self) -> None:
        """Forget every cache computed with the weights just replaced, before the engine serves again: the
        prefix cache, including the KV blocks of requests held across the swap (vLLM preempts them, so they
        recompute their tokens on the new weights when they resume), and the multimodal and encoder caches.
        vLLM's pause keeps them in keep mode, and a weight update alone clears none of them."""
        if not await self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache")
        await self.engine.reset_mm_cache()
        await self.engine.reset_encoder_cache()
