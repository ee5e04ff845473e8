"""Build the control-plane binaries from Go modules, once per version.

`k8s.io/kubernetes` cannot be `go install`ed (its go.mod points its staging modules
at local directories), so we write a small module of our own that requires it and
replaces every staging module with its published `v0.N.M` twin. etcd is built the
same way from `go.etcd.io/etcd/server/v3`. Results are cached under
`<cache>/bin/<component>-<version>/`; a cached binary is never rebuilt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollfleet.errors import RollfleetError
from rollfleet_dev.localcluster.paths import cache_dir

# v1.37.2 is listed by the Go proxy but its zip answers 403 ("not available").
KUBERNETES_VERSION = "v1.37.1"
ETCD_VERSION = "v3.6.16"
KUBE_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")


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


def _log(msg: str) -> None:
    print(f"[build] {msg}", file=sys.stderr, flush=True)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # The machine's Go must build it: never download another toolchain behind the user's back.
    env.setdefault("GOTOOLCHAIN", "local")
    env["CGO_ENABLED"] = "0"
    env.setdefault("GOFLAGS", "-mod=mod")
    env["GOFLAGS"] = env["GOFLAGS"].replace("-buildvcs=false", "").strip() + " -buildvcs=false"
    return env


def _go(args: Sequence[str], cwd: Path) -> str:
    proc = subprocess.run(["go", *args], cwd=cwd, env=_go_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"`go {' '.join(args)}` failed in {cwd}:\n{proc.stderr.strip()}")
    return proc.stdout


class BuildError(RollfleetError, RuntimeError):
    """A build step failed; the message says which and why."""


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


def go_directives(gomod_text: str) -> str:
    """The `go` and `godebug` lines of a release's go.mod, so our module builds like it."""
    lines = [ln for ln in gomod_text.splitlines() if re.match(r"^(go|godebug)\s", ln)]
    return "\n".join(lines)


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


def _build_with_progress(workdir: Path, packages: Sequence[str], outdir: Path, ldflags: str, label: str) -> None:
    """`go build -v`, printing how many of the packages to compile are done."""
    total = len(_go(["list", "-deps", *packages], workdir).split())
    outdir.mkdir(parents=True, exist_ok=True)
    tmp_out = outdir.with_name(outdir.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    tmp_out.mkdir(parents=True)
    cmd = ["go", "build", "-v", "-trimpath", "-tags", "selinux,notest", "-ldflags", ldflags,
           "-o", str(tmp_out) + "/", *packages]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=_go_env(), stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    done, last_report, errors = 0, 0.0, []
    for line in proc.stderr:
        line = line.rstrip()
        if re.fullmatch(r"[\w./~+-]+", line):
            done += 1
        else:
            errors.append(line)
        now = time.monotonic()
        if now - last_report > 15:
            last_report = now
            _log(f"{label}: compiled {done}/{total} packages, {now - start:.0f}s elapsed")
    if proc.wait() != 0:
        raise BuildError(f"building {label} failed:\n" + "\n".join(errors[-40:]))
    for f in tmp_out.iterdir():
        f.replace(outdir / f.name)
    tmp_out.rmdir()
    _log(f"{label}: built in {time.monotonic() - start:.0f}s -> {outdir}")


def build_kubernetes(version: str = KUBERNETES_VERSION) -> None:
    workdir = cache_dir() / "build" / f"kubernetes-{version}"
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"kubernetes {version}: resolving modules (first time downloads ~1 GB)")
    info = json.loads(_go(["mod", "download", "-json", f"k8s.io/kubernetes@{version}"], workdir))
    upstream = Path(info["GoMod"]).read_text()
    (workdir / "go.mod").write_text(kubernetes_gomod(version, upstream))
    pkgs = [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS]
    _go(["mod", "download"], workdir)
    _build_with_progress(workdir, pkgs, binaries().kube_apiserver.parent, _version_ldflags(version),
                         f"kubernetes {version}")


def build_etcd(version: str = ETCD_VERSION) -> None:
    workdir = cache_dir() / "build" / f"etcd-{version}"
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"etcd {version}: resolving modules")
    info = json.loads(_go(["mod", "download", "-json", f"go.etcd.io/etcd/server/v3@{version}"], workdir))
    upstream = Path(info["GoMod"]).read_text()
    (workdir / "go.mod").write_text(
        f"module rollfleet.dev/localcluster/etcdbuild\n\n{go_directives(upstream)}\n\n"
        f"require go.etcd.io/etcd/server/v3 {version}\n"
    )
    _build_with_progress(workdir, ["go.etcd.io/etcd/server/v3"], binaries().etcd.parent, "-s -w", f"etcd {version}")
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
