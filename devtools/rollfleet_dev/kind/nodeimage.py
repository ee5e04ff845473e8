"""A kind node image built without any registry, cached under a key of everything that goes in.

Three steps, each logged to a file under `<cache>/logs/` (a failure names the step and the log):

1. the system images (control plane, kube-proxy, etcd, CoreDNS, pause, kindnetd, kube-router)
   from `devtools/kind/system-images.Dockerfile`, tagged with the names kubeadm and kind ask for;
2. the node base from `devtools/kind/node.Dockerfile`: Debian, systemd, containerd, runc, the
   CNI plugins, crictl, kubeadm/kubelet/kubectl and kind's own files (from the kind module);
3. the preload, as `kind build node-image` does it: start containerd in a container of the
   base, import the system images (pinned), stop it, commit.

`kind build node-image` itself cannot run here: it fetches every image it did not build from
a registry. Talks to `docker` only (binaries come from `tools`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rollfleet_dev.gobuild import BuildError, log, module_dir
from rollfleet_dev.kind import tools
from rollfleet_dev.localcluster import build as kube_build
from rollfleet_dev.localcluster.paths import cache_dir

DEVTOOLS_KIND = Path(__file__).resolve().parents[2] / "kind"
REPO = DEVTOOLS_KIND.parents[1]
NODE_REPOSITORY = "rollfleet.local/kind-node"
KINDNETD_IMAGE_REPOSITORY = "rollfleet.local/kindnetd"
KUBE_ROUTER_IMAGE_REPOSITORY = "rollfleet.local/kube-router"
# The NetworkPolicy enforcer's DaemonSet and RBAC, appended to kind's CNI manifest.
KUBE_ROUTER_MANIFEST = DEVTOOLS_KIND / "kube-router.yaml"
KUBE_ROUTER_IMAGE_PLACEHOLDER = "KUBE_ROUTER_IMAGE"
PUBLIC_DEBIAN_IMAGE = "debian:bookworm-slim"
_K8S = kube_build.KUBERNETES_VERSION
_REGISTRY = "registry.k8s.io"


def system_images(kindnetd_tag: str) -> dict[str, list[str]]:
    """system-images.Dockerfile target -> the names it is tagged with."""
    return {
        "kube-apiserver": [f"{_REGISTRY}/kube-apiserver:{_K8S}"],
        "kube-controller-manager": [f"{_REGISTRY}/kube-controller-manager:{_K8S}"],
        "kube-scheduler": [f"{_REGISTRY}/kube-scheduler:{_K8S}"],
        "kube-proxy": [f"{_REGISTRY}/kube-proxy:{_K8S}"],
        "etcd": [f"{_REGISTRY}/etcd:{tools.ETCD_IMAGE_TAG}"],
        "coredns": [f"{_REGISTRY}/coredns/coredns:{tools.COREDNS.version}"],
        # kind's containerd config names 3.10; kubeadm's list says 3.10.2: both, one image.
        "pause": [f"{_REGISTRY}/pause:{tools.PAUSE_VERSION}", f"{_REGISTRY}/pause:{tools.PAUSE_VERSION}.2"],
        "kindnetd": [f"{KINDNETD_IMAGE_REPOSITORY}:{kindnetd_tag}"],
        "kube-router": [kube_router_image()],
    }


def kube_router_image() -> str:
    return f"{KUBE_ROUTER_IMAGE_REPOSITORY}:{tools.KUBE_ROUTER.version}{tools.KUBE_ROUTER.patch_suffix}"


def debian_image() -> str:
    """The Debian base every image here starts from: built by hack/base-images.sh (cached) where no
    registry is reachable, the public one with ROLLFLEET_PUBLIC_BASES=1 (as hack/images.sh)."""
    if os.environ.get("ROLLFLEET_PUBLIC_BASES") == "1":
        return PUBLIC_DEBIAN_IMAGE
    proc = subprocess.run([str(REPO / "hack" / "base-images.sh"), "--debian"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"hack/base-images.sh failed:\n{proc.stderr.strip()}")
    return proc.stdout.strip()


def _docker(args: Sequence[str], step: str, logfile: Path, input_path: Path | None = None) -> str:
    """Run one docker command, appending its output to `logfile`; a failure names the step and the log."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("a") as out:
        out.write(f"\n$ docker {' '.join(args)}\n")
        out.flush()
        stdin = input_path.open("rb") if input_path else subprocess.DEVNULL
        try:
            proc = subprocess.run(["docker", *args], stdin=stdin, stdout=subprocess.PIPE, stderr=out, text=True)
        finally:
            if input_path:
                stdin.close()  # type: ignore[union-attr]
        out.write(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(logfile.read_text().splitlines()[-15:])
        raise BuildError(f"kind node image: {step} failed (exit {proc.returncode}); the log is {logfile}:\n{tail}")
    return proc.stdout


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def containerd_config(kind_config: str) -> str:
    """kind's containerd config for this machine: no fuse-overlayfs proxy plugin (rootless only),
    and restrict_oom_score_adj on, because a node here lacks CAP_SYS_RESOURCE and kubelet's
    negative OOM scores would fail every static pod (docs/kind.md)."""
    text = re.sub(r"\[proxy_plugins\]\n(#.*\n)?\[proxy_plugins\.\"fuse-overlayfs\"\]\n(  .*\n)+", "", kind_config)
    text, n = re.subn(r"restrict_oom_score_adj = false", "restrict_oom_score_adj = true", text)
    if n != 1 or "proxy_plugins" in text:
        raise BuildError("kind's containerd config.toml changed shape; update rollfleet_dev.kind.nodeimage")
    return text


def default_cni_manifest(const_cni_go: str, kindnetd_image: str, netpol_manifest: str, netpol_image: str) -> str:
    """kind's kindnetd manifest (a Go string constant in kind's source) naming our kindnetd image,
    followed by the NetworkPolicy enforcer's (kube-router's firewall): kind applies the file as
    the cluster's network plugin, so both come up with the cluster."""
    m = re.search(r"const defaultCNIManifest = `(.*?)` \+ kindnetdImage \+ `(.*?)`", const_cni_go, re.S)
    if not m:
        raise BuildError("kind's const_cni.go changed shape; update rollfleet_dev.kind.nodeimage")
    if KUBE_ROUTER_IMAGE_PLACEHOLDER not in netpol_manifest:
        raise BuildError(f"{KUBE_ROUTER_MANIFEST.name} names no {KUBE_ROUTER_IMAGE_PLACEHOLDER}")
    return (
        m.group(1) + kindnetd_image + m.group(2) + netpol_manifest.replace(KUBE_ROUTER_IMAGE_PLACEHOLDER, netpol_image)
    )


def _key(parts: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]


def node_image_name(debian: str) -> str:
    """The node image's name: the Kubernetes version and a key of every input."""
    inputs = {
        "debian": debian,
        "tools": ",".join(f"{t.name}@{t.version}{t.patch_suffix}" for t in tools.go_tools()),
        "etcd": kube_build.ETCD_VERSION,
        **{f.name: f.read_text() for f in sorted(DEVTOOLS_KIND.glob("*")) if f.is_file()},
        "builder": Path(__file__).read_text(),
    }
    return f"{NODE_REPOSITORY}:{_K8S}-{_key(inputs)}"


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        dst.hardlink_to(src)  # the binaries are hundreds of MB: no copies in the context
    except OSError:
        shutil.copy2(src, dst)


def _build_system_images(dirs: dict[str, Path], debian: str, kindnetd_tag: str, logfile: Path) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="rollfleet-kind-sys-") as tmp:
        ctx = Path(tmp)
        binaries = {
            **{c: dirs["kubernetes"] / c for c in kube_build.KUBE_COMMANDS},
            "kube-proxy": dirs["kubernetes-node"] / "kube-proxy",
            "etcd": dirs["etcd"] / "etcd",
            "coredns": dirs["coredns"] / "coredns",
            "pause": dirs["pause"] / "pause",
            "kindnetd": dirs["kindnetd"] / "kindnetd",
            "kube-router": dirs["kube-router"] / "kube-router",
        }
        for name, path in binaries.items():
            _link(path, ctx / "bin" / name)
        shutil.copy2(DEVTOOLS_KIND / "iptables-wrapper", ctx / "iptables-wrapper")
        names: list[str] = []
        for target, tags in system_images(kindnetd_tag).items():
            log(f"kind node image: system image {target}")
            _docker(
                [
                    "build",
                    "--build-arg",
                    f"DEBIAN_IMAGE={debian}",
                    "--target",
                    target,
                    "-f",
                    str(DEVTOOLS_KIND / "system-images.Dockerfile"),
                    *[a for tag in tags for a in ("-t", tag)],
                    str(ctx),
                ],
                f"building the {target} image",
                logfile,
            )
            names += tags
        return names


