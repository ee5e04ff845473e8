"""From observations to facts: each engine's phase, and the fleet's status and conditions.

Pure. `observe_pod` reads an engine pod (as the API server serves it) plus what the
operator knows about its node and last polled engine state (`Observations` keeps them between passes);
`classify` gives the
engine its phase (the one the gateway routes on, via the pod's `rollfleet.dev/phase`);
`fleet_status` builds the status subresource, conditions included. Talks to nobody.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from rollfleet.api.common import Condition, ConditionStatus
from rollfleet.api.fleet import (
    LISTED_ENGINES_MAX,
    EngineStatus,
    GatewayStatus,
    InferenceAuth,
    PauseStatus,
    RolloutFleetSpec,
    RolloutFleetStatus,
)
from rollfleet.contract import (
    ANNOTATION_CRASHES,
    ANNOTATION_DRAINING_SINCE,
    ANNOTATION_PAUSE,
    ANNOTATION_PHASE,
    ANNOTATION_TEMPLATE_HASH,
    ANNOTATION_WEIGHT_GENERATION,
    LWS_LABEL_NAME,
    ROUTABLE_PHASES,
    EnginePhase,
    engine_index,
)
from rollfleet.controller.groups import Blocked
from rollfleet_engine.protocol import EngineState

# The Paused condition's reason (and a Warning event) while engines are paused but the fleet is not.
ENGINES_PAUSED_ALONE = "EnginesPausedAlone"
LOG_LINES = 5  # of a failed engine's log, in its status message
LOG_CHARS = 600


def parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


@dataclass(frozen=True)
class Exited:
    """The end of an engine container: when, and after how long a run."""

    at: datetime
    ran_s: float | None


# kubelet's CrashLoopBackOff, for engines the operator replaces (restartPolicy Never).
CRASH_BACKOFF_START_S = 10.0
CRASH_BACKOFF_CAP_S = 300.0
CRASH_RESET_AFTER_S = 600.0  # an engine that ran this long before it failed starts the count afresh


def crash_backoff_s(crashes: int) -> float:
    """How long a failed engine stays before its replacement, after `crashes` crashes before it."""
    return min(CRASH_BACKOFF_CAP_S, CRASH_BACKOFF_START_S * 2.0**crashes)


@dataclass(frozen=True)
class EngineObs:
    """One engine pod as observed: the pod's facts, its node's, and the engine's own state."""

    name: str
    index: int
    template_hash: str | None
    pod_phase: str  # Pending, Running, Succeeded, Failed, Unknown
    ready: bool  # the pod's Ready condition (the engine's readiness probe passes)
    terminating: bool  # the pod has a deletionTimestamp
    annotated_phase: str | None  # rollfleet.dev/phase as last written
    draining_since: datetime | None
    node: str | None
    node_lost: bool  # its node is gone or not Ready
    pod_ip: str | None
    reason: str | None  # why it is not running (terminated container, unschedulable, ...)
    state: EngineState | None = None  # last GET /rollfleet/v1/state; None: not (yet) reachable
    crashes: int = 0  # engines of this index that crashed in a row before this one
    exited: Exited | None = None  # when its engine container ended, if it did
    group: str | None = None  # the LeaderWorkerSet of a multi-pod engine, whose leader this pod is
    annotated_generation: str | None = None  # rollfleet.dev/weight-generation as last written
    resource_version: str | None = None  # the pod's, as the watch last showed it

    @property
    def failed(self) -> bool:
        return self.pod_phase in ("Failed", "Succeeded")

    @property
    def draining(self) -> bool:
        return self.annotated_phase == EnginePhase.DRAINING

    @property
    def crash_looping(self) -> bool:
        """It failed soon after it started: its replacement waits out a backoff (not a lost node)."""
        return (
            self.failed
            and not self.node_lost
            and self.exited is not None
            and (self.exited.ran_s is None or self.exited.ran_s < CRASH_RESET_AFTER_S)
        )

    def replace_at(self) -> datetime | None:
        """When a crash-looping engine may be replaced (None: at once)."""
        if not self.crash_looping:
            return None
        assert self.exited is not None
        return self.exited.at + timedelta(seconds=crash_backoff_s(self.crashes))

    @property
    def in_flight(self) -> int | None:
        return None if self.state is None else self.state.running + self.state.waiting


