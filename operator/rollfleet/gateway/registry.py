"""The fleet's engines as the gateway sees them: address, phase, and whether to route there.

Owns the engine table. Fed either by a Kubernetes watch of the fleet's engine pods
(`rollfleet.kube`'s list-then-watch: no polling) or by a static list of URLs
(`--engines`, for benchmarks and tests). The gateway
routes only to pods that are Ready (pod condition) and whose `rollfleet.dev/phase`
annotation is `Ready` or `Paused` (a paused engine holds requests; it does not fail
them). Connection failures eject an engine for a few seconds (passive health), so a
dead engine stops receiving traffic before its pod's readiness flips. An engine whose pod
starts to go (deletionTimestamp: an eviction, `kubectl drain`, a scale down) is announced
once to `on_leaving`: the proxy moves what runs there to other engines while it still serves.

Talks to kube-apiserver only (through `rollfleet.kube`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollfleet.contract import (
    ANNOTATION_PHASE,
    ANNOTATION_WEIGHT_GENERATION,
    ENGINE_PORT,
    ROUTABLE_PHASES,
    EnginePhase,
    engine_discovery_selector,
    engine_url,
)
from rollfleet.kube import POD, Kube, Listed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Engine:
    key: str  # pod name, or the URL in static mode
    url: str | None  # None while the pod has no IP
    routable: bool
    phase: str | None = None
    # One life of the engine (pod uid): a replacement pod keeps the name but not this,
    # so "never send an id twice to one engine" does not exclude the replacement.
    instance: str = ""
    # Its pod is being deleted (an eviction, a drain, a scale down): what runs there moves to other engines.
    leaving: bool = False
    # The generation of the weights it serves (its pod's rollfleet.dev/weight-generation; None: not known).
    generation: int | None = None


def engine_from_pod(pod: Mapping[str, Any], port: int = ENGINE_PORT) -> Engine:
    """The gateway's view of one engine pod (a pod as JSON, as the API serves it)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    phase = (meta.get("annotations") or {}).get(ANNOTATION_PHASE)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    ip = status.get("podIP")
    terminating = meta.get("deletionTimestamp") is not None
    url = engine_url(ip, port) if ip else None
    routable = bool(url) and ready and not terminating and phase in ROUTABLE_PHASES
    instance = meta.get("uid") or meta["name"]
    generation = (meta.get("annotations") or {}).get(ANNOTATION_WEIGHT_GENERATION)
    known = int(generation) if generation is not None and generation.isdigit() else None
    return Engine(meta["name"], url, routable, phase, instance, leaving=terminating, generation=known)


def lag_floor(newest: int | None, max_lag: int) -> int | None:
    """The oldest weight generation within `max_lag` generations of `newest` (the newest routable engine's,
    `newest_generation`); None where no generation is known (static mode): there is nothing to bound by."""
    return None if newest is None else newest - max_lag


def within_lag(engine: Engine, floor: int | None) -> bool:
    """Whether `engine`'s weights are at `floor` (`lag_floor`) or newer; unknown weights are within no bound."""
    return floor is None or (engine.generation is not None and engine.generation >= floor)


def newest_generation(routable: Sequence[Engine]) -> int | None:
    """The newest weight generation among `routable` (None: none known, static mode)."""
    return max((e.generation for e in routable if e.generation is not None), default=None)


def lag_label(engine: Engine | None, newest: int | None) -> str:
    """How far the engine's weights are behind `newest` (the newest routable engine's, `newest_generation`), as a
    bounded metric label: "0", "1", "2" or "3+" generations; "unknown" where its generation or the newest is not
    known (static mode)."""
    if engine is None or engine.generation is None or newest is None:
        return "unknown"
    lag = max(0, newest - engine.generation)
    return str(lag) if lag < 3 else "3+"


def lag_summary(routable: Sequence[Engine]) -> str:
    """The routable engines' generations, for a refusal: "engine-0 at 3, engine-1 at 2"."""
    return ", ".join(f"{e.key} at {'?' if e.generation is None else e.generation}" for e in routable) or "none"


