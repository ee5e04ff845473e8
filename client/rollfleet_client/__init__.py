"""Rollfleet's trainer-side client: generate and abort through a fleet's gateway.

``AsyncRolloutClient`` (and ``RolloutClient`` for synchronous code) in ``client``; what it
returns in ``models``; its errors in ``errors``; the gateway's routes, headers and names in
``protocol`` (which the gateway and operator import too); reading answers in ``answers``.
Depends on httpx and pydantic only.
"""

from rollfleet_client.client import AsyncRolloutClient, RolloutClient
from rollfleet_client.errors import (
    EngineFailed,
    GatewayUnreachable,
    GenerateTimeout,
    RequestIdInUse,
    RequestRefused,
    RollfleetClientError,
    Unauthorized,
)
from rollfleet_client.models import AbortResult, Generation

__all__ = [
    "AbortResult",
    "AsyncRolloutClient",
    "EngineFailed",
    "GatewayUnreachable",
    "GenerateTimeout",
    "Generation",
    "RequestIdInUse",
    "RequestRefused",
    "RollfleetClientError",
    "RolloutClient",
    "Unauthorized",
]
__version__ = "0.1.0"