def observe_pod(pod: Mapping[str, Any], fleet: str, node_lost: bool, state: EngineState | None) -> EngineObs | None:
    """The observation of an engine pod of `fleet`; None for a pod that is not one."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    index = engine_index(meta.get("name", ""), fleet)
    if index is None:
        return None
    annotations = meta.get("annotations") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    return EngineObs(
        name=meta["name"],
        index=index,
        template_hash=annotations.get(ANNOTATION_TEMPLATE_HASH),
        pod_phase=status.get("phase") or "Pending",
        ready=conditions.get("Ready", {}).get("status") == "True",
        terminating=meta.get("deletionTimestamp") is not None,
        annotated_phase=annotations.get(ANNOTATION_PHASE),
        annotated_generation=annotations.get(ANNOTATION_WEIGHT_GENERATION),
        resource_version=meta.get("resourceVersion"),
        draining_since=parse_time(annotations.get(ANNOTATION_DRAINING_SINCE)),
        node=(pod.get("spec") or {}).get("nodeName"),
        node_lost=node_lost,
        pod_ip=status.get("podIP"),
        reason=not_running_reason(status, conditions),
        state=state,
        crashes=_int(annotations.get(ANNOTATION_CRASHES)),
        exited=_exited(status),
        group=(meta.get("labels") or {}).get(LWS_LABEL_NAME),
    )


class Observations:
    """A fleet's engine observations, each kept while what it was made of is unchanged: its pod (the
    resourceVersion), its node's loss, its engine's state (the object last read). A pass of a fleet of 2,000 observes
    every pod, and few changed since the pass before."""

    def __init__(self, fleet: str) -> None:
        self._fleet = fleet
        self._pods: dict[str, tuple[tuple[str | None, bool], EngineObs | None]] = {}
        self._stated: dict[str, tuple[EngineObs, EngineState | None, EngineObs]] = {}

    def observe(
        self, pods: Iterable[Mapping[str, Any]], node_lost: Callable[[Mapping[str, Any]], bool]
    ) -> list[EngineObs]:
        """`observe_pod` of each of the fleet's engine pods, without its state."""
        kept: dict[str, tuple[tuple[str | None, bool], EngineObs | None]] = {}
        observed = []
        for pod in pods:
            meta = pod["metadata"]
            key = (meta.get("resourceVersion"), node_lost(pod))
            known = self._pods.get(meta["name"])
            if known is not None and known[0] == key and key[0] is not None:
                obs = known[1]
            else:
                obs = observe_pod(pod, self._fleet, key[1], None)
            kept[meta["name"]] = (key, obs)
            if obs is not None:
                observed.append(obs)
        self._pods = kept
        return observed

    def with_states(self, observed: Sequence[EngineObs], states: Mapping[str, EngineState | None]) -> list[EngineObs]:
        """`observed` (from `observe`), each with its engine's state in `states`."""
        kept: dict[str, tuple[EngineObs, EngineState | None, EngineObs]] = {}
        stated = []
        for o in observed:
            state = states.get(o.name)
            known = self._stated.get(o.name)
            if known is not None and known[0] is o and known[1] is state:
                full = known[2]
            else:
                full = dataclasses.replace(o, state=state)
            kept[o.name] = (o, state, full)
            stated.append(full)
        self._stated = kept
        return stated


