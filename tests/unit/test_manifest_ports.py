"""The sync sidecar's and the operator's ports in the manifests users copy are the contract's (YAML cannot
import it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rollfleet.contract import OPERATOR_HEALTH_PORT, OPERATOR_METRICS_PORT, SYNC_HEALTH_PORT, SYNC_WEIGHTS_PORT

REPO = Path(__file__).resolve().parents[2]
SIDECAR_MANIFESTS = [
    "manifests/sync/trainer-job.yaml",
    "manifests/samples/demo-trainer.yaml",
    "examples/grpo_tiny/trainer-pod.yaml",
]


def sidecars(path: str) -> list[dict[str, Any]]:
    """The `rollfleet sync` containers of every pod template in a manifest."""
    found = []
    for doc in yaml.safe_load_all((REPO / path).read_text()):
        spec = (doc or {}).get("spec") or {}
        pod = spec.get("template", {}).get("spec", spec) if doc.get("kind") != "Pod" else spec
        for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            if (c.get("args") or [None])[0] == "sync":
                found.append(c)
    return found


def test_sidecars_probe_the_health_port_and_publish_the_weights_port() -> None:
    for path in SIDECAR_MANIFESTS:
        found = sidecars(path)
        assert found, f"no sync sidecar in {path}"
        for c in found:
            probe_port = c["readinessProbe"]["httpGet"]["port"]
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            assert ports.get(probe_port, probe_port) == SYNC_HEALTH_PORT, path
            assert ports.get("weights", SYNC_WEIGHTS_PORT) == SYNC_WEIGHTS_PORT, path


def test_the_operators_pod_publishes_the_metrics_and_health_ports() -> None:
    docs = list(yaml.safe_load_all((REPO / "manifests/base/operator.yaml").read_text()))
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == OPERATOR_METRICS_PORT
    assert ports["healthz"] == OPERATOR_HEALTH_PORT
