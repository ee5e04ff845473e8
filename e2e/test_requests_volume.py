"""RolloutRequest results on a PersistentVolumeClaim, on the control-plane tier's simulated engines.

The claim is bound to a hostPath PersistentVolume made here, so the file the runner writes
can be checked where it lies. A missing claim fails the request before any pod runs. A
read-only or full volume (a read-only bind mount, a tiny tmpfs: root on the local cluster's
machine) fails it with that reason, in the status and in an Event, keeping what it took.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.live_fleet import LiveFleet, create, host_path_claim, results, wait_phase
from e2e.provider import wait_for
from rollfleet.contract import LABEL_REQUEST, LABEL_REQUEST_UID, runner_name

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
