"""Where the local cluster keeps its cache (built binaries) and its state (a running cluster)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Built binaries, reused across clusters and checkouts; keyed by version."""
    return Path(os.environ.get("ROLLFLEET_CACHE", Path.home() / ".cache" / "rollfleet"))


def state_dir() -> Path:
    """One running cluster: certificates, etcd data, logs, pid files, kubeconfig."""
    return Path(os.environ.get("ROLLFLEET_STATE", Path.home() / ".local" / "state" / "rollfleet" / "cluster"))
