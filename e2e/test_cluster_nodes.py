"""The local cluster's node agent: scheduling on its GPU node pools, pods as processes, env and
volumes, probes, restarts, deletion, ServiceAccounts with RBAC, Services.

Local cluster only: on kind, kubelet and containerd run the pods, and the suite's fleets on the
GPU pool (e2e/test_fleet.py) cover the scheduling there.
"""

from __future__ import annotations

import ipaddress
import json
import os
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client import ApiException

from e2e.provider import Cluster, wait_for
from rollfleet_dev.localcluster.nodeagent.ipam import POD_CIDR

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("ROLLFLEET_E2E_PROVIDER", "local") != "local",
        reason="tests the local cluster's node agent; on kind, kubelet runs the pods",
    ),
]

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def ns(core: kubernetes.client.CoreV1Api) -> Iterator[str]:
    name = f"nodes-e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    # Pods need the namespace's default ServiceAccount (made by the controller-manager).
    wait_for(
        lambda: _exists(lambda: core.read_namespaced_service_account("default", name)),
        30,
        what="default ServiceAccount",
    )
    yield name
    core.delete_namespace(name)


def _exists(read: Callable[[], Any]) -> bool:
    try:
        read()
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


def _pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {
        "name": spec.pop("container_name", "main"),
        "image": "busybox",
        "command": command,
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **spec.pop("metadata", {})},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 2, **spec},
    }


def _phase(core: kubernetes.client.CoreV1Api, ns: str, name: str) -> str:
    return core.read_namespaced_pod(name, ns).status.phase


def _ready(core: kubernetes.client.CoreV1Api, ns: str, name: str) -> bool:
    conds = core.read_namespaced_pod(name, ns).status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conds)


def _log(ns: str, pod: str, container: str | None = None) -> str:
    from rollfleet_dev.localcluster.controlplane import Layout
    from rollfleet_dev.localcluster.nodeagent.logs import LogsError, find_log

    try:
        return find_log(Layout().nodes_dir / "pods", ns, pod, container, previous=False).read_text()
    except LogsError:
        return ""


# A pod's view of the network and of /dev/shm, as JSON: run in a second pod against the first.
PROBE = """
import json, os, socket, sys
def connect(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "open"
    except OSError as err:
        return type(err).__name__
peer, service = sys.argv[1], sys.argv[2]
print(json.dumps({
    "peer": connect(peer, 8000),
    "peer_localhost_only": connect(peer, 9000),
    "own_localhost": connect("127.0.0.1", 8000),
    "service": connect(service, 80),
    "peer_shm_seen": os.path.exists("/dev/shm/marker"),
    "own_name": socket.gethostbyname(socket.gethostname()),
}), flush=True)
"""


