"""Spare request runners on the local cluster (`rollfleet.controller.requests.spares`), as the tests and
benchmarks wait for them: a spare counts once its pod has started and waits for a request (its log says so).

Talks to kube-apiserver (through `rollfleet.kube`) and reads the local node agent's log files.
"""

from __future__ import annotations

from rollfleet.controller.requests import spares
from rollfleet.controller.requests.desired import RUNNER_CONTAINER
from rollfleet.controller.requests.worker import SPARE_WAITING
from rollfleet.kube import JOB, JOB_NAME_LABEL, POD, Kube
from rollfleet_dev.localcluster.nodeagent.logs import LogsError, find_log, nodes_state_dir


async def waiting_spares(kube: Kube, namespace: str, fleet: str, claim: str) -> list[str]:
    """The spare runners of this fleet and claim whose pod waits for a request."""
    waiting = []
    for job in await kube.list(JOB, namespace, spares.untaken_selector(fleet, claim)):
        name = job["metadata"]["name"]
        for pod in await kube.list(POD, namespace, f"{JOB_NAME_LABEL}={name}"):
            try:
                log = find_log(nodes_state_dir() / "pods", namespace, pod["metadata"]["name"], RUNNER_CONTAINER, False)
            except LogsError:  # not started yet
                continue
            if log.exists() and SPARE_WAITING in log.read_text():
                waiting.append(str(name))
    return waiting
