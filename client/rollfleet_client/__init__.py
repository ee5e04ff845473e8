"""Rollfleet's trainer-side client: generate, abort, pause and push weights to a fleet.

``AsyncRolloutClient`` (and ``RolloutClient`` for synchronous code) in ``client``; what it
returns in ``models``; its errors in ``errors``; the gateway's routes, headers and names in
``protocol`` (which the gateway and operator import too); reading answers in ``answers``.
The sync sidecar's API in ``sync_protocol`` (the sidecar imports it) and its client in
``sync``, which streams tensors laid out by ``tensors``. Depends on httpx and pydantic only;
pushing in-memory tensors needs torch.
"""

from rollfleet_client.client import AsyncRolloutClient, RolloutClient
from rollfleet_client.errors import (
    EngineFailed,
    GatewayUnreachable,
    GenerateTimeout,
    InvalidArgument,
    NotSettled,
    PushFailed,
    PushInProgress,
    RequestIdInUse,
    RequestRefused,
    RollfleetClientError,
    SidecarError,
    Unauthorized,
)
from rollfleet_client.models import AbortResult, EngineState, FleetState, Generation, PauseState, WeightSegment
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import PushStatus

__all__ = [
    "AbortResult",
    "AsyncRolloutClient",
    "EngineFailed",
    "EngineState",
    "FleetState",
    "GatewayUnreachable",
    "GenerateTimeout",
    "Generation",
    "InvalidArgument",
    "NotSettled",
    "PauseState",
    "PushFailed",
    "PushInProgress",
    "PushStatus",
    "RequestIdInUse",
    "RequestRefused",
    "RollfleetClientError",
    "RolloutClient",
    "SidecarError",
    "SyncClient",
    "Unauthorized",
    "WeightSegment",
]
__version__ = "0.1.0"
