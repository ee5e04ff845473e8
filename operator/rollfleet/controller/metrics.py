"""The operator's metrics: what each fleet's last reconcile pass saw, and the RolloutRequests as the watch
delivers them, as Prometheus families.

A pass leaves a snapshot here (`FleetMetrics.observed`); a scrape turns the snapshots into samples
(`samples`, pure), so nothing is counted on the pass itself and a deleted fleet's series go with it
(`forget`). Pass durations and failures are prometheus_client's own. Requests: `RequestMetrics`, per
namespace. Names and help: `rollfleet.metrics`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollfleet import metrics as m
from rollfleet.api.fleet import RolloutFleetStatus
from rollfleet.contract import EnginePhase

Key = tuple[str, str]  # (namespace, fleet)


@dataclass(frozen=True)
class FleetSnapshot:
    """A fleet as its last pass saw it."""

    status: RolloutFleetStatus
    wanted: int  # spec.replicas
    generation: int | None  # of the committed weights (None: no push, and the engines disagree)
    engine_generations: Mapping[str, int | None]


def skewed(status: RolloutFleetStatus) -> int:
    """Engines not on the fleet's version: PendingSync (wrong, unknown or unproven weights), or reporting
    another version than the fleet's."""
    fleet = status.weight_version
    return sum(
        1
        for e in status.engines
        if e.phase is EnginePhase.PENDING_SYNC or (fleet and e.weight_version and e.weight_version != fleet)
    )


def samples(fleets: Mapping[Key, FleetSnapshot], now: datetime) -> list[GaugeMetricFamily]:
    """The gauges of every fleet's snapshot, at `now` (a pause's length)."""
    engines, wanted = m.gauge_family(m.OPERATOR_ENGINES), m.gauge_family(m.OPERATOR_ENGINES_WANTED)
    conditions, paused = m.gauge_family(m.OPERATOR_CONDITION), m.gauge_family(m.OPERATOR_PAUSED)
    pause_s, paused_engines = m.gauge_family(m.OPERATOR_PAUSE_SECONDS), m.gauge_family(m.OPERATOR_PAUSED_ENGINES)
    generation, engine_generation = m.gauge_family(m.OPERATOR_GENERATION), m.gauge_family(m.OPERATOR_ENGINE_GENERATION)
    skew, in_flight = m.gauge_family(m.OPERATOR_SKEW), m.gauge_family(m.OPERATOR_ENGINE_IN_FLIGHT)
    engine_phase = m.gauge_family(m.OPERATOR_ENGINE_PHASE)
    for (namespace, name), snap in sorted(fleets.items()):
        fleet = [namespace, name]
        st = snap.status
        for phase in EnginePhase:  # every phase, 0 included: a rule can compare without `or vector(0)`
            engines.add_metric([*fleet, phase.value], sum(1 for e in st.engines if e.phase is phase))
        wanted.add_metric(fleet, snap.wanted)
        for c in st.conditions:
            conditions.add_metric([*fleet, c.type], 1.0 if c.status == "True" else 0.0)
        paused.add_metric(fleet, 1.0 if st.pause else 0.0)
        pause_s.add_metric(fleet, max(0.0, (now - st.pause.since).total_seconds()) if st.pause else 0.0)
        paused_engines.add_metric(fleet, st.pause.paused_engines if st.pause else 0)
        if snap.generation is not None:
            generation.add_metric(fleet, snap.generation)
        for engine, gen in sorted(snap.engine_generations.items()):
            if gen is not None:
                engine_generation.add_metric([*fleet, engine], gen)
        skew.add_metric(fleet, skewed(st))
        for e in st.engines:
            engine_phase.add_metric([*fleet, e.name, e.phase.value], 1)
            if e.in_flight is not None:
                in_flight.add_metric([*fleet, e.name], e.in_flight)
    return [
        engines,
        wanted,
        conditions,
        paused,
        pause_s,
        paused_engines,
        generation,
        engine_generation,
        skew,
        in_flight,
        engine_phase,
    ]


