"""Build Go programs from their modules, once per version, with progress.

Every binary the development clusters run (the local control plane, and kind's node
image: kubelet, containerd, runc, CoreDNS, ...) comes from the Go module proxy, never from a
release download: this machine reaches the proxy and no release or image host. Each tool is
built in a small module of our own that requires it (so `replace` directives and pinned
versions are ours to choose), into `<cache>/bin/<name>-<version>/`; a built tool is never
rebuilt. Talks to `go` only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollfleet.errors import RollfleetError
from rollfleet_dev.localcluster.paths import cache_dir


class BuildError(RollfleetError, RuntimeError):
    """A build step failed; the message says which and why."""


def log(msg: str) -> None:
    print(f"[build] {msg}", file=sys.stderr, flush=True)


def go_env(cgo: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    # The machine's Go must build it: never download another toolchain behind the user's back.
    env.setdefault("GOTOOLCHAIN", "local")
    env["CGO_ENABLED"] = "1" if cgo else "0"
    env.setdefault("GOFLAGS", "-mod=mod")
    env["GOFLAGS"] = env["GOFLAGS"].replace("-buildvcs=false", "").strip() + " -buildvcs=false"
    return env


def go(args: Sequence[str], cwd: Path, cgo: bool = False) -> str:
    proc = subprocess.run(["go", *args], cwd=cwd, env=go_env(cgo), capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"`go {' '.join(args)}` failed in {cwd}:\n{proc.stderr.strip()}")
    return proc.stdout


def go_directives(gomod_text: str) -> str:
    """The `go` and `godebug` lines of a release's go.mod, so our module builds like it."""
    lines = [ln for ln in gomod_text.splitlines() if re.match(r"^(go|godebug)\s", ln)]
    return "\n".join(lines)


def upstream_gomod(module: str, version: str, workdir: Path) -> str:
    """The go.mod a module version was published with (downloaded into the module cache)."""
    info = json.loads(go(["mod", "download", "-json", f"{module}@{version}"], workdir))
    if "GoMod" not in info:
        raise BuildError(f"the Go proxy has no {module}@{version}: {info.get('Error', info)}")
    return Path(info["GoMod"]).read_text()


def module_dir(module: str, version: str) -> Path:
    """Where a module version's source lies in the module cache (downloaded if missing)."""
    workdir = cache_dir() / "build"
    workdir.mkdir(parents=True, exist_ok=True)
    info = json.loads(go(["mod", "download", "-json", f"{module}@{version}"], workdir))
    return Path(info["Dir"])


def build_packages(
    workdir: Path, packages: Sequence[str], outdir: Path, *, ldflags: str, label: str, tags: str = "", cgo: bool = False
) -> None:
    """`go build -v` into `outdir`, printing how many of the packages to compile are done. The
    binaries appear in `outdir` only when all of them built."""
    total = len(go(["list", "-deps", *packages], workdir, cgo).split())
    outdir.mkdir(parents=True, exist_ok=True)
    tmp_out = outdir.with_name(outdir.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    tmp_out.mkdir(parents=True)
    cmd = ["go", "build", "-v", "-trimpath", "-tags", tags, "-ldflags", ldflags, "-o", str(tmp_out) + "/", *packages]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=go_env(cgo), stderr=subprocess.PIPE, text=True)
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
            log(f"{label}: compiled {done}/{total} packages, {now - start:.0f}s elapsed")
    if proc.wait() != 0:
        raise BuildError(f"building {label} failed:\n" + "\n".join(errors[-40:]))
    for f in tmp_out.iterdir():
        f.replace(outdir / f.name)
    tmp_out.rmdir()
    log(f"{label}: built in {time.monotonic() - start:.0f}s -> {outdir}")


@dataclass(frozen=True)
class SourcePatch:
    """One exact replacement in a file of a published module version: a local fix, refused loudly
    when the text is not there exactly once (a new version needs the patch looked at again)."""

    path: str  # the file, relative to the module's root
    old: str
    new: str


def patch_text(text: str, patch: SourcePatch) -> str:
    if text.count(patch.old) != 1:
        raise BuildError(f"{patch.path}: the text to patch is not there exactly once: {patch.old!r}")
    return text.replace(patch.old, patch.new)


def patched_copy(module_root: Path, patches: Sequence[SourcePatch], dest: Path) -> Path:
    """A writable copy of a module version's source with `patches` applied, for a `replace`
    directive (Go builds no overlay over the module cache). The module cache stays as published."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(module_root, dest, copy_function=shutil.copyfile)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # the module cache's copies are read-only
    for patch in patches:
        target = dest / patch.path
        target.write_text(patch_text(target.read_text(), patch))
    return dest


@dataclass(frozen=True)
class GoTool:
    """A program built from a published module version (or from a directory of this repository)."""

    name: str  # also the cache directory: <cache>/bin/<name>-<version>
    module: str
    version: str
    packages: tuple[str, ...]
    binaries: tuple[str, ...]  # what the packages build into: checks the cache
    ldflags: str = "-s -w"
    tags: str = ""
    cgo: bool = False
    source: Path | None = None  # a module of this repository (its own go.mod) instead of the proxy
    replaces: Mapping[str, str] = field(default_factory=dict)  # module => module version
    patches: tuple[SourcePatch, ...] = ()  # local fixes to the module's own files

    @property
    def outdir(self) -> Path:
        return cache_dir() / "bin" / f"{self.name}-{self.version}{self.patch_suffix}"

    @property
    def patch_suffix(self) -> str:
        """A patched build is cached apart from the published one, under a key of its patches."""
        if not self.patches:
            return ""
        digest = hashlib.sha256(json.dumps([(p.path, p.old, p.new) for p in self.patches]).encode())
        return "-p" + digest.hexdigest()[:8]

    def path(self, binary: str) -> Path:
        assert binary in self.binaries, f"{self.name} builds {self.binaries}, not {binary}"
        return self.outdir / binary

    def is_built(self) -> bool:
        return all((self.outdir / b).is_file() for b in self.binaries)


def ensure_tool(tool: GoTool) -> Path:
    """Build `tool` unless its binaries are cached; returns the directory they are in."""
    if tool.is_built():
        return tool.outdir
    if shutil.which("go") is None:
        raise BuildError(f"Go is needed to build {tool.name} {tool.version}; install Go 1.26+ and retry")
    label = f"{tool.name} {tool.version}"
    if tool.source is not None:
        if tool.patches:
            raise BuildError(f"{label}: patches are for published modules; edit the source instead")
        workdir = tool.source
    else:
        workdir = cache_dir() / "build" / f"{tool.name}-{tool.version}"
        workdir.mkdir(parents=True, exist_ok=True)
        log(f"{label}: resolving modules")
        upstream = upstream_gomod(tool.module, tool.version, workdir)
        replaces = "".join(f"replace {mod} => {mod} {v}\n" for mod, v in tool.replaces.items())
        if tool.patches:
            patched_copy(module_dir(tool.module, tool.version), tool.patches, workdir / "patched")
            replaces += f"replace {tool.module} => ./patched\n"
        (workdir / "go.mod").write_text(
            f"module rollfleet.dev/build/{tool.name}\n\n{go_directives(upstream)}\n\n"
            f"require {tool.module} {tool.version}\n\n{replaces}"
        )
    build_packages(workdir, tool.packages, tool.outdir, ldflags=tool.ldflags, label=label, tags=tool.tags, cgo=tool.cgo)
    missing = [b for b in tool.binaries if not (tool.outdir / b).is_file()]
    if missing:
        raise BuildError(f"{label} built, but {', '.join(missing)} is not in {tool.outdir}")
    return tool.outdir
