"""How the gateway turns a request away: the credential check, and the refusal it answers itself.

Shared by the gateway's endpoints (`app`) and its TRL routes (`trl`). Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

from rollfleet.errors import RollfleetError
from rollfleet_engine.access import bearer, token_matches


def credential_ok(headers: Mapping[str, str], *tokens: str | None) -> bool:
    """The request presents one of `tokens` (constant-time comparison); lowercase header names. As a bearer
    token, or as the password of HTTP Basic auth: TRL's client can carry a credential only in the URL it is
    given (`http://trl:<token>@gateway/trl`), which `requests` sends as Basic on every call."""
    presented = presented_token(headers.get("authorization"))
    return any(t is not None and token_matches(presented, t) for t in tokens)


def presented_token(authorization: str | None) -> str | None:
    """The token of `Bearer <token>`, or the password of `Basic base64(<user>:<password>)`; None otherwise."""
    token = bearer(authorization)
    if token is not None or not authorization:
        return token
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon and password else None


class Refused(RollfleetError):
    """A request the gateway answers itself, with this status and message (OpenAI's error shape)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
