"""The metrics catalogue (`rollfleet.metrics`): docs/metrics.md is its rendering, and each component exports
exactly its catalogue's metrics, with their types and help."""

from __future__ import annotations

from pathlib import Path

import prometheus_client
from prometheus_client import CollectorRegistry

from rollfleet import metrics as m
from rollfleet.controller.metrics import FleetMetrics, RequestMetrics
from rollfleet.gateway.metrics import Metrics
from rollfleet.kube import API_CALLS
from rollfleet.sync.metrics import PushMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def exported(registry: CollectorRegistry) -> dict[str, tuple[str, str]]:
    """Rollfleet's families in a registry: name -> (type, help), names as prometheus_client reports them (a
    counter's without `_total`)."""
    return {f.name: (f.type, f.documentation) for f in registry.collect() if f.name.startswith("rollfleet_")}


def catalogued(component: str) -> dict[str, tuple[str, str]]:
    return {s.name: (s.kind, s.help) for s in m.of(component)}


def test_docs_metrics_md_is_the_catalogues_rendering() -> None:
    assert DOC.read_text() == m.render(), "docs/metrics.md is stale: python -m rollfleet.metrics > docs/metrics.md"


def test_names_follow_prometheus_conventions_and_are_unique() -> None:
    names = [s.exposed for s in m.CATALOG]
    assert len(names) == len(set(names))
    for s in m.CATALOG:
        assert s.name.startswith(f"rollfleet_{s.component}_"), s
        assert not s.name.endswith("_total"), f"{s.name}: prometheus_client appends _total to counters"
        assert "id" not in s.labels and "request_id" not in s.labels, f"{s.name}: an unbounded label"
        assert s.help and not s.help.endswith("."), s


def test_the_gateway_exports_exactly_its_catalogue() -> None:
    assert exported(Metrics().registry) == catalogued(m.GATEWAY)


def test_the_sync_sidecar_exports_exactly_its_catalogue() -> None:
    assert exported(PushMetrics(CollectorRegistry()).registry) == catalogued(m.SYNC)


def test_the_operator_exports_exactly_its_catalogue() -> None:
    registry = CollectorRegistry()
    fleets, requests = FleetMetrics(registry), RequestMetrics(registry)
    # The API call counter (rollfleet.kube) lives in the process's registry, which the operator serves.
    api_calls = {k: v for k, v in exported(prometheus_client.REGISTRY).items() if k == API_CALLS._name}
    assert {**exported(registry), **api_calls} == catalogued(m.OPERATOR)
    fleets.close()
    requests.close()
    assert exported(registry) == {}
