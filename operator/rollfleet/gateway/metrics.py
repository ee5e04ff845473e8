"""The gateway's Prometheus metrics, in a registry of its own (one per app, so tests can run several)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rollfleet_gateway_requests",
            "Routed requests by route and outcome (finish reason, error, rejected)",
            ["route", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "rollfleet_gateway_request_seconds",
            "Client request duration (to the last byte)",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.attempts = Counter(
            "rollfleet_gateway_upstream_attempts",
            "Upstream attempts by engine and result",
            ["engine", "result"],
            registry=r,
        )
        self.failovers = Counter(
            "rollfleet_gateway_failovers", "Requests continued on another engine after a failure", registry=r
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

    def of(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: prometheus_client's `labels` costs microseconds per call,
        and the proxy counts several times per request."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def refused(self, status: int) -> None:
        self.of(self.rejected, str(status)).inc()
