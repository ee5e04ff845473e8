"""LeaderWorkerSet as the project's scripts install it (`rollfleet cluster lws install`, from its Go module): its
own controller makes a group of two pods, tells each its leader and rank, and recreates the whole group when one
pod goes; and the operator sees it installed. Local cluster (LWS's manager runs beside the control plane); the
module removes LWS again, so the modules after it see a cluster without it."""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.fleet_helpers import Fleet, deploy_operator, fleet_manifest, group_pods, sim_engine
from e2e.provider import Cluster, wait_for
from rollfleet.contract import GATEWAY_PORT, LABEL_FLEET, engine_group_leader, engine_pod_name
from rollfleet.controller.groups import LWS_CRD
from rollfleet_client.protocol import SESSION_HEADER
from rollfleet_dev import oneshot

pytestmark = pytest.mark.cluster
NS = "rf-e2e-lws"
FLEET = "two-pods"


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
        pods = group_pods(cluster, NS, "pair")
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


def lws_of_fleet(cluster: Cluster) -> list[dict[str, Any]]:
    """The fleet's LeaderWorkerSets (not the first case's), but those being deleted."""
    out = cluster.kubectl("-n", NS, "get", "leaderworkersets", "-l", f"{LABEL_FLEET}={FLEET}", "-o", "json").stdout
    return [g for g in json.loads(out)["items"] if not g["metadata"].get("deletionTimestamp")]


def lws_names(cluster: Cluster) -> list[str]:
    return sorted(g["metadata"]["name"] for g in lws_of_fleet(cluster))


def lws_uids(cluster: Cluster) -> set[str]:
    return {g["metadata"]["uid"] for g in lws_of_fleet(cluster)}


def gateway_engines(cluster: Cluster, fleet: Fleet, requests: int) -> set[str]:
    """The engines the gateway sent `requests` completions to (its upstream attempts by engine), each a new session:
    new sessions spread over the routable engines, where requests without one stay on the engine freed last."""
    [gateway] = [p["metadata"]["name"] for p in fleet.pods("gateway") if p["status"].get("phase") == "Running"]
    with cluster.reach(NS, gateway, GATEWAY_PORT) as url:
        for i in range(requests):
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
            session = {SESSION_HEADER: f"gateway-engines-{i}-{uuid.uuid4().hex[:8]}"}
            r = oneshot.post(f"{url}/v1/completions", json=body, headers=fleet.inference() | session, timeout=30)
            assert r.status_code == 200, (i, r.status_code, r.text)
        metrics = oneshot.get(f"{url}/metrics", timeout=10).text
    return {m.group(1) for m in re.finditer(r'rollfleet_gateway_upstream_attempts_total\{engine="([^"]+)"', metrics)}


