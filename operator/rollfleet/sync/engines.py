"""The sidecar's view of engines: finding them, and what it reads from them.

Discovery is either the fleet's engine pods (labels ``rollfleet.dev/fleet=F``,
``app.kubernetes.io/component=engine``; read only: the operator sets their routing
phases from the weights record) or a static list of URLs (``--engines``).
The engine calls themselves (vLLM's RL routes and the engine package's ``/rollfleet/v1``
routes, with the fleet's bearer token) are ``rollfleet.engine_client``'s; here they are
read into the sync protocol's terms. Talks to engines (through the client) and
kube-apiserver (pods, through ``rollfleet.kube``).
"""

from __future__ import annotations

from typing import Any, Protocol

from rollfleet.contract import ANNOTATION_TEMPLATE_HASH, ENGINE_PORT, engine_discovery_selector, engine_url
from rollfleet.engine_client import CONTROL, EngineCallError, EngineClient, EngineRef
from rollfleet.kube import POD, Kube
from rollfleet.sync.protocol import EngineObservation, InFlight
from rollfleet_engine.protocol import RequestsView


async def observe(api: EngineClient, engine: EngineRef) -> EngineObservation:
    """Version, pause state and whether its weights are one version; an unreachable engine reads as version
    None. One whose weights are mixed (an update that failed midway) serves no version and is never resumed."""
    try:
        s = await api.state(engine, CONTROL)
    except EngineCallError:
        return EngineObservation(version=None)
    return EngineObservation(
        version=s.weight_version, paused=s.paused, intact=s.weights_intact, manifest=s.weights_manifest_sha256
    )


async def in_flight(api: EngineClient, engine: EngineRef) -> list[InFlight]:
    """The engine's requests in flight, with the weight versions that produced their tokens."""
    return flights(await api.requests(engine))


def flights(view: RequestsView) -> list[InFlight]:
    """The requests in flight of an engine's requests view, with the weight versions that produced their tokens."""
    return [InFlight(r.request_id, tuple(r.weight_versions), r.max_weight_lag) for r in view.in_flight]


class Discovery(Protocol):
    async def engines(self) -> list[EngineRef]: ...

    async def templates(self) -> list[str | None] | None:
        """The engine pods' template hashes (None: no pods to ask, static mode)."""
        ...


class StaticDiscovery:
    """A fixed list of engine URLs."""

    def __init__(self, urls: list[str]) -> None:
        self._engines = [EngineRef(name=u.rstrip("/"), url=u.rstrip("/")) for u in urls]

    async def engines(self) -> list[EngineRef]:
        return list(self._engines)

    async def templates(self) -> list[str | None] | None:
        return None


class PodDiscovery:
    """The fleet's engine pods that have an IP and are not being deleted."""

    def __init__(self, kube: Kube, namespace: str, fleet: str, port: int = ENGINE_PORT) -> None:
        self._kube = kube
        self.namespace, self.fleet, self.port = namespace, fleet, port
        self.selector = engine_discovery_selector(fleet)

    async def engines(self) -> list[EngineRef]:
        return [
            EngineRef(name=p["metadata"]["name"], url=engine_url(p["status"]["podIP"], self.port))
            for p in await self._live_pods()
            if (p.get("status") or {}).get("podIP")
        ]

    async def templates(self) -> list[str | None] | None:
        return [(p["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH) for p in await self._live_pods()]

    async def _live_pods(self) -> list[dict[str, Any]]:
        pods = await self._kube.list(POD, self.namespace, self.selector)
        return [p for p in pods if p["metadata"].get("deletionTimestamp") is None]
