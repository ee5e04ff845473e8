"""The CRD generator: committed files are current, schemas are structural, and the
generic path works for any model (RolloutRequest will use it too)."""

from __future__ import annotations

from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from rollfleet.api import crdgen
from rollfleet.api.common import ApiModel, CrdInfo, FreeForm, IntOrString, PrinterColumn, cel, validations
from rollfleet.api.fleet import CRD


def test_committed_files_match_the_generator() -> None:
    for path, text in crdgen.outputs(crdgen.repo_root()).items():
        assert path.exists(), f"{path} is missing: run `python -m rollfleet.api.crdgen`"
        assert path.read_text() == text, f"{path} is stale: run `python -m rollfleet.api.crdgen`"


def test_check_mode_reports_stale_files(tmp_path: Any) -> None:
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 1
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 0
    assert (tmp_path / "crds" / "rolloutfleet.yaml").exists()
    assert (tmp_path / "docs" / "crds.md").exists()


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_fleet_schema_is_structural() -> None:
    schema = crdgen.crd(CRD)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "anyOf" not in node, path
        assert node.get("type") in ("object", "array", "string", "integer", "number", "boolean"), path
        assert node.get("additionalProperties") is not False, path
        assert node.get("default", "") is not None, path


def test_every_spec_field_has_a_description_for_kubectl_explain() -> None:
    schema = crdgen.crd(CRD)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = [(p, n) for p, n in _walk(schema["properties"]["spec"], ".spec") if not p.endswith(("[]", "}"))]
    missing = [p for p, n in fields if not n.get("description")]
    assert missing == []


def test_fleet_crd_names_subresources_and_columns() -> None:
    doc = crdgen.crd(CRD)
    assert doc["metadata"]["name"] == "rolloutfleets.rollfleet.dev"
    assert doc["spec"]["names"]["shortNames"] == ["rf"]
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert {"Ready", "Desired", "Paused", "Weights", "Age"} <= set(columns)
    assert columns["Age"]["type"] == "date"


def test_nested_defaults_let_the_api_server_fill_omitted_sections() -> None:
    spec = crdgen.structural_schema(CRD.spec_model)
    # Defaults spell out nested defaults: the API server checks them against CEL rules as they are.
    assert spec["properties"]["engine"]["default"]["gpusPerEngine"] == 1
    assert spec["properties"]["updateStrategy"]["default"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert spec["properties"]["placement"]["default"] == {}
    for section in ("gateway", "weightSync"):
        assert isinstance(spec["properties"][section]["default"], dict), section
    # Optional sections stay absent unless written.
    assert "default" not in spec["properties"]["model"]["properties"]["pvc"]
    strategy = spec["properties"]["updateStrategy"]["properties"]
    assert strategy["maxSurge"]["default"] == 0
    assert strategy["maxUnavailable"]["default"] == 1


def test_cel_rules_carry_messages() -> None:
    doc = yaml.safe_load(crdgen.crd_yaml(CRD))
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [r for _, n in _walk(schema) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 8
    for r in rules:
        assert r.get("message") or r.get("messageExpression"), r["rule"]


class _Inner(ApiModel):
    """An inner object."""

    model_config = ApiModel.model_config | {"json_schema_extra": validations(cel("self.size > 0", "size > 0"))}

    size: int = Field(default=1, ge=0, description="How big.")


class _Toy(ApiModel):
    """A toy kind."""

    mode: Literal["a", "b"] = Field(default="a", description="A mode.")
    only: Literal["x"] = Field(default="x", description="A constant.")
    inner: _Inner = Field(default_factory=_Inner, description="Inner, defaulted.")
    maybe: _Inner | None = Field(default=None, description="Inner, optional.")
    labels: dict[str, str] | None = Field(default=None, description="Labels.")
    quantity: IntOrString = Field(default=1, description="A quantity.")
    raw: FreeForm | None = Field(default=None, description="Anything.")
    items: list[_Inner] = Field(default_factory=list, description="List.")


def test_generic_path_converts_pydantic_constructs() -> None:
    s = crdgen.structural_schema(_Toy)
    p = s["properties"]
    assert s["description"] == "A toy kind."
    assert p["mode"] == {"description": "A mode.", "type": "string", "enum": ["a", "b"], "default": "a"}
    assert p["only"]["enum"] == ["x"]
    assert p["inner"]["default"] == {"size": 1} and p["inner"]["description"] == "Inner, defaulted."
    assert p["inner"]["x-kubernetes-validations"] == [{"message": "size > 0", "rule": "self.size > 0"}]
    assert "default" not in p["maybe"] and p["maybe"]["type"] == "object"
    assert p["labels"]["additionalProperties"] == {"type": "string"}
    assert p["quantity"]["x-kubernetes-int-or-string"] is True
    assert p["raw"] == {"description": "Anything.", "type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert p["items"]["items"]["properties"]["size"]["minimum"] == 0

    info = CrdInfo(
        kind="Toy",
        plural="toys",
        short_names=("ty",),
        description="Toys.",
        spec_model=_Toy,
        status_model=_Inner,
        printer_columns=(PrinterColumn("Mode", "string", ".spec.mode", "m"),),
    )
    doc = crdgen.crd(info)
    assert doc["metadata"]["name"] == "toys.rollfleet.dev"
    assert "scale" not in doc["spec"]["versions"][0]["subresources"]
    assert "Toy" in crdgen.reference_markdown([info])


def test_unsupported_constructs_are_refused() -> None:
    class Union(BaseModel):
        x: int | str

    class Exclusive(BaseModel):
        x: int = Field(gt=0)

    with pytest.raises(crdgen.SchemaError, match="union"):
        crdgen.structural_schema(Union)
    with pytest.raises(crdgen.SchemaError, match="exclusiveMinimum"):
        crdgen.structural_schema(Exclusive)
