"""Pure parts of the offline kind build: kind's containerd config and CNI manifest adapted to this
machine, and the cluster config every node gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rollfleet_dev.gobuild import BuildError, GoTool, SourcePatch, patch_text, patched_copy
from rollfleet_dev.kind import cluster, nodeimage, tools
from rollfleet_engine.tiny_model import NODE_MODEL_DIR

# The shape of kind v0.33.0's images/base/files/etc/containerd/config.toml (abridged).
KIND_CONTAINERD_CONFIG = """# explicitly use v2 config format
version = 2

[proxy_plugins]
# fuse-overlayfs is used for rootless
[proxy_plugins."fuse-overlayfs"]
  type = "snapshot"
  address = "/run/containerd-fuse-overlayfs.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  # restrict_oom_score_adj needs to be true when running inside UserNS (rootless)
  restrict_oom_score_adj = false
"""

KIND_CONST_CNI = """package nodeimage

const kindnetdImage = "docker.io/kindest/kindnetd:v20260820-69b56db7"

const defaultCNIManifest = `
# would you kindly template this file
      containers:
      - name: kindnet-cni
        image: ` + kindnetdImage + `
        env:
        - name: POD_SUBNET
          value: {{ .PodSubnet }}
`
"""


def test_containerd_config_drops_the_rootless_plugin_and_clamps_oom_scores() -> None:
    config = nodeimage.containerd_config(KIND_CONTAINERD_CONFIG)
    assert "proxy_plugins" not in config and "fuse-overlayfs" not in config
    assert "restrict_oom_score_adj = true" in config
    assert 'sandbox_image = "registry.k8s.io/pause:3.10"' in config


def test_a_containerd_config_of_another_shape_is_refused() -> None:
    with pytest.raises(BuildError, match="changed shape"):
        nodeimage.containerd_config(KIND_CONTAINERD_CONFIG.replace("restrict_oom_score_adj = false", ""))


def test_the_cni_manifest_names_our_kindnetd_and_keeps_kinds_template_marker() -> None:
    netpol = "---\nkind: DaemonSet\n  image: KUBE_ROUTER_IMAGE\n"
    manifest = nodeimage.default_cni_manifest(KIND_CONST_CNI, "rollfleet.local/kindnetd:abc", netpol, "kr:1")
    assert "image: rollfleet.local/kindnetd:abc\n" in manifest
    assert manifest.endswith("---\nkind: DaemonSet\n  image: kr:1\n")
    assert "would you kindly template this file" in manifest and "{{ .PodSubnet }}" in manifest
    assert "kindest" not in manifest
    with pytest.raises(BuildError, match="KUBE_ROUTER_IMAGE"):
        nodeimage.default_cni_manifest(KIND_CONST_CNI, "k", "---\nkind: DaemonSet\n", "kr:1")


def test_kube_router_runs_its_firewall_alone_beside_kindnetd_with_the_rbac_it_reads_by() -> None:
    """The shipped manifest: policy enforcement only (kindnetd stays the CNI, kube-proxy the service
    proxy), not privileged (kind's nodes here lack CAP_SYS_RESOURCE), every node (the GPU pool is
    tainted), and read access to everything kube-router's informers wait for at start."""
    docs = [d for d in yaml.safe_load_all(nodeimage.KUBE_ROUTER_MANIFEST.read_text()) if d]
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == nodeimage.KUBE_ROUTER_IMAGE_PLACEHOLDER
    args = set(container["args"])
    assert {"--run-firewall=true", "--run-router=false", "--run-service-proxy=false"} <= args
    assert container["securityContext"]["privileged"] is False
    assert "NET_ADMIN" in container["securityContext"]["capabilities"]["add"]
    assert pod["hostNetwork"] is True and pod["tolerations"] == [{"operator": "Exists"}]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    readable = {
        (group, resource)
        for rule in role["rules"]
        if {"list", "watch"} <= set(rule["verbs"])
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    wanted = {("", r) for r in ("pods", "namespaces", "nodes", "services", "endpoints")}
    assert wanted | {("networking.k8s.io", "networkpolicies"), ("discovery.k8s.io", "endpointslices")} <= readable
    assert not any(set(rule["verbs"]) - {"get", "list", "watch"} for rule in role["rules"])  # reads only


def test_system_images_carry_the_names_kubeadm_and_kind_ask_for() -> None:
    names = [n for tags in nodeimage.system_images("k1").values() for n in tags]
    assert "registry.k8s.io/pause:3.10" in names and "registry.k8s.io/pause:3.10.2" in names
    assert f"registry.k8s.io/etcd:{tools.ETCD_IMAGE_TAG}" in names
    assert f"registry.k8s.io/coredns/coredns:{tools.COREDNS.version}" in names
    assert "rollfleet.local/kindnetd:k1" in names
    assert nodeimage.kube_router_image() in names and nodeimage.kube_router_image().startswith(
        "rollfleet.local/kube-router:v"
    )


def test_every_node_gets_the_node_image_etcd_tag_cgroup_v1_allowance_and_the_model(tmp_path: Path) -> None:
    config = cluster.cluster_config("rollfleet.local/kind-node:v1-x", tmp_path)
    assert {n["image"] for n in config["nodes"]} == {"rollfleet.local/kind-node:v1-x"}
    for node in config["nodes"]:
        assert {"hostPath": str(tmp_path), "containerPath": NODE_MODEL_DIR, "readOnly": True} in node["extraMounts"]
    assert config["networking"]["apiServerAddress"] == "127.0.0.1"
    patches = [yaml.safe_load(p) for p in config["kubeadmConfigPatches"]]
    assert {"kind": "KubeletConfiguration", "failCgroupV1": False} in patches
    etcd = next(p for p in patches if p["kind"] == "ClusterConfiguration")["etcd"]
    assert etcd == {"local": {"imageTag": tools.ETCD_IMAGE_TAG}}
    # The pools of e2e/kind/cluster.yaml are kept: a control plane, two GPU workers, one CPU worker.
    pools = [(n["role"], (n.get("labels") or {}).get("rollfleet.dev/pool")) for n in config["nodes"]]
    assert pools == [("control-plane", None), ("worker", "gpu"), ("worker", "gpu"), ("worker", "cpu")]


def test_layer_blobs_of_a_docker_manifest_are_its_layers_not_its_config() -> None:
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"digest": "sha256:c0", "size": 7},
        "layers": [{"digest": "sha256:l1", "size": 100}, {"digest": "sha256:l2", "size": 2**30}],
    }
    assert cluster.layer_blobs(manifest) == {"sha256:l1": 100, "sha256:l2": 2**30}
    assert cluster.layer_blobs({"schemaVersion": 2, "manifests": []}) == {}  # an index names no layers


