"""The sidecar's view of engines: finding them, and what it reads from them.

Discovery is either the fleet's engine pods (labels ``rollfleet.dev/fleet=F``,
``app.kubernetes.io/component=engine``; the only pod write is the phase annotation
that takes an engine out of routing and back) or a static list of URLs (``--engines``).
The engine calls themselves (vLLM's RL routes and the engine package's ``/rollfleet/v1``
routes, with the fleet's bearer token) are ``rollfleet.engine_client``'s; here they are
read into the sync protocol's terms. Talks to engines (through the client) and
kube-apiserver (pods, through ``rollfleet.kube``).
"""

from __future__ import annotations

import logging
from typing import Protocol

from rollfleet.contract import ANNOTATION_PHASE, ENGINE_PORT, engine_discovery_selector, engine_url
from rollfleet.engine_client import CONTROL, EngineCallError, EngineClient, EngineRef
from rollfleet.kube import POD, ApiError, Conflict, Kube, NotFound
from rollfleet.sync.protocol import EngineObservation, InFlight

log = logging.getLogger(__name__)


async def observe(api: EngineClient, engine: EngineRef) -> EngineObservation:
    """Version and pause state; an unreachable engine reads as version None."""
    try:
        s = await api.state(engine, CONTROL)
    except EngineCallError:
        return EngineObservation(version=None)
    return EngineObservation(version=s.weight_version, paused=s.paused)


async def in_flight(api: EngineClient, engine: EngineRef) -> list[InFlight]:
    """The engine's requests in flight, with the weight versions that produced their tokens."""
    view = await api.requests(engine)
    return [InFlight(r.request_id, tuple(r.weight_versions)) for r in view.in_flight]


class Discovery(Protocol):
    async def engines(self) -> list[EngineRef]: ...

    async def set_phase(self, engine: EngineRef, phase: str, only_if: str | None = None) -> None:
        """Write the engine's routing phase (``only_if``: only when it currently has that phase)."""
        ...


class StaticDiscovery:
    """A fixed list of engine URLs; routing phases are only reported (there is no gateway to tell)."""

    def __init__(self, urls: list[str]) -> None:
        self._engines = [EngineRef(name=u.rstrip("/"), url=u.rstrip("/")) for u in urls]

    async def engines(self) -> list[EngineRef]:
        return list(self._engines)

    async def set_phase(self, engine: EngineRef, phase: str, only_if: str | None = None) -> None:
        return None


class PodDiscovery:
    """The fleet's engine pods that have an IP and are not being deleted."""

    def __init__(self, kube: Kube, namespace: str, fleet: str, port: int = ENGINE_PORT) -> None:
        self._kube = kube
        self.namespace, self.fleet, self.port = namespace, fleet, port
        self.selector = engine_discovery_selector(fleet)

    async def engines(self) -> list[EngineRef]:
        pods = await self._kube.list(POD, self.namespace, self.selector)
        return [
            EngineRef(name=p["metadata"]["name"], url=engine_url(p["status"]["podIP"], self.port))
            for p in pods
            if (p.get("status") or {}).get("podIP") and p["metadata"].get("deletionTimestamp") is None
        ]

    async def set_phase(self, engine: EngineRef, phase: str, only_if: str | None = None) -> None:
        try:
            pod = await self._kube.get(POD, self.namespace, engine.name)
        except ApiError as err:
            log.warning("could not read %s to set its phase: %s %s", engine.name, err.status, err.reason)
            return
        current = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_PHASE)
        if current == phase or (only_if is not None and current != only_if):
            return
        # Conditioned on the resourceVersion read: if the operator changed the phase
        # meanwhile, its newer decision stands.
        meta = {"resourceVersion": pod["metadata"]["resourceVersion"], "annotations": {ANNOTATION_PHASE: phase}}
        try:
            await self._kube.patch(POD, self.namespace, engine.name, {"metadata": meta})
        except (NotFound, Conflict):
            # Best effort: the operator derives the same phase from the fleet's record
            # (fleet_weight_version), so a lost write delays the gateway, never a commit.
            pass
        except ApiError as err:
            log.warning("could not set %s to %s: %s %s", engine.name, phase, err.status, err.reason)
