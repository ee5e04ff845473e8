"""Every error the client raises: one tree, each message saying what was wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollfleet_client.models import FleetState
    from rollfleet_client.sync_protocol import PushStatus


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


class PushInProgress(RequestRefused):
    """409 to a pause or resume: a weight push is moving the fleet; ask again when it has ended."""


class NotSettled(RollfleetClientError):
    """A pause or resume was asked for (and stands), but the fleet's status did not show it done in time."""

    def __init__(self, message: str, state: FleetState) -> None:
        super().__init__(message)
        self.state = state


class InvalidArgument(RollfleetClientError, ValueError):
    """A call's argument is refused before anything is sent."""


class EngineFailed(AnsweredError):
    """The gateway or every engine it tried failed (5xx): the request did not complete."""


class GenerateTimeout(RollfleetClientError):
    """The request ran past its timeout; the client has asked the gateway to abort it at the engine."""


class SidecarError(RollfleetClientError):
    """The sync sidecar refused a call (``status``: its HTTP status) or did not answer (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GroupStale(SidecarError):
    """The fleet's engines changed since the collective group was formed: form it again."""


class PushFailed(SidecarError):
    """The push ended without moving the fleet to the new version (rolled back, or failed)."""

    def __init__(self, status: PushStatus) -> None:
        errors = "".join(f"; {e.name}: {e.error}" for e in status.engines if e.error)
        super().__init__(f"push {status.version} ended {status.state.value}: {status.message}{errors}")
        self.push = status
