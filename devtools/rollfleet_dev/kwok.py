"""KWOK on the local cluster: simulated GPU nodes for the scale harness (`rollfleet cluster kwok up`).

KWOK (sigs.k8s.io/kwok, built from its module like every other Kubernetes binary here) plays the
kubelet of the Nodes that carry its annotation: it keeps their leases, and takes each pod bound to
one through its stages (Running and Ready at once, an IP from the node's `spec.podCIDR`) without
starting anything. Nothing answers at those IPs but `rollfleet_dev.engine_host`, one process that
serves every simulated engine at its pod's address. So a fleet of 2,000 engines costs the machine
2,000 Pod objects and one process, where the node agent would start 2,000.

KWOK runs as a process beside the control plane (stopped with it), as the node agent's identity (it
does a kubelet's work). Its fake nodes form the pool `sim-gpu`: labelled as the GPU pool's nodes are,
tainted so that only pods asking for it land there, each with its own slice of POD_RANGE, a range of
the pod network that the node agent's nodes do not use (ipam.MAX_NODES).
Talks to: kube-apiserver (through kubectl) and the KWOK process it starts.
"""

from __future__ import annotations

import functools
import ipaddress
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import yaml

from rollfleet.kubectl import Kubectl
from rollfleet_dev import engine_host
from rollfleet_dev.gobuild import GoTool, ensure_tool, log, module_dir
from rollfleet_dev.localcluster import controlplane
from rollfleet_dev.localcluster.nodeagent.ipam import KWOK_POD_CIDR

MODULE = "sigs.k8s.io/kwok"
VERSION = "v0.8.0"
KWOK = GoTool("kwok", MODULE, VERSION, (f"{MODULE}/cmd/kwok",), ("kwok",))
COMPONENT = "kwok"
HOST_COMPONENT = "engine-host"  # rollfleet_dev.engine_host: the engines at the fake nodes' pod IPs
SERVER_PORT = 10247  # its health endpoint
# The module's own stages (kustomize/stage/): nodes turn Ready and keep a lease, pods turn Ready at once
# and go away when deleted.
STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)
MANAGED = ("kwok.x-k8s.io/node", "fake")  # the annotation KWOK manages nodes by; also the nodes' taint
POOL = "sim-gpu"
NODE_PREFIX = 23  # 510 pods a node
NODE_NAME = "sim-gpu-{}"

Manifest = dict[str, Any]


def node_manifest(index: int) -> Manifest:
    """Fake GPU node `index` (pure): the GPU pool's labels, KWOK's annotation and taint, its pod range.

    One fake node stands for a rack: as many GPUs as pods (a real node has 8), so that 2,000 one-GPU engines
    need 4 nodes, not 250 nodes whose leases would load the API server all the time. What is measured is the
    operator's work per engine; the scheduler's per node is the same for the operator and its baseline."""
    cidr = list(ipaddress.IPv4Network(KWOK_POD_CIDR).subnets(new_prefix=NODE_PREFIX))[index]
    pods = str(cidr.num_addresses - 2)
    capacity = {"cpu": "4096", "memory": "32Ti", "pods": pods, "nvidia.com/gpu": pods}
    key, value = MANAGED
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": NODE_NAME.format(index),
            "annotations": {key: value},
            "labels": {
                "type": "kwok",
                "rollfleet.dev/pool": POOL,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.count": pods,
                "kubernetes.io/hostname": NODE_NAME.format(index),
            },
        },
        "spec": {"podCIDR": str(cidr), "taints": [{"key": key, "value": value, "effect": "NoSchedule"}]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def max_nodes() -> int:
    return int(2 ** (NODE_PREFIX - ipaddress.IPv4Network(KWOK_POD_CIDR).prefixlen))


def placement() -> Manifest:
    """A fleet's `spec.placement` that puts its engines on the fake nodes (and only there)."""
    key, value = MANAGED
    return {
        "nodeSelector": {"rollfleet.dev/pool": POOL},
        "tolerations": [{"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}],
    }


def config_text() -> str:
    """KWOK's `--config`: the module's stage files, as one YAML stream."""
    root = module_dir(MODULE, VERSION) / "kustomize" / "stage"
    return "\n---\n".join((root / stage).read_text() for stage in STAGES)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{controlplane.HOST}:{port}/healthz", timeout=1) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def up(nodes: int, layout: controlplane.Layout | None = None) -> None:
    """Start KWOK and the engine host beside the running local cluster (those not running) and have `nodes` fake
    GPU nodes Ready."""
    layout = layout or controlplane.Layout()
    if not controlplane.is_up(layout):
        raise controlplane.ClusterError("the local cluster is not running: `rollfleet cluster up` first")
    if not 1 <= nodes <= max_nodes():
        raise ValueError(f"--nodes {nodes}: between 1 and {max_nodes()} fake nodes fit in {KWOK_POD_CIDR}")
    binary = ensure_tool(KWOK) / "kwok"
    if controlplane.running_pid(layout, COMPONENT) is None:
        config = layout.root / "kwok" / "stages.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(config_text())
        argv = [
            str(binary),
            f"--kubeconfig={layout.component_kubeconfig('node-agent')}",
            f"--config={config}",
            f"--manage-nodes-with-annotation-selector={MANAGED[0]}={MANAGED[1]}",
            f"--node-ip={controlplane.HOST}",
            # Its nodes' leases: without them the node lifecycle controller (a 20 s grace here) takes the nodes
            # for lost and marks their pods not Ready, which KWOK's stages never undo.
            "--node-lease-duration-seconds=40",
            f"--server-address={controlplane.HOST}:{SERVER_PORT}",
        ]
        t0 = time.monotonic()
        controlplane.start_component(layout, COMPONENT, argv, functools.partial(_healthy, SERVER_PORT))
        log(f"KWOK {VERSION} running ({time.monotonic() - t0:.1f}s); its log: {layout.log_file(COMPONENT)}")
    if controlplane.running_pid(layout, HOST_COMPONENT) is None:
        argv = [sys.executable, "-m", "rollfleet_dev.engine_host", f"--kubeconfig={layout.kubeconfig}"]
        controlplane.start_component(
            layout, HOST_COMPONENT, argv, functools.partial(_healthy, engine_host.CONTROL_PORT)
        )
        log(f"engine host serving; its log: {layout.log_file(HOST_COMPONENT)}")
    kubectl = Kubectl(layout.kubeconfig)
    text = yaml.safe_dump_all([node_manifest(i) for i in range(nodes)])
    kubectl.run("apply", "--server-side", "--force-conflicts", "--field-manager=rollfleet-kwok", "-f", "-", input=text)
    names = [f"node/{NODE_NAME.format(i)}" for i in range(nodes)]
    kubectl.run("wait", "--for=condition=Ready", "--timeout=120s", *names, timeout=130)
    log(f"{nodes} fake GPU nodes Ready (pool {POOL}, pods from {KWOK_POD_CIDR})")


def down(layout: controlplane.Layout | None = None) -> None:
    """Delete the fake nodes (their pods go with them) and stop KWOK."""
    layout = layout or controlplane.Layout()
    kubectl = Kubectl(layout.kubeconfig)
    kubectl.run("delete", "node", "-l", f"rollfleet.dev/pool={POOL}", "--ignore-not-found", "--wait=true")
    for component in (HOST_COMPONENT, COMPONENT):
        pid = controlplane.running_pid(layout, component)
        if pid is not None:
            controlplane.stop_process(pid, grace=10)
    log("KWOK and the engine host stopped, the fake nodes deleted")
