"""The kind cluster of `e2e/kind/cluster.yaml` on this machine: up (idempotent) and down (clean).

`up` builds the node image if needed (`nodeimage`), creates the cluster with the API server on
127.0.0.1, advertises `nvidia.com/gpu` on the GPU pool (kind nodes have no GPUs; the CPU engine
image runs where a CUDA one would), and loads Rollfleet's images: the control-plane image on
every node, the engine image on the GPU pool only (it is the large one). Talks to `docker`,
`kind` and the new cluster's API server (kubectl).
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from rollfleet.api.common import DEFAULT_ENGINE_IMAGE, DEFAULT_ROLLFLEET_IMAGE
from rollfleet.errors import RollfleetError
from rollfleet.kubectl import Kubectl
from rollfleet_dev.gobuild import ensure_tool, log
from rollfleet_dev.kind import imageload, nodeimage, tools
from rollfleet_dev.localcluster.paths import state_dir
from rollfleet_engine.tiny_model import NODE_MODEL_DIR, default_model_dir, ensure_tiny_model

CLUSTER_NAME = "rollfleet"
CLUSTER_CONFIG = nodeimage.REPO / "e2e" / "kind" / "cluster.yaml"
GPU_POOL_SELECTOR = "rollfleet.dev/pool=gpu"
GPUS_PER_NODE = 8
KIND_NETWORK = "kind"
RESTART_TIMEOUT_S = 180.0
CLEAN_TIMEOUT_S = 300.0
# Kubernetes' own namespaces: `up(clean=True)` deletes every other one.
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
# kind's Service range (its default). On a booting node, until kube-proxy's rules are in place, a
# client's packets to a ClusterIP go to the node's gateway, this machine, which would route them off
# it. The fence refuses them here: Docker's DOCKER-USER chain sees what containers send through the host.
SERVICE_SUBNET = "10.96.0.0/16"
FENCE = ["DOCKER-USER", "-d", SERVICE_SUBNET, "-j", "REJECT"]


class KindError(RollfleetError, RuntimeError):
    """The kind cluster could not be brought up or down; the message says what to do."""


def kubeconfig_path() -> Path:
    return state_dir().parent / "kind" / "kubeconfig"


def _node_ips_path() -> Path:
    """Each node container's address when `stop` stopped it (`_start` gives them back in that order)."""
    return kubeconfig_path().parent / "node-ips.json"


def _kind() -> str:
    return str(ensure_tool(tools.KIND) / "kind")


def _run(args: list[str], what: str, timeout: float = 900) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise KindError(f"{what} failed ({proc.returncode}):\n{(proc.stderr or proc.stdout).strip()[-3000:]}")
    return proc.stdout


