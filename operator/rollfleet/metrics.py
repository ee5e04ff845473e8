"""Every Prometheus metric Rollfleet's own components export, in one catalogue.

The components build their metrics from these specs (`counter`, `gauge`, `histogram`, `*_family`), so a name,
type, help or label set is written once. docs/metrics.md is rendered from the catalogue
(`python -m rollfleet.metrics > docs/metrics.md`), and unit tests hold the two together and scrape each
component for exactly its catalogue's metrics. Names follow Prometheus' conventions: a unit suffix
(`_seconds`, `_bytes`), `_total` on counters (prometheus_client appends it: the specs name counters
without it), and no unbounded label (no request id): an engine label is bounded by the fleet's size.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

Kind = Literal["counter", "gauge", "histogram"]
METRICS_PATH = "/metrics"  # where each component serves them (the operator: on --metrics-port, any path)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class MetricSpec:
    component: str  # who exports it (a heading of docs/metrics.md)
    name: str  # as registered: a counter's exposed name adds `_total`
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exposed(self) -> str:
        return f"{self.name}_total" if self.kind == "counter" else self.name


GATEWAY, OPERATOR, SYNC = "gateway", "operator", "sync"
FLEET_LABELS = ("namespace", "fleet")

# ---- gateway (`rollfleet.gateway.metrics`; /metrics on the gateway's port) --------------------------------------
GATEWAY_REQUESTS = MetricSpec(
    GATEWAY,
    "rollfleet_gateway_requests",
    "counter",
    "Routed requests by route and outcome (finish reason, error, rejected)",
    ("route", "outcome"),
)
GATEWAY_REQUEST_SECONDS = MetricSpec(
    GATEWAY, "rollfleet_gateway_request_seconds", "histogram", "Client request duration (to the last byte)", ("route",)
)
GATEWAY_UPSTREAM_ATTEMPTS = MetricSpec(
    GATEWAY,
    "rollfleet_gateway_upstream_attempts",
    "counter",
    "Upstream attempts by engine and result",
    ("engine", "result"),
)
GATEWAY_FAILOVERS = MetricSpec(
    GATEWAY, "rollfleet_gateway_failovers", "counter", "Requests continued on another engine after a failure"
)
GATEWAY_MOVES = MetricSpec(
    GATEWAY,
    "rollfleet_gateway_moves",
    "counter",
    "Requests moved off an engine whose pod was being deleted (eviction, drain, scale down)",
)
GATEWAY_STOPS = MetricSpec(
    GATEWAY, "rollfleet_gateway_stops", "counter", "Requests stopped before their end, by reason", ("reason",)
)
GATEWAY_ABORT_RESULTS = MetricSpec(
    GATEWAY, "rollfleet_gateway_abort_results", "counter", "Per-id answers of POST /v1/abort", ("result",)
)
GATEWAY_ABORT_SECONDS = MetricSpec(
    GATEWAY,
    "rollfleet_gateway_abort_seconds",
    "histogram",
    "From a POST /v1/abort to its engine's word that the request stopped (each id answered `aborted`)",
)
GATEWAY_TOKENS = MetricSpec(
    GATEWAY,
    "rollfleet_gateway_tokens",
    "counter",
    "Completion tokens served, counted as they pass, by engine and its lag: how many weight generations its "
    "weights were behind the newest routable engine's when the attempt started (0, 1, 2, 3+; unknown: no "
    "generation known)",
    ("engine", "lag"),
)
GATEWAY_IN_FLIGHT = MetricSpec(GATEWAY, "rollfleet_gateway_in_flight", "gauge", "Requests in flight at this replica")
GATEWAY_SESSION_MOVES = MetricSpec(
    GATEWAY, "rollfleet_gateway_session_moves", "counter", "Sticky sessions moved (engine unroutable or overloaded)"
)
GATEWAY_SESSIONS = MetricSpec(GATEWAY, "rollfleet_gateway_sessions", "gauge", "Sticky sessions in the table")
GATEWAY_ROUTABLE = MetricSpec(GATEWAY, "rollfleet_gateway_routable_engines", "gauge", "Engines the gateway routes to")
GATEWAY_REJECTED = MetricSpec(
    GATEWAY, "rollfleet_gateway_rejected", "counter", "Requests refused before routing (4xx), by status", ("status",)
)

# ---- operator (`rollfleet.controller.metrics`, `rollfleet.kube`; --metrics-port) -----------------------------------
OPERATOR_API_CALLS = MetricSpec(
    OPERATOR,
    "rollfleet_operator_api_calls",
    "counter",
    "Requests made to the API server (kopf's watch streams not included)",
    ("call",),
)
OPERATOR_PASS_SECONDS = MetricSpec(
    OPERATOR, "rollfleet_operator_reconcile_seconds", "histogram", "Duration of one fleet's reconcile pass"
)
OPERATOR_PASS_ERRORS = MetricSpec(
    OPERATOR,
    "rollfleet_operator_reconcile_errors",
    "counter",
    "Reconcile passes that failed (retried after a backoff), by fleet",
    FLEET_LABELS,
)
OPERATOR_ENGINES = MetricSpec(
    OPERATOR,
    "rollfleet_operator_engines",
    "gauge",
    "Engines by phase (Starting, PendingSync, Ready, Paused, Syncing, Draining, Failed), as the fleet's status "
    "shows them",
    (*FLEET_LABELS, "phase"),
)
OPERATOR_ENGINES_WANTED = MetricSpec(
    OPERATOR, "rollfleet_operator_engines_wanted", "gauge", "Engines the fleet's spec asks for", FLEET_LABELS
)
OPERATOR_CONDITION = MetricSpec(
    OPERATOR,
    "rollfleet_operator_fleet_condition",
    "gauge",
    "The fleet's conditions (Ready, Progressing, Degraded, Paused): 1 when True",
    (*FLEET_LABELS, "condition"),
)
OPERATOR_PAUSED = MetricSpec(
    OPERATOR, "rollfleet_operator_fleet_paused", "gauge", "1 while a pause is requested of the fleet", FLEET_LABELS
)
OPERATOR_PAUSE_SECONDS = MetricSpec(
    OPERATOR,
    "rollfleet_operator_fleet_pause_seconds",
    "gauge",
    "How long the fleet's current pause has lasted (0 when not paused)",
    FLEET_LABELS,
)
OPERATOR_PAUSED_ENGINES = MetricSpec(
    OPERATOR, "rollfleet_operator_fleet_paused_engines", "gauge", "Engines that report being paused", FLEET_LABELS
)
OPERATOR_GENERATION = MetricSpec(
    OPERATOR,
    "rollfleet_operator_fleet_weight_generation",
    "gauge",
    "Generation of the fleet's committed weights (0: those the engines started with)",
    FLEET_LABELS,
)
OPERATOR_ENGINE_GENERATION = MetricSpec(
    OPERATOR,
    "rollfleet_operator_engine_weight_generation",
    "gauge",
    "Generation of the weights each engine reports (absent while unknown)",
    (*FLEET_LABELS, "engine"),
)
OPERATOR_ENGINE_PHASE = MetricSpec(
    OPERATOR,
    "rollfleet_operator_engine_phase",
    "gauge",
    "Each engine's phase, as the fleet's status shows it: 1 on the engine's current phase (an engine's phase is the "
    "operator's verdict from its pod, node and state, so the operator exports it, beside the engine's vLLM metrics)",
    (*FLEET_LABELS, "engine", "phase"),
)
OPERATOR_SKEW = MetricSpec(
    OPERATOR,
    "rollfleet_operator_fleet_version_skew_engines",
    "gauge",
    "Engines that report weights other than the fleet's version, or none they can prove (PendingSync)",
    FLEET_LABELS,
)
OPERATOR_ENGINE_IN_FLIGHT = MetricSpec(
    OPERATOR,
    "rollfleet_operator_engine_in_flight",
    "gauge",
    "Requests running or waiting in each engine, at the operator's last look",
    (*FLEET_LABELS, "engine"),
)

OPERATOR_REQUESTS = MetricSpec(
    OPERATOR,
    "rollfleet_operator_requests",
    "gauge",
    "RolloutRequests by phase (Pending, Running, Paused, Succeeded, Failed, Aborted)",
    ("namespace", "phase"),
)
OPERATOR_REQUEST_SAMPLES = MetricSpec(
    OPERATOR,
    "rollfleet_operator_request_samples",
    "gauge",
    "Samples of the RolloutRequests that exist, by outcome (total, completed, aborted, failed, in_flight), as "
    "their runners report them",
    ("namespace", "outcome"),
)
OPERATOR_REQUEST_FINISHED = MetricSpec(
    OPERATOR,
    "rollfleet_operator_request_samples_finished",
    "counter",
    "Samples RolloutRequests finished while this operator watched, by outcome (completed, aborted, failed): "
    "rate() is samples/s. A runner never retries a sample (the gateway continues one on another engine: "
    "rollfleet_gateway_failovers_total)",
    ("namespace", "outcome"),
)
OPERATOR_REQUEST_RESULTS_BYTES = MetricSpec(
    OPERATOR,
    "rollfleet_operator_request_results_bytes",
    "counter",
    "Bytes of results RolloutRequests' runners stored while this operator watched",
    ("namespace",),
)

# ---- sync sidecar (`rollfleet.sync.metrics`; /metrics on its health port, beside /healthz) -----------------------
SYNC_PUSHES = MetricSpec(
    SYNC, "rollfleet_sync_pushes", "counter", "Pushes ended, by result (done, rolled-back, failed)", ("result",)
)
SYNC_PUSH_PHASE_SECONDS = MetricSpec(
    SYNC,
    "rollfleet_sync_push_phase_seconds",
    "histogram",
    "A push's phases: receive (the trainer's tensors into the spool), staging (hashing and serving them), "
    "prefetch (engines staging while they serve), transfer (first pause to last engine verified), "
    "pause_window (first pause to last resume), total",
    ("phase",),
)
SYNC_PUSHED_BYTES = MetricSpec(SYNC, "rollfleet_sync_pushed_bytes", "counter", "Bytes of the weights pushed (one copy)")
SYNC_ENGINE_STEP_SECONDS = MetricSpec(
    SYNC,
    "rollfleet_sync_engine_step_seconds",
    "histogram",
    "Each engine's part of a push: stage (download and verify while serving), load (paused)",
    ("step",),
)
SYNC_ENGINE_STAGES = MetricSpec(
    SYNC,
    "rollfleet_sync_engine_stages",
    "counter",
    "Engines' stagings of a push's weights, by source (sidecar, or relay: another engine)",
    ("source",),
)
SYNC_RELAY_BYTES = MetricSpec(
    SYNC, "rollfleet_sync_relay_bytes", "counter", "Bytes engines staged from another engine instead of the sidecar"
)
SYNC_ENGINES_LEFT_BEHIND = MetricSpec(
    SYNC,
    "rollfleet_sync_engines_left_behind",
    "counter",
    "Engines a push ended without (pending-sync: out of routing until caught up; failed)",
    ("step",),
)
SYNC_ABORTED_STALE = MetricSpec(
    SYNC,
    "rollfleet_sync_aborted_stale_requests",
    "counter",
    "Requests a push aborted as too many generations behind its bound",
)
SYNC_GENERATION = MetricSpec(
    SYNC, "rollfleet_sync_generation", "gauge", "Generation of the last push that ended done (0: none yet)"
)

CATALOG: tuple[MetricSpec, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, MetricSpec))


def of(component: str) -> tuple[MetricSpec, ...]:
    return tuple(m for m in CATALOG if m.component == component)


def counter(spec: MetricSpec, registry: CollectorRegistry | None) -> Counter:
    assert spec.kind == "counter", spec
    return Counter(spec.name, spec.help, spec.labels, registry=registry)


def gauge(spec: MetricSpec, registry: CollectorRegistry | None) -> Gauge:
    assert spec.kind == "gauge", spec
    return Gauge(spec.name, spec.help, spec.labels, registry=registry)


def histogram(spec: MetricSpec, registry: CollectorRegistry | None) -> Histogram:
    assert spec.kind == "histogram", spec
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=LATENCY_BUCKETS)


# Empty families of a spec, for collectors that turn their own state into samples at scrape time.
def counter_family(spec: MetricSpec) -> CounterMetricFamily:
    assert spec.kind == "counter", spec
    return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))


def gauge_family(spec: MetricSpec) -> GaugeMetricFamily:
    assert spec.kind == "gauge", spec
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


def histogram_family(spec: MetricSpec) -> HistogramMetricFamily:
    assert spec.kind == "histogram", spec
    return HistogramMetricFamily(spec.name, spec.help, labels=list(spec.labels))


def render() -> str:
    """docs/metrics.md."""
    lines = [
        "# Metrics",
        "",
        "Every metric Rollfleet's own components export, rendered from `rollfleet.metrics` (the catalogue the",
        "components build their metrics from): `python -m rollfleet.metrics > docs/metrics.md`. A unit test fails",
        "when this file and the catalogue differ, and another scrapes each component for exactly these names.",
        "The engines export vLLM's own metrics (`vllm:*`) on their port besides. An engine's phase and the",
        "generation of its weights are the operator's verdicts (from the pod, its node, the engine's state and the",
        "fleet's weights record), so the operator exports them per engine. A RolloutRequest's runner is a Job that",
        "lives as long as its request: its figures (samples by outcome, results bytes) reach the request's status,",
        "and the operator counts them from there, per namespace. `rollfleet top` shows the same live, at a",
        "terminal.",
        "",
        "Scraping, alerts and a Grafana dashboard, in `manifests/monitoring/`: a PodMonitor per component, the",
        "dashboard (`grafana/rollfleet.json`, rendered from `rollfleet.dashboard`) and the alerts as a",
        "PrometheusRule (prometheus-operator, checked against its v0.85 CRDs on a real API server by",
        "`e2e/test_monitoring.py`); each alert fires and resolves under `promtool test rules`",
        "(`tests/unit/monitoring/`), and on a real Prometheus (Debian's, scraping a fleet of real engines on kind",
        "through a push, traffic and a RolloutRequest) every panel's query and every alert's expression returns",
        "data (`e2e/test_sync.py`, `rollfleet_dev.prometheus`). Without prometheus-operator:",
        "`manifests/monitoring/prometheus/` holds the same targets as kubernetes_sd jobs (not yet checked by a",
        "test: Debian's Prometheus, the one installed here, is built without kubernetes_sd), and the rule's",
        "`spec` is a plain rule file. The Helm chart installs the same objects (`monitoring.podMonitors`,",
        "`monitoring.prometheusRule`, `monitoring.dashboard` in charts/rollfleet/values.yaml). The operator's",
        "series carry the fleet's namespace in their own `namespace` label: scrape it with honor_labels, as its",
        "PodMonitor does.",
        "Engines admit only the gateway, trainers and the operator: add Prometheus' namespace to a fleet's",
        "`spec.networkPolicy.extraIngressFrom` for it to scrape them.",
    ]
    for component in dict.fromkeys(m.component for m in CATALOG):
        lines += ["", f"## {component}", "", "| metric | type | labels | meaning |", "|---|---|---|---|"]
        for m in of(component):
            labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
            lines.append(f"| `{m.exposed}` | {m.kind} | {labels} | {m.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
