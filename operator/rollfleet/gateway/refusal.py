"""How the gateway turns a request away: the bearer-token check, and the refusal it answers itself.

Shared by the gateway's endpoints (`app`) and its TRL routes (`trl`). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollfleet.errors import RollfleetError
from rollfleet_engine.access import bearer, token_matches


def bearer_ok(headers: Mapping[str, str], *tokens: str | None) -> bool:
    """The request's bearer token is one of `tokens` (constant-time comparison); lowercase header names."""
    presented = bearer(headers.get("authorization"))
    return any(t is not None and token_matches(presented, t) for t in tokens)


class Refused(RollfleetError):
    """A request the gateway answers itself, with this status and message (OpenAI's error shape)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
