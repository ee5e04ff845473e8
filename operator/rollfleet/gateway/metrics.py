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

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from rollfleet import metrics as m
from rollfleet.metrics import LATENCY_BUCKETS
from rollfleet_engine.protocol import AbortStatus


class _PerRequest(Collector):
    """The per-request counts, kept in plain numbers, as Prometheus families."""

    def __init__(self) -> None:
        self.requests: Tally[tuple[str, str]] = Tally()  # (route, outcome) -> requests
        self.attempts: Tally[tuple[str, str]] = Tally()  # (engine, result) -> attempts
        self.tokens: Tally[tuple[str, str]] = Tally()  # (engine, lag) -> completion tokens
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
        requests = m.counter_family(m.GATEWAY_REQUESTS)
        for (route, outcome), n in self.requests.items():
            requests.add_metric([route, outcome], n)
        yield requests
        durations = m.histogram_family(m.GATEWAY_REQUEST_SECONDS)
        for route, counts in self.durations.items():
            bounds = [*(str(float(b)) for b in LATENCY_BUCKETS), "+Inf"]
            cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
            durations.add_metric([route], list(zip(bounds, cumulative, strict=True)), self.seconds[route])
        yield durations
        attempts = m.counter_family(m.GATEWAY_UPSTREAM_ATTEMPTS)
        for (engine, result), n in self.attempts.items():
            attempts.add_metric([engine, result], n)
        yield attempts
        tokens = m.counter_family(m.GATEWAY_TOKENS)
        for (engine, lag), n in self.tokens.items():
            tokens.add_metric([engine, lag], n)
        yield tokens


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self._per_request = _PerRequest()
        r.register(self._per_request)
        self.failovers = m.counter(m.GATEWAY_FAILOVERS, r)
        self.moves = m.counter(m.GATEWAY_MOVES, r)
        self.stops = m.counter(m.GATEWAY_STOPS, r)
        self.aborts = m.counter(m.GATEWAY_ABORT_RESULTS, r)
        self.abort_seconds = m.histogram(m.GATEWAY_ABORT_SECONDS, r)
        self.in_flight = m.gauge(m.GATEWAY_IN_FLIGHT, r)
        self.session_moves = m.counter(m.GATEWAY_SESSION_MOVES, r)
        self.sessions = m.gauge(m.GATEWAY_SESSIONS, r)
        self.routable = m.gauge(m.GATEWAY_ROUTABLE, r)
        self.rejected = m.counter(m.GATEWAY_REJECTED, r)
        for status in AbortStatus:  # at 0 from the start, for `increase()` to see the first one (alerts)
            self.aborts.labels(status.value)

    def request_done(self, route: str, outcome: str, seconds: float) -> None:
        self._per_request.requests[(route, outcome)] += 1
        self._per_request.observe(route, seconds)

    def attempt_done(self, engine: str, result: str) -> None:
        self._per_request.attempts[(engine, result)] += 1

    def tokens_served(self, engine: str, lag: str, tokens: int) -> None:
        self._per_request.tokens[(engine, lag)] += tokens

    def of(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once (prometheus_client's `labels` costs microseconds)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def refused(self, status: int) -> None:
        self.of(self.rejected, str(status)).inc()
