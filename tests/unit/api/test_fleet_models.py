"""The RolloutFleet models parse what users write (samples included) and what the API server stores."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rollfleet.api.fleet import RESERVED_ENGINE_FLAGS, EngineStatus, RolloutFleet, RolloutFleetSpec
from rollfleet.api.request import RolloutRequest

SAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "samples"


def test_minimal_spec_gets_the_documented_defaults() -> None:
    spec = RolloutFleetSpec.model_validate({"model": {"servedName": "tiny", "hostPath": "/models/tiny"}})
    assert spec.replicas == 1
    assert spec.engine.gpus_per_engine == 1 and spec.engine.tensor_parallel_size == 1
    assert spec.update_strategy.max_surge == 0 and spec.update_strategy.max_unavailable == 1
    assert spec.drain_timeout_seconds == 300
    assert spec.gateway.enabled and spec.gateway.replicas == 1
    assert spec.engine.image.startswith("rollfleet/engine-cpu:")
    assert spec.network_policy.enabled and spec.network_policy.extra_ingress_from == []


def test_wire_form_is_camel_case_without_nulls() -> None:
    spec = RolloutFleetSpec.model_validate({"model": {"servedName": "tiny", "imagePath": "/m"}, "replicas": 2})
    wire = spec.wire()
    assert wire["model"] == {"servedName": "tiny", "imagePath": "/m"}
    assert wire["updateStrategy"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert "maxModelLen" not in wire["engine"]
    assert EngineStatus(name="a-engine-0", index=0, phase="Ready", pod_ip="127.10.0.1").wire()["podIP"] == "127.10.0.1"


def test_bounds_are_checked_in_python_too() -> None:
    with pytest.raises(ValidationError):
        RolloutFleetSpec.model_validate({"model": {"servedName": "tiny", "hostPath": "/m"}, "replicas": -1})
    with pytest.raises(ValidationError):
        RolloutFleetSpec.model_validate({"model": {"servedName": "tiny", "hostPath": "relative/path"}})


def test_network_policy_peers_keep_kubernetes_spelling() -> None:
    spec = RolloutFleetSpec.model_validate(
        {
            "model": {"servedName": "tiny", "imagePath": "/m"},
            "networkPolicy": {"extraIngressFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]},
        }
    )
    assert spec.network_policy.extra_ingress_from[0].wire() == {
        "ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}
    }
    with pytest.raises(ValidationError):
        RolloutFleetSpec.model_validate(
            {
                "model": {"servedName": "tiny", "imagePath": "/m"},
                "networkPolicy": {"extraIngressFrom": [{"podSelector": {"matchLabels": {"app": "not a label value"}}}]},
            }
        )


def test_reserved_flags_are_the_ones_the_operator_sets() -> None:
    assert {"--model", "--port", "--host", "--served-model-name"} <= set(RESERVED_ENGINE_FLAGS)


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_samples_parse(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "RolloutFleet":
            RolloutFleet.model_validate(doc)
        elif doc and doc.get("kind") == "RolloutRequest":
            RolloutRequest.model_validate(doc)
