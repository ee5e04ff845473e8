"""The weight sync protocol: the durable push record and every decision made on it. Pure.

A push moves the fleet from the *committed* weights (version A, generation g) to a
*target* (version B, generation g+1). Versions are free-form labels chosen by the
trainer; generations are the order: a monotonically increasing integer assigned by the
sidecar, so staleness ("how many versions behind") is a subtraction.

The record lives in the fleet's ConfigMap ``<fleet>-weights`` (``store`` writes it with
optimistic concurrency; the trainer may write that object and no other part of the fleet)
so that a restarted sidecar, and the operator, know:

- which version every routable engine must have (``committed``), and where an engine
  that starts later can pull it from (``url`` + ``manifest_sha256``);
- whether a push was under way (``push.phase``), towards what, and from what.

Push phases, each written *before* the step it announces::

    InProgress ──(≥1 engine finished and verified)──▶ Committed ──(resumed)──▶ Done
        │
        └──(no engine got the target)──▶ RolledBack

Consistency rule: an engine is routable only if it reports the committed version
(or, while a push is InProgress, the target: it is then paused by the sidecar and only
holds requests). Everything else is PendingSync until it is caught up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from rollfleet.contract import (
    ANNOTATION_MAX_STALENESS,
    RECORD_ENGINE_TEMPLATE,
    RECORD_MODEL,
    RECORD_SYNC_STATE,
    RECORD_WEIGHT_GENERATION,
    RECORD_WEIGHT_VERSION,
    RECORD_WEIGHTS_URL,
)
from rollfleet.errors import RollfleetError

# Versions remembered for staleness (request versions -> generations).
HISTORY_LENGTH = 64


class PushPhase(StrEnum):
    IN_PROGRESS = "InProgress"  # engines may be paused; some may already have the target
    COMMITTED = "Committed"  # the target is the fleet's version; engines are being resumed
    DONE = "Done"
    ROLLED_BACK = "RolledBack"  # the fleet stayed on the committed version

    @property
    def active(self) -> bool:
        return self in (PushPhase.IN_PROGRESS, PushPhase.COMMITTED)


class PushRefused(RollfleetError, ValueError):
    """A push that must not start (another is active, or the version was already used)."""


@dataclass(frozen=True)
class WeightsRef:
    """One set of weights: its label, its order, and where it can be pulled from."""

    version: str
    generation: int
    url: str | None = None  # weights server serving it (None: the engines' initial weights)
    manifest_sha256: str | None = None  # pins the exact weights served at url
    source: str | None = None  # directory the sidecar serves it from (None: not servable)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightsRef:
        return cls(
            version=str(data["version"]),
            generation=int(data["generation"]),
            url=data.get("url"),
            manifest_sha256=data.get("manifest_sha256"),
            source=data.get("source"),
        )


@dataclass(frozen=True)
class PushRecord:
    phase: PushPhase
    target: WeightsRef
    previous: WeightsRef | None
    started_at: float
    failed: tuple[str, ...] = ()  # engines left out of the commit (PendingSync)
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "target": self.target.to_json(),
            "previous": self.previous.to_json() if self.previous else None,
            "started_at": self.started_at,
            "failed": list(self.failed),
            "message": self.message,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PushRecord:
        prev = data.get("previous")
        return cls(
            phase=PushPhase(data["phase"]),
            target=WeightsRef.from_json(data["target"]),
            previous=WeightsRef.from_json(prev) if prev else None,
            started_at=float(data.get("started_at", 0.0)),
            failed=tuple(data.get("failed", ())),
            message=str(data.get("message", "")),
        )


@dataclass(frozen=True)
class FleetRecord:
    """Everything the sidecar keeps on the fleet."""

    committed: WeightsRef | None = None
    push: PushRecord | None = None
    history: tuple[tuple[str, int], ...] = field(default=())  # (version, generation), oldest first
    engine_template: str | None = None  # the operator's: the template engines roll to (never encoded here)

    @property
    def generation(self) -> int:
        return self.committed.generation if self.committed else 0

    def generation_of(self, version: str) -> int | None:
        return next((g for v, g in reversed(self.history) if v == version), None)

    @property
    def pristine(self) -> bool:
        """No push was ever started: the fleet serves the weights of its spec.model, those an engine starts with
        (generation 0; at most adopted as the fleet's version, ``adopt_initial``). A record kept for another model
        starts over (``operator_fields``)."""
        return self.push is None and self.generation == 0


# --- the record as the ConfigMap's data --------------------------------------------


def encode_record(record: FleetRecord) -> dict[str, str | None]:
    """Data keys to merge into the record's ConfigMap (None deletes a key).

    The JSON under ``sync-state`` is the whole record; the plain keys repeat the
    committed version for people (``kubectl get cm <fleet>-weights -o yaml``).
    """
    state = {
        "committed": record.committed.to_json() if record.committed else None,
        "push": record.push.to_json() if record.push else None,
        "history": [list(h) for h in record.history],
    }
    c = record.committed
    return {
        RECORD_SYNC_STATE: json.dumps(state, sort_keys=True, separators=(",", ":")),
        RECORD_WEIGHT_VERSION: c.version if c else None,
        RECORD_WEIGHT_GENERATION: str(c.generation) if c else None,
        RECORD_WEIGHTS_URL: c.url if c else None,
    }


def decode_record(data: Mapping[str, str] | None) -> FleetRecord:
    """The record from its ConfigMap's data; an absent or empty one reads as empty."""
    data = data or {}
    template = data.get(RECORD_ENGINE_TEMPLATE)
    raw = data.get(RECORD_SYNC_STATE)
    if raw:
        state = json.loads(raw)
        committed, push = state.get("committed"), state.get("push")
        return FleetRecord(
            committed=WeightsRef.from_json(committed) if committed else None,
            push=PushRecord.from_json(push) if push else None,
            history=tuple((str(v), int(g)) for v, g in state.get("history", ())),
            engine_template=template,
        )
    version = data.get(RECORD_WEIGHT_VERSION)
    if version:  # set by hand: a committed version without a source
        generation = int(data.get(RECORD_WEIGHT_GENERATION) or 0)
        ref = WeightsRef(version, generation, url=data.get(RECORD_WEIGHTS_URL))
        return FleetRecord(committed=ref, history=((version, generation),), engine_template=template)
    return FleetRecord(engine_template=template)


def operator_fields(data: Mapping[str, str] | None, model: str, engine_template: str) -> dict[str, str | None] | None:
    """What the operator writes into the record for the fleet's spec.model and engine template, or None.

    A record kept for another model starts over, empty (the next push is generation 1 again):
    weights pushed for that model must not reach engines of this one, nor hold them in
    PendingSync. The template only gates adoption (``adopt_initial``).
    """
    data = data or {}
    if data.get(RECORD_MODEL) != model:
        ours = (RECORD_MODEL, RECORD_ENGINE_TEMPLATE)
        return {k: None for k in data if k not in ours} | {RECORD_MODEL: model, RECORD_ENGINE_TEMPLATE: engine_template}
    if data.get(RECORD_ENGINE_TEMPLATE) != engine_template:
        return {RECORD_ENGINE_TEMPLATE: engine_template}
    return None


def max_staleness(annotations: Mapping[str, str] | None, default: int | None) -> int | None:
    """The fleet's staleness bound: its annotation, else the sidecar's flag (None: unbounded)."""
    raw = (annotations or {}).get(ANNOTATION_MAX_STALENESS)
    if raw is None or raw.strip() == "":
        return default
    if not raw.strip().isdigit():
        raise ValueError(
            f"the fleet's annotation {ANNOTATION_MAX_STALENESS}={raw!r} is not a whole number >= 0 "
            "(generations a request may run behind); fix or remove it"
        )
    return int(raw)


# --- transitions ---------------------------------------------------------------------


def adopt_initial(
    record: FleetRecord, versions: Sequence[str | None], templates: Sequence[str | None] | None = None
) -> FleetRecord:
    """A fleet never pushed to: adopt the version its engines started with, if they agree.

    ``templates``: the engine pods' template hashes (None where there are no pods: static
    mode). Then every one must be the record's ``engine_template``: while a rollout replaces
    engines (a model change among others), the old ones' version is not the fleet's.
    """
    if templates is not None and (record.engine_template is None or set(templates) != {record.engine_template}):
        return record
    if record.committed is not None or not versions or any(v is None for v in versions) or len(set(versions)) != 1:
        return record
    version = str(versions[0])
    return replace(record, committed=WeightsRef(version, 0), history=((version, 0),))


def begin_push(record: FleetRecord, target: WeightsRef, now: float) -> FleetRecord:
    """Record a push as InProgress; refuse if one is active or the version was used."""
    if record.push is not None and record.push.phase.active:
        raise PushRefused(
            f"push of {record.push.target.version!r} (generation {record.push.target.generation}) is still "
            f"{record.push.phase.value}"
        )
    if record.generation_of(target.version) is not None:
        raise PushRefused(f"version {target.version!r} was already pushed; every push needs a new version label")
    if target.generation != record.generation + 1:
        raise PushRefused(f"target generation {target.generation} does not follow {record.generation}")
    push = PushRecord(PushPhase.IN_PROGRESS, target, record.committed, now)
    return replace(record, push=push)


def commit(record: FleetRecord, failed: Sequence[str] = (), message: str = "") -> FleetRecord:
    """The target becomes the fleet's version; the failed engines stay out of routing."""
    push = _active(record)
    history = (*record.history, (push.target.version, push.target.generation))[-HISTORY_LENGTH:]
    done = replace(push, phase=PushPhase.COMMITTED, failed=tuple(sorted(failed)), message=message)
    return FleetRecord(committed=push.target, push=done, history=history)


def complete(record: FleetRecord) -> FleetRecord:
    """After resume: Committed -> Done."""
    push = _active(record)
    return replace(record, push=replace(push, phase=PushPhase.DONE))


def roll_back(record: FleetRecord, message: str) -> FleetRecord:
    """The fleet stays on the committed version."""
    push = _active(record)
    return replace(record, push=replace(push, phase=PushPhase.ROLLED_BACK, message=message))


def _active(record: FleetRecord) -> PushRecord:
    if record.push is None or not record.push.phase.active:
        raise ValueError("no active push in the record")
    return record.push


# --- decisions -----------------------------------------------------------------------


@dataclass(frozen=True)
class EngineObservation:
    """One engine as the sidecar sees it: None version means unreachable. `intact` is false while its
    weights are no one version (EngineState.weights_intact): then it serves no version (`served`)."""

    version: str | None
    paused: bool | None = None
    intact: bool = True
    manifest: str | None = None  # EngineState.weights_manifest_sha256: the proof of its bytes

    @property
    def reachable(self) -> bool:
        return self.version is not None

    @property
    def served(self) -> str | None:
        return self.version if self.intact else None

    def serves(self, ref: WeightsRef) -> bool:
        """Whether it serves `ref`: its label, and where the record pins the bytes, the proof of them."""
        return self.served == ref.version and proven(ref, self.manifest)


def layout_change(
    current: Mapping[str, tuple[str, tuple[int, ...]]], new: Mapping[str, tuple[str, tuple[int, ...]]], shown: int = 3
) -> str | None:
    """How a push's tensors (name -> dtype, shape) differ from the fleet's current ones, or None."""
    problems = [f"{name!r} is not in the current weights" for name in sorted(set(new) - set(current))]
    problems += [f"{name!r} is missing" for name in sorted(set(current) - set(new))]
    problems += [
        f"{name!r} is {new[name][0]} {list(new[name][1])}, the current one {current[name][0]} {list(current[name][1])}"
        for name in sorted(set(new) & set(current))
        if new[name] != current[name]
    ]
    if not problems:
        return None
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def should_commit(succeeded: Sequence[str]) -> bool:
    """Commit when at least one engine finished and verified the target.

    The others are PendingSync and get caught up (or replaced); rolling back a fleet
    where most engines already hold the trainer's newest weights would throw that away.
    """
    return len(succeeded) > 0


class RecoveryAction(StrEnum):
    NOTHING = "nothing"  # no active push
    RESUME = "resume"  # Committed: resume the engines on the committed version
    ROLL_FORWARD = "roll-forward"  # re-run the transfer to the target (its source still exists)
    ROLL_BACK = "roll-back"  # nothing reached the target: resume on the committed version
    REPUSH_PREVIOUS = "repush-previous"  # some reached the target, its source is gone: push them back
    COMMIT_PARTIAL = "commit-partial"  # neither source exists: commit the target with those that have it


def plan_recovery(
    record: FleetRecord,
    observed: Mapping[str, EngineObservation],
    target_source_exists: bool,
    previous_source_exists: bool,
) -> RecoveryAction:
    """What a restarted sidecar does with the push it finds on the fleet.

    Prefers finishing what the trainer asked for; rolls back only when the target's
    weights are gone. Whatever the action, the engines not on the resulting version
    stay out of routing (``routable``), so no mix is ever served.
    """
    push = record.push
    if push is None or not push.phase.active:
        return RecoveryAction.NOTHING
    if push.phase is PushPhase.COMMITTED:
        return RecoveryAction.RESUME
    if target_source_exists:
        return RecoveryAction.ROLL_FORWARD
    if not any(o.served == push.target.version for o in observed.values()):
        return RecoveryAction.ROLL_BACK
    if previous_source_exists:
        return RecoveryAction.REPUSH_PREVIOUS
    return RecoveryAction.COMMIT_PARTIAL


def proven(ref: WeightsRef, manifest: str | None) -> bool:
    """Whether an engine whose last load was verified against `manifest` (EngineState.weights_manifest_sha256)
    holds the bytes of `ref`: the manifest the record pins for it, where it pins one (an HTTP push does; the
    weights the engines started with and collective pushes do not, and then the label is all there is)."""
    return ref.manifest_sha256 is None or manifest == ref.manifest_sha256


def vouched(version: str | None, manifest: str | None, record: FleetRecord) -> str | None:
    """The version an engine reports, unless the record pins that version's bytes (the committed one, or the
    target of a push under way) to another manifest than the one its load was verified against: then None,
    weights nobody can vouch for (a relabel, a load from elsewhere under the fleet's label)."""
    pinned = [r for r in (record.committed, record.push.target if record.push else None) if r and r.version == version]
    return version if all(proven(r, manifest) for r in pinned) else None


def routable(version: str | None, record: FleetRecord) -> bool:
    """Whether an engine reporting ``version`` may get traffic under ``record``.

    No committed version (a fleet never synced and whose engines disagree): every
    reachable engine is routable, there is nothing to be consistent with.
    """
    if version is None:
        return False
    if record.committed is None:
        return True
    if version == record.committed.version:
        return True
    push = record.push
    return push is not None and push.phase is PushPhase.IN_PROGRESS and version == push.target.version


def needs_catch_up(obs: EngineObservation, record: FleetRecord) -> bool:
    """A reachable engine, not on the committed version (or with mixed weights), that can pull it."""
    c = record.committed
    active = record.push is not None and record.push.phase.active
    return obs.reachable and c is not None and c.url is not None and not obs.serves(c) and not active


@dataclass(frozen=True)
class InFlight:
    """A request in an engine, with the versions that produced its tokens so far."""

    request_id: str
    versions: tuple[str, ...]
    max_weight_lag: int | None = None  # the request's own bound (its X-Rollfleet-Max-Weight-Lag)


def stale_requests(
    in_flight: Sequence[InFlight], record: FleetRecord, target_generation: int, bound: int | None
) -> list[str]:
    """Ids of requests that would run more than their bound generations behind the target: the fleet's
    ``bound`` or the request's own, the tighter (None: unbounded).

    A request's age is that of the oldest weights that produced its tokens; one with
    no tokens yet runs entirely on the target and is never stale. A version missing
    from the history is older than anything remembered, so it is stale.
    """
    stale = []
    for req in in_flight:
        limits = [b for b in (bound, req.max_weight_lag) if b is not None]
        if not req.versions or not limits:
            continue
        bound_here = min(limits)
        generations = [record.generation_of(v) for v in req.versions]
        oldest = min(-1 if g is None else g for g in generations)
        if target_generation - oldest > bound_here:
            stale.append(req.request_id)
    return stale