def test_a_multi_pod_fleet_runs_each_engine_as_a_group_and_acts_on_groups_whole(cluster: Cluster, lws: None) -> None:
    """A fleet of 2 engines of 2 pods: each engine is a LeaderWorkerSet group across the GPU pool's 2 nodes, the
    leader is the engine (status, gateway), the other pod its headless rank; a rank lost restarts the group, scale
    and a rolling update create and delete whole groups."""
    deploy_operator(cluster, [NS])
    fleet = Fleet(cluster, FLEET, NS)
    manifest = fleet_manifest(fleet.name, NS, replicas=2, engine={**sim_engine(cluster, 5.0), "tensorParallelSize": 2})
    manifest["spec"]["engine"] |= {"podsPerEngine": 2, "gpusPerEngine": 1}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    st = fleet.wait_ready(2, timeout=120)
    groups = [engine_pod_name(fleet.name, i) for i in (0, 1)]
    assert sorted(e["name"] for e in st["engines"]) == [engine_group_leader(g) for g in groups], st["engines"]
    assert lws_names(cluster) == groups
    for group in groups:
        pods = {p["metadata"]["name"]: p for p in group_pods(cluster, NS, group)}
        leader, rank = pods[engine_group_leader(group)], pods[f"{engine_group_leader(group)}-1"]
        assert len(pods) == 2 and leader["spec"]["nodeName"] != rank["spec"]["nodeName"], "one pod per node"
        assert rank["metadata"]["labels"]["app.kubernetes.io/component"] == "engine-rank"
        args = rank["spec"]["containers"][0]["args"]
        assert "--headless" in args and args[args.index("--pod-rank") + 1] == "$(LWS_WORKER_INDEX)", args
        assert env_of(rank)["LWS_WORKER_INDEX"] == "1" and env_of(leader)["LWS_WORKER_INDEX"] == "0"
    # The gateway finds the leaders only: the headless ranks serve nothing.
    assert gateway_engines(cluster, fleet, 8) == {engine_group_leader(g) for g in groups}

    # A rank lost: LWS recreates its whole group, a fresh engine the operator waits for as for any other.
    leader = engine_group_leader(groups[0])
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in group_pods(cluster, NS, groups[0])}

    def readied() -> int:
        """How often the operator saw the leader become Ready: the status alone may still show the old group."""
        mine = [e for e in fleet.events() if e.get("reason") == "EngineReady" and e["message"].startswith(f"{leader}:")]
        return sum(e.get("count") or 1 for e in mine)

    ready_before = readied()
    cluster.kubectl("-n", NS, "delete", "pod", f"{leader}-1", "--wait=false")

    def restarted(st: dict[str, Any]) -> bool:
        pods = group_pods(cluster, NS, groups[0])
        fresh = len(pods) == 2 and all(p["metadata"]["uid"] != before.get(p["metadata"]["name"]) for p in pods)
        # LWS may make the new group before the operator has seen the old one go: then the status still counts 2
        # Ready, and a scale-down right after would pick the new group as the engine not serving yet.
        return fresh and st.get("readyReplicas") == 2 and readied() > ready_before

    fleet.wait(restarted, "the group recreated whole, and Ready again", timeout=120)
    assert lws_names(cluster) == groups  # the same group, not a second one

    # Scale down: the last engine's group goes whole; the other is not touched.
    kept = {p["metadata"]["uid"] for p in group_pods(cluster, NS, groups[0])}
    cluster.kubectl("-n", NS, "patch", "rf", fleet.name, "--type=merge", "-p", '{"spec":{"replicas":1}}')
    fleet.wait_ready(1, timeout=120)

    def gone() -> bool:
        return lws_names(cluster) == groups[:1] and not group_pods(cluster, NS, groups[1])

    wait_for(gone, 60, what="group 1 gone")
    assert {p["metadata"]["uid"] for p in group_pods(cluster, NS, groups[0])} == kept

    # A rolling update: the engine's group is drained and deleted whole, and a new one made (the same index, as
    # the fleet's update strategy has no surge: a new LeaderWorkerSet of the same name).
    old = lws_uids(cluster)
    patch = {"spec": {"engine": {"env": [{"name": "ROLLED", "value": "1"}]}}}
    cluster.kubectl("-n", NS, "patch", "rf", fleet.name, "--type=merge", "-p", json.dumps(patch))

    def rolled(st: dict[str, Any]) -> bool:
        uids = lws_uids(cluster)
        return st.get("updatedReplicas") == 1 and st.get("readyReplicas") == 1 and len(uids) == 1 and not uids & old

    fleet.wait(rolled, "rolled to a new group", timeout=120)
    [group] = lws_names(cluster)
    pods = group_pods(cluster, NS, group)
    assert len(pods) == 2 and all(p["metadata"]["uid"] not in kept for p in pods)
    assert all(env_of(p).get("ROLLED") == "1" for p in pods)
    cluster.kubectl("-n", NS, "delete", "rf", fleet.name, "--wait=true", "--timeout=120s", timeout=130)
    wait_for(lambda: not lws_names(cluster), 60, what="the fleet's groups deleted with it")
