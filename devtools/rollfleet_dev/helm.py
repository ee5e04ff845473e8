"""Helm, built from its Go module, for the chart in `charts/rollfleet` (`rollfleet helm`).

Users install Rollfleet with their own Helm; the project's tests use the release pinned here,
built from `helm.sh/helm/v3` (no release download is reachable from this machine), to lint the
chart, render it, and install, upgrade and uninstall it on kind. Talks to `go` (once, to build)
and runs `helm` with the kubeconfig it is given.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from rollfleet_dev.gobuild import GoTool, ensure_tool

HELM_VERSION = "v3.22.0"
HELM = GoTool(
    "helm",
    "helm.sh/helm/v3",
    HELM_VERSION,
    ("helm.sh/helm/v3/cmd/helm",),
    ("helm",),
    ldflags=f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
)


def helm_binary() -> Path:
    """The pinned `helm` (built once, cached)."""
    return ensure_tool(HELM) / "helm"


def helm(args: Sequence[str], kubeconfig: Path | None = None, timeout: float = 600) -> str:
    """Run `helm args...`; returns its stdout, raises with its stderr when it fails."""
    env = dict(os.environ)
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    proc = subprocess.run(
        [str(helm_binary()), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"`helm {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr.strip()}")
    return proc.stdout