def _int(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def _exited(status: Mapping[str, Any]) -> Exited | None:
    for cs in status.get("containerStatuses") or []:
        t = (cs.get("state") or {}).get("terminated")
        if t and t.get("finishedAt"):
            finished = parse_time(t["finishedAt"])
            assert finished is not None
            started = parse_time(t.get("startedAt"))
            return Exited(finished, (finished - started).total_seconds() if started else None)
    return None


def not_running_reason(status: Mapping[str, Any], conditions: Mapping[str, Any], what: str = "engine") -> str | None:
    """Why a pod's container does not run (exited, cannot start, not scheduled), or None."""
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "terminated" in state:
            t = state["terminated"]
            why = f"{what} exited with code {t.get('exitCode')} ({t.get('reason') or 'no reason'})"
            # The container's last log lines (terminationMessagePolicy FallbackToLogsOnError), shortened.
            lines = [line.strip() for line in (t.get("message") or "").splitlines() if line.strip()]
            tail = " | ".join(lines[-LOG_LINES:])
            return f"{why}: {tail[-LOG_CHARS:]}" if tail else why
        if "waiting" in state and state["waiting"].get("reason") not in (None, "ContainerCreating"):
            w = state["waiting"]
            return f"{w.get('reason')}: {w.get('message') or ''}".strip(": ")
    scheduled = conditions.get("PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return f"{scheduled.get('reason')}: {scheduled.get('message') or ''}".strip(": ")
    return status.get("reason") and f"{status.get('reason')}: {status.get('message') or ''}"


@dataclass(frozen=True)
class Engine:
    """An observed engine and the phase it is in."""

    obs: EngineObs
    phase: EnginePhase
    message: str | None = None

    @property
    def serving(self) -> bool:
        return self.phase in ROUTABLE_PHASES


@dataclass(frozen=True)
class WeightView:
    """What the sync protocol says about weights (rollfleet.sync.fleetversion), reduced to what phases need."""

    version: str | None
    pending_sync: frozenset[str]
    syncing: bool  # a push is under way


def classify(obs: EngineObs, weights: WeightView, fleet_paused: bool, require_sync: bool) -> Engine:
    """The engine's phase, with a message saying why when it does not serve."""
    if obs.node_lost:
        return Engine(obs, EnginePhase.FAILED, f"node {obs.node} is lost")
    if obs.terminating:
        return Engine(obs, EnginePhase.DRAINING, "pod is being deleted")
    if obs.failed:
        why = obs.reason or f"pod {obs.pod_phase}"
        retry = obs.replace_at()
        if retry is not None:
            why = f"crashed {obs.crashes + 1} time(s) in a row, replaced from {retry:%H:%M:%S}Z on: {why}"
        return Engine(obs, EnginePhase.FAILED, why)
    if obs.draining:
        in_flight = obs.in_flight if obs.in_flight is not None else "?"
        return Engine(obs, EnginePhase.DRAINING, f"draining, {in_flight} in flight")
    if obs.pod_phase != "Running":
        return Engine(obs, EnginePhase.STARTING, obs.reason or "pod is being scheduled and started")
    if not obs.ready:
        # Never read: an engine born Ready (plan.born_ready) is annotated Ready while it loads.
        loading = obs.annotated_phase in (None, EnginePhase.STARTING) or obs.state is None
        return Engine(obs, EnginePhase.STARTING, "loading the model" if loading else "readiness probe failing")
    if obs.state is None:
        return Engine(obs, EnginePhase.STARTING, "waiting for the engine's state")
    # Before Paused: a paused engine is routable (it holds requests), one on other weights must not be.
    if require_sync and obs.name in weights.pending_sync:
        return Engine(obs, EnginePhase.PENDING_SYNC, _not_the_fleets(obs.state, weights.version))
    if obs.state.paused:
        return Engine(obs, EnginePhase.SYNCING if weights.syncing and not fleet_paused else EnginePhase.PAUSED)
    if fleet_paused and obs.annotated_phase in (None, EnginePhase.STARTING):
        # A new engine in a paused fleet gets no traffic until it is paused too.
        return Engine(obs, EnginePhase.STARTING, "pausing to join the paused fleet")
    return Engine(obs, EnginePhase.READY)


def _not_the_fleets(state: EngineState, version: str | None) -> str:
    if state.served_version is not None and state.served_version == version:  # the label, not the bytes
        return (
            f"its weights are labelled {version} but were not verified against {version}'s manifest as they were "
            f"loaded (it reports {state.weights_manifest_sha256 or 'none'}): not routed until the sidecar loads "
            f"{version} again"
        )
    return f"weights {state.weight_version} are not the fleet's {version}"


@dataclass(frozen=True)
class GatewayObs:
    replicas: int
    ready_replicas: int
    owner: str | None = None  # the uid of the fleet that owns the Deployment


def _condition(
    previous: Sequence[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> Condition:
    value: ConditionStatus = "True" if status else "False"
    old = next((c for c in previous if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == value else now
    return Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


@dataclass(frozen=True)
class PauseView:
    """The fleet's pause as the operator tracks it: recorded state plus any refused annotation value."""

    status: PauseStatus | None
    invalid_value: str | None = None
    resuming: bool = False  # the pause was lifted; `status` stays until no engine reports paused


# A condition's (status, reason, message), before its transition time is settled.
CondValue = tuple[bool, str, str]


def _ready_condition(ready: int, desired: int, gateway: GatewayObs | None, gateway_enabled: bool) -> CondValue:
    gateway_ready = not gateway_enabled or (gateway is not None and gateway.ready_replicas > 0)
    gateway_note = (
        f"; gateway {gateway.ready_replicas if gateway else 0}/{gateway.replicas if gateway else 0} ready"
        if gateway_enabled
        else ""
    )
    message = f"{ready}/{desired} engines serve{gateway_note}"
    if ready < desired:
        return False, "EnginesNotReady", message
    if not gateway_ready:
        return False, "GatewayNotReady", message
    return True, "AllEnginesReady", message


def _progress_condition(staying: int, leaving: int, updated: int, ready: int, desired: int) -> CondValue:
    if staying < desired:
        return True, "ScalingUp", f"{staying}/{desired} engines exist"
    if staying > desired:
        return True, "ScalingDown", f"{staying}/{desired} engines exist"
    if updated < staying:
        return True, "RollingUpdate", f"{updated}/{desired} engines updated"
    if leaving:
        return True, "Draining", f"{leaving} engines finish their requests before deletion"
    if ready < desired:
        return True, "EnginesStarting", f"{ready}/{desired} engines serve"
    return False, "Complete", f"{desired} engines, all up to date"


def _degraded_condition(
    engines: Sequence[Engine],
    staying: Sequence[Engine],
    ready: int,
    desired: int,
    generation: int | None,
    previous: RolloutFleetStatus | None,
) -> CondValue:
    """An engine failed, or the fleet served fully for this spec and no longer does. It stays
    set (status is the memory, across operator restarts) until every engine serves."""
    failed = [e for e in engines if e.phase == EnginePhase.FAILED]
    if failed:
        return True, "EngineFailed", "; ".join(f"{e.obs.name}: {e.message}" for e in failed)
    was_degraded = any(c.type == "Degraded" and c.status == "True" for c in (previous.conditions if previous else []))
    converged_before = (
        previous is not None and previous.observed_generation == generation and previous.ready_replicas >= desired
    )
    if ready < desired and (was_degraded or converged_before):
        lost = ", ".join(f"{e.obs.name} ({e.phase}: {e.message})" for e in staying if not e.serving) or "pods missing"
        return True, "EnginesLost", f"{ready}/{desired} engines serve; replacing {lost}"
    return False, "AsExpected", "no engine failed"


def _pause_condition(pause: PauseView, paused: Sequence[Engine], staying: int) -> CondValue:
    if pause.status is not None and pause.resuming:
        cond = (True, "Resuming", f"mode {pause.status.mode} lifted: {len(paused)}/{staying} engines still paused")
    elif pause.status is not None:
        reason = "Paused" if len(paused) >= staying else "Pausing"
        cond = (True, reason, f"mode {pause.status.mode}: {len(paused)}/{staying} engines paused")
    elif paused:
        # Paused at the engine's own control route (a person, a test, a framework), not by the fleet:
        # the operator cannot tell whether whoever paused it still needs it held, so it leaves it.
        names = ", ".join(f"{e.obs.name} ({e.obs.state.pause_mode if e.obs.state else None})" for e in paused)
        cond = (
            False,
            ENGINES_PAUSED_ALONE,
            f"the fleet is not paused, but {names} paused at its own control route; the operator leaves such "
            "a pause to whoever made it: POST /resume to the engine, or pause the fleet and resume it",
        )
    else:
        cond = (False, "Running", "not paused")
    if pause.invalid_value is None:
        return cond
    return (
        cond[0],
        "InvalidPauseAnnotation",
        f"{ANNOTATION_PAUSE}={pause.invalid_value!r} is not keep, wait or abort; ignored ("
        + ("fleet stays paused)" if pause.status else "fleet keeps running)"),
    )


def fleet_status(
    *,
    spec: RolloutFleetSpec,
    generation: int | None,
    current_hash: str,
    selector: str,
    engines: Sequence[Engine],
    weights: WeightView,
    pause: PauseView,
    gateway: GatewayObs | None,
    gateway_endpoint: str,
    gateway_enabled: bool,
    previous: RolloutFleetStatus | None,
    now: datetime,
    blocked: Blocked | None = None,
) -> RolloutFleetStatus:
    """The status subresource: counts, per-engine entries, pause, gateway and conditions. `blocked`: why the
    operator leaves the engines as they are (a shape the cluster cannot run)."""
    desired = spec.replicas
    existing = [e for e in engines if not e.obs.terminating]
    leaving = [e for e in existing if e.phase == EnginePhase.DRAINING]
    staying = [e for e in existing if e.phase != EnginePhase.DRAINING]
    ready = sum(e.serving for e in staying)
    updated = sum(e.obs.template_hash == current_hash for e in staying)

    entries = [
        EngineStatus(
            name=e.obs.name,
            index=e.obs.index,
            phase=e.phase,
            node=e.obs.node,
            pod_ip=e.obs.pod_ip,
            updated=e.obs.template_hash == current_hash,
            weight_version=e.obs.state.weight_version if e.obs.state else None,
            weights_manifest=e.obs.state.weights_manifest_sha256 if e.obs.state else None,
            in_flight=e.obs.in_flight,
            message=e.message,
        )
        for e in sorted(engines, key=lambda e: e.obs.index)
    ]
    paused = [e for e in staying if e.phase == EnginePhase.PAUSED]
    pause_status = pause.status.model_copy(update={"paused_engines": len(paused)}) if pause.status else None

    prev_conditions = previous.conditions if previous else []
    values = {
        "Ready": _ready_condition(ready, desired, gateway, gateway_enabled),
        "Progressing": (
            (False, blocked.reason, "no engine is created or replaced until this is fixed")
            if blocked
            else _progress_condition(len(staying), len(leaving), updated, ready, desired)
        ),
        "Degraded": (
            (True, blocked.reason, blocked.message)
            if blocked
            else _degraded_condition(engines, staying, ready, desired, generation, previous)
        ),
        "Paused": _pause_condition(pause, paused, len(staying)),
    }
    conditions = [_condition(prev_conditions, t, *c, generation=generation, now=now) for t, c in values.items()]
    return RolloutFleetStatus(
        observed_generation=generation,
        replicas=len(existing),
        ready_replicas=ready,
        updated_replicas=updated,
        ready=f"{ready}/{desired}",
        selector=selector,
        weight_version=weights.version,
        engines=entries,
        pause=pause_status,
        gateway=GatewayStatus(
            endpoint=gateway_endpoint,
            replicas=gateway.replicas if gateway else 0,
            ready_replicas=gateway.ready_replicas if gateway else 0,
        )
        if gateway_enabled
        else None,
        auth=inference_auth(spec, existing),
        conditions=conditions,
    )


def listed(status: RolloutFleetStatus) -> RolloutFleetStatus:
    """The status as written (pure): a fleet of more than LISTED_ENGINES_MAX engines lists only the engines that
    need a look, and counts the rest; every fleet's status counts its engines by phase. The operator keeps the
    whole view in memory (its metrics, its events)."""
    phases = dict(sorted(Counter(e.phase.value for e in status.engines).items()))
    if len(status.engines) <= LISTED_ENGINES_MAX:
        return status.model_copy(update={"engine_phases": phases})
    routine = (EnginePhase.READY, EnginePhase.PAUSED)
    odd = [
        e
        for e in status.engines
        if e.phase not in routine
        or not e.updated
        or (status.weight_version is not None and e.weight_version != status.weight_version)
    ]
    shown = odd[:LISTED_ENGINES_MAX]
    update = {"engines": shown, "engines_unlisted": len(status.engines) - len(shown), "engine_phases": phases}
    return status.model_copy(update=update)


def inference_auth(spec: RolloutFleetSpec, engines: Sequence[Engine]) -> InferenceAuth:
    """Open when the spec opens generation or any engine says it serves without a token (one started before
    the spec asked for one, until it is replaced); Token otherwise."""
    if spec.auth.inference == "Open" or any(e.obs.state is not None and e.obs.state.inference_open for e in engines):
        return "Open"
    return "Token"
