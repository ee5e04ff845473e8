"""The pinned programs a kind node image carries, and how each is built from Go modules.

Versions follow kind v0.33.0's own base image (images/base/Dockerfile) so the node runs what
upstream tested together; kubelet, kubeadm, kubectl and kube-proxy are the local control
plane's Kubernetes version (`rollfleet_dev.localcluster.build`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from rollfleet_dev.gobuild import BuildError, GoTool, SourcePatch, ensure_tool, log, module_dir
from rollfleet_dev.localcluster import build as kube_build
from rollfleet_dev.localcluster.paths import cache_dir

KIND_VERSION = "v0.33.0"
# kubeadm 1.37 asks for etcd 3.7.0-0; the cluster config pins the etcd the local cluster
# already builds (kubeadm passes it flags 3.6 has), tagged as kubeadm would name it.
ETCD_IMAGE_TAG = kube_build.ETCD_VERSION.removeprefix("v") + "-0"
PAUSE_VERSION = "3.10"  # kind's containerd config names this sandbox image

KIND = GoTool("kind", "sigs.k8s.io/kind", KIND_VERSION, ("sigs.k8s.io/kind",), ("kind",))

_CONTAINERD_VERSION = "v2.3.4"
_CONTAINERD_LDFLAGS = f"-s -w -X github.com/containerd/containerd/v2/version.Version={_CONTAINERD_VERSION}"
CONTAINERD = GoTool(
    "containerd",
    "github.com/containerd/containerd/v2",
    _CONTAINERD_VERSION,
    ("github.com/containerd/containerd/v2/cmd/containerd", "github.com/containerd/containerd/v2/cmd/ctr"),
    ("containerd", "ctr"),
    ldflags=_CONTAINERD_LDFLAGS,
    tags="no_aufs,no_zfs,no_btrfs,no_devmapper,urfave_cli_no_docs",
)
# Upstream builds the shim apart, without gRPC (containerd's Makefile).
CONTAINERD_SHIM = GoTool(
    "containerd-shim",
    "github.com/containerd/containerd/v2",
    _CONTAINERD_VERSION,
    ("github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",),
    ("containerd-shim-runc-v2",),
    ldflags=_CONTAINERD_LDFLAGS,
    tags="urfave_cli_no_docs,no_grpc",
)
# runc needs cgo (its nsenter is C) and libseccomp's headers.
RUNC = GoTool(
    "runc",
    "github.com/opencontainers/runc",
    "v1.4.3",
    ("github.com/opencontainers/runc",),
    ("runc",),
    tags="seccomp,urfave_cli_no_docs",
    cgo=True,
)
CRICTL = GoTool(
    "crictl",
    "sigs.k8s.io/cri-tools",
    "v1.36.0",
    ("sigs.k8s.io/cri-tools/cmd/crictl",),
    ("crictl",),
    ldflags="-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=v1.36.0",
)
CNI_PLUGINS = GoTool(
    "cni-plugins",
    "github.com/containernetworking/plugins",
    "v1.9.1",
    tuple(
        f"github.com/containernetworking/plugins/plugins/{p}"
        for p in ("ipam/host-local", "main/loopback", "main/ptp", "meta/portmap")
    ),
    ("host-local", "loopback", "ptp", "portmap"),
)
COREDNS = GoTool("coredns", "github.com/coredns/coredns", "v1.14.6", ("github.com/coredns/coredns",), ("coredns",))
LOCAL_PATH = GoTool(
    "local-path-provisioner",
    "github.com/rancher/local-path-provisioner",
    "v0.0.30",
    ("github.com/rancher/local-path-provisioner",),
    ("local-path-provisioner",),
)

# The NetworkPolicy enforcer: kube-router's firewall alone (no routing, no service proxy) beside
# kindnetd. iptables and ipset, which this kernel has; kindnetd's own dataplane needs an nftables
# `queue` it lacks. v2.1.0 is the one version the Go proxy serves here; its advisories are for
# the parts not run (docs/kind.md).
KUBE_ROUTER_VERSION = "v2.1.0"
_KUBE_ROUTER_POLICY = "pkg/controllers/netpol/policy.go"
# v2.1.0 admits every port from a rule's pod peers when none of the rule's ports resolves: a named
# port that no selected pod has with that protocol (`port: http, protocol: UDP` for a TCP `http`)
# then opened the pod. A rule with ports admits only what they resolve to; no ports, everything.
KUBE_ROUTER_PATCHES = tuple(
    SourcePatch(
        _KUBE_ROUTER_POLICY,
        f"if len({rule}.ports) == 0 && len({rule}.namedPorts) == 0 {{",
        f"if {rule}.matchAllPorts {{ // rollfleet: an unresolved named port admits nothing",
    )
    for rule in ("ingressRule", "egressRule")
)
KUBE_ROUTER = GoTool(
    "kube-router",
    "github.com/cloudnativelabs/kube-router/v2",
    KUBE_ROUTER_VERSION,
    ("github.com/cloudnativelabs/kube-router/v2/cmd/kube-router",),
    ("kube-router",),
    ldflags=f"-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version={KUBE_ROUTER_VERSION}",
    patches=KUBE_ROUTER_PATCHES,
)

_KINDNETD_SOURCE = Path(__file__).resolve().parents[2] / "kind" / "kindnetd"


def kindnetd() -> GoTool:
    """kind's kindnetd (vendored: its module is not on the Go proxy), keyed by a hash of the source."""
    digest = hashlib.sha256()
    for f in sorted(_KINDNETD_SOURCE.rglob("*")):
        if f.is_file():
            digest.update(f.relative_to(_KINDNETD_SOURCE).as_posix().encode() + f.read_bytes())
    return GoTool(
        "kindnetd", "rollfleet.dev/kindnetd", digest.hexdigest()[:12], (".",), ("kindnetd",), source=_KINDNETD_SOURCE
    )


