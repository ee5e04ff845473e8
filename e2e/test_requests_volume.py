"""RolloutRequest results on a PersistentVolumeClaim, on the control-plane tier's simulated engines.

The claim is bound to a hostPath PersistentVolume made here, so the file the runner writes
can be checked where it lies. A missing claim fails the request before any pod runs. A
read-only or full volume (a read-only bind mount, a tiny tmpfs: root on the local cluster's
machine) fails it with that reason, in the status and in an Event, keeping what it took.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.live_fleet import LiveFleet, create, host_path_claim, may, results, wait_phase
from e2e.provider import wait_for
from rollfleet.contract import LABEL_REQUEST, LABEL_REQUEST_UID, SPARE_RUNNER_PREFIX, gateway_name, runner_name
from rollfleet.controller.owner import RequestRef
from rollfleet.controller.requests import spares
from rollfleet.controller.requests.worker import wait_for_assignment
from rollfleet.kube import CONFIG_MAP, Conflict, Kube, load_client
from rollfleet_dev.runners import waiting_spares

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("ROLLFLEET_E2E_PROVIDER", "local") != "local",
        reason="the volume is a directory of this machine: the local cluster's nodes are this machine",
    ),
]


@pytest.fixture
def fleet(sim_live: LiveFleet) -> LiveFleet:
    sim_live.ready()
    return sim_live


@pytest.fixture
def claim(fleet: LiveFleet, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A claim bound to a hostPath volume at a fresh directory here: (claim name, directory)."""
    directory = tmp_path / "volume"
    directory.mkdir()
    with host_path_claim(fleet, directory) as name:
        yield name, directory


@pytest.fixture
def mounted(claim: tuple[str, Path]) -> Iterator[tuple[str, Path, list[list[str]]]]:
    """The claim, its directory, and a list for the mounts made over it (undone after the test)."""
    if os.geteuid() != 0:
        pytest.skip("making a directory read-only or full takes mount(8), as root")
    name, directory = claim
    mounts: list[list[str]] = []
    yield name, directory, mounts
    for _ in mounts:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def _event(fleet: LiveFleet, name: str, reason: str) -> dict[str, Any] | None:
    selector = f"involvedObject.kind=RolloutRequest,involvedObject.name={name}"
    out = fleet.cluster.kubectl("-n", fleet.namespace, "get", "events", "--field-selector", selector, "-o", "json")
    return next((e for e in json.loads(out.stdout)["items"] if e["reason"] == reason), None)


def _result_config_maps(fleet: LiveFleet, uid: str) -> list[str]:
    out = fleet.cluster.kubectl(
        "-n", fleet.namespace, "get", "configmaps", "-l", f"{LABEL_REQUEST_UID}={uid}", "-o", "name"
    )
    return out.stdout.split()


def _json(fleet: LiveFleet, *args: str) -> Any:
    return json.loads(fleet.cluster.kubectl("-n", fleet.namespace, *args, "-o", "json").stdout)


def _waiting_spare(fleet: LiveFleet, claim: str, other_than: str = "") -> str:
    """A spare runner of the fleet and claim whose pod waits for a request (not `other_than`)."""
    kube = Kube(load_client(str(fleet.cluster.kubeconfig)))

    def waiting() -> str | None:
        names = asyncio.run(waiting_spares(kube, fleet.namespace, fleet.fleet.name, claim))
        return next((n for n in names if n != other_than), None)

    try:
        return str(wait_for(waiting, 120, interval=0.5, what=f"a spare runner of claim {claim} waiting"))
    finally:
        kube.close()


def _lines(file: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in file.read_text().splitlines()]


def test_results_on_a_claim_are_a_file_there_read_back_by_rollfleet_results_and_none_in_etcd(
    fleet: LiveFleet, claim: tuple[str, Path]
) -> None:
    claim_name, directory = claim
    tokens = 8
    sampling = {"maxTokens": tokens, "ignoreEos": True, "seed": 3, "logprobs": 0}
    spec = {"results": {"persistentVolumeClaim": {"claimName": claim_name, "subPath": "step-1"}}}
    name, uid = create(fleet, 12, 2, sampling=sampling, **spec)
    st = wait_phase(fleet, name, "Succeeded", timeout=300)

    ref = st["results"]
    assert ref["persistentVolumeClaim"] == claim_name and ref["samples"] == 24 and not ref.get("configMaps")
    assert ref["path"] == f"step-1/{name}-{uid[:8]}/samples.jsonl"
    file = directory / ref["path"]
    stored = _lines(file)
    assert ref["bytes"] == file.stat().st_size
    assert sorted((r["prompt"], r["sample"]) for r in stored) == [(p, s) for p in range(12) for s in range(2)]
    assert all(len(r["token_ids"]) == tokens and len(r["logprobs"]) == tokens for r in stored)
    assert _result_config_maps(fleet, uid) == []  # nothing of the results went to etcd

    printed = results(fleet, name)  # through a reader pod that mounts the claim
    assert sorted(json.dumps(r, sort_keys=True) for r in printed) == sorted(
        json.dumps(r, sort_keys=True) for r in stored
    )
    readers = fleet.cluster.kubectl("-n", fleet.namespace, "get", "pods", "-l", f"{LABEL_REQUEST}={name}", "-o", "name")
    assert "results-reader" not in readers.stdout  # deleted once read


