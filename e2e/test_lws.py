"""LeaderWorkerSet as the project's scripts install it (`rollfleet cluster lws install`, from its Go module): its
own controller makes a group of two pods, tells each its leader and rank, and recreates the whole group when one
pod goes; and the operator sees it installed. Local cluster (LWS's manager runs beside the control plane); the
module removes LWS again, so the modules after it see a cluster without it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.fleet_helpers import Fleet, deploy_operator, fleet_manifest, sim_engine
from e2e.provider import Cluster, wait_for
from rollfleet.controller.groups import LWS_CRD

pytestmark = pytest.mark.cluster
NS = "rf-e2e-lws"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/name"


@pytest.fixture(scope="module")
def lws(cluster: Cluster) -> Iterator[None]:
    if cluster.provider != "local":
        pytest.skip(
            "this module installs LWS on the local cluster; on kind `rollfleet kind lws install` is checked by hand"
        )
    from rollfleet_dev import lws as lws_install

    cluster.kubectl("create", "namespace", NS, check=False)
    lws_install.install_local()
    yield
    cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", check=False, timeout=320)
    lws_install.uninstall_local()


def group_pods(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("-n", NS, "get", "pods", "-l", f"{GROUP_LABEL}={name}", "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env", [])}


def test_lws_runs_a_group_of_two_pods_and_recreates_it_whole_when_one_goes(cluster: Cluster, lws: None) -> None:
    assert cluster.kubectl("get", "crd", LWS_CRD, check=False).returncode == 0
    rank = {
        "name": "rank",
        "image": "rollfleet/none:0",
        "command": [sys.executable, "-c", "import time; time.sleep(3600)"],
    }
    group = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "pair", "namespace": NS},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": 2,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"spec": {"containers": [rank]}},
            },
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(group))

    def running() -> list[dict[str, Any]] | None:
        pods = group_pods(cluster, "pair")
        return pods if len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods) else None

    pods = wait_for(running, timeout=120, what="LWS's group of two pods running")
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert sorted(by_name) == ["pair-0", "pair-0-1"], sorted(by_name)  # the leader and its worker
    # LWS's pod webhook tells each rank where its leader is and which rank it is.
    leader, worker = env_of(by_name["pair-0"]), env_of(by_name["pair-0-1"])
    assert leader["LWS_WORKER_INDEX"] == "0" and worker["LWS_WORKER_INDEX"] == "1", (leader, worker)
    assert worker["LWS_LEADER_ADDRESS"] == f"pair-0.pair.{NS}" == leader["LWS_LEADER_ADDRESS"], worker
    assert worker["LWS_GROUP_SIZE"] == "2"

    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    cluster.kubectl("-n", NS, "delete", "pod", "pair-0-1", "--wait=false")

    def recreated() -> bool:
        pods = running() or []
        return len(pods) == 2 and all(p["metadata"]["uid"] != before[p["metadata"]["name"]] for p in pods)

    wait_for(recreated, timeout=120, what="the whole group recreated (the leader too) after its worker went")


def test_a_multi_pod_fleet_sees_leaderworkerset_installed(cluster: Cluster, lws: None) -> None:
    """With LWS's CRD there, the operator's verdict on a 2-pod fleet is no longer that LWS is missing; the GPU pool
    (2 nodes) holds a group of 2."""
    deploy_operator(cluster, [NS])
    fleet = Fleet(cluster, "two-pods", NS)
    manifest = fleet_manifest(fleet.name, NS, replicas=1, engine={**sim_engine(cluster, 5.0), "tensorParallelSize": 2})
    manifest["spec"]["engine"] |= {"podsPerEngine": 2, "gpusPerEngine": 1}
    manifest["spec"]["gateway"] = {"enabled": False}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def verdict(st: dict[str, Any]) -> bool:
        return any(c["type"] == "Degraded" and c["reason"] == "GroupsNotServed" for c in st.get("conditions", []))

    fleet.wait(verdict, "the operator's verdict with LWS installed", timeout=60)
    assert fleet.pods() == []
