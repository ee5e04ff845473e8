"""The gateway in Kubernetes mode on a real cluster: engines come from a watch of pods.

Engine pods here are labelled like the operator's (`rollfleet.dev/fleet`,
`app.kubernetes.io/component=engine`) and run the vLLM-compatible simulator
(devtools/rollfleet_dev/sim_engine.py) as their process: what is under test is discovery and
routability (pod Ready + `rollfleet.dev/phase`), which does not need a real model. The
test flips the phase annotation as the operator would and checks, through requests,
that the gateway follows within seconds (watch, not poll). The gateway runs as a
local process with the admin kubeconfig, and as a pod the way the operator deploys it
(in-cluster config, a ServiceAccount allowed only to read pods, the token Secret
mounted). Real engines behind the gateway are e2e/test_gateway.py.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import pytest

from e2e.provider import Cluster, _free_port, wait_for

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
TOKEN = "gateway-kube-token"


def engine_pod(fleet: str, index: int, phase: str) -> dict[str, Any]:
    name = f"{fleet}-engine-{index}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/name": "rollfleet",
                "app.kubernetes.io/component": "engine",
                "rollfleet.dev/fleet": fleet,
            },
            "annotations": {"rollfleet.dev/phase": phase},
        },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "engine",
                    "image": "python:3.11",
                    "command": [
                        sys.executable,
                        "-m",
                        "rollfleet_dev.sim_engine",
                        "--host",
                        "$(POD_IP)",
                        "--port",
                        "8000",
                        "--name",
                        name,
                    ],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def ns(cluster: Cluster, core: kubernetes.client.CoreV1Api) -> Iterator[str]:
    name = f"gw-e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="module")
def gateway(cluster: Cluster, ns: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("gateway-kube")
    (tmp / "token").write_text(TOKEN + "\n")
    port = _free_port()
    log = tmp / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollfleet.gateway",
                "--fleet",
                "f",
                "--namespace",
                ns,
                "--kubeconfig",
                str(cluster.kubeconfig),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--token-file",
                str(tmp / "token"),
                "--queue-timeout",
                "5",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(url + "/ready").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, 60, what="the gateway's first LIST of engine pods")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def routable(url: str) -> int:
    return int(httpx.get(url + "/ready").json()["routable_engines"])


def served_by(url: str, n: int) -> set[str]:
    engines = set()
    for i in range(n):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        engines.update(r.json()["rollfleet"]["engines"])
    return engines


def set_phase(core: kubernetes.client.CoreV1Api, ns: str, pod: str, phase: str) -> None:
    core.patch_namespaced_pod(pod, ns, {"metadata": {"annotations": {"rollfleet.dev/phase": phase}}})


def test_the_gateway_routes_only_to_ready_engine_pods_and_follows_phase_changes(
    core: kubernetes.client.CoreV1Api, ns: str, gateway: str
) -> None:
    assert routable(gateway) == 0
    for i, phase in enumerate(("Ready", "PendingSync")):
        core.create_namespaced_pod(ns, engine_pod("f", i, phase))
    # Pod Ready (probe) and phase Ready: only engine 0.
    wait_for(lambda: routable(gateway) == 1, 90, what="engine 0 to become routable")
    assert served_by(gateway, 4) == {"f-engine-0"}

    set_phase(core, ns, "f-engine-1", "Ready")
    wait_for(lambda: routable(gateway) == 2, 5, what="the phase change to reach the gateway")
    assert served_by(gateway, 4) == {"f-engine-0", "f-engine-1"}

    set_phase(core, ns, "f-engine-0", "Draining")
    wait_for(lambda: routable(gateway) == 1, 5, what="the draining engine to leave the routing set")
    assert served_by(gateway, 4) == {"f-engine-1"}

    set_phase(core, ns, "f-engine-0", "Paused")  # a paused engine holds requests: still routable
    wait_for(lambda: routable(gateway) == 2, 5, what="the paused engine to be routable")

    core.delete_namespaced_pod("f-engine-1", ns)
    wait_for(lambda: routable(gateway) == 1, 15, what="the deleted engine to leave the routing set")
    assert served_by(gateway, 4) == {"f-engine-0"}


def test_the_gateway_as_deployed_reads_pods_with_its_own_service_account(
    cluster: Cluster, core: kubernetes.client.CoreV1Api, ns: str
) -> None:
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client())
    core.create_namespaced_service_account(ns, {"metadata": {"name": "g-gateway"}})
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "g-gateway"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "g-gateway"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "g-gateway"},
            "subjects": [{"kind": "ServiceAccount", "name": "g-gateway", "namespace": ns}],
        },
    )
    core.create_namespaced_secret(ns, {"metadata": {"name": "g-admin-token"}, "stringData": {"token": TOKEN}})
    core.create_namespaced_pod(ns, engine_pod("g", 0, "Ready"))
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": "g-gateway", "labels": {"app.kubernetes.io/component": "gateway"}},
            "spec": {
                "serviceAccountName": "g-gateway",
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "gateway",
                        "image": "rollfleet/gateway:dev",  # the node agent runs `rollfleet gateway` for it
                        "args": [
                            "--fleet",
                            "g",
                            "--namespace",
                            ns,
                            "--port",
                            "8080",
                            "--token-file",
                            "/var/run/secrets/rollfleet/token",
                        ],
                        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 1},
                        "volumeMounts": [
                            {"name": "token", "mountPath": "/var/run/secrets/rollfleet", "readOnly": True}
                        ],
                    }
                ],
                "volumes": [{"name": "token", "secret": {"secretName": "g-admin-token"}}],
            },
        },
    )

    def gateway_url() -> str | None:
        pod = core.read_namespaced_pod("g-gateway", ns)
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        return f"http://{pod.status.pod_ip}:8080" if ready else None

    url = wait_for(gateway_url, 90, what="the gateway pod to be ready")
    wait_for(lambda: routable(url) == 1, 90, what="the engine pod to be routable through the pod watch")
    assert served_by(url, 2) == {"g-engine-0"}
    r = httpx.post(
        url + "/v1/abort", json={"request_ids": ["nothing-here"]}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert r.json() == {"results": {"nothing-here": "unknown"}}  # the mounted token is the admin token
