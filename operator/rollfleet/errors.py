"""The root of all Rollfleet errors.

Every error type that Rollfleet's own code raises on purpose derives from
`RollfleetError`, so a caller can catch "anything Rollfleet refused or failed" in one
clause without also catching programming errors. Talks to nobody.
"""

from __future__ import annotations


class RollfleetError(Exception):
    """The root of all Rollfleet errors."""