def test_a_pod_has_its_own_network_and_dev_shm_and_is_reached_at_its_ip_and_service(
    core: kubernetes.client.CoreV1Api, ns: str, cluster: Cluster
) -> None:
    # Two servers as in any pod: one on every address, one on localhost only; and a file in /dev/shm.
    serve = "echo x > /dev/shm/marker; python -m http.server 9000 --bind 127.0.0.1 & exec python -m http.server 8000"
    pod = _pod(
        "gpu4",
        ["sh", "-c", serve],
        tolerations=[GPU_TOLERATION],
        metadata={"labels": {"app": "gpu4"}},
        container={
            "image": "python:3.11",
            "resources": {"limits": {"nvidia.com/gpu": "4"}},
            "ports": [{"containerPort": 8000, "name": "http"}],
            "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 1},
        },
    )
    core.create_namespaced_pod(ns, pod)
    wait_for(lambda: _ready(core, ns, "gpu4"), 60, what="gpu4 ready")
    p = core.read_namespaced_pod("gpu4", ns)
    node = core.read_node(p.spec.node_name)
    assert node.metadata.labels["rollfleet.dev/pool"] == "gpu"
    assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
    # Reached at its own address, routed from this machine, as kubelet's CNI gives one.
    assert ipaddress.ip_address(p.status.pod_ip) in ipaddress.ip_network(POD_CIDR)
    with cluster.reach(ns, "gpu4", 8000) as url:
        assert urllib.request.urlopen(url, timeout=10).status == 200
    assert not Path("/dev/shm/marker").exists(), "the pod wrote into this machine's /dev/shm"
    svc = core.create_namespaced_service(
        ns,
        {
            "metadata": {"name": "gpu4"},
            "spec": {"selector": {"app": "gpu4"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )

    def through_service() -> bool:
        try:
            return urllib.request.urlopen(f"http://{svc.spec.cluster_ip}:80/", timeout=5).status == 200
        except OSError:
            return False

    wait_for(through_service, 30, what="the Service answering on its ClusterIP")
    # From another pod: the first one's IP and its Service, not its localhost, nor its /dev/shm.
    probe = _pod(
        "probe",
        ["python", "-c", PROBE, p.status.pod_ip, svc.spec.cluster_ip],
        restartPolicy="Never",
        container={"image": "python:3.11"},
    )
    core.create_namespaced_pod(ns, probe)
    wait_for(lambda: _phase(core, ns, "probe") == "Succeeded", 60, what="the probe pod to finish")
    seen = json.loads(_log(ns, "probe").strip().splitlines()[-1])
    # Its own name is its own address, from /etc/hosts as kubelet writes it (gloo looks it up; no DNS here).
    assert seen.pop("own_name") == core.read_namespaced_pod("probe", ns).status.pod_ip
    assert seen == {
        "peer": "open",
        "peer_localhost_only": "ConnectionRefusedError",
        "own_localhost": "ConnectionRefusedError",
        "service": "open",
        "peer_shm_seen": False,
    }, seen


def test_nine_gpus_stay_pending_unschedulable(core: kubernetes.client.CoreV1Api, ns: str) -> None:
    core.create_namespaced_pod(
        ns,
        _pod(
            "gpu9",
            ["sleep", "300"],
            tolerations=[GPU_TOLERATION],
            container={"resources": {"limits": {"nvidia.com/gpu": "9"}}},
        ),
    )

    def unschedulable() -> bool:
        p = core.read_namespaced_pod("gpu9", ns)
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in p.status.conditions or []
        )

    wait_for(unschedulable, 30, what="gpu9 Unschedulable")
    p = core.read_namespaced_pod("gpu9", ns)
    assert p.status.phase == "Pending" and not p.spec.node_name


def test_pod_without_toleration_avoids_gpu_nodes(core: kubernetes.client.CoreV1Api, ns: str) -> None:
    for i in range(3):
        core.create_namespaced_pod(ns, _pod(f"plain-{i}", ["sleep", "300"]))
    for i in range(3):
        node = wait_for(
            lambda i=i: core.read_namespaced_pod(f"plain-{i}", ns).spec.node_name, 30, what=f"plain-{i} scheduled"
        )
        assert core.read_node(node).metadata.labels["rollfleet.dev/pool"] == "cpu"
    # Pinned to the GPU pool without the toleration: never scheduled.
    core.create_namespaced_pod(ns, _pod("pinned", ["sleep", "300"], nodeSelector={"rollfleet.dev/pool": "gpu"}))
    wait_for(
        lambda: any(
            c.reason == "Unschedulable" for c in core.read_namespaced_pod("pinned", ns).status.conditions or []
        ),
        30,
        what="pinned Unschedulable",
    )
    assert not core.read_namespaced_pod("pinned", ns).spec.node_name


def test_deployment_ready_and_owner_deletion_collects_children(
    cluster: Cluster, core: kubernetes.client.CoreV1Api, ns: str
) -> None:
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    apps.create_namespaced_deployment(
        ns,
        {
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 2,
                        "containers": [
                            {
                                "name": "web",
                                "image": "python:3.11",
                                "command": ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
                                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                                "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
                            }
                        ],
                    },
                },
            },
        },
    )
    wait_for(
        lambda: (apps.read_namespaced_deployment("web", ns).status.ready_replicas or 0) == 2,
        90,
        what="2 ready replicas",
    )
    apps.delete_namespaced_deployment("web", ns, propagation_policy="Background")
    wait_for(
        lambda: not core.list_namespaced_pod(ns, label_selector="app=web").items,
        60,
        what="the Deployment's pods garbage-collected",
    )


