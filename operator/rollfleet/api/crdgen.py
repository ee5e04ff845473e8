"""Generates CustomResourceDefinitions and their reference page from the pydantic models.

One generic path for every kind: `crd(info)` turns a `CrdInfo` (spec and status models
plus names, printer columns, subresources) into a CRD dict with a structural OpenAPI v3
schema; `reference_markdown` renders the same schema for people. `CRDS` lists the kinds;
adding a kind is adding its `CrdInfo` there.

Run `python -m rollfleet.api.crdgen` to rewrite `crds/*.yaml` (with the
`crds/kustomization.yaml` that manifests/base includes) and `docs/crds.md`; `--check`
fails when they are stale. Pure apart from reading and writing those files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rollfleet.api import fleet, request
from rollfleet.api.admission import gateway_policy, runner_policy
from rollfleet.api.common import CrdInfo
from rollfleet.contract import APP_NAME, LABEL_NAME
from rollfleet.errors import RollfleetError

CRDS: tuple[CrdInfo, ...] = (fleet.CRD, request.CRD)

Schema = dict[str, Any]

# Keys of pydantic's JSON schema that a CRD schema does not take.
_DROPPED = {"title", "examples", "$defs"}
# The order keys are written in, so the YAML reads top-down like `kubectl explain`.
_KEY_ORDER = [
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "items",
    "properties",
    "additionalProperties",
    "required",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-validations",
]


class SchemaError(RollfleetError, ValueError):
    """The model uses a JSON schema construct that a structural CRD schema cannot express."""


def structural_schema(model: type[BaseModel]) -> Schema:
    """The model's JSON schema rewritten as a structural OpenAPI v3 schema (refs inlined, no nulls)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(raw, raw.get("$defs", {}), path=model.__name__)


def _convert(node: Schema, defs: dict[str, Schema], path: str) -> Schema:
    node = _resolve(node, defs)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        # Optional[X] is anyOf [X, null]: the CRD says "optional" by leaving X out of `required`.
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise SchemaError(f"{path}: a union of several types cannot be a structural schema")
        outer = {k: v for k, v in node.items() if k != "anyOf"}
        node = {**_resolve(branches[0], defs), **outer}
    for bad in ("oneOf", "allOf", "exclusiveMinimum", "exclusiveMaximum", "prefixItems"):
        if bad in node:
            raise SchemaError(f"{path}: {bad} is not supported in CRD schemas (use ge/le, plain types)")

    out: Schema = {}
    for key, value in node.items():
        if key in _DROPPED or (key == "default" and value is None):
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out[key] = {name: _convert(sub, defs, f"{path}.{name}") for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, f"{path}[]")
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = _convert(value, defs, f"{path}{{}}")
            # False (extra="forbid") is implied: the API server prunes unknown fields.
        else:
            out[key] = value

    required = set(out.get("required", []))
    for name, sub in out.get("properties", {}).items():
        # A non-required object field without a default has a default_factory (a model
        # with defaults). The API server checks defaults against CEL rules without
        # defaulting inside them, so the default spells out every nested default.
        if (
            name not in required
            and sub.get("type") == "object"
            and "properties" in sub
            and "default" not in sub
            and not _nullable(node["properties"][name], defs)
        ):
            sub["default"] = _implied_default(sub)
    return _ordered(out)