def test_clean_deletes_every_namespace_but_kubernetes_own() -> None:
    names = ["default", "kube-node-lease", "kube-public", "kube-system", "live-e2e-310448", "rollfleet-system"]
    assert cluster.leftover_namespaces(names) == ["live-e2e-310448", "rollfleet-system"]
    assert cluster.leftover_namespaces(names[:4]) == []


def test_a_source_patch_applies_to_a_copy_exactly_once_or_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "mod@v1"
    (root / "pkg").mkdir(parents=True)
    source = root / "pkg" / "policy.go"
    source.write_text("if len(a) == 0 {\n}\nif len(b) == 0 {\n}\n")
    for path in (source, root / "pkg", root):
        path.chmod(0o444 if path.is_file() else 0o555)  # as the module cache keeps them
    patch = SourcePatch("pkg/policy.go", "if len(a) == 0 {", "if all {")
    for _ in range(2):  # a second build lays the copy anew
        copy = patched_copy(root, [patch], tmp_path / "patched")
        assert (copy / "pkg" / "policy.go").read_text() == "if all {\n}\nif len(b) == 0 {\n}\n"
    assert source.read_text().startswith("if len(a) == 0 {")  # the module stays as published
    with pytest.raises(BuildError, match="exactly once"):
        patch_text("x x", SourcePatch("f.go", "x", "y"))
    with pytest.raises(BuildError, match="exactly once"):
        patch_text("", SourcePatch("f.go", "x", "y"))
    for path in (root, root / "pkg"):
        path.chmod(0o755)


def test_kube_router_is_patched_so_an_unresolved_named_port_admits_nothing_and_is_cached_apart() -> None:
    """v2.1.0 opened every port to a rule's pod peers when none of its ports resolved (a named port no
    selected pod has with that protocol); the patch keys its build and image apart from the published one."""
    kube_router = tools.KUBE_ROUTER
    assert [p.new.split(" //")[0] for p in kube_router.patches] == [
        "if ingressRule.matchAllPorts {",
        "if egressRule.matchAllPorts {",
    ]
    assert kube_router.patch_suffix.startswith("-p") and kube_router.outdir.name.endswith(kube_router.patch_suffix)
    unpatched = GoTool("kube-router", kube_router.module, kube_router.version, kube_router.packages, ("kube-router",))
    assert unpatched.patch_suffix == "" and unpatched.outdir != kube_router.outdir
    assert nodeimage.kube_router_image().endswith(kube_router.patch_suffix)


def test_stopped_nodes_start_in_the_order_of_their_addresses_and_a_moved_one_is_named() -> None:
    before = {"rf-worker": "172.18.0.3", "rf-control-plane": "172.18.0.10", "rf-worker2": "172.18.0.2"}
    # By address, not by name ("10" sorts before "2" as text); a node never seen goes last.
    order = cluster.start_order(["rf-control-plane", "rf-new", "rf-worker", "rf-worker2"], before)
    assert order == ["rf-worker2", "rf-worker", "rf-control-plane", "rf-new"]
    assert cluster.moved(before, dict(before)) == []
    swapped = before | {"rf-worker": "172.18.0.2", "rf-worker2": "172.18.0.3"}
    assert cluster.moved(before, swapped) == [
        "rf-worker: 172.18.0.3 -> 172.18.0.2",
        "rf-worker2: 172.18.0.2 -> 172.18.0.3",
    ]
    assert cluster.moved(before, before | {"rf-worker": ""}) == ["rf-worker: 172.18.0.3 -> none"]


def test_a_node_whose_kindnet_hands_out_another_nodes_range_is_named() -> None:
    conf = json.dumps(
        {
            "plugins": [
                {"type": "ptp", "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.1.0/24"}]]}},
                {"type": "portmap"},
            ]
        }
    )
    assert cluster.cni_subnet(conf) == "10.244.1.0/24"
    assert cluster.cni_subnet("") is None  # kindnet has written none yet
    cidrs = {"w2": "10.244.1.0/24", "w3": "10.244.2.0/24", "cp": "10.244.0.0/24"}
    # What a Docker restart left on this machine once: w3 kept w2's range.
    subnets = {"w2": "10.244.1.0/24", "w3": "10.244.1.0/24", "cp": "10.244.0.0/24"}
    assert cluster.range_faults(subnets, cidrs) == ["w3: hands out 10.244.1.0/24, its range is 10.244.2.0/24"]
    assert cluster.range_faults(subnets | {"w3": "10.244.2.0/24"}, cidrs) == []
    assert cluster.range_faults({"w2": None}, {"w2": "10.244.1.0/24"}) == [
        "w2: hands out no range, its range is 10.244.1.0/24"
    ]
    assert cluster.range_faults({}, {"new": None}) == []  # no range allocated to it yet: nothing to compare
