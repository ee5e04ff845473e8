"""The identity of an object that owns what the operator makes for it (a RolloutFleet, a
RolloutRequest): enough to name those objects and to make the garbage collector delete them
with their owner. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from rollfleet.api import fleet, request
from rollfleet.contract import API_VERSION


@dataclass(frozen=True)
class OwnerRef:
    kind: ClassVar[str]
    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Self:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])

    def owner_reference(self) -> dict[str, Any]:
        # controller=True makes the owner the one manager; the garbage collector deletes
        # everything it owns when it is deleted.
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class FleetRef(OwnerRef):
    """A RolloutFleet: it owns its engine pods, gateway, Secret, RBAC and NetworkPolicy."""

    kind: ClassVar[str] = fleet.KIND


@dataclass(frozen=True)
class RequestRef(OwnerRef):
    """A RolloutRequest: it owns its runner (Job, ServiceAccount, RBAC) and its result ConfigMaps."""

    kind: ClassVar[str] = request.KIND