def test_a_missing_results_claim_fails_the_request_before_any_runner_starts(fleet: LiveFleet) -> None:
    name, _ = create(fleet, 2, 1, results={"persistentVolumeClaim": {"claimName": "no-such-claim"}})
    st = wait_phase(fleet, name, "Failed", timeout=120)
    assert st["reason"] == "ResultsVolumeNotFound" and "no-such-claim" in st["message"], st
    assert wait_for(lambda: _event(fleet, name, "ResultsVolumeNotFound"), 30, what="the event")
    jobs = fleet.cluster.kubectl("-n", fleet.namespace, "get", "jobs", "-o", "name").stdout
    assert runner_name(name) not in jobs


def test_a_read_only_results_volume_fails_the_request_saying_so(
    fleet: LiveFleet, mounted: tuple[str, Path, list[list[str]]]
) -> None:
    claim_name, directory, mounts = mounted
    bind = ["mount", "--bind", str(directory), str(directory)]
    subprocess.run(bind, check=True)
    mounts.append(bind)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
    name, _ = create(fleet, 2, 1, results={"persistentVolumeClaim": {"claimName": claim_name}})
    st = wait_phase(fleet, name, "Failed", timeout=180)
    assert st["reason"] == "ResultsVolumeReadOnly" and claim_name in st["message"], st
    assert st["counts"]["completed"] == 0 and st.get("startTime") is None  # no sample was sent
    assert wait_for(lambda: _event(fleet, name, "ResultsVolumeReadOnly"), 30, what="the event")


def test_a_full_results_volume_fails_the_request_keeping_every_sample_it_took(
    fleet: LiveFleet, mounted: tuple[str, Path, list[list[str]]]
) -> None:
    claim_name, directory, mounts = mounted
    cmd = ["mount", "-t", "tmpfs", "-o", "size=48k,mode=0777", "tmpfs", str(directory)]
    subprocess.run(cmd, check=True)
    mounts.append(cmd)
    sampling = {"maxTokens": 16, "ignoreEos": True, "logprobs": 0}
    name, uid = create(fleet, 64, 4, sampling=sampling, results={"persistentVolumeClaim": {"claimName": claim_name}})
    st = wait_phase(fleet, name, "Failed", timeout=300)
    assert st["reason"] == "ResultsVolumeFull" and claim_name in st["message"], st
    assert wait_for(lambda: _event(fleet, name, "ResultsVolumeFull"), 30, what="the event")
    stored = _lines(directory / st["results"]["path"])  # whole lines only: no torn sample
    counts = st["counts"]
    assert 0 < len(stored) < 256
    assert st["results"]["samples"] == len(stored) == counts["completed"] + counts["aborted"] + counts["failed"]
    assert len({(r["prompt"], r["sample"]) for r in stored}) == len(stored)
    assert counts["inFlight"] == 0
    wait_for(lambda: not any(fleet.in_flight(f"{uid}-").values()), 30, what="its samples stopped at the engines")