def require_docker() -> None:
    if shutil.which("docker") is None:
        raise KindError("docker is not installed: run `make docker` (hack/docker.sh installs Debian's docker.io)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        raise KindError("no Docker daemon answers: run `make docker` (hack/docker.sh starts one; as root)")


def cluster_config(node_image: str, model_dir: Path) -> dict[str, Any]:
    """e2e/kind/cluster.yaml, plus what this build of the node needs on every node: the node image,
    the etcd it carries, kubelet allowed on cgroup v1 (this machine's hierarchy), and the tiny
    model at the node directory the samples and the suite name (as on the local cluster)."""
    config: dict[str, Any] = yaml.safe_load(CLUSTER_CONFIG.read_text())
    for node in config["nodes"]:
        node["image"] = node_image
        node.setdefault("extraMounts", []).append(
            {"hostPath": str(model_dir), "containerPath": NODE_MODEL_DIR, "readOnly": True}
        )
    config.setdefault("networking", {})["apiServerAddress"] = "127.0.0.1"
    config.setdefault("kubeadmConfigPatches", []).extend(
        [
            "kind: ClusterConfiguration\netcd:\n  local:\n    imageTag: " + tools.ETCD_IMAGE_TAG + "\n",
            "kind: KubeletConfiguration\nfailCgroupV1: false\n",
        ]
    )
    return config


def exists() -> bool:
    out = subprocess.run([_kind(), "get", "clusters"], capture_output=True, text=True).stdout
    return CLUSTER_NAME in out.split()


def _node_containers() -> dict[str, tuple[str, bool]]:
    """The cluster's node containers: name -> (image, running)."""
    names = _run([_kind(), "get", "nodes", "--name", CLUSTER_NAME], "kind get nodes").split()
    if not names:
        return {}
    out = _run(["docker", "inspect", "-f", "{{.Name}} {{.Config.Image}} {{.State.Running}}", *names], "docker inspect")
    rows = (line.split() for line in out.splitlines())
    return {name.lstrip("/"): (image, running == "true") for name, image, running in rows}


def _wait_nodes_ready(kubectl: Kubectl, count: int, timeout_s: float = RESTART_TIMEOUT_S) -> bool:
    """Whether the API server answers and `count` nodes are Ready within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            proc = kubectl.run("get", "nodes", "-o", "json", check=False, timeout=20)
        except subprocess.TimeoutExpired:
            continue
        if proc.returncode == 0:
            nodes = json.loads(proc.stdout)["items"]
            ready = [
                n
                for n in nodes
                if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
            ]
            if len(ready) == count:
                return True
        time.sleep(2)  # polling a condition: node containers are booting
    return False


KINDNET_CONF = "/etc/cni/net.d/10-kindnet.conflist"


def cni_subnet(conflist: str) -> str | None:
    """The pod range kindnet's CNI configuration on a node hands out (None: no configuration yet)."""
    try:
        plugins = json.loads(conflist)["plugins"]
    except (ValueError, KeyError, TypeError):
        return None
    ranges = [r for p in plugins for group in (p.get("ipam") or {}).get("ranges", []) for r in group]
    return str(ranges[0]["subnet"]) if ranges else None


def range_faults(cni_subnets: dict[str, str | None], pod_cidrs: dict[str, str | None]) -> list[str]:
    """Nodes whose kindnet hands out another range than the node's podCIDR, as "node: hands out X, its range
    is Y". Docker restarting the node containers in another order moves their addresses; kindnet on a node
    then takes the node whose address it has for its own, writes that node's range into its CNI
    configuration, and keeps it: two nodes give pods addresses of one range, and traffic to half of them goes
    to the other node (engines Running and probed Ready by their kubelet, but unreachable from other nodes)."""
    return [
        f"{node}: hands out {cni_subnets.get(node) or 'no range'}, its range is {cidr}"
        for node, cidr in sorted(pod_cidrs.items())
        if cidr and cni_subnets.get(node) != cidr
    ]


def _pod_network_faults(kubectl: Kubectl) -> list[str]:
    nodes = json.loads(kubectl.run("get", "nodes", "-o", "json").stdout)["items"]
    cidrs = {n["metadata"]["name"]: n["spec"].get("podCIDR") for n in nodes}
    confs = {
        node: cni_subnet(
            subprocess.run(["docker", "exec", node, "cat", KINDNET_CONF], capture_output=True, text=True).stdout
        )
        for node in cidrs
    }
    return range_faults(confs, cidrs)


def _node_ips(nodes: list[str]) -> dict[str, str]:
    """Each running node container's address on kind's network ("" for a stopped one)."""
    tmpl = "{{.Name}} {{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
    out = _run(["docker", "inspect", "-f", tmpl, *nodes], "docker inspect")
    return {name.lstrip("/"): (ip[0] if ip else "") for name, *ip in (line.split() for line in out.splitlines())}


def _record_node_ips(nodes: list[str]) -> None:
    """Keep the running nodes' addresses for `_start` (not while one is stopped: it has none)."""
    addresses = _node_ips(nodes)
    if all(addresses.values()):
        _node_ips_path().write_text(json.dumps(addresses))


def start_order(nodes: list[str], addresses: dict[str, str]) -> list[str]:
    """The nodes in the order of the addresses they had; those without one last. Docker gives a started
    container the lowest free address of the network, so this order gives each its own back."""

    def key(node: str) -> tuple[int, int, str]:
        ip = addresses.get(node)
        return (0, int(ipaddress.ip_address(ip)), node) if ip else (1, 0, node)

    return sorted(nodes, key=key)


def moved(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The nodes whose address changed across a restart, as "node: old -> new"."""
    return [f"{n}: {ip} -> {after.get(n) or 'none'}" for n, ip in sorted(before.items()) if after.get(n) != ip]


def _start(nodes: list[str]) -> bool:
    """Start the stopped node containers of an unchanged cluster, each on the address it had. Much
    cheaper than a new cluster: the images stay. A node on another address would be a broken cluster
    (kindnet takes the node whose address it now has for its own and hands out that node's pod
    range), so then the caller makes it anew."""
    path = _node_ips_path()
    before = json.loads(path.read_text()) if path.exists() else {}
    if set(before) != set(nodes):
        log("kind: the nodes' addresses before they stopped are not known")
        return False
    log(f"kind: starting the cluster's stopped node containers ({', '.join(nodes)})")
    for node in start_order(nodes, before):
        if subprocess.run(["docker", "start", node], capture_output=True).returncode != 0:
            return False
    changed = moved(before, _node_ips(nodes))
    if changed:
        log(f"kind: nodes came back on other addresses ({'; '.join(changed)})")
    return not changed


def leftover_namespaces(names: list[str]) -> list[str]:
    """Of a cluster's namespaces, the ones that are not Kubernetes' own."""
    return [n for n in names if n not in SYSTEM_NAMESPACES]


def _delete_namespaces(kubectl: Kubectl) -> bool:
    """Delete every namespace but Kubernetes' own, with what runs in them; True once they are gone."""
    names = kubectl.run("get", "namespaces", "-o", "jsonpath={.items[*].metadata.name}").stdout.split()
    left = leftover_namespaces(names)
    if not left:
        return True
    log(f"kind: deleting what earlier runs left in the cluster: {', '.join(left)}")
    timeout = f"--timeout={CLEAN_TIMEOUT_S:.0f}s"
    deleted = kubectl.run(
        "delete", "namespace", *left, "--wait=true", timeout, check=False, timeout=CLEAN_TIMEOUT_S + 60
    )
    return deleted.returncode == 0


def advertise_gpus(kubectl: Kubectl, count: int = GPUS_PER_NODE) -> list[str]:
    """Extended resource `nvidia.com/gpu` in the GPU pool's node status (what a device plugin
    would report), so the scheduler places engines exactly as on a GPU cluster."""
    nodes = kubectl.run("get", "nodes", "-l", GPU_POOL_SELECTOR, "-o", "name").stdout.split()
    if not nodes:
        raise KindError(f"no node matches {GPU_POOL_SELECTOR}: check {CLUSTER_CONFIG}")
    patch = f'[{{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"{count}"}}]'
    for node in nodes:
        kubectl.run("patch", node, "--subresource=status", "--type=json", "-p", patch)
    return nodes


def all_nodes() -> list[str]:
    """The kind cluster's node containers."""
    return _run([_kind(), "get", "nodes", "--name", CLUSTER_NAME], "kind get nodes").split()


def load_image(image: str, nodes: list[str]) -> None:
    """A Docker image into `nodes`, each sent only the layers it lacks (`imageload`)."""

    def kind_load(cold: list[str]) -> None:
        _run([_kind(), "load", "docker-image", "--name", CLUSTER_NAME, "--nodes", ",".join(cold), image], "kind load")

    imageload.load(image, nodes, kind_load, log)


def load_images(kubectl: Kubectl) -> None:
    """Rollfleet's images into the nodes, each sent only what it lacks (`imageload`)."""
    for image in (DEFAULT_ROLLFLEET_IMAGE, DEFAULT_ENGINE_IMAGE):
        if not nodeimage.image_exists(image):
            raise KindError(f"{image} is not built: run `make images` first")
    gpu_nodes = [
        n.removeprefix("node/")
        for n in kubectl.run("get", "nodes", "-l", GPU_POOL_SELECTOR, "-o", "name").stdout.split()
    ]
    every_node = all_nodes()
    log(f"kind: loading {DEFAULT_ROLLFLEET_IMAGE} into every node")
    load_image(DEFAULT_ROLLFLEET_IMAGE, every_node)
    log(f"kind: loading {DEFAULT_ENGINE_IMAGE} into the GPU pool ({', '.join(gpu_nodes)})")
    load_image(DEFAULT_ENGINE_IMAGE, gpu_nodes)
    # `kind load` also names each import `import-<date>@<digest>`: after a rebuild those names keep
    # the previous image (GBs for the engine) alive on every node. The tags stay; those go.
    for node in every_node:
        _run(
            [
                "docker",
                "exec",
                node,
                "bash",
                "-c",
                "ctr -n k8s.io images ls -q | grep -E '^(import-|sha256:)' "
                "| xargs -r ctr -n k8s.io images rm >/dev/null",
            ],
            f"pruning old image names on {node}",
        )
    for node in gpu_nodes:
        freed = _discard_unpacked_layers(node, DEFAULT_ENGINE_IMAGE)
        if freed:
            log(f"kind: {node}: dropped {freed / 2**20:,.0f} MiB of {DEFAULT_ENGINE_IMAGE}'s unpacked layer blobs")


def layer_blobs(manifest: dict[str, Any]) -> dict[str, int]:
    """The layer blobs an image manifest (Docker schema 2 or OCI) names, with their sizes."""
    return {layer["digest"]: int(layer["size"]) for layer in manifest.get("layers") or []}


def _discard_unpacked_layers(node: str, image: str) -> int:
    """Drop an unpacked image's layer blobs on a node; the bytes freed.

    `ctr import` keeps every layer twice: the blob and its unpacked snapshot (7.4 + 7.1 GB of
    the engine image per GPU-pool node). Containers start from the snapshots, and the image's
    manifest and config stay, so this is what containerd's CRI does for pulled images with
    `discard_unpacked_layers`. A later `kind load` of a changed image writes the blobs it needs.
    """

    def ctr(*args: str) -> str:
        return _run(["docker", "exec", node, "ctr", "-n", "k8s.io", *args], f"ctr {args[0]} on {node}")

    ref = imageload.full_ref(image)
    # Columns: REF TYPE DIGEST STATUS SIZE UNPACKED; discard only what the snapshotter holds.
    checked = [line.split() for line in ctr("images", "check", f"name=={ref}").splitlines()[1:] if line.strip()]
    if not checked or checked[0][-1] != "true":
        return 0
    layers = layer_blobs(json.loads(ctr("content", "get", checked[0][2])))
    present = set(ctr("content", "ls", "-q").split())
    gone = [d for d in layers if d in present]
    if gone:
        ctr("content", "rm", *gone)
    return sum(layers[d] for d in gone)


def up(clean: bool = False) -> Path:
    """Bring the cluster up and advertise GPUs and load images. Idempotent: a running cluster of the
    current node image and config is kept; a stopped one (Docker restarted) is started again; one of
    another node image or config is made anew. `clean`: a kept cluster loses every namespace but
    Kubernetes' own (what earlier runs left there would run beside the next one), or is made anew
    if they do not go away."""
    require_docker()
    _fence(True)
    kubeconfig = kubeconfig_path()
    kubeconfig.parent.mkdir(parents=True, exist_ok=True)
    node = nodeimage.ensure_node_image()
    spec = yaml.safe_dump(cluster_config(node, ensure_tiny_model(default_model_dir())), sort_keys=False)
    config = kubeconfig.parent / "cluster.yaml"
    if exists():
        containers = _node_containers()
        stale = config.read_text() != spec if config.exists() else True
        if stale or any(image != node for image, _ in containers.values()):
            log(f"kind: cluster {CLUSTER_NAME} was made from another node image or config: making it anew")
            down()
        elif not all(running for _, running in containers.values()) and not _start(list(containers)):
            log(f"kind: cluster {CLUSTER_NAME}'s node containers did not start: making it anew")
            down()
    if exists():
        _run(
            [_kind(), "export", "kubeconfig", "--name", CLUSTER_NAME, "--kubeconfig", str(kubeconfig)],
            "kind export kubeconfig",
        )
        # Node containers Docker restarted may still be booting: until its RBAC is loaded, the API
        # server refuses even the admin.
        if not _wait_nodes_ready(Kubectl(kubeconfig), len(_node_containers())):
            log(f"kind: cluster {CLUSTER_NAME} did not answer with every node Ready: making it anew")
            down()
        elif faults := _pod_network_faults(Kubectl(kubeconfig)):
            log(f"kind: cluster {CLUSTER_NAME}'s pod network is broken ({'; '.join(faults)}): making it anew")
            down()
    if exists():
        log(f"kind: cluster {CLUSTER_NAME} is up")
        if clean and not _delete_namespaces(Kubectl(kubeconfig)):
            log(
                f"kind: namespaces of cluster {CLUSTER_NAME} did not go away within {CLEAN_TIMEOUT_S:.0f} s: "
                "making it anew"
            )
            down()
    if not exists():
        _fence(True)  # a `down` above took it down
        config.write_text(spec)
        log(f"kind: creating cluster {CLUSTER_NAME} from {node}")
        _run(
            [
                _kind(),
                "create",
                "cluster",
                "--name",
                CLUSTER_NAME,
                "--config",
                str(config),
                "--kubeconfig",
                str(kubeconfig),
                "--wait",
                "5m",
            ],
            "kind create cluster",
        )
    kubectl = Kubectl(kubeconfig)
    advertise_gpus(kubectl)
    load_images(kubectl)
    nodes = list(_node_containers())
    _record_node_ips(nodes)
    # kind's restart policy has Docker start the nodes itself when its daemon starts, in an order of its own
    # (swapped addresses: a broken pod network); without one they wait for `up`, which starts them in order.
    _run(["docker", "update", "--restart=no", *nodes], "docker update")
    log(f"kind: ready; export KUBECONFIG={kubeconfig}")
    return kubeconfig


def _fence(on: bool) -> None:
    """Put up (before any node starts) or take down the fence of the Service range (FENCE)."""
    present = subprocess.run(["iptables", "-w", "-C", *FENCE], capture_output=True).returncode == 0
    if on and not present:
        _run(["iptables", "-w", "-I", *FENCE], "iptables: refusing what nodes send to the Service range")
    elif not on and present:
        _run(["iptables", "-w", "-D", *FENCE], "iptables: the Service range's fence")


def stop() -> None:
    """Stop the node containers, keeping the cluster and its loaded images: an idle cluster costs a
    share of a core, which `make test` needs for the local suite. `up` starts them again."""
    require_docker()
    if exists() and (nodes := list(_node_containers())):
        log(f"kind: stopping the cluster's node containers ({', '.join(nodes)}); `rollfleet kind up` starts them")
        _record_node_ips(nodes)
        _run(["docker", "stop", *nodes], "docker stop")


def down() -> None:
    """Delete the cluster and kind's network: no container, network or kubeconfig left behind."""
    require_docker()
    if exists():
        _run(
            [_kind(), "delete", "cluster", "--name", CLUSTER_NAME, "--kubeconfig", str(kubeconfig_path())],
            "kind delete cluster",
        )
    left = _run(["docker", "ps", "-aq", "--filter", f"label=io.x-k8s.kind.cluster={CLUSTER_NAME}"], "docker ps").split()
    if left:
        _run(["docker", "rm", "-f", "-v", *left], "removing the cluster's containers")
    # kind keeps its network for the next cluster; nothing else of ours uses it.
    attached = subprocess.run(
        ["docker", "network", "inspect", KIND_NETWORK, "-f", "{{len .Containers}}"], capture_output=True, text=True
    )
    if attached.returncode == 0 and attached.stdout.strip() == "0":
        _run(["docker", "network", "rm", KIND_NETWORK], "removing the kind network")
    _fence(False)
    kubeconfig_path().unlink(missing_ok=True)
