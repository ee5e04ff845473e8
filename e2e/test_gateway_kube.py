"""The gateway in Kubernetes mode on a real cluster: engines come from a watch of pods.

Engine pods here are labelled like the operator's (`rollfleet.dev/fleet`,
`app.kubernetes.io/component=engine`) and run the vLLM-compatible simulator
(devtools/rollfleet_dev/sim_engine.py, mounted from a ConfigMap) in the control-plane image:
what is under test is discovery and routability (pod Ready + `rollfleet.dev/phase`), which
does not need a real model. The gateway runs as a pod the way the operator deploys it
(in-cluster config, a ServiceAccount allowed only to read pods, the token Secret mounted).
The test flips the phase annotation as the operator would and checks, through requests,
that the gateway follows within seconds (watch, not poll). Real engines behind the gateway
are e2e/test_gateway.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from e2e.provider import Cluster, wait_for
from rollfleet.api.common import DEFAULT_ROLLFLEET_IMAGE
from rollfleet.contract import (
    ANNOTATION_PHASE,
    COMPONENT_ENGINE,
    COMPONENT_GATEWAY,
    LABEL_COMPONENT,
    component_labels,
)
from rollfleet_client.protocol import SESSION_HEADER
from rollfleet_dev import oneshot

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
SIM_ENGINE = ROOT / "devtools" / "rollfleet_dev" / "sim_engine.py"
TOKEN = "gateway-kube-token"
GATEWAY_PORT = 8080


def engine_pod(fleet: str, index: int, phase: str) -> dict[str, Any]:
    name = f"{fleet}-engine-{index}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": component_labels(fleet, COMPONENT_ENGINE),
            "annotations": {ANNOTATION_PHASE: phase},
        },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "engine",
                    "image": DEFAULT_ROLLFLEET_IMAGE,  # Python with aiohttp and orjson, what the simulator needs
                    "command": [
                        "python",
                        "/sim/sim_engine.py",
                        "--host",
                        "$(POD_IP)",
                        "--port",
                        "8000",
                        "--name",
                        name,
                    ],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
                    "volumeMounts": [{"name": "sim", "mountPath": "/sim", "readOnly": True}],
                }
            ],
            "volumes": [{"name": "sim", "configMap": {"name": "sim-engine"}}],
        },
    }


@pytest.fixture(scope="module")
def ns(cluster: Cluster, core: kubernetes.client.CoreV1Api) -> Iterator[str]:
    name = f"gw-e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_config_map(
        name, {"metadata": {"name": "sim-engine"}, "data": {"sim_engine.py": SIM_ENGINE.read_text()}}
    )
    yield name
    core.delete_namespace(name)


def deploy_gateway(cluster: Cluster, core: kubernetes.client.CoreV1Api, ns: str, fleet: str, *args: str) -> str:
    """A gateway pod for `fleet` as the operator makes one: its own ServiceAccount, allowed only
    to read pods, and the fleet's token Secret mounted. Returns the pod's name once it is Ready."""
    name = f"{fleet}-gateway"
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client())
    core.create_namespaced_service_account(ns, {"metadata": {"name": name}})
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": name},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
    )
    core.create_namespaced_secret(ns, {"metadata": {"name": f"{fleet}-admin-token"}, "stringData": {"token": TOKEN}})
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": name, "labels": {LABEL_COMPONENT: COMPONENT_GATEWAY}},
            "spec": {
                "serviceAccountName": name,
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "gateway",
                        "image": DEFAULT_ROLLFLEET_IMAGE,
                        "args": [
                            "gateway",
                            *("--fleet", fleet, "--namespace", ns, "--port", str(GATEWAY_PORT)),
                            *("--token-file", "/var/run/secrets/rollfleet/token", *args),
                        ],
                        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                        "readinessProbe": {"httpGet": {"path": "/ready", "port": GATEWAY_PORT}, "periodSeconds": 1},
                        "volumeMounts": [
                            {"name": "token", "mountPath": "/var/run/secrets/rollfleet", "readOnly": True}
                        ],
                    }
                ],
                "volumes": [{"name": "token", "secret": {"secretName": f"{fleet}-admin-token"}}],
            },
        },
    )

    def ready() -> bool:
        pod = core.read_namespaced_pod(name, ns)
        return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])

    wait_for(ready, 120, what=f"the gateway pod {name} to be ready (its first LIST of engine pods)")
    return name


@pytest.fixture(scope="module")
def gateway(cluster: Cluster, core: kubernetes.client.CoreV1Api, ns: str) -> Iterator[str]:
    pod = deploy_gateway(cluster, core, ns, "f", "--queue-timeout", "5")
    with cluster.reach(ns, pod, GATEWAY_PORT) as url:
        yield url


def routable(url: str) -> int:
    return int(oneshot.get(url + "/ready").json()["routable_engines"])


def served_by(url: str, n: int) -> set[str]:
    """The engines `n` requests went to, each a new session: new sessions spread over the routable engines, where
    requests without one stay on the engine freed last."""
    engines = set()
    for i in range(n):
        session = {SESSION_HEADER: f"served-by-{uuid.uuid4().hex[:8]}"}
        r = oneshot.post(
            url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 4}, headers=session, timeout=30
        )
        assert r.status_code == 200, r.text
        engines.update(r.json()["rollfleet"]["engines"])
    return engines


def set_phase(core: kubernetes.client.CoreV1Api, ns: str, pod: str, phase: str) -> None:
    core.patch_namespaced_pod(pod, ns, {"metadata": {"annotations": {ANNOTATION_PHASE: phase}}})


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
    core.create_namespaced_pod(ns, engine_pod("g", 0, "Ready"))
    with cluster.reach(ns, deploy_gateway(cluster, core, ns, "g"), GATEWAY_PORT) as url:
        wait_for(lambda: routable(url) == 1, 90, what="the engine pod to be routable through the pod watch")
        assert served_by(url, 2) == {"g-engine-0"}
        r = oneshot.post(
            url + "/v1/abort", json={"request_ids": ["nothing-here"]}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert r.json() == {
            "results": {"nothing-here": "unknown"},
            "reasons": {},
        }  # the mounted token is the admin token