def test_the_next_request_of_a_fleet_and_claim_runs_in_a_spare_started_ahead_of_it_with_only_its_rights(
    fleet: LiveFleet, claim: tuple[str, Path]
) -> None:
    claim_name, directory = claim
    on_claim = {"results": {"persistentVolumeClaim": {"claimName": claim_name}}, "sampling": {"maxTokens": 4}}
    first, _ = create(fleet, 4, 2, **on_claim)
    wait_phase(fleet, first, "Succeeded", timeout=300)
    assert _json(fleet, "get", "job", runner_name(first))["metadata"]["labels"][LABEL_REQUEST] == first  # its own

    spare = _waiting_spare(fleet, claim_name)
    assert spare.startswith(SPARE_RUNNER_PREFIX)
    # Until a request takes it, the spare may read and expire its assignment, read its fleet and gateway Service
    # (it reads them as it learns of its request), and nothing else.
    assert may(fleet, spare, "get", f"configmaps/{spare}") and may(fleet, spare, "patch", f"configmaps/{spare}")
    gateway = gateway_name(fleet.fleet.name)
    assert may(fleet, spare, "get", f"rolloutfleets/{fleet.fleet.name}") and may(
        fleet, spare, "get", f"services/{gateway}"
    )
    assert not may(fleet, spare, "list", "rolloutfleets") and not may(fleet, spare, "get", "services/other")
    assert not may(fleet, spare, "get", f"rolloutrequests/{first}") and not may(fleet, spare, "list", "configmaps")
    assert not may(fleet, spare, "get", "secrets") and not may(fleet, spare, "create", "configmaps")
    started = _json(fleet, "get", "job", spare)["metadata"]["creationTimestamp"]

    second, uid = create(fleet, 4, 2, **on_claim)
    st = wait_phase(fleet, second, "Succeeded", timeout=300)
    [job] = _json(fleet, "get", "jobs", "-l", f"{LABEL_REQUEST_UID}={uid}")["items"]
    assert job["metadata"]["name"] == spare and job["metadata"]["creationTimestamp"] == started
    [owner] = job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("RolloutRequest", uid)  # deleted with its request
    assert "ttlSecondsAfterFinished" not in job["spec"] and "activeDeadlineSeconds" not in job["spec"]
    own = fleet.cluster.kubectl("-n", fleet.namespace, "get", "job", runner_name(second), check=False)
    assert own.returncode != 0 and "NotFound" in own.stderr  # no runner of its own was made
    wait_for(lambda: _json(fleet, "get", "job", spare)["status"].get("succeeded") == 1, 60, what=f"{spare} completed")
    stored = _lines(directory / st["results"]["path"])
    assert sorted((r["prompt"], r["sample"]) for r in stored) == [(p, s) for p in range(4) for s in range(2)]
    # Taken, it has the rights of that request's runner, and no other request's.
    assert may(fleet, spare, "get", f"rolloutrequests/{second}") and may(fleet, spare, "get", f"configmaps/{spare}")
    assert not may(fleet, spare, "get", f"rolloutrequests/{first}")

    # A new spare waits for the next one; the one taken went with its request.
    _waiting_spare(fleet, claim_name, other_than=spare)
    fleet.cluster.kubectl("-n", fleet.namespace, "delete", "rolloutrequest", second)
    wait_for(
        lambda: not fleet.cluster.kubectl("-n", fleet.namespace, "get", "job", spare, check=False).stdout,
        120,
        what=f"{spare} deleted with {second}",
    )


def test_a_spare_left_idle_expires_unless_it_was_taken_first(fleet: LiveFleet) -> None:
    """The spare's wait, against the API server: the compare-and-swap on its ConfigMap decides between a
    request given to it and its own expiry, whichever comes first."""
    ns = fleet.namespace
    kube = Kube(load_client(str(fleet.cluster.kubeconfig)))

    async def scenario() -> None:
        for name, give in ((f"{SPARE_RUNNER_PREFIX}idle", False), (f"{SPARE_RUNNER_PREFIX}taken", True)):
            waiting = {spares.KEY_STATE: spares.WAITING}
            meta = {"name": name, "namespace": ns, "labels": {"app.kubernetes.io/name": "rollfleet"}}
            await kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": waiting})
            try:
                waited = asyncio.create_task(wait_for_assignment(kube, ns, name, idle_s=5.0 if give else 0.5))
                if give:
                    await kube.json_patch(CONFIG_MAP, ns, name, spares.take(RequestRef("rr-x", ns, "u-1234567890")))
                    assert await waited == spares.Assignment("rr-x", "u-1234567890")
                else:
                    assert await waited is None
                    after = await kube.get(CONFIG_MAP, ns, name)
                    assert after["data"] == {spares.KEY_STATE: spares.EXPIRED}
                    with pytest.raises(Conflict) as refused:  # too late to take it: the operator's patch fails
                        await kube.json_patch(CONFIG_MAP, ns, name, spares.take(RequestRef("rr-y", ns, "u-2")))
                    assert refused.value.status == 422
            finally:
                await kube.delete(CONFIG_MAP, ns, name)

    try:
        asyncio.run(scenario())
    finally:
        kube.close()
