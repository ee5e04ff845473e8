"""Bodies of the sidecar's localhost HTTP API, shared by ``server`` and ``client``. Pure.

Routes (all on 127.0.0.1, port 8471 by default):

- ``POST /v1/pushes`` ``PushDirRequest``: push a safetensors directory (shared volume).
- ``PUT /v1/pushes/stream?version=V``: push a safetensors stream (the client lays the
  trainer's tensors out as one shard); header ``X-Rollfleet-Manifest-Sha256`` pins it.
- ``GET /v1/pushes/{generation}?wait=S``: a push's progress; waits up to S seconds for
  it to end.
- ``GET /v1/version``: the fleet's weight version (``FleetVersionView``).
- ``GET /healthz``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MANIFEST_SHA_HEADER = "X-Rollfleet-Manifest-Sha256"


class PushDirRequest(BaseModel):
    version: str = Field(pattern=VERSION_PATTERN, description="New, unique version label.")
    path: str = Field(min_length=1, description="Directory of .safetensors files, readable by the sidecar.")


class EngineStep(StrEnum):
    WAITING = "waiting"
    PAUSED = "paused"
    TRANSFERRING = "transferring"
    VERIFIED = "verified"  # reports the target version
    RESUMED = "resumed"
    PENDING_SYNC = "pending-sync"  # out of routing: not on the fleet's version
    FAILED = "failed"


class EngineProgress(BaseModel):
    name: str
    step: EngineStep = EngineStep.WAITING
    transfer_s: float | None = None
    error: str | None = None


class PushState(StrEnum):
    RUNNING = "running"  # recorded on the fleet; engines are being paused, updated, resumed
    DONE = "done"  # the fleet is on the target (engines in pending_sync excepted)
    ROLLED_BACK = "rolled-back"  # the fleet stayed on its previous version
    FAILED = "failed"  # refused or broken before the fleet was touched, or left paused on an error

    @property
    def terminal(self) -> bool:
        return self in (PushState.DONE, PushState.ROLLED_BACK, PushState.FAILED)


class PushStatus(BaseModel):
    generation: int
    version: str
    state: PushState = PushState.RUNNING
    engines: list[EngineProgress] = Field(default_factory=list)
    bytes: int = Field(default=0, description="Size of the weights (one copy).")
    receive_s: float | None = Field(default=None, description="Streamed pushes: writing the tensors into the spool.")
    staging_s: float | None = Field(default=None, description="Hashing and serving the weights, before any pause.")
    transfer_s: float | None = Field(default=None, description="First pause sent to last engine verified.")
    pause_window_s: float | None = Field(default=None, description="First pause sent to last resume answered.")
    total_s: float | None = None
    throughput_bytes_per_s: float | None = Field(default=None, description="bytes x verified engines / transfer_s.")
    aborted_stale: int = Field(default=0, description="Requests aborted as too many generations behind.")
    message: str = ""

    @property
    def pending_sync(self) -> list[str]:
        return [e.name for e in self.engines if e.step in (EngineStep.PENDING_SYNC, EngineStep.FAILED)]


class FleetVersionView(BaseModel):
    version: str | None
    generation: int | None
    routable: list[str]
    pending_sync: list[str]
    syncing_to: str | None = None
    last_push: PushStatus | None = None
