"""prometheus-operator's CRDs, from its Go module (no release download is reachable here): the e2e suite checks
Rollfleet's PodMonitors and PrometheusRule (manifests/monitoring/) against them on a real API server."""

from __future__ import annotations

from pathlib import Path

from rollfleet_dev.gobuild import module_dir

MODULE = "github.com/prometheus-operator/prometheus-operator"
VERSION = "v0.85.0"
KINDS = ("podmonitors", "prometheusrules")  # what manifests/monitoring/ holds


def crd_files() -> list[Path]:
    """The CRDs of the kinds Rollfleet ships objects of, as the module's example/ holds them (its releases'
    bundle is made from these files)."""
    directory = module_dir(MODULE, VERSION) / "example" / "prometheus-operator-crd"
    return [directory / f"monitoring.coreos.com_{kind}.yaml" for kind in KINDS]
