"""What to do next, given what is observed: pod actions, pause decisions, phase updates.

Pure. `plan_pods` scales up and down (scale-down drains first), replaces failed or
lost engines (one that crashed soon after it started waits out a doubling backoff first,
as kubelet's CrashLoopBackOff), and rolls spec changes one engine at a time within
maxUnavailable and maxSurge. Draining is explicit state on the pod (`rollfleet.dev/phase=Draining`,
`rollfleet.dev/draining-since`), so a restarted operator continues where it was.
`pause_request` and `pause_record` turn the fleet's annotations and its recorded pause
into the pause to hold; `engine_pause_calls` and `phase_updates` say which engines need a call or a new
phase annotation. Talks to nobody.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rollfleet.api.fleet import PauseStatus, UpdateStrategy
from rollfleet.contract import ANNOTATION_PAUSE, ANNOTATION_RESUME, EnginePhase, PauseMode, parse_pause_mode
from rollfleet.controller.status import Engine, EngineObs

# After an engine is marked Draining, gateways need a moment to see it and stop
# routing; an in-flight count of 0 before that could miss a request on its way.
DRAIN_SETTLE_SECONDS = 2.0


@dataclass(frozen=True)
class Create:
    index: int
    reason: str


def awaited_creations(
    created: Mapping[int, float], seen: Collection[int], now: float, patience_s: float
) -> dict[int, float]:
    """The engines created (index -> when) whose pods the watch has not shown yet, each for at most `patience_s`: a
    plan's creations at these indexes are in flight already (the expectations of Kubernetes' ReplicaSet controller)."""
    return {i: at for i, at in created.items() if i not in seen and now - at < patience_s}


Annotations = Mapping[str, str | None]  # a pod's annotation writes: None removes one


def awaited_annotations(
    changes: Mapping[str, Annotations],
    written: Mapping[str, tuple[str | None, Annotations]],
    versions: Mapping[str, str | None],
) -> tuple[dict[str, Annotations], dict[str, tuple[str | None, Annotations]]]:
    """The annotation writes a pass still has to make, and the writes still awaited in the watch. `written` has the
    last writes (pod -> the pod's resourceVersion they were made over, what they wrote); `versions` the pods'
    resourceVersions as the watch shows them now. A write is awaited while its pod is still at that version: the
    same write again is left out (a pass that ran before the watch delivered the last pass's patches made them all
    again: 2,896 pod patches for 2,000 engines coming up, bench_scale). Once the watch shows the pod changed, what it
    shows is the truth, whoever wrote it."""
    awaited = {name: w for name, w in written.items() if name in versions and versions[name] == w[0]}
    todo = {name: a for name, a in changes.items() if name not in awaited or awaited[name][1] != a}
    return todo, awaited


@dataclass(frozen=True)
class Drain:
    name: str
    reason: str


@dataclass(frozen=True)
class Delete:
    name: str
    reason: str
    force: bool = False  # grace period 0: for pods on a lost node, whose kubelet will never confirm
    # A crashed engine's: the crash count its replacement carries (the index's next backoff).
    crashes: int | None = None


PodAction = Create | Drain | Delete


def resolve(value: int | str, replicas: int, round_up: bool) -> int:
    """An int-or-percent budget in engines (percentages of replicas, as Deployments round them)."""
    if isinstance(value, int):
        return value
    exact = int(value.rstrip("%")) * replicas / 100
    return math.ceil(exact) if round_up else math.floor(exact)


def rollout_budget(strategy: UpdateStrategy, replicas: int) -> tuple[int, int]:
    """(maxUnavailable, maxSurge) in engines; never both 0, or an update could not progress."""
    surge = resolve(strategy.max_surge, replicas, round_up=True)
    unavailable = resolve(strategy.max_unavailable, replicas, round_up=False)
    return (1 if surge == 0 and unavailable == 0 else unavailable), surge


def disruption_budget(strategy: UpdateStrategy, replicas: int) -> int:
    """Engines that voluntary disruptions (a node drain's evictions) may take down at once: as many as a rolling
    update, and at least 1. A disruption cannot surge, and a budget of 0 would block every drain of a node that
    runs an engine for good."""
    return max(1, rollout_budget(strategy, replicas)[0])


def drain_finished(engine: Engine, drain_timeout: float, now: datetime) -> str | None:
    """Why a draining engine may be deleted now, or None to keep waiting."""
    obs = engine.obs
    if obs.draining_since is None:
        return "drain start unknown"
    waited = (now - obs.draining_since).total_seconds()
    if waited >= drain_timeout:
        return f"drain timeout ({drain_timeout:.0f}s) reached with {obs.in_flight} in flight"
    if obs.pod_phase != "Running" or not obs.ready:
        return "engine not running: nothing to wait for"
    if obs.in_flight == 0 and waited >= DRAIN_SETTLE_SECONDS:
        return f"drained after {waited:.0f}s"
    return None


def replace_failed(engine: Engine, current_hash: str, now: datetime) -> list[PodAction]:
    """Delete a failed engine (to be replaced) unless it crash-loops and its backoff has not passed.

    An outdated one (its spec was fixed) goes at once, and its replacement counts crashes afresh."""
    obs = engine.obs
    outdated = obs.template_hash != current_hash
    retry = obs.replace_at()
    if retry is not None and not outdated and now < retry:
        return []
    carry = obs.crashes + 1 if obs.crash_looping and not outdated else None
    return [Delete(obs.name, f"replacing failed engine: {engine.message}", crashes=carry)]


def plan_pods(
    engines: Sequence[Engine],
    *,
    replicas: int,
    current_hash: str,
    max_unavailable: int,
    max_surge: int,
    drain_timeout: float,
    now: datetime,
) -> list[PodAction]:
    """Pod actions that move the observed engines towards `replicas` up-to-date serving engines."""
    actions: list[PodAction] = []
    live: list[Engine] = []
    occupying = 0  # pods that hold (or will hold) node resources: counted against replicas + surge
    for e in sorted(engines, key=lambda e: e.obs.index):
        obs = e.obs
        if obs.node_lost:
            actions.append(Delete(obs.name, e.message or "node lost", force=True))
            continue
        if obs.terminating:  # on its way out (an engine that exits on SIGTERM is not a failure)
            occupying += 1
            continue
        if obs.failed:
            # Kept through a crash-loop backoff, the failed pod keeps its index (it holds no resources).
            actions += replace_failed(e, current_hash, now)
            continue
        occupying += 1
        if obs.draining:
            why = drain_finished(e, drain_timeout, now)
            if why is not None:
                actions.append(Delete(obs.name, why))
            continue
        live.append(e)

    old = [e for e in live if e.obs.template_hash != current_hash]
    limit = replicas + (max_surge if old else 0)

    # Scale down: the fewest useful engines go first (not serving, then outdated, then highest index).
    excess = len(live) - limit
    if excess > 0:
        victims = sorted(live, key=lambda e: (e.serving, e.obs.template_hash == current_hash, -e.obs.index))[:excess]
        for e in victims:
            actions.append(
                Drain(e.obs.name, "scale-down")
                if e.serving
                else Delete(e.obs.name, f"scale-down of a {e.phase} engine")
            )
        live = [e for e in live if e not in victims]
        old = [e for e in old if e not in victims]

    # Create: lowest free indices below the limit, so names stay <fleet>-engine-0..N-1 and a
    # replacement reuses the name of the engine it replaces (once that pod is gone).
    updated = len(live) - len(old)
    want = min(limit - occupying, replicas - updated, limit - len(live))
    taken = {e.obs.index for e in engines}
    free = [i for i in range(limit) if i not in taken]
    reason = "update" if old else f"{replicas} engines wanted, {len(live)} exist"
    actions += [Create(i, reason) for i in free[: max(0, want)]]

    # Roll: outdated engines that do not serve go at once; serving ones within maxUnavailable.
    if old:
        available = sum(e.serving for e in live)
        budget = available - (replicas - max_unavailable)
        for e in sorted(old, key=lambda e: (e.serving, -e.obs.index)):
            if not e.serving:
                actions.append(Delete(e.obs.name, f"update of a {e.phase} engine"))
            elif budget > 0:
                actions.append(Drain(e.obs.name, "update"))
                budget -= 1
    return actions


@dataclass(frozen=True)
class PauseRequest:
    """The pause the fleet's annotations ask for."""

    mode: PauseMode | None  # what engines should be: paused in this mode, or (None) running
    invalid_value: str | None = None  # a rollfleet.dev/pause value that was ignored
    remove_annotations: tuple[str, ...] = ()  # a one-shot resume consumes its annotation
    requested_by: str | None = None  # the field manager that set the pause annotation


def annotation_manager(metadata: Mapping[str, Any], key: str) -> str | None:
    """Who last set the annotation `key`: the field manager that owns it in managedFields
    (`kubectl-annotate`, or `rollfleet-client/<caller>` when a trainer asked the gateway)."""
    for entry in metadata.get("managedFields") or ():
        annotations = ((entry.get("fieldsV1") or {}).get("f:metadata") or {}).get("f:annotations") or {}
        if f"f:{key}" in annotations:
            return str(entry.get("manager") or "") or None
    return None


def pause_request(metadata: Mapping[str, Any], recorded: PauseStatus | None) -> PauseRequest:
    """`rollfleet.dev/pause=keep|wait|abort` pauses; removing it, or `rollfleet.dev/resume`, resumes."""
    annotations: Mapping[str, str] = metadata.get("annotations") or {}
    raw = annotations.get(ANNOTATION_PAUSE)
    if ANNOTATION_RESUME in annotations:
        return PauseRequest(
            None, remove_annotations=tuple(a for a in (ANNOTATION_RESUME, ANNOTATION_PAUSE) if a in annotations)
        )
    if raw is None:
        return PauseRequest(None)
    mode = parse_pause_mode(raw)
    if mode is not None:
        return PauseRequest(mode, requested_by=annotation_manager(metadata, ANNOTATION_PAUSE))
    # An invalid value changes nothing: the fleet keeps the pause it had (or had not).
    return PauseRequest(recorded.mode if recorded else None, invalid_value=raw)


def pause_record(
    request: PauseRequest, recorded: PauseStatus | None, engines: Sequence[Engine], now: datetime
) -> PauseStatus | None:
    """What status.pause becomes; while resuming, the record stays until no engine reports paused."""
    if request.mode is not None:
        return PauseStatus(
            mode=request.mode,
            since=recorded.since if recorded else now,
            paused_engines=recorded.paused_engines if recorded else 0,
            requested_by=request.requested_by,
        )
    if recorded is not None and any(
        e.obs.state and e.obs.state.paused for e in engines if e.phase not in (EnginePhase.DRAINING, EnginePhase.FAILED)
    ):
        return recorded
    return None


@dataclass(frozen=True)
class PauseCall:
    name: str
    mode: PauseMode


@dataclass(frozen=True)
class ResumeCall:
    name: str


def engine_pause_calls(
    mode: PauseMode | None, record: PauseStatus | None, engines: Sequence[Engine]
) -> list[PauseCall | ResumeCall]:
    """Engine control calls that make every reachable engine match the fleet's pause.

    Only a fleet pause is undone: an engine paused by the sync sidecar for a weight
    update while the fleet runs is not the operator's to resume, nor is one waiting
    for the fleet's weights (PendingSync): the sidecar resumes it once it catches up.
    """
    calls: list[PauseCall | ResumeCall] = []
    for e in engines:
        state = e.obs.state
        if state is None or e.phase in (EnginePhase.DRAINING, EnginePhase.FAILED):
            continue
        if mode is not None and (not state.paused or state.pause_mode not in (None, mode)):
            calls.append(PauseCall(e.obs.name, mode))
        elif mode is None and record is not None and state.paused and e.phase != EnginePhase.PENDING_SYNC:
            calls.append(ResumeCall(e.obs.name))
    return calls


def born_ready(pristine: bool, pause_mode: PauseMode | None) -> bool:
    """Whether a new engine is created Ready at weight generation 0, where otherwise it is created Starting and
    written Ready once its state says so: when nothing the operator checks can hold it back. No push ever
    (`pristine`: it serves the weights every engine started with) and no pause asked for. The gateway routes
    an engine only once its pod is Ready too, and its readiness probe passes only once the model is loaded.
    Each engine then needs no write of its own to start serving: at 2,000 engines, 2,000 pod patches fewer,
    each sent to every pod watcher (docs/architecture.md, "Scale")."""
    return pristine and pause_mode is None


def phase_updates(engines: Sequence[Engine], actions: Sequence[PodAction], born: bool) -> dict[str, str]:
    """Engines whose `rollfleet.dev/phase` annotation must change (the gateway routes on it). `born`
    (`born_ready`): an engine annotated Ready keeps its annotation while it is Starting (its pod not Ready, or its
    state not read): the gateway routes no pod that is not Ready, and nothing its state could say yet would hold it
    back. Otherwise it is held back as Starting until its state is read, in case it came back on other weights or
    into a paused fleet."""
    leaving = {a.name for a in actions if isinstance(a, Drain | Delete)}
    return {
        e.obs.name: e.phase
        for e in engines
        if e.phase != e.obs.annotated_phase
        and e.obs.name not in leaving
        and not e.obs.terminating
        and e.phase != EnginePhase.FAILED
        and not (born and e.obs.annotated_phase == EnginePhase.READY and e.phase == EnginePhase.STARTING)
    }


# Phases whose engine state changes only by the operator's own calls (a pause or resume, after which it reads
# the state anew) or by a push (whose record change drops every state read before it).
STEADY_PHASES = frozenset({EnginePhase.READY, EnginePhase.PAUSED})


def state_max_age(obs: EngineObs, busy: bool, busy_s: float, idle_s: float) -> float:
    """How old an engine's last read state may be before it is read again: `busy_s` while the fleet is busy, but
    only for an engine whose state may change on its own (loading, syncing); a steady engine waits `idle_s` even
    then. A converging fleet of 2,000 re-read every engine each second: the operator spent 58-60 CPU-seconds to
    converge, and 49-53 reading only these (bench_scale, docs/architecture.md "Scale", runs I and J against L and M)."""
    return busy_s if busy and obs.annotated_phase not in STEADY_PHASES else idle_s


def generation_updates(engines: Sequence[Engine], generations: Mapping[str, int | None]) -> dict[str, str | None]:
    """Engines whose `rollfleet.dev/weight-generation` annotation must change: the generation of the weights
    each reports (removed when the record does not know them). `generations` has the engines whose state was
    read this time; the others keep theirs until it is."""
    updates: dict[str, str | None] = {}
    for e in engines:
        if e.obs.terminating or e.obs.name not in generations:
            continue
        generation = generations[e.obs.name]
        value = None if generation is None else str(generation)
        if value != e.obs.annotated_generation:
            updates[e.obs.name] = value
    return updates