def test_crashing_container_restarts_with_growing_count(core: kubernetes.client.CoreV1Api, ns: str) -> None:
    core.create_namespaced_pod(ns, _pod("crash", ["sh", "-c", "echo run; exit 3"]))

    def restarts() -> int:
        statuses = core.read_namespaced_pod("crash", ns).status.container_statuses or []
        return statuses[0].restart_count if statuses else 0

    wait_for(lambda: restarts() >= 2, 60, what="2 restarts")
    s = core.read_namespaced_pod("crash", ns).status.container_statuses[0]
    assert s.last_state.terminated.exit_code == 3
    assert _phase(core, ns, "crash") == "Running"  # restartPolicy Always: it keeps being restarted
    waiting = wait_for(
        lambda: core.read_namespaced_pod("crash", ns).status.container_statuses[0].state.waiting,
        30,
        interval=0.1,
        what="CrashLoopBackOff",
    )
    assert waiting.reason == "CrashLoopBackOff"
    from rollfleet_dev.localcluster.controlplane import Layout
    from rollfleet_dev.localcluster.nodeagent.logs import find_log

    assert find_log(Layout().nodes_dir / "pods", ns, "crash", None, previous=True).read_text() == "run\n"


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_deleted_pod_leaves_no_process(core: kubernetes.client.CoreV1Api, ns: str) -> None:
    marker = f"ROLLFLEET_E2E_MARKER={uuid.uuid4().hex}"
    # A child that ignores SIGTERM and leaves the process group: the agent still gets it.
    script = "trap '' TERM; setsid sleep 300 & sleep 300"
    core.create_namespaced_pod(
        ns,
        _pod(
            "doomed",
            ["sh", "-c", script],
            container={"env": [{"name": "ROLLFLEET_E2E_MARKER", "value": marker.split("=", 1)[1]}]},
        ),
    )
    wait_for(lambda: len(_processes_with(marker)) >= 3, 30, what="the pod's processes")
    core.delete_namespaced_pod("doomed", ns, grace_period_seconds=1)
    wait_for(lambda: not _exists(lambda: core.read_namespaced_pod("doomed", ns)), 30, what="pod gone")
    assert _processes_with(marker) == []


RBAC_SCRIPT = textwrap.dedent("""
    import sys
    from kubernetes import client, config
    config.load_incluster_config()
    ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
    try:
        client.CoreV1Api().list_namespaced_config_map(ns)
    except client.ApiException as e:
        print("refused", e.status)
        sys.exit(3)
    print("allowed")
""")


def test_service_account_permissions_are_enforced(cluster: Cluster, core: kubernetes.client.CoreV1Api, ns: str) -> None:
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client())
    for sa in ("reader", "nobody"):
        core.create_namespaced_service_account(ns, {"metadata": {"name": sa}})
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "cm-reader"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        },
    )
    for sa in ("reader", "nobody"):
        core.create_namespaced_pod(
            ns,
            _pod(
                f"as-{sa}",
                ["python", "-c", RBAC_SCRIPT],
                restartPolicy="Never",
                serviceAccountName=sa,
                container={"image": "python:3.11"},
            ),
        )
    for sa in ("reader", "nobody"):
        wait_for(lambda sa=sa: _phase(core, ns, f"as-{sa}") in ("Succeeded", "Failed"), 60, what=f"as-{sa} done")
    exit_code = {
        sa: core.read_namespaced_pod(f"as-{sa}", ns).status.container_statuses[0].state.terminated.exit_code
        for sa in ("reader", "nobody")
    }
    assert exit_code == {"reader": 0, "nobody": 3}
    assert "refused 403" in _log(ns, "as-nobody")


