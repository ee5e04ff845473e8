"""The downward API (pure): `fieldRef` and `resourceFieldRef` values of a pod.

Used by `env` (environment variables) and `volumes` (downwardAPI files). Talks to nobody.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from rollfleet.errors import RollfleetError

Obj = dict[str, Any]

_SUFFIXES = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


class FieldError(RollfleetError, ValueError):
    """A field path the downward API does not support (the pod cannot start)."""


def parse_quantity(text: str | int | float) -> Decimal:
    """`500m` -> 0.5, `1Gi` -> 1073741824 (Kubernetes resource.Quantity notation)."""
    m = _QUANTITY.match(str(text).strip())
    if not m or m.group(2) not in _SUFFIXES:
        raise FieldError(f"not a quantity: {text!r}")
    return Decimal(m.group(1)) * _SUFFIXES[m.group(2)]


_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_value(pod: Obj, path: str) -> str:
    """The value of a `fieldRef.fieldPath` for this pod (status fields as the agent reports them)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs", [])),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs", [])),
    }
    if path in simple:
        return str(simple[path])
    if path in ("metadata.labels", "metadata.annotations"):
        values = meta.get(path.split(".")[1], {}) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
    m = _SUBSCRIPT.match(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise FieldError(f"unsupported fieldPath {path!r}")


def resource_value(
    pod: Obj, container_name: str, resource: str, divisor: str | None, node_allocatable: dict[str, str]
) -> str:
    """A `resourceFieldRef`: requests/limits of a container, divided and rounded up like kubelet.

    A limit that is not set reads as the node's allocatable amount; a request that is not set as 0.
    """
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not name:
        raise FieldError(f"unsupported resource {resource!r}")
    containers = pod.get("spec", {}).get("containers", []) + pod.get("spec", {}).get("initContainers", [])
    container = next((c for c in containers if c["name"] == container_name), None)
    if container is None:
        raise FieldError(f"no container {container_name!r} for resourceFieldRef")
    amounts = (container.get("resources") or {}).get(kind) or {}
    if name in amounts:
        value = parse_quantity(amounts[name])
    elif kind == "limits" and name in node_allocatable:
        value = parse_quantity(node_allocatable[name])
    else:
        value = Decimal(0)
    return str(math.ceil(value / parse_quantity(divisor or "1")))
