"""Leaving without losing work: the engine pod's preStop hook, which waits until nothing runs here.

When an engine's pod is deleted (an eviction, ``kubectl drain``, a scale down), the kubelet runs
``python -m rollfleet_engine wait-idle`` before it signals the engine. Meanwhile the gateway, which
saw the pod go, moves the requests running here to other engines (aborts them here and continues
them there from the tokens their clients have), so the engine keeps serving until each has left
cleanly. Bounded by the pod's grace period; an engine that does not answer (dead, still loading, a
headless rank) ends the wait at once. Reads the engine's open state route on loopback, with the
standard library only: it runs in a fresh interpreter, inside the grace period.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

from rollfleet_engine.protocol import STATE_PATH

POLL_S = 0.2


def in_flight(state: Mapping[str, Any]) -> int:
    """Requests the engine still holds: decoding, paused, or waiting to start."""
    return int(state.get("running") or 0) + int(state.get("waiting") or 0)


def read_state(engine_url: str) -> Mapping[str, Any]:
    with urllib.request.urlopen(engine_url + STATE_PATH, timeout=2) as resp:
        state: Mapping[str, Any] = json.load(resp)
        return state


def wait_idle(engine_url: str, timeout_s: float, poll_s: float = POLL_S) -> str:
    """Wait until the engine holds no request, or `timeout_s`; say how it ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            held = in_flight(read_state(engine_url))
        except (OSError, ValueError) as err:
            return f"the engine does not answer ({err}): nothing to wait for"
        if held == 0:
            return "no request left on the engine"
        if time.monotonic() >= deadline:
            return f"{held} request(s) still on the engine after {timeout_s:g} s: it stops with them"
        time.sleep(poll_s)
