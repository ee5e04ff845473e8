"""The sidecar's view of engines: finding them, and the HTTP calls it makes to them.

Discovery is either the fleet's engine pods (labels ``rollfleet.dev/fleet=F``,
``app.kubernetes.io/component=engine``; the only pod write is the phase annotation
that takes an engine out of routing and back) or a static list of URLs (``--engines``).
Engine calls are vLLM's RL routes (pause, resume, the weight update handshake) and the
engine package's ``/rollfleet/v1`` routes, all with the fleet's bearer token.
Talks to engines (HTTP) and kube-apiserver (pods).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from rollfleet.contract import ANNOTATION_PHASE, ENGINE_PORT, engine_discovery_selector, engine_url
from rollfleet.sync.protocol import EngineObservation, InFlight
from rollfleet_engine.protocol import (
    ABORT_PATH,
    REQUESTS_PATH,
    STATE_PATH,
    AbortRequest,
    EngineState,
    PauseMode,
    RequestsView,
)

log = logging.getLogger(__name__)



class EngineCallError(RuntimeError):
    """An engine refused or failed a call (or could not be reached)."""


@dataclass(frozen=True)
class EngineRef:
    name: str  # pod name, or the URL in static mode
    url: str


class EngineAPI:
    """HTTP client for the routes the sidecar uses; one connection pool for all engines."""

    def __init__(self, token: str, control_timeout_s: float = 30.0, transfer_timeout_s: float = 900.0) -> None:
        self._http = httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=control_timeout_s)
        self.transfer_timeout_s = transfer_timeout_s

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, engine: EngineRef, path: str, **kwargs: Any) -> Any:
        try:
            resp = await self._http.request(method, engine.url.rstrip("/") + path, **kwargs)
        except httpx.HTTPError as err:
            raise EngineCallError(f"{engine.name}: {method} {path}: {type(err).__name__}: {err}") from err
        if resp.status_code != 200:
            raise EngineCallError(f"{engine.name}: {method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json() if resp.content else None

    async def state(self, engine: EngineRef) -> EngineState:
        return EngineState.model_validate(await self._call("GET", engine, STATE_PATH))

    async def observe(self, engine: EngineRef) -> EngineObservation:
        """Version and pause state; an unreachable engine reads as version None."""
        try:
            s = await self.state(engine)
        except EngineCallError:
            return EngineObservation(version=None)
        return EngineObservation(version=s.weight_version, paused=s.paused)

    async def pause(self, engine: EngineRef, mode: PauseMode) -> None:
        await self._call("POST", engine, "/pause", params={"mode": mode})

    async def resume(self, engine: EngineRef) -> None:
        await self._call("POST", engine, "/resume")

    async def start_update(self, engine: EngineRef) -> None:
        await self._call("POST", engine, "/start_weight_update")

    async def update(self, engine: EngineRef, update_info: dict[str, Any]) -> None:
        await self._call(
            "POST", engine, "/update_weights", json={"update_info": update_info}, timeout=self.transfer_timeout_s
        )

    async def finish(self, engine: EngineRef, version: str) -> None:
        await self._call(
            "POST", engine, "/finish_weight_update", json={"weight_version": version}, timeout=self.transfer_timeout_s
        )

    async def in_flight(self, engine: EngineRef) -> list[InFlight]:
        view = RequestsView.model_validate(await self._call("GET", engine, REQUESTS_PATH))
        return [InFlight(r.request_id, tuple(r.weight_versions)) for r in view.in_flight]

    async def abort(self, engine: EngineRef, request_ids: list[str]) -> None:
        body = AbortRequest(request_ids=request_ids).model_dump()
        await self._call("POST", engine, ABORT_PATH, json=body)


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

    def __init__(self, core: Any, namespace: str, fleet: str, port: int = ENGINE_PORT) -> None:
        self._core = core  # kubernetes.client.CoreV1Api
        self.namespace, self.fleet, self.port = namespace, fleet, port
        self.selector = engine_discovery_selector(fleet)

    async def engines(self) -> list[EngineRef]:
        pods = await asyncio.to_thread(self._core.list_namespaced_pod, self.namespace, label_selector=self.selector)
        return [
            EngineRef(name=p.metadata.name, url=engine_url(p.status.pod_ip, self.port))
            for p in pods.items
            if p.status and p.status.pod_ip and p.metadata.deletion_timestamp is None
        ]

    async def set_phase(self, engine: EngineRef, phase: str, only_if: str | None = None) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            pod = await asyncio.to_thread(self._core.read_namespaced_pod, engine.name, self.namespace)
        except ApiException as err:
            log.warning("could not read %s to set its phase: %s %s", engine.name, err.status, err.reason)
            return
        current = (pod.metadata.annotations or {}).get(ANNOTATION_PHASE)
        if current == phase or (only_if is not None and current != only_if):
            return
        # Conditioned on the resourceVersion read: if the operator changed the phase
        # meanwhile, its newer decision stands.
        meta = {"resourceVersion": pod.metadata.resource_version, "annotations": {ANNOTATION_PHASE: phase}}
        body = {"metadata": meta}
        try:
            await asyncio.to_thread(self._core.patch_namespaced_pod, engine.name, self.namespace, body)
        except ApiException as err:
            # Best effort: the operator derives the same phase from the fleet's record
            # (fleet_weight_version), so a lost write delays the gateway, never a commit.
            if err.status not in (404, 409):
                log.warning("could not set %s to %s: %s %s", engine.name, phase, err.status, err.reason)