class FleetMetrics(Collector):
    """The fleets' snapshots, and the passes' durations and failures, in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.fleets: dict[Key, FleetSnapshot] = {}
        self.pass_seconds = m.histogram(m.OPERATOR_PASS_SECONDS, registry)
        self.pass_errors = m.counter(m.OPERATOR_PASS_ERRORS, registry)
        registry.register(self)

    def observed(self, key: Key, snapshot: FleetSnapshot) -> None:
        if key not in self.fleets:
            self.pass_errors.labels(*key)  # at 0 from the start: an alert's increase() sees the first failure
        self.fleets[key] = snapshot

    def passed(self, seconds: float) -> None:
        self.pass_seconds.observe(seconds)

    def failed(self, key: Key) -> None:
        self.pass_errors.labels(*key).inc()

    def forget(self, key: Key) -> None:
        """A fleet deleted (or the operator stopping its loop): its series go."""
        self.fleets.pop(key, None)
        with contextlib.suppress(KeyError):  # never observed
            self.pass_errors.remove(*key)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from samples(self.fleets, datetime.now(UTC))

    def close(self) -> None:
        for metric in (self, self.pass_seconds, self.pass_errors):
            self.registry.unregister(metric)


class RequestMetrics(Collector):
    """RolloutRequests by phase and their samples by outcome, per namespace, from the watch's events (the
    runner writes the counts into each request's status). Per namespace, not per request: requests come
    and go by the thousand, and a series each would outlive them. The counters count what changed while this
    operator watched: the requests it finds at its start (events of no type, the initial listing) are its
    baseline, so a restart does not count their samples again."""

    OUTCOMES = ("total", "completed", "aborted", "failed", "in_flight")
    FINISHED = ("completed", "aborted", "failed")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests: dict[str, tuple[str, str, Mapping[str, int]]] = {}  # uid -> (namespace, phase, counts)
        self.finished: dict[tuple[str, str], int] = {}  # (namespace, outcome) -> samples, counted as they change
        self.results_bytes: dict[str, int] = {}  # namespace -> bytes stored
        self._bytes: dict[str, int] = {}  # uid -> the request's results bytes last seen
        registry.register(self)

    def seen(self, event_type: str | None, obj: Mapping[str, object]) -> None:
        meta = obj.get("metadata")
        if not isinstance(meta, Mapping) or not meta.get("uid"):
            return
        uid = str(meta["uid"])
        if event_type == "DELETED":
            self.requests.pop(uid, None)
            self._bytes.pop(uid, None)
            return
        namespace = str(meta.get("namespace"))
        status = _mapping(obj.get("status"))
        counts = _mapping(status.get("counts"))
        by_outcome = {"in_flight" if k == "inFlight" else k: int(v) for k, v in counts.items() if isinstance(v, int)}
        stored = _mapping(status.get("results")).get("bytes")
        stored = stored if isinstance(stored, int) else 0
        before = self.requests.get(uid)
        if before is not None or event_type is not None:  # not the listing at this operator's start
            old = before[2] if before else {}
            for outcome in self.FINISHED:
                grown = by_outcome.get(outcome, 0) - old.get(outcome, 0)
                if grown > 0:
                    self.finished[(namespace, outcome)] = self.finished.get((namespace, outcome), 0) + grown
            grown = stored - self._bytes.get(uid, 0)
            if grown > 0:
                self.results_bytes[namespace] = self.results_bytes.get(namespace, 0) + grown
        self._bytes[uid] = stored
        self.requests[uid] = (namespace, str(status.get("phase") or "Pending"), by_outcome)

    def collect(self) -> Iterator[Metric]:
        yield from request_samples(self.requests.values())
        finished, stored = (
            m.counter_family(m.OPERATOR_REQUEST_FINISHED),
            m.counter_family(m.OPERATOR_REQUEST_RESULTS_BYTES),
        )
        for (namespace, outcome), n in sorted(self.finished.items()):
            finished.add_metric([namespace, outcome], n)
        for namespace, n in sorted(self.results_bytes.items()):
            stored.add_metric([namespace], n)
        yield finished
        yield stored

    def close(self) -> None:
        self.registry.unregister(self)


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def request_samples(requests: Iterable[tuple[str, str, Mapping[str, int]]]) -> list[GaugeMetricFamily]:
    phases: dict[tuple[str, str], int] = {}
    samples_: dict[tuple[str, str], int] = {}
    for namespace, phase, counts in requests:
        phases[(namespace, phase)] = phases.get((namespace, phase), 0) + 1
        for outcome in RequestMetrics.OUTCOMES:
            key = (namespace, outcome)
            samples_[key] = samples_.get(key, 0) + counts.get(outcome, 0)
    by_phase, by_outcome = m.gauge_family(m.OPERATOR_REQUESTS), m.gauge_family(m.OPERATOR_REQUEST_SAMPLES)
    for key, n in sorted(phases.items()):
        by_phase.add_metric(list(key), n)
    for key, n in sorted(samples_.items()):
        by_outcome.add_metric(list(key), n)
    return [by_phase, by_outcome]
