"""The engines' NetworkPolicy, enforced: only the gateway, the operator, the fleet's trainers and its
engines (a push's relay chain) reach the engine port, and switching the policy off in the spec opens it.

Enforcement needs a network plugin that enforces policies, so this module runs on kind (its
NetworkPolicy agent, docs/kind.md); the local cluster's pods share the host's loopback and
nothing there can enforce a policy. Probes connect from inside pods (`kubectl exec`), to the
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
        reason="the local cluster's pods share the host network: no plugin can enforce a policy",
    ),
]

# A TCP connect from inside a pod: "open", or why not ("refused" is the agent's reset).
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


def probe_pod(fleet: LiveFleet, name: str, labels: dict[str, str]) -> str:
    """A pod that only sleeps, to connect from; any image with Python (the control-plane one)."""
    meta = {"name": name, "namespace": fleet.namespace, "labels": labels}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "probe", "image": DEFAULT_ROLLFLEET_IMAGE, "command": ["sleep", "3600"]}],
        },
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
    engine_ips = [
        json.loads(live.cluster.kubectl("-n", live.namespace, "get", "pod", e.key, "-o", "json").stdout)["status"][
            "podIP"
        ]
        for e in live.engines
    ]
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