def test_env_and_volumes_reach_the_process(core: kubernetes.client.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello", "mode": "x"}})
    core.create_namespaced_secret(ns, {"metadata": {"name": "sec"}, "stringData": {"password": "s3cret"}})
    script = textwrap.dedent("""
        echo "name=$MY_NAME ns=$MY_NS ip=$MY_IP node=$MY_NODE app=$MY_APP"
        echo "greeting=$GREETING password=$PASSWORD mode=$CFG_mode expanded=$EXPANDED escaped=$ESCAPED cpu=$CPU"
        echo "init=$(cat /scratch/init.txt) file=$(cat /etc/cfg/greeting) secret=$(cat /etc/sec/password)"
        echo "token=$(test -s /var/run/secrets/kubernetes.io/serviceaccount/token && echo yes)"
        echo "labels=$(cat /etc/podinfo/labels)"
        touch /etc/cfg/x 2>/dev/null || echo "cfg read-only"
    """)
    core.create_namespaced_pod(
        ns,
        _pod(
            "envpod",
            ["sh", "-c", script],
            restartPolicy="Never",
            metadata={"labels": {"app": "envpod"}},
            initContainers=[
                {
                    "name": "init",
                    "image": "busybox",
                    "command": ["sh", "-c", "echo ok > /scratch/init.txt"],
                    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                }
            ],
            volumes=[
                {"name": "scratch", "emptyDir": {}},
                {"name": "cfg", "configMap": {"name": "cfg"}},
                {"name": "sec", "secret": {"secretName": "sec"}},
                {
                    "name": "podinfo",
                    "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels['app']"}}]},
                },
            ],
            container={
                "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
                "env": [
                    {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "MY_APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
                    {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
                    {"name": "EXPANDED", "value": "$(GREETING)-$(MY_NAME)-$(NOT_SET)"},
                    {"name": "ESCAPED", "value": "$$(GREETING)"},
                    {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1m"}}},
                ],
                "resources": {"limits": {"cpu": "500m"}},
                "volumeMounts": [
                    {"name": "scratch", "mountPath": "/scratch"},
                    {"name": "cfg", "mountPath": "/etc/cfg"},
                    {"name": "sec", "mountPath": "/etc/sec", "readOnly": True},
                    {"name": "podinfo", "mountPath": "/etc/podinfo"},
                ],
            },
        ),
    )
    wait_for(lambda: _phase(core, ns, "envpod") == "Succeeded", 60, what="envpod Succeeded")
    p = core.read_namespaced_pod("envpod", ns)
    out = _log(ns, "envpod")
    assert f"name=envpod ns={ns} ip={p.status.pod_ip} node={p.spec.node_name} app=envpod" in out
    assert "greeting=hello password=s3cret mode=x expanded=hello-envpod-$(NOT_SET) escaped=$(GREETING) cpu=500" in out
    assert "init=ok file=hello secret=s3cret" in out
    assert "token=yes" in out and "labels=envpod" in out and "cfg read-only" in out
    # Nothing of the pod's mounts leaks to the host.
    assert not Path("/etc/cfg/greeting").exists() and not Path("/scratch/init.txt").exists()


def test_probes_drive_readiness_and_liveness(core: kubernetes.client.CoreV1Api, ns: str) -> None:
    # Ready only once /tmp/ready-<pod> exists (created after a moment); liveness fails on /healthz.
    core.create_namespaced_pod(
        ns,
        _pod(
            "probed",
            ["sh", "-c", "sleep 2; touch /tmp/ready-$(POD); sleep 300"],
            container={
                "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
                "readinessProbe": {"exec": {"command": ["sh", "-c", "test -f /tmp/ready-$POD"]}, "periodSeconds": 1},
            },
        ),
    )
    wait_for(lambda: core.read_namespaced_pod("probed", ns).status.phase == "Running", 30, what="probed running")
    assert not _ready(core, ns, "probed")
    wait_for(lambda: _ready(core, ns, "probed"), 30, what="probed ready")

    core.create_namespaced_pod(
        ns,
        _pod(
            "unlive",
            ["python", "-m", "http.server", "8000", "--bind", "$(POD_IP)"],
            container={
                "image": "python:3.11",
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "startupProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1, "failureThreshold": 30},
                "livenessProbe": {
                    "httpGet": {"path": "/healthz", "port": 8000},
                    "periodSeconds": 1,
                    "failureThreshold": 2,
                },
            },
        ),
    )

    def restarted() -> bool:
        s = core.read_namespaced_pod("unlive", ns).status.container_statuses or []
        return bool(s) and s[0].restart_count >= 1

    wait_for(restarted, 60, what="unlive restarted by its liveness probe")


def test_node_objects_look_like_gpu_nodes(core: kubernetes.client.CoreV1Api) -> None:
    nodes = {n.metadata.name: n for n in core.list_node().items}
    assert {"gpu-0", "gpu-1", "cpu-0"} <= set(nodes)
    gpu = nodes["gpu-0"]
    assert gpu.status.capacity["nvidia.com/gpu"] == "8" and gpu.status.allocatable["nvidia.com/gpu"] == "8"
    assert any(t.key == "nvidia.com/gpu" and t.effect == "NoSchedule" for t in gpu.spec.taints or [])
    assert not nodes["cpu-0"].spec.taints
    assert gpu.status.node_info.kubelet_version.startswith("v1.")
    assert [a.address for a in gpu.status.addresses if a.type == "InternalIP"] == ["127.10.0.1"]
    lease = kubernetes.client.CoordinationV1Api(core.api_client).read_namespaced_lease("gpu-0", "kube-node-lease")
    age = time.time() - lease.spec.renew_time.timestamp()
    assert age < 30, f"lease renewed {age:.0f}s ago"


def test_failing_init_container_fails_a_never_pod(core: kubernetes.client.CoreV1Api, ns: str) -> None:
    core.create_namespaced_pod(
        ns,
        _pod(
            "badinit",
            ["true"],
            restartPolicy="Never",
            initContainers=[{"name": "init", "image": "busybox", "command": ["sh", "-c", "exit 7"]}],
        ),
    )
    wait_for(lambda: _phase(core, ns, "badinit") == "Failed", 30, what="badinit Failed")
    p = core.read_namespaced_pod("badinit", ns)
    assert p.status.init_container_statuses[0].state.terminated.exit_code == 7
    assert p.status.container_statuses[0].state.waiting.reason == "PodInitializing"
