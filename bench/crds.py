"""Rollfleet's CRDs on a benchmark's cluster: a fresh local cluster (`rollfleet cluster up` after `down`) has
none, and the operator a benchmark starts serves them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rollfleet.api.crdgen import CRDS

REPO = Path(__file__).resolve().parents[1]
KUBECTL = Path(sys.executable).parent / "kubectl"


def install_crds(kubeconfig: Path) -> None:
    """`crds/` (the CRDs and the admission policies) applied, and every CRD Established."""
    kubectl = [str(KUBECTL), f"--kubeconfig={kubeconfig}"]
    subprocess.run([*kubectl, "apply", "--server-side", "-k", str(REPO / "crds")], check=True, capture_output=True)
    names = [f"crd/{info.name}" for info in CRDS]
    subprocess.run(
        [*kubectl, "wait", "--for=condition=Established", *names, "--timeout=60s"], check=True, capture_output=True
    )