def go_tools() -> tuple[GoTool, ...]:
    """Every tool built with `ensure_tool`: what the node image's key and the build both go by."""
    return KIND, CONTAINERD, CONTAINERD_SHIM, RUNC, CRICTL, CNI_PLUGINS, COREDNS, kindnetd(), KUBE_ROUTER


def kube_node_dir() -> Path:
    """kubelet, kubeadm, kubectl and kube-proxy, built beside (not into) the control plane's directory."""
    outdir = cache_dir() / "bin" / f"kubernetes-node-{kube_build.KUBERNETES_VERSION}"
    if not all((outdir / c).is_file() for c in kube_build.KUBE_NODE_COMMANDS):
        kube_build.build_kubernetes(commands=kube_build.KUBE_NODE_COMMANDS, outdir=outdir)
    return outdir


def pause_binary() -> Path:
    """Kubernetes' pause (one C file in the k8s.io/kubernetes module), static as upstream builds it."""
    out = cache_dir() / "bin" / f"pause-{kube_build.KUBERNETES_VERSION}" / "pause"
    if out.is_file():
        return out
    source = module_dir("k8s.io/kubernetes", kube_build.KUBERNETES_VERSION) / "build" / "pause" / "linux" / "pause.c"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [
            "gcc",
            "-Os",
            "-Wall",
            "-Werror",
            "-static",
            f"-DVERSION=v{PAUSE_VERSION}-rollfleet",
            "-o",
            str(out) + ".partial",
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise BuildError(f"gcc could not build {source}:\n{proc.stderr.strip()}")
    Path(str(out) + ".partial").replace(out)
    log(f"pause: built -> {out}")
    return out


def _ensure_c_toolchain() -> None:
    """gcc and libseccomp's headers (runc, pause); installed from Debian when missing and root."""
    if shutil.which("gcc") and Path("/usr/include/seccomp.h").is_file():
        return
    packages = ["gcc", "libc6-dev", "libseccomp-dev"]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BuildError(f"runc and pause need a C compiler and libseccomp: install {' '.join(packages)}")
    log(f"installing {' '.join(packages)} (runc and pause are C)")
    proc = subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        capture_output=True,
        text=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
    if proc.returncode != 0:
        raise BuildError(f"apt-get install {' '.join(packages)} failed:\n{proc.stderr.strip()[-2000:]}")


def build_all() -> dict[str, Path]:
    """Every program the node image and its preloaded images need, built once; name -> directory."""
    _ensure_c_toolchain()
    dirs = {tool.name: ensure_tool(tool) for tool in go_tools()}
    dirs["kubernetes-node"] = kube_node_dir()
    dirs["kubernetes"] = kube_build.ensure_built().kube_apiserver.parent
    dirs["etcd"] = kube_build.binaries().etcd.parent
    dirs["pause"] = pause_binary().parent
    return dirs
