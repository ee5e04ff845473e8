"""`rollfleet cluster down` leaves no process or port of the cluster behind.

Runs last: it stops the shared cluster (and brings it back if it was up before the
session, so a developer's cluster survives `make test`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from e2e.provider import Cluster, wait_for

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.last,
    pytest.mark.skipif(
        os.environ.get("ROLLFLEET_E2E_PROVIDER", "local") != "local",
        reason="stops the local cluster; kind clusters are deleted by their workflow",
    ),
]


def _pids_with_arg(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_down_leaves_no_process_or_port(cluster: Cluster) -> None:
    from rollfleet_dev.localcluster import controlplane
    from rollfleet_dev.localcluster.nodeagent.processes import start_ticks

    marker = f"rollfleet-e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=f"""
apiVersion: v1
kind: Pod
metadata: {{name: survivor-check, namespace: default}}
spec:
  terminationGracePeriodSeconds: 2
  containers:
  - name: sleeper
    image: python:3.11
    command: [python, -c, "import time, sys; time.sleep(3600)", {marker}]
""",
    )
    cluster.kubectl("wait", "--for=condition=Ready", "pod/survivor-check", "--timeout=60s")
    pod_pids = wait_for(lambda: _pids_with_arg(marker), 30, what="the pod's process")
    cluster_pids = [controlplane.running_pid(controlplane.Layout(), c) for c in controlplane.START_ORDER]
    assert all(cluster_pids)
    # A pid with its start time names one process: pids here wrap at 32,768, and a busy host reuses a freed
    # one within seconds.
    started = [(pid, start_ticks(pid)) for pid in [*pod_pids, *cluster_pids]]

    subprocess.run([sys.executable, "-m", "rollfleet.cli", "cluster", "down"], check=True, timeout=120)

    alive = [pid for pid, ticks in started if ticks is not None and start_ticks(pid) == ticks]
    assert alive == [], f"processes left behind: {alive}"
    busy = [port for port in controlplane.PORTS.values() if controlplane.port_in_use(port)]
    assert busy == [], f"ports left in use: {busy}"
    assert controlplane.status() == {c: "stopped" for c in controlplane.START_ORDER}

    if not cluster.started_here:  # leave a developer's cluster as we found it
        controlplane.up()
