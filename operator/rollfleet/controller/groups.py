"""Engines of several pods: whether the cluster can run a fleet's engine shape. Pure.

An engine whose `spec.engine.podsPerEngine` is above 1 is a LeaderWorkerSet group (LWS,
sigs.k8s.io/lws, a prerequisite the way cert-manager is elsewhere; `desired.engine_group` makes it):
one pod per node of the pool, restarted as a whole. The API server refuses shapes that are impossible on
their face (the CEL rules of `rollfleet.api.fleet.EngineSpec`); what depends on the cluster is
judged here, from what the reconciler read: whether LWS's CRD is installed, and how many nodes
of the pool could hold one pod each. A fleet that cannot run is Degraded with the reason, and the
operator changes none of its pods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rollfleet.api.fleet import RolloutFleetSpec
from rollfleet.contract import LWS_API_GROUP, LWS_PLURAL

LWS_CRD = f"{LWS_PLURAL}.{LWS_API_GROUP}"
LWS_VERSION = "v0.8.0"


@dataclass(frozen=True)
class Blocked:
    """Why the operator does not act on a fleet's engines: the Degraded condition's reason and message."""

    reason: str
    message: str


def _quantity(value: Any) -> int:
    """A count-like resource quantity ("8", 8): GPUs are whole."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def pool_nodes(spec: RolloutFleetSpec, nodes: Iterable[Mapping[str, Any]]) -> list[str]:
    """The nodes an engine pod of this fleet could run on: its node selector's labels, schedulable, and (for GPU
    engines) as many GPUs allocatable as a pod asks for."""
    selector = spec.placement.node_selector or {}
    gpus, resource = spec.engine.gpus_per_engine, spec.engine.gpu_resource
    names = []
    for node in nodes:
        labels = node.get("metadata", {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()) or (node.get("spec") or {}).get("unschedulable"):
            continue
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        if gpus and _quantity(allocatable.get(resource, 0)) < gpus:
            continue
        names.append(node["metadata"]["name"])
    return sorted(names)


def group_problem(spec: RolloutFleetSpec, lws_installed: bool, pool: list[str]) -> Blocked | None:
    """Why this cluster cannot run the fleet's engines as asked; None for single-pod engines, which need nothing."""
    pods = spec.engine.pods_per_engine
    if pods == 1:
        return None
    if not lws_installed:
        return Blocked(
            "LeaderWorkerSetMissing",
            f"engine.podsPerEngine={pods}: an engine of several pods runs as a LeaderWorkerSet group, and the CRD "
            f"{LWS_CRD} is not installed; install LWS {LWS_VERSION} (docs/operator.md, Prerequisites)",
        )
    if len(pool) < pods:
        where = f"nodeSelector {spec.placement.node_selector}" if spec.placement.node_selector else "any labels"
        gpus = (
            f", {spec.engine.gpus_per_engine} {spec.engine.gpu_resource} allocatable"
            if spec.engine.gpus_per_engine
            else ""
        )
        return Blocked(
            "PoolTooSmall",
            f"engine.podsPerEngine={pods} puts each pod of an engine on its own node, but {len(pool)} schedulable "
            f"nodes match the pool ({where}{gpus}): add nodes to the pool or lower podsPerEngine",
        )
    return None
