"""What the watch last showed of the objects each fleet owns, and whether a fleet loop must apply one again.

A fleet owns ServiceAccounts, RBAC, a PodDisruptionBudget, maybe a NetworkPolicy, the gateway's Service and
Deployment, and the weights record (`desired.owned_objects`). The loop applies each when its manifest changes, and
again when the watch shows it changed or deleted by someone else: controller-runtime's `Owns()`. An operator at rest
makes no call (a re-apply every 5 minutes made 7 calls per fleet, bench_scale). Fed by kopf's watch handlers
(controller/handlers.py), read by the fleet loops (controller/reconciler.py); talks to nobody.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

Key = tuple[str, str]  # (namespace, fleet name)
ObjectKey = str  # "Kind/name"

ABSENT: Final = "absent"  # the digest recorded for an object the spec switched off (deleted, not applied)


class _Unseen:
    def __repr__(self) -> str:
        return "UNSEEN"


UNSEEN: Final = _Unseen()  # the watch has not shown the object since the loop started
Seen = str | None | _Unseen  # a version (`version_of`), None for deleted, or UNSEEN


@dataclass(frozen=True)
class Applied:
    """What the loop last did to one owned object."""

    digest: str  # of the manifest applied, or ABSENT for an object it deleted
    version: str | None  # the object's (`version_of`) as the apply returned it; None once deleted


def object_key(kind: str, name: str) -> ObjectKey:
    return f"{kind}/{name}"


def version_of(meta: Mapping[str, Any]) -> str:
    """What says an object changed, from its metadata: its uid and generation where it has one (a Deployment's or a
    PodDisruptionBudget's status moves its resourceVersion, not its generation: controller-runtime's
    GenerationChangedPredicate), else its resourceVersion."""
    if "generation" in meta:
        return f"{meta['uid']}/{meta['generation']}"
    return str(meta["resourceVersion"])


def must_write(last: Applied | None, digest: str, seen: Seen) -> bool:
    """Whether to apply (or delete, for digest ABSENT) an owned object now: never done, the manifest changed, or the
    watch has shown it otherwise than the loop left it. A watch that has not caught up yet costs one idempotent call,
    no more: the apply returns the version the watch will show."""
    if last is None or last.digest != digest:
        return True
    return seen is not UNSEEN and seen != last.version


class OwnedObjects:
    """The version (`version_of`) of each owned object of each running fleet loop, as last watched (None: deleted),
    and a count of changes per fleet that wakes its loop."""

    def __init__(self) -> None:
        self._seen: dict[Key, dict[ObjectKey, str | None]] = {}
        self._changes: dict[Key, int] = {}
        self._loops: dict[Key, int] = {}  # a fleet made again under its name may start before the last one ends

    def track(self, key: Key) -> None:
        """A fleet loop starts: keep what the watch shows of its objects from now on."""
        self._loops[key] = self._loops.get(key, 0) + 1
        self._seen.setdefault(key, {})
        self._changes.setdefault(key, 0)

    def forget(self, key: Key) -> None:
        """A fleet loop ends: what the garbage collector deletes next is nobody's concern."""
        self._loops[key] -= 1
        if not self._loops[key]:
            del self._loops[key], self._seen[key], self._changes[key]

    def saw(self, key: Key, obj: ObjectKey, version: str | None) -> None:
        seen = self._seen.get(key)
        if seen is None or seen.get(obj, UNSEEN) == version:
            return
        seen[obj] = version
        self._changes[key] += 1

    def seen(self, key: Key, obj: ObjectKey) -> Seen:
        return self._seen.get(key, {}).get(obj, UNSEEN)

    def changes(self, key: Key) -> int:
        return self._changes.get(key, 0)
