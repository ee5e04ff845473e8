"""Bodies of the engine's own HTTP API, and the names of its routes and headers.

Pure pydantic: no vLLM or torch import, so the gateway, the operator and the sync
sidecar import this module to talk to engines.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args

from pydantic import BaseModel, Field

API_PREFIX = "/rollfleet/v1"
STATE_PATH = f"{API_PREFIX}/state"
REQUESTS_PATH = f"{API_PREFIX}/requests"
ABORT_PATH = f"{API_PREFIX}/abort"
READY_PATH = f"{API_PREFIX}/ready"
# Prefetch: POST a WeightUpdateInfo to download and verify the next weights into the engine's staging
# area while it serves; GET the StageStatus (``?wait=S``: once it is no longer staging, or after S
# seconds, at most STAGE_WAIT_MAX_S). The staged copy is then loaded by /update_weights with
# the StageStatus's `staged_url` (file://), which only this engine's staging area may be.
STAGE_PATH = f"{API_PREFIX}/weights/stage"
STAGED_URL_SCHEME = "file"
STAGE_WAIT_MAX_S = 30.0
# Relay: an engine staging a set serves it on, as it arrives, to the next engine of a chain: this is
# the base URL of a weights server (WEIGHTS_MANIFEST_PATH, then each shard's path) on the engine port.
STAGE_RELAY_PATH = f"{STAGE_PATH}/relay"
# Sent with every request of a staging (to a relay, and harmlessly to a weights server): the manifest of the set it
# stages. A relay serves only that set, and waits for its own engine to begin staging it (up to 10 s): an engine
# may be asked before its own staging, and one that still holds an earlier set staged must not serve that one.
RELAY_MANIFEST_HEADER = "X-Rollfleet-Manifest-Sha256"
WEIGHTS_MANIFEST_PATH = "/manifest"  # under a weights server's base URL; the manifest names the shards' paths
# Shard-aware pull: POST a SlicePlan here (under a weights server's base URL) for the manifest of one
# rank's slices, one shard whose path the answer names (rollfleet_engine.tp_slices).
WEIGHTS_SLICES_PATH = "/slices"
# The load in a pause, in one call (the sync sidecar's, per engine, at each push): a LoadRequest; the engine runs
# vLLM's /start_weight_update, /update_weights with its update_info and /finish_weight_update with its
# weight_version, in that order and each as if called on its own, then answers its EngineState (what the sidecar
# verifies). A refused start is passed over, as the sidecar passes it over: an update session that a sidecar which
# died left open is continued. The first of the others that fails answers for the call. Four calls in one: at
# thousands of engines the sidecar's CPU per call, not the network, made the pause window (docs/weight-sync.md).
LOAD_PATH = f"{API_PREFIX}/weights/load"
# The pause of a push, in one call: POST ?mode= runs vLLM's /pause?mode= as if called on its own, then answers the
# requests view (RequestsView) as it stands paused, which the sync sidecar reads for requests too stale to keep.
PAUSE_AND_LOOK_PATH = f"{API_PREFIX}/pause"
# Where an engine stages weights (a memory-backed emptyDir in the engine pod), and its bound in bytes.
STAGING_DIR_ENV = "ROLLFLEET_STAGING_DIR"
STAGING_MAX_BYTES_ENV = "ROLLFLEET_STAGING_MAX_BYTES"

# vLLM's RL routes that Rollfleet calls (control routes: they need the admin token).
PAUSE_PATH = "/pause"  # ?mode=, one of PAUSE_MODES
RESUME_PATH = "/resume"
INIT_WEIGHT_TRANSFER_PATH = "/init_weight_transfer_engine"  # {"init_info": ...}: join a collective group
SHUTDOWN_WEIGHT_TRANSFER_PATH = "/shutdown_weight_transfer_engine"  # leave it
START_WEIGHT_UPDATE_PATH = "/start_weight_update"
UPDATE_WEIGHTS_PATH = "/update_weights"  # {"update_info": ...}, WeightUpdateInfo for the http backend
FINISH_WEIGHT_UPDATE_PATH = "/finish_weight_update"  # {"weight_version": ...}
WORLD_SIZE_PATH = "/get_world_size"  # {"world_size": N}: tensor x data parallel ranks
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"

# The port engines serve on (vLLM's default): the operator's pods, the gateway and the sidecar use it.
ENGINE_PORT = 8000

REQUEST_ID_HEADER = "X-Request-Id"
# Which sender's request an id is: the gateway sends a value of its own with each request, and stops
# (deadline, client gone, failover) abort the id only where it has that value. Caller ids are chosen by
# clients, and two clients' requests may share one on an engine over time (or be refused it while the
# other runs): an abort for one must never end the other's.
ATTEMPT_HEADER = "X-Rollfleet-Attempt"
MAX_ATTEMPT_CHARS = 200
WEIGHT_VERSION_HEADER = "X-Rollfleet-Weight-Version"
# A request's own staleness bound, in weight generations (an integer >= 0): at a push to generation T, the
# sync sidecar aborts it in the pause if its oldest tokens came from a generation below T - N. The gateway
# also routes it only to engines within N of the fleet (docs/weight-sync.md, Staleness).
MAX_WEIGHT_LAG_HEADER = "X-Rollfleet-Max-Weight-Lag"
MAX_WEIGHT_LAG = 1_000_000


def parse_max_weight_lag(value: str | None) -> int | None:
    """A request's staleness bound from its header (None: unbounded); ValueError naming the rule otherwise."""
    if value is None:
        return None
    if not value.isdigit() or int(value) > MAX_WEIGHT_LAG:
        raise ValueError(f"{MAX_WEIGHT_LAG_HEADER} must be a whole number of generations, 0 to {MAX_WEIGHT_LAG}")
    return int(value)