class Registry:
    """Engine table shared by routing, proxy and abort. All methods run on the event loop."""

    def __init__(self, eject_s: float = 5.0) -> None:
        self.eject_s = eject_s
        self._engines: dict[str, Engine] = {}
        self._ejected_until: dict[str, float] = {}
        self._changed = asyncio.Event()
        self.synced = False
        self.on_removed: list[Callable[[str], None]] = []
        self.on_leaving: list[Callable[[str], None]] = []  # called once when an engine's pod starts to go
        # Weight version each engine last stated (response headers) and how often it changed.
        self._versions: dict[str, str] = {}
        self._version_epochs: dict[str, int] = {}
        # routable(), kept until the table changes or an ejection ends: the proxy asks once per request.
        # With it, what each request derives from it: its keys (the router's load index) and the newest generation.
        self._routable: list[Engine] | None = None
        self._routable_keys: list[str] = []
        self._newest: int | None = None
        self._routable_until = 0.0

    # --- fed by a source ------------------------------------------------------------
    def replace_all(self, engines: Iterable[Engine]) -> None:
        fresh = {e.key: e for e in engines}
        for key in set(self._engines) - set(fresh):
            self._removed(key)
        old, self._engines = self._engines, fresh
        self.synced = True
        self._notify()
        for engine in fresh.values():
            self._check_leaving(old.get(engine.key), engine)

    def upsert(self, engine: Engine) -> None:
        old = self._engines.get(engine.key)
        self._engines[engine.key] = engine
        self._notify()
        self._check_leaving(old, engine)

    def remove(self, key: str) -> None:
        if self._engines.pop(key, None) is not None:
            self._removed(key)
            self._notify()

    # --- fed by the proxy -----------------------------------------------------------
    def eject(self, key: str) -> None:
        """The engine refused or dropped a connection: no new traffic for `eject_s`."""
        self._ejected_until[key] = time.monotonic() + self.eject_s
        self._routable = None
        log.warning("engine %s ejected for %.0fs after a connection failure", key, self.eject_s)

    def observe_version(self, key: str, version: str) -> None:
        """An engine stated its current weight version (on a response)."""
        previous = self._versions.get(key)
        if previous != version:
            if previous is not None:
                self._version_epochs[key] = self._version_epochs.get(key, 0) + 1
            self._versions[key] = version

    def version_epoch(self, key: str) -> int:
        """Changes to the engine's weight version seen so far: a request that saw this number
        change while it ran may have been produced by more than one version."""
        return self._version_epochs.get(key, 0)

    # --- read side ------------------------------------------------------------------
    def routable(self) -> list[Engine]:
        """The engines to route to now (do not change the list)."""
        now = time.monotonic()
        if self._routable is None or now >= self._routable_until:
            ejected = {k: until for k, until in self._ejected_until.items() if until > now}
            self._routable = [e for e in self._engines.values() if e.routable and e.url and e.key not in ejected]
            self._routable_keys = [e.key for e in self._routable]
            self._newest = newest_generation(self._routable)
            self._routable_until = min(ejected.values(), default=float("inf"))
        return self._routable

    def routable_keys(self) -> list[str]:
        """The keys of `routable()`: the same list object until the routable engines change (the router keeps
        its load index for it)."""
        self.routable()
        return self._routable_keys

    def newest_generation(self) -> int | None:
        """`newest_generation(routable())`, computed once per routable list (each request asks: at 2,000 engines
        a scan per request was a sixth of the gateway's CPU, bench_scale)."""
        self.routable()
        return self._newest

    def get(self, key: str) -> Engine | None:
        return self._engines.get(key)

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    async def wait_changed(self, within_s: float) -> None:
        """Return when the engine table changes, or after `within_s` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), within_s)

    def _removed(self, key: str) -> None:
        self._ejected_until.pop(key, None)
        self._versions.pop(key, None)
        self._version_epochs.pop(key, None)
        for callback in self.on_removed:
            callback(key)

    def _check_leaving(self, old: Engine | None, new: Engine) -> None:
        if new.leaving and not (old is not None and old.leaving and old.instance == new.instance):
            for callback in self.on_leaving:
                callback(new.key)

    def _notify(self) -> None:
        self._routable = None
        self._changed.set()
        self._changed = asyncio.Event()


def static_registry(urls: Iterable[str], eject_s: float = 5.0) -> Registry:
    registry = Registry(eject_s)
    clean = [u.rstrip("/") for u in urls]
    registry.replace_all(Engine(key=u, url=u, routable=True, phase=EnginePhase.READY, instance=u) for u in clean)
    return registry


async def follow_pods(registry: Registry, kube: Kube, namespace: str, fleet: str) -> None:
    """Keep the registry in step with the fleet's engine pods, until cancelled."""
    async for update in kube.watch(POD, namespace, engine_discovery_selector(fleet)):
        if isinstance(update, Listed):
            registry.replace_all(engine_from_pod(p) for p in update.items)
        elif update.type == "DELETED":
            registry.remove(update.object["metadata"]["name"])
        else:
            registry.upsert(engine_from_pod(update.object))
