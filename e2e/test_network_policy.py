"""The engines' NetworkPolicy, enforced: only the gateway, the operator, the fleet's trainers and its
engines (a push's relay chain) reach the engine port, and switching the policy off in the spec opens it.
And the enforcer honours egress: a pod whose egress a policy limits to the engines reaches them and
nothing else.

Enforcement needs a network plugin that enforces policies, so this module runs on kind (kube-router's
policy controller, docs/kind.md); the local cluster runs no enforcer (docs/local-cluster.md), so
nothing there holds a policy. Probes connect from inside pods (`kubectl exec`), to the
engine pod's IP, as a misbehaving workload in the namespace would.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import pytest

from e2e.live_fleet import NAME, LiveFleet
from e2e.provider import wait_for
from rollfleet.api.common import DEFAULT_ROLLFLEET_IMAGE
from rollfleet.contract import (
    COMPONENT_ENGINE,
    COMPONENT_TRAINER,
    ENGINE_PORT,
    LABEL_COMPONENT,
    LABEL_FLEET,
    network_policy_name,
)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.engine,
    pytest.mark.skipif(
        os.environ.get("ROLLFLEET_E2E_PROVIDER", "local") == "local",
        reason="the local cluster runs no NetworkPolicy enforcer: policies are stored, not enforced",
    ),
]

# A TCP connect from inside a pod: "open", or why not ("refused": the enforcer's REJECT).
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("open")
except ConnectionRefusedError:
    print("refused")
except OSError as err:
    print(type(err).__name__)
"""


def probe_pod(fleet: LiveFleet, name: str, labels: dict[str, str], command: list[str] | None = None) -> str:
    """A pod that only sleeps (or runs `command`), to connect from or to; any image with Python (the
    control-plane one)."""
    meta = {"name": name, "namespace": fleet.namespace, "labels": labels}
    container = {"name": "probe", "image": DEFAULT_ROLLFLEET_IMAGE, "command": command or ["sleep", "3600"]}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"terminationGracePeriodSeconds": 0, "containers": [container]},
    }
    fleet.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    return name


def connect(fleet: LiveFleet, pod: str, ip: str, container: str | None = None) -> str:
    args = [
        "-n",
        fleet.namespace,
        "exec",
        pod,
        *(["-c", container] if container else []),
        "--",
        "python",
        "-c",
        CONNECT,
        ip,
        str(ENGINE_PORT),
    ]
    return fleet.cluster.kubectl(*args, timeout=60).stdout.strip()


EGRESS_LABEL = "rollfleet.dev/e2e-egress"


def engine_ip_list(live: LiveFleet) -> list[str]:
    return [
        json.loads(live.cluster.kubectl("-n", live.namespace, "get", "pod", e.key, "-o", "json").stdout)["status"][
            "podIP"
        ]
        for e in live.engines
    ]


@pytest.fixture
def probes(live: LiveFleet) -> Iterator[tuple[str, str]]:
    live.ready()
    suffix = uuid.uuid4().hex[:5]
    stranger = probe_pod(live, f"stranger-{suffix}", {"app": "curious"})
    trainer = probe_pod(live, f"trainer-{suffix}", {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_FLEET: NAME})
    live.cluster.kubectl(
        "-n",
        live.namespace,
        "wait",
        "--for=condition=Ready",
        f"pod/{stranger}",
        f"pod/{trainer}",
        "--timeout=120s",
        timeout=130,
    )
    yield stranger, trainer
    live.cluster.kubectl("-n", live.namespace, "delete", "pod", stranger, trainer, "--wait=false", check=False)


