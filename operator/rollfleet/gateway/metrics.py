"""The gateway's Prometheus metrics, in a registry of its own (one per app, so tests can run several).

What every request counts (requests by route and outcome, their durations, upstream
attempts) is kept in plain integers and turned into Prometheus families when /metrics is
scraped: prometheus_client's labelled children cost a lock and microseconds per update,
several times per request on the proxy's hot path. The rest are prometheus_client's own.
"""

from __future__ import annotations

import bisect
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _PerRequest(Collector):
    """The per-request counts, kept in plain numbers, as Prometheus families."""

    def __init__(self) -> None:
        self.requests: Tally[tuple[str, str]] = Tally()  # (route, outcome) -> requests
        self.attempts: Tally[tuple[str, str]] = Tally()  # (engine, result) -> attempts
        self.durations: dict[str, list[int]] = {}  # route -> count per bucket (the last: over every bucket)
        self.seconds: dict[str, float] = {}  # route -> sum of durations

    def observe(self, route: str, seconds: float) -> None:
        counts = self.durations.get(route)
        if counts is None:
            counts = self.durations[route] = [0] * (len(LATENCY_BUCKETS) + 1)
            self.seconds[route] = 0.0
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.seconds[route] += seconds

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "rollfleet_gateway_requests",
            "Routed requests by route and outcome (finish reason, error, rejected)",
            labels=["route", "outcome"],
        )
        for (route, outcome), n in self.requests.items():
            requests.add_metric([route, outcome], n)
        yield requests
        durations = HistogramMetricFamily(
            "rollfleet_gateway_request_seconds", "Client request duration (to the last byte)", labels=["route"]
        )
        for route, counts in self.durations.items():
            bounds = [*(str(float(b)) for b in LATENCY_BUCKETS), "+Inf"]
            cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
            durations.add_metric([route], list(zip(bounds, cumulative, strict=True)), self.seconds[route])
        yield durations
        attempts = CounterMetricFamily(
            "rollfleet_gateway_upstream_attempts", "Upstream attempts by engine and result", labels=["engine", "result"]
        )
        for (engine, result), n in self.attempts.items():
            attempts.add_metric([engine, result], n)
        yield attempts


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self._per_request = _PerRequest()
        r.register(self._per_request)
        self.failovers = Counter(
            "rollfleet_gateway_failovers", "Requests continued on another engine after a failure", registry=r
        )
        self.moves = Counter(
            "rollfleet_gateway_moves",
            "Requests moved off an engine whose pod was being deleted (eviction, drain, scale down)",
            registry=r,
        )
        self.stops = Counter(
            "rollfleet_gateway_stops", "Requests stopped before their end, by reason", ["reason"], registry=r
        )
        self.aborts = Counter(
            "rollfleet_gateway_abort_results", "Per-id answers of POST /v1/abort", ["result"], registry=r
        )
        self.in_flight = Gauge("rollfleet_gateway_in_flight", "Requests in flight at this replica", registry=r)
        self.session_moves = Counter(
            "rollfleet_gateway_session_moves", "Sticky sessions moved (engine unroutable or overloaded)", registry=r
        )
        self.sessions = Gauge("rollfleet_gateway_sessions", "Sticky sessions in the table", registry=r)
        self.routable = Gauge("rollfleet_gateway_routable_engines", "Engines the gateway routes to", registry=r)
        self.rejected = Counter(
            "rollfleet_gateway_rejected", "Requests refused before routing (4xx), by status", ["status"], registry=r
        )

    def request_done(self, route: str, outcome: str, seconds: float) -> None:
        self._per_request.requests[(route, outcome)] += 1
        self._per_request.observe(route, seconds)

    def attempt_done(self, engine: str, result: str) -> None:
        self._per_request.attempts[(engine, result)] += 1

    def of(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once (prometheus_client's `labels` costs microseconds)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def refused(self, status: int) -> None:
        self.of(self.rejected, str(status)).inc()
