"""Rollfleet's monitoring manifests (manifests/monitoring/: PodMonitors, PrometheusRule) against prometheus-operator's
own CRDs (v0.85, from its Go module, `rollfleet_dev.monitoring`) on a real API server: a server-side dry run with
strict field validation accepts them, and refuses a misspelled field, so the check is the schema's. Metrics and
alerts themselves: docs/metrics.md, tests/unit/monitoring/."""

from __future__ import annotations

import pytest
import yaml

from e2e.fleet_helpers import REPO
from e2e.provider import Cluster

pytestmark = pytest.mark.cluster
MANIFESTS = sorted((REPO / "manifests" / "monitoring").glob("*.yaml"))


def dry_run(cluster: Cluster, text: str) -> tuple[int, str]:
    """A server-side dry run of `text`'s objects, with strict field validation: its exit status and output."""
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=text, check=False, timeout=60
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.usefixtures("prometheus_operator_crds")
def test_the_podmonitors_and_the_prometheusrule_are_valid_against_prometheus_operators_crds(cluster: Cluster) -> None:
    kinds = [d["kind"] for m in MANIFESTS for d in yaml.safe_load_all(m.read_text()) if d]
    assert sorted(set(kinds)) == ["PodMonitor", "PrometheusRule"], kinds
    for manifest in MANIFESTS:
        rc, out = dry_run(cluster, manifest.read_text())
        assert rc == 0, f"{manifest.name}: {out}"
        assert out.count("(server dry run)") == len([d for d in yaml.safe_load_all(manifest.read_text()) if d])
    # The schema is what accepted them: a misspelled field is refused, naming it.
    monitor = next(yaml.safe_load_all((REPO / "manifests" / "monitoring" / "podmonitors.yaml").read_text()))
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    rc, out = dry_run(cluster, yaml.safe_dump(monitor))
    assert rc != 0 and "podMetricEndpoints" in out, out
