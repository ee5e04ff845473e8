"""Build the control-plane binaries from Go modules, once per version.

`k8s.io/kubernetes` cannot be `go install`ed (its go.mod points its staging modules
at local directories), so we write a small module of our own that requires it and
replaces every staging module with its published `v0.N.M` twin. etcd is built the
same way from `go.etcd.io/etcd/server/v3`. Results are cached under
`<cache>/bin/<component>-<version>/`; a cached binary is never rebuilt.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollfleet_dev.gobuild import BuildError, build_packages, go, go_directives, log
from rollfleet_dev.localcluster.paths import cache_dir

# v1.37.2 is listed by the Go proxy but its zip answers 403 ("not available").
KUBERNETES_VERSION = "v1.37.1"
ETCD_VERSION = "v3.6.16"
KUBE_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
# What a kind node runs besides the control plane (rollfleet_dev.kind).
KUBE_NODE_COMMANDS = ("kubelet", "kubeadm", "kubectl", "kube-proxy")


@dataclass(frozen=True)
class Binaries:
    """Where the built control-plane binaries live."""

    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path


def binaries() -> Binaries:
    kube = cache_dir() / "bin" / f"kubernetes-{KUBERNETES_VERSION}"
    return Binaries(
        etcd=cache_dir() / "bin" / f"etcd-{ETCD_VERSION}" / "etcd",
        kube_apiserver=kube / "kube-apiserver",
        kube_scheduler=kube / "kube-scheduler",
        kube_controller_manager=kube / "kube-controller-manager",
    )


def is_built() -> bool:
    b = binaries()
    return all(p.is_file() for p in (b.etcd, b.kube_apiserver, b.kube_scheduler, b.kube_controller_manager))


def staging_replaces(gomod_text: str, version: str) -> dict[str, str]:
    """Map each staging module of k/k's go.mod to its published version.

    Kubernetes vX.Y.Z publishes staging modules as v0.Y.Z.
    """
    m = re.fullmatch(r"v1\.(\d+)\.(\d+)", version)
    if not m:
        raise BuildError(f"unexpected Kubernetes version {version!r}; want v1.N.M")
    staging_version = f"v0.{m.group(1)}.{m.group(2)}"
    mods = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod_text, flags=re.M)
    if not mods:
        raise BuildError("found no staging replaces in k8s.io/kubernetes go.mod")
    return {mod: staging_version for mod in sorted(set(mods))}


def kubernetes_gomod(version: str, upstream_gomod: str) -> str:
    replaces = "\n".join(f"\t{mod} => {mod} {v}" for mod, v in staging_replaces(upstream_gomod, version).items())
    return (
        "module rollfleet.dev/localcluster/kubebuild\n\n"
        f"{go_directives(upstream_gomod)}\n\n"
        f"require k8s.io/kubernetes {version}\n\n"
        f"replace (\n{replaces}\n)\n"
    )


def _version_ldflags(version: str) -> str:
    m = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", version)
    assert m, version
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={m.group(1)}",
            f"-X {pkg}.gitMinor={m.group(2)}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate={date}",
        ]
    return "-s -w " + " ".join(flags)


def build_kubernetes(
    version: str = KUBERNETES_VERSION, commands: Sequence[str] = KUBE_COMMANDS, outdir: Path | None = None
) -> Path:
    """Build `commands` of k8s.io/kubernetes into `outdir` (default: the control plane's directory)."""
    outdir = outdir or binaries().kube_apiserver.parent
    workdir = cache_dir() / "build" / f"kubernetes-{version}"
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"kubernetes {version}: resolving modules (first time downloads ~1 GB)")
    info = json.loads(go(["mod", "download", "-json", f"k8s.io/kubernetes@{version}"], workdir))
    upstream = Path(info["GoMod"]).read_text()
    (workdir / "go.mod").write_text(kubernetes_gomod(version, upstream))
    go(["mod", "download"], workdir)
    build_packages(
        workdir,
        [f"k8s.io/kubernetes/cmd/{c}" for c in commands],
        outdir,
        ldflags=_version_ldflags(version),
        tags="selinux,notest",
        label=f"kubernetes {version}",
    )
    return outdir


def build_etcd(version: str = ETCD_VERSION) -> None:
    workdir = cache_dir() / "build" / f"etcd-{version}"
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"etcd {version}: resolving modules")
    info = json.loads(go(["mod", "download", "-json", f"go.etcd.io/etcd/server/v3@{version}"], workdir))
    upstream = Path(info["GoMod"]).read_text()
    (workdir / "go.mod").write_text(
        f"module rollfleet.dev/localcluster/etcdbuild\n\n{go_directives(upstream)}\n\n"
        f"require go.etcd.io/etcd/server/v3 {version}\n"
    )
    build_packages(
        workdir,
        ["go.etcd.io/etcd/server/v3"],
        binaries().etcd.parent,
        ldflags="-s -w",
        tags="selinux,notest",
        label=f"etcd {version}",
    )
    # Go names the binary of module path .../server/v3 after "server".
    (binaries().etcd.parent / "server").replace(binaries().etcd)


def ensure_built() -> Binaries:
    """Build whatever is missing from the cache; a warm cache returns at once."""
    if shutil.which("go") is None and not is_built():
        raise BuildError("Go is needed to build the local control plane; install Go 1.26+ and retry")
    b = binaries()
    if not b.etcd.is_file():
        build_etcd()
    if not all(p.is_file() for p in (b.kube_apiserver, b.kube_scheduler, b.kube_controller_manager)):
        build_kubernetes()
    return b


if __name__ == "__main__":
    ensure_built()