def _build_node_base(dirs: dict[str, Path], debian: str, kindnetd_image: str, base: str, logfile: Path) -> None:
    kind_src = module_dir("sigs.k8s.io/kind", tools.KIND_VERSION)
    with tempfile.TemporaryDirectory(prefix="rollfleet-kind-node-") as tmp:
        ctx = Path(tmp)
        shutil.copytree(kind_src / "images" / "base" / "files", ctx / "files")
        for f in (ctx / "files").rglob("*"):
            f.chmod(0o755 if f.is_dir() or "bin" in f.parts else 0o644)  # module files are read-only
        config = ctx / "files" / "etc" / "containerd" / "config.toml"
        config.write_text(containerd_config(config.read_text()))
        (ctx / "files" / "etc" / "systemd" / "system" / "containerd-fuse-overlayfs.service").unlink()
        cni_go = (kind_src / "pkg" / "build" / "nodeimage" / "const_cni.go").read_text()
        (ctx / "manifests").mkdir()
        (ctx / "manifests" / "default-cni.yaml").write_text(
            default_cni_manifest(cni_go, kindnetd_image, KUBE_ROUTER_MANIFEST.read_text(), kube_router_image())
        )
        (ctx / "version").write_text(_K8S + "\n")
        for name in ("containerd", "ctr"):
            _link(dirs["containerd"] / name, ctx / "bin" / name)
        _link(dirs["containerd-shim"] / "containerd-shim-runc-v2", ctx / "bin" / "containerd-shim-runc-v2")
        _link(dirs["crictl"] / "crictl", ctx / "bin" / "crictl")
        _link(dirs["runc"] / "runc", ctx / "bin" / "runc")
        for name in kube_build.KUBE_NODE_COMMANDS:
            if name != "kube-proxy":
                _link(dirs["kubernetes-node"] / name, ctx / "bin" / name)
        for name in tools.CNI_PLUGINS.binaries:
            _link(dirs["cni-plugins"] / name, ctx / "cni" / name)
        log("kind node image: the node base (systemd, containerd, runc, kubelet, ...)")
        _docker(
            [
                "build",
                "--build-arg",
                f"DEBIAN_IMAGE={debian}",
                "-f",
                str(DEVTOOLS_KIND / "node.Dockerfile"),
                "-t",
                base,
                str(ctx),
            ],
            "building the node base",
            logfile,
        )