# How vLLM's `POST /pause?mode=` treats in-flight requests; also the values of a fleet's
# `rollfleet.dev/pause` annotation (in this order in the RolloutFleet CRD).
PauseMode = Literal["keep", "wait", "abort"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)


def parse_pause_mode(value: str | None) -> PauseMode | None:
    """The pause mode named by `value`, or None for anything else."""
    return next((m for m in PAUSE_MODES if m == value), None)


# The backend names this package registers with vLLM's weight transfer factories.
HTTP_WEIGHT_BACKEND = "http"
GLOO_WEIGHT_BACKEND = "gloo"  # the CPU twin of vLLM's nccl: the same broadcast over torch's gloo
# Collective backends: the trainer process broadcasts to the engines' workers (rollfleet_client.collective),
# which load each tensor as it arrives, so from start_weight_update until finish_weight_update the model
# holds no one version (the http backend loads at finish). "nccl" is vLLM's own.
COLLECTIVE_BACKENDS = frozenset({GLOO_WEIGHT_BACKEND, "nccl"})
# In the error of a weight route whose load failed after some layers took new values: the middleware
# finds it in the answer and reports the engine not intact (EngineState.weights_intact).
MIXED_WEIGHTS_MARK = "[rollfleet: weights partly loaded]"


class AbortStatus(StrEnum):
    """What an abort did to one caller id, as observed at the engine."""

    ABORTED = "aborted"  # it ended with finish_reason "abort" (now or earlier)
    UNKNOWN = "unknown"  # the engine never saw this id (or forgot it: finished long ago)
    FINISHED = "finished"  # it had already ended for another reason (stop, length, error)
    PENDING = "pending"  # abort sent, but the request had not ended within the deadline
    # The gateway's answer only: it could not get the engine's word (unreachable, refused, or its
    # stream cut before it ended the request); the id may still run.
    UNCONFIRMED = "unconfirmed"


class AbortRequest(BaseModel):
    request_ids: list[str] = Field(min_length=1, description="Caller ids (the X-Request-Id or body request_id).")
    timeout_s: float = Field(default=10.0, gt=0, le=120, description="How long to wait for each request to end.")
    attempt: str | None = Field(
        default=None,
        max_length=MAX_ATTEMPT_CHARS,
        description=f"Only requests sent with this {ATTEMPT_HEADER}; any other with the id is answered unknown.",
    )


class AbortResult(BaseModel):
    results: dict[str, AbortStatus]


class RequestPhase(StrEnum):
    QUEUED = "queued"  # accepted by the HTTP server, not yet handed to the engine
    RUNNING = "running"  # in the engine (decoding, waiting for a batch slot, or held by a pause)
    FINISHED = "finished"


class WeightSegment(BaseModel):
    """Output tokens ``[start, end)`` came from the weights labelled ``version`` (vLLM's WeightVersionSpan)."""

    version: str
    start: int
    end: int


class TrackedRequest(BaseModel):
    """The engine's view of one caller request."""

    request_id: str
    phase: RequestPhase
    finish_reason: str | None = None
    engine_request_ids: list[str] = Field(default_factory=list, description="vLLM's own ids for this request.")
    output_tokens: int = Field(default=0, description="Tokens produced so far (streaming) or in total (at the end).")
    weight_versions: list[str] = Field(default_factory=list, description="Versions that produced its tokens.")
    max_weight_lag: int | None = Field(default=None, description=f"Its {MAX_WEIGHT_LAG_HEADER}, if sent.")
    weight_segments: list[WeightSegment] = Field(
        default_factory=list,
        description="Which output tokens came from which version, in order (a request of one sequence only).",
    )