def test_only_the_gateway_and_trainers_reach_the_engines_until_the_policy_is_switched_off(
    live: LiveFleet, probes: tuple[str, str]
) -> None:
    stranger, trainer = probes
    engine_ips = engine_ip_list(live)
    gateway = live.gateways[0].key
    for ip in engine_ips:
        # The agent applies a new pod's rules within moments of its IP appearing: wait, then hold.
        wait_for(
            lambda ip=ip: connect(live, stranger, ip) == "refused",
            timeout=60,
            interval=1,
            what=f"the policy to keep {stranger} from {ip}",
        )
        assert connect(live, trainer, ip) == "open"
        assert connect(live, gateway, ip) == "open"
    # Engines reach each other's engine port: a push's relay chain.
    assert connect(live, live.engines[0].key, engine_ips[-1], container="engine") == "open"

    def switch(enabled: bool) -> None:
        live.cluster.kubectl(
            "-n",
            live.namespace,
            "patch",
            "rf",
            NAME,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"networkPolicy": {"enabled": enabled}}}),
        )

    switch(False)
    try:
        wait_for(
            lambda: (
                live.cluster.kubectl(
                    "-n", live.namespace, "get", "networkpolicy", network_policy_name(NAME), check=False
                ).returncode
                != 0
            ),
            timeout=60,
            what="the policy deleted",
        )
        for ip in engine_ips:
            wait_for(
                lambda ip=ip: connect(live, stranger, ip) == "open",
                timeout=60,
                interval=1,
                what=f"{stranger} to reach {ip} with the policy off",
            )
    finally:
        switch(True)
    for ip in engine_ips:
        wait_for(
            lambda ip=ip: connect(live, stranger, ip) == "refused",
            timeout=60,
            interval=1,
            what=f"the policy back in force for {ip}",
        )


def test_a_pod_whose_egress_is_limited_to_the_engines_reaches_them_and_nothing_else(live: LiveFleet) -> None:
    """Egress, enforced: a trainer-like pod under an egress policy whose one rule names the fleet's
    engines on the engine port reaches them (labelled: admitted), and is refused at a pod without the
    fleet's labels listening on the same port, which an unpoliced pod reaches."""
    live.ready()
    suffix = uuid.uuid4().hex[:5]
    policy_name = f"egress-{suffix}"
    # Trainer labels, so the engines' own (ingress) policy admits it: only its egress is under test.
    limited = probe_pod(
        live, f"limited-{suffix}", {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_FLEET: NAME, EGRESS_LABEL: suffix}
    )
    free = probe_pod(live, f"free-{suffix}", {"app": "curious"})
    # Listens on the engine port and carries none of the fleet's labels.
    listener = probe_pod(
        live, f"listener-{suffix}", {"app": "listener"}, ["python", "-m", "http.server", str(ENGINE_PORT)]
    )
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": policy_name, "namespace": live.namespace},
        "spec": {
            "podSelector": {"matchLabels": {EGRESS_LABEL: suffix}},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": {LABEL_COMPONENT: COMPONENT_ENGINE, LABEL_FLEET: NAME}}}],
                    "ports": [{"protocol": "TCP", "port": ENGINE_PORT}],
                }
            ],
        },
    }
    try:
        live.cluster.kubectl(
            "-n",
            live.namespace,
            "wait",
            "--for=condition=Ready",
            f"pod/{limited}",
            f"pod/{free}",
            f"pod/{listener}",
            "--timeout=120s",
            timeout=130,
        )
        listener_ip = json.loads(
            live.cluster.kubectl("-n", live.namespace, "get", "pod", listener, "-o", "json").stdout
        )["status"]["podIP"]
        # Before the policy: the listener answers anyone (so a refusal below is the policy's).
        wait_for(
            lambda: connect(live, limited, listener_ip) == "open",
            timeout=60,
            interval=1,
            what=f"{listener} to listen on {ENGINE_PORT}",
        )
        live.cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
        wait_for(
            lambda: connect(live, limited, listener_ip) == "refused",
            timeout=60,
            interval=1,
            what=f"the egress policy to keep {limited} from {listener_ip}",
        )
        assert connect(live, free, listener_ip) == "open"  # only the policed pod is held
        for ip in engine_ip_list(live):
            assert connect(live, limited, ip) == "open"  # the rule's peers, on the rule's port
    finally:
        live.cluster.kubectl("-n", live.namespace, "delete", "networkpolicy", policy_name, "--wait=false", check=False)
        live.cluster.kubectl(
            "-n", live.namespace, "delete", "pod", limited, free, listener, "--wait=false", check=False
        )