def _preload(base: str, images: Sequence[str], node: str, logfile: Path) -> None:
    """Import `images` into the base's containerd (namespace k8s.io, pinned against kubelet's image
    GC) and commit the result as `node`: kind's own buildcontext/imageimporter, by hand."""
    log(f"kind node image: preloading {len(images)} images")
    with tempfile.TemporaryDirectory(prefix="rollfleet-kind-preload-") as tmp:
        archive = Path(tmp) / "images.tar"
        _docker(["save", "-o", str(archive), *images], "saving the system images", logfile)
        cid = _docker(
            ["run", "-d", "--entrypoint=sleep", "--security-opt", "seccomp=unconfined", base, "infinity"],
            "starting the preload container",
            logfile,
        ).strip()
        try:
            _docker(
                ["exec", cid, "bash", "-c", "nohup containerd >/tmp/containerd.log 2>&1 &"],
                "starting containerd in the preload container",
                logfile,
            )
            _docker(
                [
                    "exec",
                    cid,
                    "bash",
                    "-c",
                    "for i in $(seq 100); do ctr version >/dev/null 2>&1 && exit 0; "
                    "sleep 0.1; done; cat /tmp/containerd.log; exit 1",
                ],
                "waiting for containerd",
                logfile,
            )
            _docker(
                [
                    "exec",
                    "-i",
                    cid,
                    "ctr",
                    "--namespace=k8s.io",
                    "images",
                    "import",
                    "--label=io.cri-containerd.pinned=pinned",
                    "--all-platforms",
                    "--no-unpack",
                    "--digests",
                    "-",
                ],
                "importing the images into containerd",
                logfile,
                input_path=archive,
            )
            listed = set(
                _docker(
                    ["exec", cid, "ctr", "--namespace=k8s.io", "images", "ls", "-q"],
                    "listing the imported images",
                    logfile,
                ).split()
            )
            missing = [i for i in images if i not in listed and f"docker.io/{i}" not in listed]
            if missing:
                raise BuildError(f"kind node image: {', '.join(missing)} missing after the import; see {logfile}")
            # Stopped means exited: a zombie (nothing reaps it under `sleep`) has flushed its database.
            _docker(
                [
                    "exec",
                    cid,
                    "bash",
                    "-c",
                    "pkill containerd; for i in $(seq 300); do ps -C containerd "
                    "-o stat= | grep -qv Z || exit 0; sleep 0.1; done; exit 1",
                ],
                "stopping containerd",
                logfile,
            )
            _docker(
                ["commit", "--change", 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]', cid, node],
                "committing the node image",
                logfile,
            )
        finally:
            subprocess.run(["docker", "rm", "-f", "-v", cid], capture_output=True)


def ensure_node_image() -> str:
    """Build the node image unless one with the same inputs exists; returns its name."""
    debian = debian_image()
    node = node_image_name(debian)
    if image_exists(node):
        return node
    start = time.monotonic()
    dirs = tools.build_all()
    logfile = cache_dir() / "logs" / f"kind-node-{node.rsplit(':', 1)[1]}.log"
    logfile.unlink(missing_ok=True)
    kindnetd_tag = tools.kindnetd().version
    images = _build_system_images(dirs, debian, kindnetd_tag, logfile)
    base = node + "-base"
    _build_node_base(dirs, debian, f"{KINDNETD_IMAGE_REPOSITORY}:{kindnetd_tag}", base, logfile)
    _preload(base, images, node, logfile)
    subprocess.run(["docker", "rmi", base], capture_output=True)  # only its tag: the node image holds the layers
    log(f"kind node image: {node} in {time.monotonic() - start:.0f}s")
    return node