class RequestsView(BaseModel):
    in_flight: list[TrackedRequest]
    recently_finished: list[TrackedRequest]


class EngineState(BaseModel):
    model: str
    weight_version: str
    paused: bool
    pause_mode: PauseMode | None = Field(default=None, description="Mode of the last pause, while paused.")
    running: int
    waiting: int
    weight_backend: str | None = None
    instance: str = Field(
        default="", description="Random id of this engine process: a restart at the same address gets a new one."
    )
    weights_intact: bool = Field(
        default=True,
        description="False while an update of an in-place backend (COLLECTIVE_BACKENDS) is open or after one "
        "failed: the model then holds parts of two versions, and the engine refuses to resume until a full "
        "update finishes.",
    )
    inference_open: bool = Field(
        default=False,
        description="True when this engine generates for anyone who reaches it (started without an inference "
        "token); the fleet's status says Open then.",
    )
    weights_manifest_sha256: str | None = Field(
        default=None,
        description="The proof of the bytes: the sha256 of the weight manifest that every tensor of the last "
        "finished update was verified against as it was loaded (the manifest holds each tensor's checksum). None: "
        "the weights it started with, or an update not pinned to one manifest (a collective one, one without "
        "manifest_sha256, one of several manifests). A relabel (/update_weight_version) keeps it.",
    )

    @property
    def served_version(self) -> str | None:
        """The version its weights are, or None while they are no one version."""
        return self.weight_version if self.weights_intact else None


class WeightUpdateInfo(BaseModel):
    """``update_info`` for vLLM's ``/update_weights`` with the ``http`` backend."""

    url: str = Field(
        description="Base URL of a weights server (rollfleet_engine.weights_server), or the file:// URL of "
        "weights this engine staged (StageStatus.staged_url)."
    )
    manifest_sha256: str | None = Field(
        default=None, description="Expected sha256 of the manifest; pins the exact weights the trainer meant."
    )
    timeout_s: float = Field(default=300.0, gt=0)
    second_url: str | None = Field(
        default=None,
        description="Staging only: the base URL of a second upstream (another engine's relay, or the weights "
        "server) serving the second half of every shard (safetensors_stream.second_half), received from it while "
        "the first half comes from `url`: the sync sidecar's second relay tree.",
    )

    def for_load(self) -> dict[str, object]:
        """The `update_info` of a load (vLLM's http backend takes no field of staging's only)."""
        return self.model_dump(mode="json", exclude={"second_url"})


class LoadRequest(BaseModel):
    """The body of LOAD_PATH."""

    update_info: WeightUpdateInfo
    weight_version: str = Field(min_length=1, description="What the engine reports once loaded.")


class TensorEntry(BaseModel):
    name: str
    dtype: str = Field(description="safetensors dtype: F32, BF16, F16, I64, ...")
    shape: list[int]
    data_offsets: tuple[int, int] = Field(description="[begin, end) in the shard's data section.")
    xxh3_128: str = Field(description="XXH3-128 checksum (hex) of the tensor's bytes.")


class Shard(BaseModel):
    path: str = Field(description="URL path of the shard, relative to the server's base URL.")
    size: int = Field(description="Bytes in the whole shard (header included).")
    tensors: list[TensorEntry]


class WeightManifest(BaseModel):
    """What a weights server serves: safetensors shards and a checksum per tensor (its own sha256 pins it)."""

    format: Literal["safetensors"] = "safetensors"
    shards: list[Shard]

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


class TensorCut(BaseModel):
    """The part of one tensor a rank needs: rows ``[begin, end)`` of dimension `dim`, or the whole tensor."""

    name: str
    dim: int | None = Field(default=None, ge=0, description="None: the whole tensor.")
    begin: int = Field(default=0, ge=0)
    end: int = Field(default=0, ge=0)


class SlicePlan(BaseModel):
    """What one rank asks a weights server for: a cut of every tensor it needs, of the manifest it pinned."""

    manifest_sha256: str
    cuts: list[TensorCut]


class StageState(StrEnum):
    IDLE = "idle"  # nothing staged
    STAGING = "staging"
    STAGED = "staged"  # downloaded and verified: load it with staged_url
    FAILED = "failed"


class StageStatus(BaseModel):
    state: StageState = StageState.IDLE
    manifest_sha256: str | None = None
    bytes: int = Field(default=0, description="Size of the weights being staged.")
    staged_url: str | None = Field(default=None, description="Give this to /update_weights once staged.")
    seconds: float | None = Field(default=None, description="Download and verification, once ended.")
    error: str | None = None
