"""One reconcile loop per RolloutFleet: observe, decide (pure functions), act, report.

`FleetLoop.run` is the fleet's task (`controller/tasks.py`, started by `controller/handlers.py`).
It reads the fleet's engine pods, gateway and weight-sync record from kopf's indexes, and wakes
when they or the fleet change, or on a timer. Each pass reads the engines' state over HTTP, asks `plan` what to do,
applies it, and writes status at most once per second (a pass coalesces everything that
changed since the last write). Durable state lives in the cluster (pod names and
annotations, the fleet's status), never only here, so a restarted operator resumes.
Talks to kube-apiserver (through `rollfleet.kube`) and engines (through `rollfleet.engine_client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import ValidationError

from rollfleet.api.fleet import KIND, RolloutFleetSpec, RolloutFleetStatus
from rollfleet.contract import (
    ANNOTATION_DRAINING_SINCE,
    ANNOTATION_PAUSE,
    ANNOTATION_PHASE,
    ANNOTATION_WEIGHT_GENERATION,
    RECORD_MODEL,
    RECORD_SYNC_STATE,
    EnginePhase,
    engine_selector,
    engine_url,
    gateway_endpoint,
    weights_record_name,
)
from rollfleet.controller import desired, groups, plan
from rollfleet.controller.events import batched, event_manifest, rfc3339
from rollfleet.controller.metrics import FleetMetrics, FleetSnapshot
from rollfleet.controller.owned import ABSENT, Applied, Key, ObjectKey, OwnedObjects, must_write, object_key, version_of
from rollfleet.controller.owner import FleetRef
from rollfleet.controller.status import (
    ENGINES_PAUSED_ALONE,
    Engine,
    EngineObs,
    GatewayObs,
    Observations,
    PauseView,
    WeightView,
    classify,
    fleet_status,
    listed,
)
from rollfleet.controller.tasks import Stop
from rollfleet.controller.tokens import OperatorKey
from rollfleet.engine_client import EngineCallError, EngineClient, EngineRef
from rollfleet.kube import (
    CONFIG_MAP,
    CRD,
    FLEET,
    LEADER_WORKER_SET,
    NODE,
    POD,
    Conflict,
    Kube,
    NotFound,
    kind_named,
)
from rollfleet.sync.fleetversion import fleet_weight_version
from rollfleet.sync.protocol import EngineObservation, decode_record, operator_fields
from rollfleet_engine.protocol import EngineState, PauseMode

log = logging.getLogger("rollfleet.operator")

STATUS_MIN_INTERVAL_S = 1.0  # at most one status patch per fleet per second
PASS_MIN_INTERVAL_S = 0.25  # bursts of watch events coalesce into one pass
INDEX_POLL_S = 0.05  # between passes, how often the loop looks for changes in kopf's indexes
BUSY_RESYNC_S = 1.0  # while anything changes: engines starting, draining, pausing
IDLE_RESYNC_S = 10.0  # otherwise: refresh engine states (in-flight, weight versions)
IDLE_STATE_READS_PER_S = 50.0
# Engine calls begun before the loop lets those begun connect and send: begun all at once, a pause's 2,000 calls
# each opened a connection before any sent its request, and the first engine paused as late as the last.
FAN_OUT_BATCH = 50
# How long an engine that missed a state read keeps its last one: a busy engine (2,000 on one host) is not a
# starting one, and its readiness probe, not one slow answer, says when it stops serving.
KEEP_S = 30.0
# How long an engine created is awaited in the watch before its index counts as free again: a pass that ran before
# the watch delivered the pods of the last one created them again (364 conflicts in 2,000 creates, bench_scale).
CREATED_AWAIT_S = 60.0
NODE_REFRESH_S = 5.0
# Phases that change only by outside action.
SETTLED = frozenset({EnginePhase.READY, EnginePhase.PAUSED, EnginePhase.PENDING_SYNC})


def now_utc() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


async def annotate_pod(kube: Kube, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
    with contextlib.suppress(NotFound):  # gone meanwhile: nothing to annotate
        await kube.patch(POD, namespace, name, {"metadata": {"annotations": dict(annotations)}})


class NodeHealth:
    """The nodes as last listed (at most every NODE_REFRESH_S, for every fleet): which are lost (gone, or not
    Ready), refreshed only when an engine looks unwell, and which hold a multi-pod fleet's pool."""

    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self.listed: list[dict[str, Any]] = []
        self._ready: dict[str, bool] = {}
        self._at = -1e9
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._at < NODE_REFRESH_S:
                return
            nodes = self.listed = await self._kube.list(NODE)
            self._ready = {
                n["metadata"]["name"]: any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (n.get("status") or {}).get("conditions") or []
                )
                for n in nodes
            }
            self._at = time.monotonic()

    def lost(self, node: str | None) -> bool:
        # Before the first listing nothing is known to be lost.
        return node is not None and self._at > 0 and not self._ready.get(node, False)