def _implied_default(node: Schema) -> Schema:
    return {name: sub["default"] for name, sub in node.get("properties", {}).items() if "default" in sub}


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    """Inline a $ref; the referring node's own keys (its field description) win."""
    ref = node.get("$ref")
    if ref is None:
        return node
    target = defs[ref.rsplit("/", 1)[-1]]
    return {**_resolve(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}


def _nullable(node: Schema, defs: dict[str, Schema]) -> bool:
    return any(b.get("type") == "null" for b in _resolve(node, defs).get("anyOf", []))


def _ordered(node: Schema) -> Schema:
    rank = {k: i for i, k in enumerate(_KEY_ORDER)}
    return dict(sorted(node.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def crd(info: CrdInfo) -> Schema:
    """The CustomResourceDefinition of one kind, as a dict ready for `kubectl apply`."""
    root: Schema = {
        "description": info.description,
        "type": "object",
        "properties": {
            "apiVersion": {"description": "APIVersion of this object.", "type": "string"},
            "kind": {"description": "Kind of this object.", "type": "string"},
            # Declaring name (the API server allows only name and generateName here) lets
            # root rules point their message at metadata.name.
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": structural_schema(info.spec_model),
            "status": structural_schema(info.status_model),
        },
        "required": ["spec"],
    }
    if info.root_validations:
        root["x-kubernetes-validations"] = list(info.root_validations)
    subresources: Schema = {"status": {}}
    if info.scalable:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    version: Schema = {
        "name": info.version,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": root},
        "subresources": subresources,
    }
    if info.printer_columns:
        version["additionalPrinterColumns"] = [
            {"name": c.name, "type": c.type, "jsonPath": c.json_path, "description": c.description}
            | ({"priority": c.priority} if c.priority else {})
            for c in info.printer_columns
        ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": info.name, "labels": {LABEL_NAME: APP_NAME}},
        "spec": {
            "group": info.group,
            "scope": "Namespaced",
            "names": {
                "kind": info.kind,
                "listKind": f"{info.kind}List",
                "plural": info.plural,
                "singular": info.singular,
                "shortNames": list(info.short_names),
                "categories": list(info.categories),
            },
            "versions": [version],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-schemas out in full: anchors and aliases would puzzle a reader of the CRD."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml(info: CrdInfo) -> str:
    header = f"# Generated by `python -m rollfleet.api.crdgen` from rollfleet.api ({info.kind}); do not edit.\n"
    return header + yaml.dump(crd(info), Dumper=_NoAliasDumper, sort_keys=False, width=120, allow_unicode=True)


# The admission policies (rollfleet.api.admission), a file each.
POLICY_FILES = {"gateway-policy.yaml": gateway_policy, "runner-policy.yaml": runner_policy}


def policy_yaml(file: str) -> str:
    header = "# Generated by `python -m rollfleet.api.crdgen` from rollfleet.api.admission; do not edit.\n"
    return header + yaml.dump_all(POLICY_FILES[file](), Dumper=_NoAliasDumper, sort_keys=False, width=120)


def crds_kustomization(infos: Sequence[CrdInfo]) -> str:
    """crds/kustomization.yaml, so that manifests/base can include the CRDs (and the admission policies)
    by directory."""
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [*(f"{info.singular}.yaml" for info in infos), *POLICY_FILES],
    }
    return "# Generated by `python -m rollfleet.api.crdgen`; do not edit.\n" + yaml.safe_dump(doc, sort_keys=False)


def reference_markdown(infos: Sequence[CrdInfo]) -> str:
    """docs/crds.md: every field with its type, default, constraints and description, plus the CEL rules."""
    lines = [
        "# Custom resource reference",
        "",
        "Generated by `python -m rollfleet.api.crdgen` from the pydantic models in `operator/rollfleet/api/`;",
        "do not edit. `kubectl explain` shows the same descriptions.",
        "",
    ]
    for info in infos:
        lines += [
            f"## {info.kind} (`{info.group}/{info.version}`)",
            "",
            info.description,
            "",
            f"Short names: {', '.join(f'`{n}`' for n in info.short_names)}. "
            f"Subresources: status{', scale' if info.scalable else ''}.",
            "",
        ]
        if info.printer_columns:
            lines += ["`kubectl get` columns:", "", "| column | from | |", "|---|---|---|"]
            lines += [
                f"| {c.name} | `{c.json_path}` | {c.description}{' (wide)' if c.priority else ''} |"
                for c in info.printer_columns
            ]
            lines.append("")
        rules = [("(object)", r) for r in info.root_validations]
        for part, model in (("spec", info.spec_model), ("status", info.status_model)):
            lines += [f"### {part}", "", "| field | type | default | description |", "|---|---|---|---|"]
            rows: list[str] = []
            _field_rows(structural_schema(model), f".{part}", rows, rules)
            lines += rows
            lines.append("")
        if rules:
            lines += [
                "### Validation rules",
                "",
                "Checked by the API server on every create and update:",
                "",
                "| where | rule | message |",
                "|---|---|---|",
            ]
            for where, r in rules:
                message = str(r.get("message") or r.get("messageExpression", ""))
                lines.append(f"| `{where}` | `{_cell(str(r['rule']))}` | {_cell(message)} |")
            lines.append("")
    return "\n".join(lines)


def _field_rows(node: Schema, path: str, rows: list[str], rules: list[tuple[str, dict[str, str | bool]]]) -> None:
    rules += [(path, r) for r in node.get("x-kubernetes-validations", [])]
    required = set(node.get("required", []))
    for name, sub in node.get("properties", {}).items():
        sub_path = f"{path}.{name}"
        default = sub.get("default")
        desc = sub.get("description", "") + _constraints(sub) + (" Required." if name in required else "")
        default_text = f"`{json.dumps(default)}`" if default not in (None, {}) else ""
        rows.append(f"| `{sub_path}` | {_type_name(sub)} | {default_text} | {_cell(desc)} |")
        if sub.get("type") == "object":
            _field_rows(sub, sub_path, rows, rules)
        elif sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            rules += [(sub_path, r) for r in sub.get("x-kubernetes-validations", [])]
            if sub["items"].get("type") == "object":  # its rules are collected with its fields
                _field_rows(sub["items"], f"{sub_path}[]", rows, rules)
            else:
                rules += [(f"{sub_path}[]", r) for r in sub["items"].get("x-kubernetes-validations", [])]


def _type_name(node: Schema) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    if node.get("type") == "array":
        return f"[]{_type_name(node.get('items', {}))}"
    if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map[string]{_type_name(node['additionalProperties'])}"
    return str(node.get("type", "any"))


def _constraints(node: Schema) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    if "minimum" in node or "maximum" in node:
        parts.append(f"range {node.get('minimum', '')}..{node.get('maximum', '')}")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    return f" ({'; '.join(parts)})" if parts else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def repo_root() -> Path:
    """The source checkout this module lives in (crds/ and docs/ are written there)."""
    return Path(__file__).resolve().parents[3]


def outputs(root: Path) -> dict[Path, str]:
    """Every generated file and its content."""
    files = {root / "crds" / f"{info.singular}.yaml": crd_yaml(info) for info in CRDS}
    files |= {root / "crds" / name: policy_yaml(name) for name in POLICY_FILES}
    files[root / "crds" / "kustomization.yaml"] = crds_kustomization(CRDS)
    files[root / "docs" / "crds.md"] = reference_markdown(CRDS)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollfleet.api.crdgen", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=repo_root(), help="checkout to write into (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args(argv)
    return write_outputs(outputs(args.root), check=args.check, command="python -m rollfleet.api.crdgen")


def write_outputs(files: Mapping[Path, str], *, check: bool, command: str) -> int:
    """Write the generated files that differ (or, with `check`, name them and fail); `command` regenerates them."""
    stale = []
    for path, text in files.items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if check and stale:
        print(f"stale (run `{command}`): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
