"""Kubernetes Events the operator posts on its objects (`kubectl describe rf|rr` shows them). Pure.

Events say what changed and why; they are best effort (the status carries the truth), so the
callers post them without holding up their loops.
"""

from __future__ import annotations

import socket
import uuid
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
