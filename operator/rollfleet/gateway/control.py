"""The trainer's control of its fleet through the gateway: the fleet's state, pause and resume.

A pause asked for here is the same change as ``kubectl annotate rf/<fleet> rollfleet.dev/pause=<mode>``:
the gateway patches that annotation on the RolloutFleet, as the field manager
``rollfleet-client/<caller>``. The operator, the only one that pauses engines, acts on it as on
any annotation and records in ``status.pause`` the mode, the engines paused and who asked
(the annotation's field manager). One path, two triggers. The gateway only waits until the
status says it is done, and refuses while a weight push is moving the fleet (the sidecar
pauses and resumes the engines it updates; a fleet pause in the middle would leave half).

Talks to the API server only: the fleet (get, patch) and its weight-sync record (get).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from typing import Any

from rollfleet.contract import (
    ANNOTATION_PAUSE,
    ANNOTATION_RESUME,
    ROUTABLE_PHASES,
    EnginePhase,
    PauseMode,
    weights_record_name,
)
from rollfleet.errors import RollfleetError
from rollfleet.gateway.refusal import Refused
from rollfleet.kube import CONFIG_MAP, FLEET, Kube, NotFound
from rollfleet.sync.protocol import decode_record
from rollfleet_client.models import EngineState, FleetState, PauseState
from rollfleet_client.protocol import CALLER_HEADER, CALLER_MANAGER_PREFIX

CALLER_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


def caller_name(headers: Mapping[str, str], default: str) -> str:
    """Who asks for a pause or resume (X-Rollfleet-Caller, else `default`): it names the field manager, so it must
    be a name; Refused 400 otherwise."""
    caller = headers.get(CALLER_HEADER, default)
    if not CALLER_RE.match(caller):
        raise Refused(400, f"{CALLER_HEADER} must be 1-100 characters of [A-Za-z0-9._-]")
    return caller


_POLL_S = 0.25


class PushRunning(RollfleetError):
    """A weight push is moving the fleet: a pause or resume now would leave it half done."""


class NoSuchFleet(RollfleetError):
    """The gateway's fleet is gone (or was never made)."""


def field_manager(caller: str) -> str:
    """The managedFields name the operator reports as who asked."""
    return f"{CALLER_MANAGER_PREFIX}/{caller}"


def fleet_state(namespace: str, fleet: Mapping[str, Any], record_data: Mapping[str, str] | None) -> FleetState:
    """The fleet as its status and its weight-sync record show it. Pure."""
    status = fleet.get("status") or {}
    record = decode_record(record_data)
    pause = status.get("pause")
    push = record.push.target.version if record.push and record.push.phase.active else None
    generations = dict(record.history)
    if record.committed is None and status.get("weightVersion"):
        # No push recorded yet: the engines serve the weights they started with, generation 0.
        generations[status["weightVersion"]] = 0
    return FleetState(
        fleet=fleet["metadata"]["name"],
        namespace=namespace,
        replicas=int((fleet.get("spec") or {}).get("replicas") or 0),
        ready_replicas=int(status.get("readyReplicas") or 0),
        weight_version=status.get("weightVersion"),
        weight_generation=generations.get(status.get("weightVersion") or ""),
        generations=generations,
        push=push,
        pause=PauseState(
            mode=pause["mode"],
            since=pause["since"],
            paused_engines=pause.get("pausedEngines", 0),
            requested_by=pause.get("requestedBy"),
        )
        if pause
        else None,
        engines=[
            EngineState(
                name=e["name"], phase=e["phase"], weight_version=e.get("weightVersion"), in_flight=e.get("inFlight")
            )
            for e in status.get("engines") or ()
        ],
    )


def pause_done(state: FleetState, mode: PauseMode | None) -> bool:
    """The status shows the pause asked for: the operator recorded it and every serving engine is paused
    (or, asked to resume, the record is gone and no engine is paused)."""
    paused = [e.phase == EnginePhase.PAUSED for e in state.engines if e.phase in ROUTABLE_PHASES]
    if mode is None:
        return state.pause is None and not any(paused)
    return state.pause is not None and state.pause.mode == mode and all(paused)


class FleetControl:
    """One fleet, seen and paused through the API server."""

    def __init__(self, kube: Kube, namespace: str, fleet: str) -> None:
        self.kube, self.namespace, self.fleet = kube, namespace, fleet

    async def state(self) -> FleetState:
        try:
            fleet = await self.kube.get(FLEET, self.namespace, self.fleet)
        except NotFound:
            raise NoSuchFleet(f"RolloutFleet {self.namespace}/{self.fleet} does not exist") from None
        try:
            record = await self.kube.get(CONFIG_MAP, self.namespace, weights_record_name(self.fleet))
        except NotFound:
            record = {}  # a fleet the operator has not reconciled yet has no record
        return fleet_state(self.namespace, fleet, record.get("data"))

    async def pause(self, mode: PauseMode, caller: str, wait_s: float) -> FleetState:
        return await self._ask(mode, {ANNOTATION_PAUSE: mode, ANNOTATION_RESUME: None}, caller, wait_s)

    async def resume(self, caller: str, wait_s: float) -> FleetState:
        return await self._ask(None, {ANNOTATION_PAUSE: None, ANNOTATION_RESUME: None}, caller, wait_s)

    async def _ask(
        self, mode: PauseMode | None, annotations: Mapping[str, str | None], caller: str, wait_s: float
    ) -> FleetState:
        state = await self.state()
        if state.push is not None:
            raise PushRunning(
                f"a weight push to version {state.push} is in progress; the sync sidecar pauses and resumes the "
                "engines it updates itself. Ask again when the push has ended"
            )
        await self.kube.patch(
            FLEET,
            self.namespace,
            self.fleet,
            {"metadata": {"annotations": dict(annotations)}},
            field_manager=field_manager(caller),
        )
        return await self._until(lambda s: pause_done(s, mode), wait_s)

    async def _until(self, done: Callable[[FleetState], bool], wait_s: float) -> FleetState:
        """The state once `done`, or as it is after `wait_s` (the caller reads whether it is done)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            state = await self.state()
            if done(state) or asyncio.get_running_loop().time() >= deadline:
                return state
            await asyncio.sleep(_POLL_S)
