"""Kubernetes Events the operator posts on its objects (`kubectl describe rf|rr` shows them). Pure.

Events say what changed and why; they are best effort (the status carries the truth), so the
callers post them without holding up their loops.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from rollfleet.contract import API_VERSION, MANAGER

INSTANCE = socket.gethostname()  # this operator's replica, in its Events


def rfc3339(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def event_manifest(
    kind: str, name: str, namespace: str, uid: str, type_: str, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    """A core/v1 Event on one of Rollfleet's objects (`kind` RolloutFleet or RolloutRequest)."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": {"apiVersion": API_VERSION, "kind": kind, "name": name, "namespace": namespace, "uid": uid},
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "firstTimestamp": rfc3339(now),
        "lastTimestamp": rfc3339(now),
        "count": 1,
        "source": {"component": MANAGER},
        "reportingComponent": MANAGER,
        "reportingInstance": INSTANCE,
    }


# Past this many in one pass, engines that did the same thing share one Event: 2,000 engines coming up were
# 10,000 Events, a third of the operator's API calls (bench_scale).
EVENTS_ONE_BY_ONE = 8
NAMES_IN_SUMMARY = 10


def batched(items: Sequence[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """(type, reason, message) Events for `items` of (type, reason, engine name + what): each its own while
    there are few, else one per (type, reason) naming how many, the first names and the first one's words."""
    if len(items) <= EVENTS_ONE_BY_ONE:
        return list(items)
    groups: dict[tuple[str, str], list[str]] = {}
    for type_, reason, message in items:
        groups.setdefault((type_, reason), []).append(message)
    out = []
    for (type_, reason), messages in groups.items():
        if len(messages) == 1:
            out.append((type_, reason, messages[0]))
            continue
        names = [m.split(" ", 1)[0].rstrip(":") for m in messages[:NAMES_IN_SUMMARY]]
        more = f" and {len(messages) - len(names)} more" if len(messages) > len(names) else ""
        out.append((type_, reason, f"{len(messages)} engines ({', '.join(names)}{more}); the first: {messages[0]}"))
    return out