@dataclass(frozen=True)
class WeightsRecord:
    """The fleet's weight-sync record (the ConfigMap `<fleet>-weights`) as last watched."""

    data: Mapping[str, str]
    resource_version: str
    owner: str | None = None  # the uid of the fleet that owns the ConfigMap


# An index entry that names the fleet owning its object.
OwnedT = TypeVar("OwnedT", GatewayObs, WeightsRecord)


# kopf's indexes (`controller/handlers.py`), by (namespace, fleet name): the fleet's engine
# pods, its gateway Deployment's replica counts, and its weight-sync record.
PodIndex = Mapping[Key, Iterable[Mapping[str, Any]]]
GatewayIndex = Mapping[Key, Iterable[GatewayObs]]
RecordIndex = Mapping[Key, Iterable[WeightsRecord]]


@dataclass
class Shared:
    """What every fleet loop uses: the clients and the node view (in kopf's memo)."""

    kube: Kube
    engines: EngineClient
    nodes: NodeHealth
    operator_namespace: str | None  # where this operator's pod runs; None outside a pod
    key: OperatorKey  # fleets' admin tokens derive from it
    metrics: FleetMetrics
    owned: OwnedObjects = field(default_factory=OwnedObjects)  # fed by the watches of what fleets own


class FleetLoop:
    """One fleet's loop and what it remembers between passes (and across a failed pass's retry)."""

    def __init__(
        self, shared: Shared, body: Mapping[str, Any], pods: PodIndex, gateways: GatewayIndex, records: RecordIndex
    ) -> None:
        self.shared = shared
        self.body = body  # a live view: always the newest the watch delivered
        self.ref = FleetRef.of(dict(body))
        self.key: Key = (self.ref.namespace, self.ref.name)
        self._pod_index = pods
        self._gateway_index = gateways
        self._record_index = records
        self._gone: set[str | None] = set()  # uids of pods the index holds but a LIST showed gone
        self._token: str | None = None
        self._states: dict[str, tuple[float, EngineState | None]] = {}
        self._observations = Observations(self.ref.name)
        self._refreshing: dict[str, asyncio.Task[None]] = {}  # engine -> a state read in the background
        self._sync_record: str | None = None  # the sync sidecar's record (its JSON) last seen
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._applied: dict[ObjectKey, Applied] = {}
        self._last_status_at = -1e9
        self._warned_pause: str | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._spec_error: str | None = None
        self._written: RolloutFleetStatus | None = None
        # A state read changed what a phase rests on, or the last control call in flight ended: pass again without
        # waiting for the timer.
        self._wake_early = False
        self._created: dict[int, float] = {}  # engines created (index -> when) that the watch has not shown yet
        # Annotation writes the watch has not shown yet: pod -> (its resourceVersion then, what was written).
        self._annotated: dict[str, tuple[str | None, plan.Annotations]] = {}
        # Crash counts of deleted crashed engines, by index, until their replacement carries it.
        self._crashes: dict[int, int] = {}
        shared.owned.track(self.key)

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self, stopped: Stop) -> None:
        """Passes until the fleet is deleted or the operator exits. A pass follows every change to the fleet,
        its pods or its gateway (seen in the indexes), at most every 0.25 s, and at least as often as the last
        pass asked. A failed pass raises: the task runs this again after a backoff."""
        while not stopped:
            seen = self._fingerprint()
            started = time.monotonic()
            try:
                interval = await self.reconcile()
            except Exception:
                self.shared.metrics.failed(self.key)
                raise
            self.shared.metrics.passed(time.monotonic() - started)
            await self._wait(stopped, seen, earliest=started + PASS_MIN_INTERVAL_S, latest=started + interval)

    async def _wait(self, stopped: Stop, seen: tuple[object, ...], earliest: float, latest: float) -> None:
        while not stopped:
            now = time.monotonic()
            if now >= latest or (now >= earliest and (self._wake_early or self._fingerprint() != seen)):
                self._wake_early = False
                return
            await stopped.wait(max(0.01, min(INDEX_POLL_S, latest - now)))

    def _fingerprint(self) -> tuple[object, ...]:
        """What the watch has delivered for this fleet, in a form that changes with any of it (compared, not hashed).

        The pods are the index's own objects: kopf stores a new one for each change, and a tuple compares them by
        identity first, in C; holding them keeps their ids from being reused meanwhile. Polled every INDEX_POLL_S:
        a set of (uid, resourceVersion) built in Python was most of an operator's CPU at rest with 2,000 engines
        (bench_scale)."""
        pods = tuple(self._pod_index.get(self.key, ()))
        gateway, record = self._gateway(), self._weights_record()
        owned = self.shared.owned.changes(self.key)
        return self.body["metadata"].get("resourceVersion"), pods, gateway, record and record.resource_version, owned

    def _weights_record(self) -> WeightsRecord | None:
        return self._own(self._record_index.get(self.key, ()))

    def _gateway(self) -> GatewayObs | None:
        return self._own(self._gateway_index.get(self.key, ()))

    def _own(self, entries: Iterable[OwnedT]) -> OwnedT | None:
        """This fleet's entry of an index. kopf misses deletions in a namespace deleted and made again: an entry
        of the deleted fleet of this name may stay in the index for ever, owned by another uid."""
        return next((e for e in entries if e.owner in (None, self.ref.uid)), None)

    def _index_pods(self) -> Sequence[Mapping[str, Any]]:
        return [p for p in self._pod_index.get(self.key, ()) if p["metadata"].get("uid") not in self._gone]

    async def exists(self) -> bool:
        return await self.shared.kube.exists(FLEET, self.ref.namespace, self.ref.name, self.ref.uid)

    async def close(self) -> None:
        """Cancel its engine calls and Events in flight (the fleet is gone, or the operator exits)."""
        tasks = [*self._calls.values(), *self._background, *self._refreshing.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._calls.clear()
        self.shared.metrics.forget(self.key)
        self.shared.owned.forget(self.key)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def event(self, type_: str, reason: str, message: str) -> None:
        """Post an Event in the background: a slow API server must not hold up the loop."""
        log.info("%s/%s %s %s: %s", *self.key, type_, reason, message)
        self._spawn(self._post_event(type_, reason, message))

    async def _post_event(self, type_: str, reason: str, message: str) -> None:
        try:
            ref, now = self.ref, datetime.now(UTC)
            await self.shared.kube.create(
                event_manifest(KIND, ref.name, ref.namespace, ref.uid, type_, reason, message, now)
            )
        except Exception as err:  # an Event is best effort; the status carries the truth
            log.warning("event %s on %s/%s not posted: %s", reason, *self.key, err)

    # ---- one pass --------------------------------------------------------------------------

    async def _observe_engines(self, spec: RolloutFleetSpec, record: Mapping[str, str]) -> tuple[list[EngineObs], bool]:
        """The fleet's engine pods as observations with the engines' own state, and whether the
        fleet is busy (engines coming and going: 1 s passes). Engines are re-read as `plan.state_max_age` says."""
        pods = self._index_pods()
        if any(p["metadata"].get("deletionTimestamp") for p in pods):
            # kopf re-lists after a watch gap (a namespace deleted and made again, an API server
            # restart) without reporting what vanished meanwhile: a terminating pod whose DELETED
            # was lost would block its name for ever. Confirm with the API server while any is.
            listed = await self.shared.kube.list(POD, self.ref.namespace, engine_selector(self.ref.name))
            live = {p["metadata"]["uid"] for p in listed}
            self._gone = {p["metadata"].get("uid") for p in self._pod_index.get(self.key, ())} - live
            pods = listed
        if any(_unwell(p) for p in pods):
            await self.shared.nodes.refresh()
        observed = self._observations.observe(pods, self._node_lost)
        busy = len(observed) != spec.replicas or any(o.annotated_phase not in SETTLED or not o.ready for o in observed)
        sync_record = record.get(RECORD_SYNC_STATE)
        if sync_record != self._sync_record:
            # A push started or committed: engines' weight versions just changed; cached states would
            # show them PendingSync (or routable on the old version) until their next read.
            self._forget_state()
            self._sync_record = sync_record
        # At rest a fleet's engines are re-read at most IDLE_STATE_READS_PER_S a second (2,000 engines every 10 s
        # were 200 reads a second: 40% of a core, bench_scale); busy, those not Ready or Paused every second.
        idle_age = max(IDLE_RESYNC_S, len(observed) / IDLE_STATE_READS_PER_S)
        states = await self._poll_states(
            observed, functools.partial(plan.state_max_age, busy=busy, busy_s=BUSY_RESYNC_S, idle_s=idle_age)
        )
        return self._observations.with_states(observed, states), busy

    def _node_lost(self, pod: Mapping[str, Any]) -> bool:
        return self.shared.nodes.lost(_node_of(pod))

    def _not_in_flight(self, actions: list[plan.PodAction], observed: Sequence[EngineObs]) -> list[plan.PodAction]:
        """The pass's actions less the creations of engines created already whose pods the watch has not shown."""
        seen = {o.index for o in observed}
        self._created = plan.awaited_creations(self._created, seen, time.monotonic(), CREATED_AWAIT_S)
        return [a for a in actions if not (isinstance(a, plan.Create) and a.index in self._created)]

    async def _annotate_engines(
        self,
        engines: Sequence[Engine],
        actions: Sequence[plan.PodAction],
        generations: Mapping[str, int | None],
        born: bool,
    ) -> bool:
        """Write the engine pods' annotations the gateway routes on (phase, weight generation); whether any
        phase changed. `born`: `plan.born_ready`."""
        changes: dict[str, dict[str, str | None]] = {}
        phases = plan.phase_updates(engines, actions, born)
        for name, phase in phases.items():
            changes.setdefault(name, {})[ANNOTATION_PHASE] = phase
        for name, generation in plan.generation_updates(engines, generations).items():
            changes.setdefault(name, {})[ANNOTATION_WEIGHT_GENERATION] = generation
        versions = {e.obs.name: e.obs.resource_version for e in engines}
        todo, self._annotated = plan.awaited_annotations(changes, self._annotated, versions)
        kube, ns = self.shared.kube, self.ref.namespace
        await asyncio.gather(*(annotate_pod(kube, ns, name, a) for name, a in todo.items()))
        self._annotated.update((name, (versions[name], a)) for name, a in todo.items())
        return bool(phases)

    async def reconcile(self) -> float:
        """One pass; returns how long to sleep unless woken by a watch event."""
        body = self.body
        meta = body["metadata"]
        try:
            spec = RolloutFleetSpec.model_validate(body.get("spec") or {})
        except ValidationError as err:
            if str(err) != self._spec_error:
                self._spec_error = str(err)
                self.event("Warning", "InvalidSpec", f"spec not understood, nothing changed: {err}")
            return IDLE_RESYNC_S
        # The status this operator last wrote is the reference; after a restart, the stored one.
        previous = self._written or _parse_status(body.get("status"))
        now = now_utc()

        token = await self._ensure_token()
        await self._ensure_owned(spec)
        current_hash = desired.template_hash(spec)
        weights_record = await self._record_for(spec, current_hash)

        observed, busy = await self._observe_engines(spec, weights_record)

        # Engines whose state is unknown (still loading) do not make the fleet's version unknown; one whose
        # weights are mixed (an in-place update that did not finish), or whose bytes are not those the record
        # pins for its label (the proof of the bytes), is on no version: PendingSync.
        reports = {
            o.name: EngineObservation(o.state.served_version, manifest=o.state.weights_manifest_sha256)
            for o in observed
            if o.state is not None and not (o.terminating or o.draining)
        }
        fv = fleet_weight_version(weights_record, reports)
        weights = WeightView(fv.version, frozenset(fv.pending_sync), fv.syncing_to is not None)
        recorded = previous.pause if previous else None
        request = plan.pause_request(meta, recorded)
        engines = [classify(o, weights, request.mode is not None, spec.weight_sync.require_sync) for o in observed]
        record = plan.pause_record(request, recorded, engines, now)
        born = plan.born_ready(fv.pristine, request.mode)

        blocked = await self._group_check(spec)
        max_unavailable, max_surge = plan.rollout_budget(spec.update_strategy, spec.replicas)
        # A shape this cluster cannot run changes no pod: the engines already there keep serving.
        actions = (
            []
            if blocked
            else plan.plan_pods(
                engines,
                replicas=spec.replicas,
                current_hash=current_hash,
                max_unavailable=max_unavailable,
                max_surge=max_surge,
                drain_timeout=spec.drain_timeout_seconds,
                now=now,
            )
        )
        actions = self._not_in_flight(actions, observed)
        by_name = {e.obs.name: e for e in engines}
        # The engines' pause calls first: the pod writes below take seconds at 2,000 engines (bench_scale).
        calls = plan.engine_pause_calls(request.mode, record, engines)
        await self._begin_calls([(c, by_name[c.name].obs.pod_ip) for c in calls], token)
        done = await asyncio.gather(*(self._act(a, spec, by_name, now, born) for a in actions))
        for type_, reason, message in batched([d for d in done if d is not None]):
            self.event(type_, reason, message)
        phase_changes = await self._annotate_engines(engines, actions, fv.engine_generations, born)
        await self._pause_bookkeeping(request)

        status = fleet_status(
            spec=spec,
            generation=meta.get("generation"),
            current_hash=current_hash,
            selector=engine_selector(self.ref.name),
            engines=engines,
            weights=weights,
            pause=PauseView(record, request.invalid_value, resuming=request.mode is None),
            gateway=self._gateway(),
            gateway_endpoint=gateway_endpoint(self.ref.name, self.ref.namespace),
            gateway_enabled=spec.gateway.enabled,
            previous=previous,
            now=now,
            blocked=blocked,
        )
        self.shared.metrics.observed(
            self.key, FleetSnapshot(status, spec.replicas, fv.generation, fv.engine_generations)
        )
        interval = BUSY_RESYNC_S if busy or actions or phase_changes or self._calls else IDLE_RESYNC_S
        return await self._publish(status, previous, interval)

    async def _group_check(self, spec: RolloutFleetSpec) -> groups.Blocked | None:
        """Whether this cluster can run the fleet's engines of several pods (single-pod ones: no call)."""
        if spec.engine.pods_per_engine == 1:
            return None
        try:
            await self.shared.kube.get(CRD, "", groups.LWS_CRD)
        except NotFound:
            return groups.group_problem(spec, lws_installed=False, pool=[])
        nodes = self.shared.nodes
        await nodes.refresh()  # one listing serves every fleet's checks for NODE_REFRESH_S
        return groups.group_problem(spec, lws_installed=True, pool=groups.pool_nodes(spec, nodes.listed))

    # ---- owned objects ---------------------------------------------------------------------

    async def _ensure_token(self) -> str:
        """The fleet's token, derived (never read back); its Secret, and the inference token's, are made the
        first time."""
        if self._token is None:
            kube, ref = self.shared.kube, self.ref
            token = await self.shared.key.token(kube, ref.namespace, ref.name, ref.uid)
            # Made once and never rotated: engines and gateways read it at start. If it exists it holds
            # this token, unless the operator's key was replaced (docs/security.md says what to do then).
            inference = await self.shared.key.inference_token(kube, ref.namespace, ref.name, ref.uid)
            for secret in (desired.admin_secret(ref, token), desired.inference_secret(ref, inference)):
                await kube.create_kept(secret)
            self._token = token
        return self._token

    async def _record_for(self, spec: RolloutFleetSpec, template_hash: str) -> Mapping[str, str]:
        """The weight-sync record's data, with the operator's fields for this spec written first: reset if it
        was kept for another spec.model."""
        watched = self._weights_record()
        if watched is None or spec.weight_sync.backend == "none":
            return {}
        model = desired.model_key(spec)
        change = operator_fields(watched.data, model, template_hash)
        if change is None:
            return watched.data
        other_model = watched.data.get(RECORD_MODEL) != model
        body = {"metadata": {"resourceVersion": watched.resource_version}, "data": change}
        try:
            await self.shared.kube.patch(CONFIG_MAP, self.ref.namespace, weights_record_name(self.ref.name), body)
        except (Conflict, NotFound):
            # Written or deleted meanwhile: the watch brings it, the next pass writes again. Until then the
            # record as watched stands, unless it is another model's (its versions are not this one's).
            return {} if other_model else watched.data
        merged = {k: v for k, v in (dict(watched.data) | change).items() if v is not None}
        committed = decode_record(watched.data).committed
        if committed is not None and other_model:
            self.event(
                "Normal",
                "WeightsReset",
                f"spec.model changed: weights pushed for the previous model (last {committed.version}) are "
                "forgotten; engines of the new model serve its own weights until the next push",
            )
        return merged

    async def _ensure_owned(self, spec: RolloutFleetSpec) -> None:
        """Apply ServiceAccounts, RBAC, the NetworkPolicy and the gateway when their manifest changed, or when the
        watch showed them edited or deleted by someone else; delete what the spec switched off."""
        owned = self.shared.owned
        for manifest in desired.owned_objects(self.ref, spec, self.shared.operator_namespace):
            key = object_key(manifest["kind"], manifest["metadata"]["name"])
            digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
            last = self._applied.get(key)
            if not must_write(last, digest, owned.seen(self.key, key)):
                continue
            applied = await self.shared.kube.apply(manifest)
            if last is None or last.digest != digest:
                log.info("%s/%s applied %s", *self.key, key)
            else:  # at debug: a trainer's push changes the weights record (its data, not what is applied)
                log.debug("%s/%s %s changed or deleted by someone else: applied again", *self.key, key)
            self._applied[key] = Applied(digest, version_of(applied["metadata"]))
        for kind, name in desired.absent_objects(self.ref, spec):
            key = object_key(kind, name)
            last = self._applied.get(key)
            if not must_write(last, ABSENT, owned.seen(self.key, key)):
                continue
            with contextlib.suppress(NotFound):  # gone already: fine
                await self.shared.kube.delete(kind_named(kind), self.ref.namespace, name)
            if last is not None and last.digest != ABSENT:
                log.info("%s/%s deleted %s", *self.key, key)
            self._applied[key] = Applied(ABSENT, None)

    # ---- engines ---------------------------------------------------------------------------

    async def _poll_states(
        self, obs: list[EngineObs], max_age: Callable[[EngineObs], float]
    ) -> dict[str, EngineState | None]:
        """Engine states. Read now: an engine's first, one that did not answer, a draining one's (every pass: its
        in-flight count decides when it goes). Read in the background once older than its `max_age`: the older
        state serves until the new one is in, so a pass never waits for a thousand engines' answers (that held
        a pause back by seconds at 1,000 engines, bench_scale)."""
        now = time.monotonic()
        live = {o.name for o in obs}
        for name in list(self._states):
            if name not in live:
                self._forget_state(name)

        async def fetch(o: EngineObs) -> None:
            assert o.pod_ip is not None  # only engines with an IP are due
            try:
                state: EngineState | None = await self.shared.engines.state(EngineRef(o.name, engine_url(o.pod_ip)))
            except EngineCallError as err:
                log.debug("%s: %s", o.name, err)
                state = None
            before = self._states.get(o.name)
            if state is None and before is not None and before[1] is not None and time.monotonic() - before[0] < KEEP_S:
                return  # a missed read keeps the last state a while (its time unchanged: read again next pass)
            self._states[o.name] = (time.monotonic(), state)
            if before is not None and _phase_relevant(before[1]) != _phase_relevant(state):
                self._wake_early = True

        due, stale = [], []
        for o in obs:
            if not (o.pod_ip and o.ready and o.pod_phase == "Running" and not o.terminating):
                continue
            known = self._states.get(o.name)
            if known is None or known[1] is None or o.draining:
                due.append(o)
            elif now - known[0] >= max_age(o) and o.name not in self._refreshing:
                stale.append(o)
        await asyncio.gather(*(fetch(o) for o in due))
        for o in stale:
            task = asyncio.ensure_future(fetch(o))
            self._refreshing[o.name] = task
            task.add_done_callback(functools.partial(self._refreshed, o.name))
        for o in obs:  # an engine that is not ready has no state worth keeping
            if not o.ready:
                self._forget_state(o.name)
        return {name: st for name, (_, st) in self._states.items()}

    def _refreshed(self, name: str, task: asyncio.Task[None]) -> None:
        if self._refreshing.get(name) is task:  # not one cancelled and already replaced
            del self._refreshing[name]

    def _forget_state(self, name: str | None = None) -> None:
        """Drop an engine's state (every engine's: None), and any read of it under way, which may predate what
        made it stale (a pause call, a push)."""
        for n in [name] if name is not None else [*self._states, *self._refreshing]:
            self._states.pop(n, None)
            task = self._refreshing.pop(n, None)
            if task is not None:
                task.cancel()

    async def _act(
        self, action: plan.PodAction, spec: RolloutFleetSpec, engines: Mapping[str, Engine], now: datetime, born: bool
    ) -> tuple[str, str, str] | None:
        """Carry out one pod action; the Event that says so (posted batched with the pass's others). `born`: a new
        engine is created Ready (`plan.born_ready`)."""
        kube, ns = self.shared.kube, self.ref.namespace
        if isinstance(action, plan.Create):
            crashes = self._crashes.pop(action.index, 0)
            engine = desired.engine_object(self.ref, spec, action.index, born, crashes)
            try:
                await kube.create(engine)
            except Conflict:  # names are stable: one of that name exists already, no duplicate
                return None
            self._created[action.index] = time.monotonic()
            what = "" if engine["kind"] == "Pod" else f" ({engine['kind']} of {spec.engine.pods_per_engine} pods)"
            return "Normal", "EngineCreated", f"{engine['metadata']['name']}{what} created ({action.reason})"
        if isinstance(action, plan.Drain):
            await annotate_pod(
                kube,
                ns,
                action.name,
                {ANNOTATION_PHASE: EnginePhase.DRAINING, ANNOTATION_DRAINING_SINCE: rfc3339(now)},
            )
            e = engines[action.name]
            return (
                "Normal",
                "EngineDraining",
                f"{action.name} draining ({action.reason}): {e.obs.in_flight} requests in flight, up to "
                f"{spec.drain_timeout_seconds}s",
            )
        if action.crashes is not None:
            self._crashes[engines[action.name].obs.index] = action.crashes
        force = {"gracePeriodSeconds": 0} if action.force else None
        group = engines[action.name].obs.group
        with contextlib.suppress(NotFound):
            # A multi-pod engine goes as a whole: its LeaderWorkerSet, whose pods the garbage collector deletes.
            if group is not None:
                await kube.delete(LEADER_WORKER_SET, ns, group)
            if group is None or force:
                await kube.delete(POD, ns, action.name, force)
        failed = engines[action.name].phase == EnginePhase.FAILED
        self._forget_state(action.name)
        return (
            "Warning" if failed else "Normal",
            "EngineReplaced" if failed else "EngineDeleted",
            f"{action.name} deleted: {action.reason}",
        )

    async def _begin_calls(
        self, calls: Sequence[tuple[plan.PauseCall | plan.ResumeCall, str | None]], token: str
    ) -> None:
        """Start each (call, engine IP) in the background, FAN_OUT_BATCH at a time; not one to an engine with a
        call in flight (pause?mode=wait blocks until requests finish) or without an IP."""
        for i, (call, ip) in enumerate(calls, 1):
            if call.name not in self._calls and ip is not None:
                self._calls[call.name] = asyncio.create_task(self._control(call, ip, token))
            if i % FAN_OUT_BATCH == 0:
                await asyncio.sleep(0)  # one turn of the loop: the calls begun so far connect and send

    async def _control(self, call: plan.PauseCall | plan.ResumeCall, ip: str, token: str) -> None:
        engines, engine = self.shared.engines.with_token(token), EngineRef(call.name, engine_url(ip))
        mode = call.mode if isinstance(call, plan.PauseCall) else None
        try:
            if mode is not None:
                await engines.pause(engine, mode)
            else:
                await engines.resume(engine)
        except EngineCallError as err:
            self.event("Warning", "EngineControlFailed", f"{call.name}: {err}")
            self._forget_state(call.name)  # read the state anew on the next pass
        else:
            self._confirmed(call.name, mode)
        finally:
            self._calls.pop(call.name, None)
            # Once the fan-out's last call ends: a pass for each that ended (2,000 passes' worth of wake-ups, one pass
            # of 2,000 engines every 0.25 s) competed with the calls still going; the 1 s busy pass still comes.
            if not self._calls:
                self._wake_early = True

    def _confirmed(self, name: str, mode: PauseMode | None) -> None:
        """The engine answered its pause (`mode`) or resume (None) call: its state says so from now on, until its
        next read.
        Read anew instead, 2,000 engines' states in the passes that followed a pause held its last calls back
        by seconds (bench_scale)."""
        known = self._states.get(name)
        self._forget_state(name)  # a read under way may predate the call
        # Not after abort or wait: they end requests, and the state's in-flight counts with them.
        if known is not None and known[1] is not None and mode in (None, "keep"):
            self._states[name] = (
                time.monotonic(),
                known[1].model_copy(update={"paused": mode is not None, "pause_mode": mode}),
            )

    async def _pause_bookkeeping(self, request: plan.PauseRequest) -> None:
        if request.invalid_value is not None and request.invalid_value != self._warned_pause:
            self.event(
                "Warning",
                "InvalidPauseAnnotation",
                f"{ANNOTATION_PAUSE}={request.invalid_value!r} is not keep, wait or abort: ignored, nothing changed",
            )
        self._warned_pause = request.invalid_value
        if request.remove_annotations:
            await self._patch_fleet({"metadata": {"annotations": dict.fromkeys(request.remove_annotations)}})

    # ---- status ----------------------------------------------------------------------------

    async def _publish(self, status: RolloutFleetStatus, previous: RolloutFleetStatus | None, interval: float) -> float:
        """Write the status if it changed, at most every STATUS_MIN_INTERVAL_S; how long to sleep (`interval`, or
        until the status may be written)."""
        if status != previous:
            wait = STATUS_MIN_INTERVAL_S - (time.monotonic() - self._last_status_at)
            if wait > 0:  # rate limit: the next pass writes whatever is newest by then
                return min(interval, wait)
            await self._write_status(status, previous)
            self._transition_events(previous, status)
        return interval

    async def _write_status(self, status: RolloutFleetStatus, previous: RolloutFleetStatus | None) -> None:
        wire = listed(status).wire()
        old = listed(previous).wire() if previous else {}
        patch = {"status": {**dict.fromkeys(set(old) - set(wire)), **wire}}  # null deletes what is gone
        await self._patch_fleet(patch, status=True)
        self._last_status_at = time.monotonic()
        self._written = status

    async def _patch_fleet(self, patch: Mapping[str, Any], status: bool = False) -> None:
        with contextlib.suppress(NotFound):  # deleted meanwhile
            await self.shared.kube.patch(FLEET, self.ref.namespace, self.ref.name, patch, status=status)

    def _transition_events(self, previous: RolloutFleetStatus | None, status: RolloutFleetStatus) -> None:
        """Events for what changed between two written statuses: conditions, pause mode, engine phases."""
        if previous is None:
            return
        old_conds = {c.type: c for c in previous.conditions}
        for c in status.conditions:
            o = old_conds.get(c.type)
            if o is None or (o.status, o.reason) != (c.status, c.reason):
                warn = (c.type == "Degraded" and c.status == "True") or c.reason in (
                    "InvalidPauseAnnotation",
                    ENGINES_PAUSED_ALONE,
                )
                self.event("Warning" if warn else "Normal", f"{c.type}{c.status}", f"{c.reason}: {c.message}")
        if previous.pause and status.pause and previous.pause.mode != status.pause.mode:
            self.event("Normal", "PauseModeChanged", f"pause mode {previous.pause.mode} -> {status.pause.mode}")
        old_phases = {e.name: e.phase for e in previous.engines}
        moves = [
            (
                "Warning" if e.phase == EnginePhase.FAILED else "Normal",
                f"Engine{e.phase}",
                f"{e.name}: {old_phases[e.name]} -> {e.phase}" + (f" ({e.message})" if e.message else ""),
            )
            for e in status.engines
            if old_phases.get(e.name) not in (None, e.phase)
        ]
        for type_, reason, message in batched(moves):
            self.event(type_, reason, message)


def _phase_relevant(state: EngineState | None) -> tuple[Any, ...] | None:
    """What of an engine's state its phase depends on (its in-flight counts do not)."""
    if state is None:
        return None
    return state.paused, state.served_version, state.weights_manifest_sha256, state.inference_open


def _parse_status(raw: Any) -> RolloutFleetStatus | None:
    if not raw:
        return None
    try:
        return RolloutFleetStatus.model_validate(raw)
    except ValidationError:
        return None  # written by something else, or by an older operator: rebuild it


def _node_of(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("spec") or {}).get("nodeName")


def _unwell(pod: Mapping[str, Any]) -> bool:
    """A pod whose node might be lost: running but not ready, stuck terminating, or of unknown phase."""
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return (
        (status.get("phase") == "Running" and not ready)
        or status.get("phase") == "Unknown"
        or (pod.get("metadata") or {}).get("deletionTimestamp") is not None
    )
