"""How the controller's kopf daemons (one per RolloutFleet, one per RolloutRequest) fail.

A daemon that fails raises `kopf.TemporaryError`: kopf logs its one-line message, posts it as
an Event on the object, and runs the daemon again after the delay given here, which doubles
with each consecutive failure up to 30 s. The traceback goes to the operator's log. Talks to
nobody.
"""

from __future__ import annotations

import logging

import kopf

MAX_BACKOFF_S = 30.0

log = logging.getLogger("rollfleet.operator")


def backoff_s(failures: int) -> float:
    """Seconds before the next try after `failures` consecutive failures (1 or more): 2, 4, 8, ... 30."""
    return min(MAX_BACKOFF_S, 2.0**failures)


def retry_later(what: str, err: Exception, failures: int) -> kopf.TemporaryError:
    delay = backoff_s(failures)
    log.warning("%s failed (%d in a row), retrying in %.0fs", what, failures, delay, exc_info=err)
    return kopf.TemporaryError(f"{what} failed: {err}; retrying in {delay:.0f}s", delay=delay)
