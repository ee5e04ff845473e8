"""Every error the client raises: one tree, each message saying what was wrong and what to do."""

from __future__ import annotations


class RollfleetClientError(Exception):
    """Base of every error this client raises."""


class GatewayUnreachable(RollfleetClientError):
    """No gateway answered at the URL: a wrong URL, a fleet that does not exist, or a network policy."""


class Unauthorized(RollfleetClientError):
    """The gateway refused the fleet token (401), or the client has none for a control call."""


class AnsweredError(RollfleetClientError):
    """The gateway answered with an error status; ``message`` is the server's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class RequestRefused(AnsweredError):
    """The gateway or an engine refused the request as the caller's fault (4xx): not worth retrying as is."""


class RequestIdInUse(RequestRefused):
    """409: a request with this id is still in flight; abort it, or use a new id."""


class EngineFailed(AnsweredError):
    """The gateway or every engine it tried failed (5xx): the request did not complete."""


class GenerateTimeout(RollfleetClientError):
    """The request ran past its timeout; the client has asked the gateway to abort it at the engine."""
