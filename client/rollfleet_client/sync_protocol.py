"""The sync sidecar's trainer API: port, routes and bodies. Pure.

The sidecar (``rollfleet.sync.server``) serves it and ``rollfleet_client.sync`` calls it;
both import it from here. Routes (on 127.0.0.1: the trainer pod's own containers):

- ``POST /v1/pushes`` ``PushDirRequest``: push a safetensors directory (shared volume).
- ``PUT /v1/pushes/stream?version=V``: push a safetensors stream (the client lays the
  trainer's tensors out as one shard; the sidecar spools, hashes and serves it).
- ``POST /v1/pushes/spooled`` ``PushSpooledRequest``: push a shard the client wrote itself
  into ``incoming/<name>`` of the sidecar's spool, which the trainer container mounts too
  (at ``$ROLLFLEET_SYNC_SPOOL``): no network hop. The sidecar takes the directory over.
- ``GET /v1/pushes/{generation}?wait=S``: a push's progress; waits up to S seconds for
  it to end.
- ``GET /v1/version``: the fleet's weight version (``FleetVersionView``).
- ``/v1/collective/...``: collective pushes (the trainer broadcasts with vLLM's nccl, or its
  CPU twin gloo): ``GET /v1/collective`` the group the fleet's engines form
  (``CollectiveGroup``), then vLLM's handshake, fanned out to the engines: ``POST .../init``
  ``{"init_info": ...}``, ``.../start`` ``CollectiveStart``, ``.../update``
  ``{"update_info": ...}``, ``.../finish`` ``{"weight_version": ...}`` (``PushStatus``).
- ``GET /healthz`` (on SYNC_HEALTH_PORT, for kubelet).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

# The trainer API (localhost), the weights server engines pull from (the pod IP), and /healthz
# for kubelet's probes (the pod network, where kubelet reaches it; nothing else is served there).
SYNC_API_PORT = 8471
SYNC_WEIGHTS_PORT = 8472
SYNC_HEALTH_PORT = 8473


# The trainer API listens on localhost: the containers of the sidecar's pod reach it, nothing else does.
SYNC_API_HOST = "127.0.0.1"
SYNC_API_URL = f"http://{SYNC_API_HOST}:{SYNC_API_PORT}"


PUSHES_PATH = "/v1/pushes"
PUSH_STREAM_PATH = "/v1/pushes/stream"
PUSH_SPOOLED_PATH = "/v1/pushes/spooled"
# Where the trainer container mounts the sidecar's spool volume; unset: pushes are streamed.
SPOOL_ENV = "ROLLFLEET_SYNC_SPOOL"
# The spool's directory that trainers write into: one directory per push, named by the trainer.
SPOOL_INCOMING_DIR = "incoming"
# In incoming/: the file of a superseded push, kept for the next push to write over (``rollfleet_client.spool``).
SPOOL_SPARE_FILE = ".spare.safetensors"
VERSION_PATH = "/v1/version"
HEALTH_PATH = "/healthz"
COLLECTIVE_PATH = "/v1/collective"
COLLECTIVE_INIT_PATH = f"{COLLECTIVE_PATH}/init"
COLLECTIVE_START_PATH = f"{COLLECTIVE_PATH}/start"
COLLECTIVE_UPDATE_PATH = f"{COLLECTIVE_PATH}/update"
COLLECTIVE_FINISH_PATH = f"{COLLECTIVE_PATH}/finish"
# Answered by start when the engines changed since the group was formed: form it again (init).
GROUP_STALE_STATUS = 410

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class PushDirRequest(BaseModel):
    version: str = Field(pattern=VERSION_PATTERN, description="New, unique version label.")
    path: str = Field(min_length=1, description="Directory of .safetensors files, readable by the sidecar.")


class PushSpooledRequest(BaseModel):
    version: str = Field(pattern=VERSION_PATTERN, description="New, unique version label.")
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$",
        description=f"The directory in the spool's {SPOOL_INCOMING_DIR}/ holding the shard (no path: the "
        "containers may mount the spool at different paths).",
    )
    write_s: float | None = Field(default=None, description="How long the trainer took to write it (status only).")


class CollectiveMember(BaseModel):
    name: str
    instance: str = Field(description="The engine process (EngineState.instance): a restarted engine is not a member.")
    rank_offset: int = Field(description="The engine's first rank in the group (the trainer is rank 0).")
    ranks: int = Field(description="Its workers (tensor x data parallel).")


class CollectiveGroup(BaseModel):
    members: list[CollectiveMember]
    world_size: int = Field(description="1 (the trainer) + every member's ranks: the world_size of init_info.")
    formed: bool = Field(description="Whether these engines are the group last formed: false means init again.")


class CollectiveInit(BaseModel):
    backend: str = Field(description="The trainer's backend: every engine must receive with it.")
    init_info: dict[str, Any] = Field(description="vLLM's worker init info; the sidecar sets rank_offset.")


class CollectiveStart(BaseModel):
    version: str = Field(pattern=VERSION_PATTERN, description="New, unique version label.")


class CollectiveUpdate(BaseModel):
    update_info: dict[str, Any] = Field(description="vLLM's update info of the backend (names, dtypes, shapes).")


class CollectiveFinish(BaseModel):
    weight_version: str = Field(pattern=VERSION_PATTERN)


class EngineStep(StrEnum):
    WAITING = "waiting"
    STAGING = "staging"  # prefetch: downloading and verifying the new weights while it serves
    STAGED = "staged"
    PAUSED = "paused"
    TRANSFERRING = "transferring"
    VERIFIED = "verified"  # reports the target version
    RESUMED = "resumed"
    PENDING_SYNC = "pending-sync"  # out of routing: not on the fleet's version
    FAILED = "failed"


class EngineProgress(BaseModel):
    name: str
    step: EngineStep = EngineStep.WAITING
    stage_s: float | None = Field(default=None, description="Prefetch: download and verification, while serving.")
    source: str | None = Field(default=None, description="The engine it staged from (relay); None: the sidecar.")
    second_source: str | None = Field(
        default=None,
        description="Down two relay trees: the engine it staged the second half of every shard from (None: the "
        "sidecar, or one tree).",
    )
    relay_error: str | None = Field(default=None, description="Why a relay failed, and it staged from the sidecar.")
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
    receive_s: float | None = Field(
        default=None, description="Pushes from the trainer's memory: writing the tensors into the spool."
    )
    staging_s: float | None = Field(default=None, description="Hashing and serving the weights, before any pause.")
    prefetch_s: float | None = Field(default=None, description="Engines staging the weights while they serve.")
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
