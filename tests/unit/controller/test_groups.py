"""Engines of several pods: what the cluster must have (LWS, enough nodes in the pool) before the operator acts."""

from __future__ import annotations

from typing import Any

from rollfleet.api.fleet import RolloutFleetSpec
from rollfleet.controller.groups import LWS_CRD, group_problem, pool_nodes


def spec(**engine: Any) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate(
        {
            "model": {"servedName": "m", "hostPath": "/m"},
            "engine": engine,
            "placement": {"nodeSelector": {"pool": "gpu"}},
        }
    )


def node(name: str, pool: str = "gpu", gpus: int | None = 8, unschedulable: bool = False) -> dict[str, Any]:
    allocatable = {} if gpus is None else {"nvidia.com/gpu": str(gpus)}
    return {
        "metadata": {"name": name, "labels": {"pool": pool}},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {"allocatable": allocatable},
    }


def test_single_pod_engines_need_nothing_from_the_cluster() -> None:
    assert group_problem(spec(), lws_installed=False, pool=[]) is None


def test_without_lws_a_multi_pod_fleet_is_blocked_naming_the_crd() -> None:
    blocked = group_problem(spec(podsPerEngine=2, tensorParallelSize=2), lws_installed=False, pool=["a", "b"])
    assert blocked is not None and blocked.reason == "LeaderWorkerSetMissing"
    assert LWS_CRD in blocked.message and "v0.8.0" in blocked.message


def test_the_pool_counts_schedulable_nodes_of_the_selector_with_the_gpus_a_pod_asks_for() -> None:
    nodes = [
        node("a"),
        node("b", gpus=1),  # too few GPUs for a pod of 2
        node("c", pool="cpu"),
        node("d", unschedulable=True),
        node("e", gpus=None),
        node("f", gpus=2),
    ]
    two_gpus = spec(podsPerEngine=2, tensorParallelSize=4, gpusPerEngine=2)
    assert pool_nodes(two_gpus, nodes) == ["a", "f"]
    assert pool_nodes(spec(podsPerEngine=2, tensorParallelSize=2, gpusPerEngine=0), nodes) == ["a", "b", "e", "f"]


def test_more_pods_per_engine_than_nodes_in_the_pool_is_blocked_with_the_count() -> None:
    four = spec(podsPerEngine=4, tensorParallelSize=4, gpusPerEngine=1)
    blocked = group_problem(four, lws_installed=True, pool=["a", "b"])
    assert blocked is not None and blocked.reason == "PoolTooSmall"
    assert "podsPerEngine=4" in blocked.message and "2 schedulable nodes" in blocked.message
    assert "{'pool': 'gpu'}" in blocked.message and "1 nvidia.com/gpu" in blocked.message
