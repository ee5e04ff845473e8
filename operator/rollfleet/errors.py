"""The root of every error Rollfleet raises on purpose.

Each component derives its errors from `RollfleetError` (keeping the built-in base that
its callers already catch, such as ValueError for bad input), so that the CLI can turn
any of them into one line that says what was wrong and what to do, while a bug still
shows its traceback.
"""

from __future__ import annotations


class RollfleetError(Exception):
    """An error whose message is meant for the person running Rollfleet."""
