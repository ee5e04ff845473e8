"""PersistentVolumeClaims on the local cluster: a claim bound to a hostPath volume at a directory here.

The local cluster's pods run on this machine, so a hostPath volume is a directory of it that
tests and benchmarks can read where it lies (the node agent mounts a bound claim as its
volume's hostPath: `nodeagent.volumes.claim_volume`). Pure: the manifests only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

Manifest = dict[str, Any]


def host_path_claim(namespace: str, claim: str, directory: Path, size: str = "1Gi") -> tuple[Manifest, Manifest]:
    """A PersistentVolume at `directory` (named `<namespace>-<claim>`) and the claim bound to it."""
    volume = f"{namespace}-{claim}"
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(directory), "type": "Directory"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "volumeName": volume,
            "resources": {"requests": {"storage": size}},
        },
    }
    return pv, pvc
