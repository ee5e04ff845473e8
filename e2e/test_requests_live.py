"""RolloutRequests run by the deployed operator, on the control-plane tier's simulated engines.

The fleet is the session's `sim_live` (`e2e/live_fleet.py`: operator from manifests/,
2 simulated engine pods, 2 gateway replicas). Requests are created with kubectl, watched with
`kubectl get rr`, aborted with `kubectl annotate`, and read back with `rollfleet
results`. Every stop is checked at the engines: their trackers list what is still in
flight (`GET /rollfleet/v1/requests`), by the sample ids `<rr uid>-<prompt>-<sample>`.
The test that kills the operator and the gateway runs last in this module.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.fleet_helpers import OPERATOR_NS, operator_pods
from e2e.live_fleet import LiveFleet, create, host_path_claim, results, runner_pods, running, status, wait_phase
from e2e.live_fleet import may as may_as
from e2e.provider import wait_for
from rollfleet.api.admission import RUNNER_POLICY_NAME
from rollfleet.contract import (
    ANNOTATION_ABORT,
    COMPONENT_RESULTS,
    LABEL_COMPONENT,
    LABEL_REQUEST,
    LABEL_REQUEST_UID,
    results_chunk_name,
    runner_account,
    weights_record_name,
)
from rollfleet_engine.tiny_model import LONG_GENERATION as LONG

pytestmark = pytest.mark.cluster

# A liveness bound, not a speed goal (the abort latency is a benchmark's): the engines drop the
# samples within about a second; a loaded 2-core host can stretch that to a few.
ABORT_LIVENESS_S = 30.0


@pytest.fixture
def fleet(sim_live: LiveFleet) -> LiveFleet:
    sim_live.ready()
    return sim_live


def test_a_64x4_request_completes_showing_progress_and_keeps_256_results(fleet: LiveFleet) -> None:
    tokens = 24
    name, _ = create(fleet, 64, 4, sampling={"maxTokens": tokens, "ignoreEos": True, "seed": 7})
    seen: list[str] = []

    def progress() -> bool:  # as a person watching `kubectl get rr` sees it
        header, row = fleet.cluster.kubectl("-n", fleet.namespace, "get", "rr", name).stdout.splitlines()[:2]
        cells = dict(zip(header.split(), row.split(), strict=False))
        seen.append(cells.get("PROGRESS", ""))
        return cells.get("PHASE") == "Succeeded"

    wait_for(progress, 600, interval=0.3, what=f"{name} Succeeded")
    assert seen[-1] == "256/256"
    partial = [p for p in seen if p.endswith("/256") and 0 < int(p.split("/")[0]) < 256]
    assert partial, f"no progress shown between 0 and 256: {seen}"

    st = status(fleet, name)
    assert st["counts"] == {"total": 256, "completed": 256, "aborted": 0, "failed": 0, "inFlight": 0}
    assert st["tokens"] == 256 * tokens and st["completionTime"] and st["startTime"]
    rows = results(fleet, name)
    assert len(rows) == 256 and st["results"]["samples"] == 256
    assert sorted((r["prompt"], r["sample"]) for r in rows) == [(p, s) for p in range(64) for s in range(4)]
    for r in rows:
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == tokens and r["error"] is None, r
        assert isinstance(r["text"], str) and r["finished_at"] >= r["started_at"] > 0
    # Samples of a prompt use seed + sample: they differ.
    by_prompt: dict[int, set[tuple[int, ...]]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"], set()).add(tuple(r["token_ids"]))
    assert sum(len(v) for v in by_prompt.values()) > 64 * 3


def test_a_runner_may_touch_only_its_own_result_configmaps(fleet: LiveFleet) -> None:
    """Not the fleet's weight-sync record (it says where engines pull weights from), nor any other: by
    name in its Role, and `create`, which RBAC cannot limit by name, by the admission policy."""
    name, uid = create(fleet, 1, 1, sampling={"maxTokens": 4})
    ns, kubectl = fleet.namespace, fleet.cluster.kubectl
    account = runner_account(name)
    as_runner = f"--as=system:serviceaccount:{ns}:{account}"

    def may(verb: str, resource: str) -> bool:
        return may_as(fleet, account, verb, resource)

    own = results_chunk_name(name, uid, 0)
    wait_for(lambda: may("get", f"configmaps/{own}"), 60, what=f"the Role of {name}'s runner")
    weights = weights_record_name(fleet.fleet.name)
    for verb in ("get", "update", "patch", "delete"):
        assert not may(verb, f"configmaps/{weights}"), f"a runner may {verb} {weights}"
    assert not may("list", "configmaps") and not may("watch", "configmaps") and not may("get", "configmaps/other")
    assert may("update", f"configmaps/{own}")

    def made(cm_name: str, labels: dict[str, str]) -> subprocess.CompletedProcess[str]:
        doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": cm_name, "labels": labels}}
        return kubectl("-n", ns, "create", "--dry-run=server", "-f", "-", as_runner, input=json.dumps(doc), check=False)

    chunk = {LABEL_COMPONENT: COMPONENT_RESULTS, LABEL_REQUEST: name, LABEL_REQUEST_UID: uid}
    assert made(results_chunk_name(name, uid, 5), chunk).returncode == 0
    for cm_name, labels in (
        (weights, chunk),  # the record, labelled as a chunk
        (weights, {}),
        (results_chunk_name("another", uid, 0), chunk | {LABEL_REQUEST: "another"}),  # another request's
    ):
        refused = made(cm_name, labels)
        assert refused.returncode != 0 and RUNNER_POLICY_NAME in refused.stderr, (cm_name, refused)


def test_samples_an_engine_refuses_fail_with_its_message_and_the_request_ends(fleet: LiveFleet) -> None:
    """A token id outside the vocabulary: vLLM refuses it inside a stream it answered 200."""
    prompts = [{"tokenIds": [1, 2, 3]}, {"tokenIds": [1, 10**9]}]
    name, _ = create(fleet, prompts, 2, sampling={"maxTokens": 4, "ignoreEos": True})
    st = wait_phase(fleet, name, "Failed", timeout=120)
    assert st["reason"] == "SamplesFailed" and "vocab" in st["message"].lower(), st

    def event() -> dict[str, Any] | None:
        selector = f"involvedObject.kind=RolloutRequest,involvedObject.name={name}"
        out = fleet.cluster.kubectl("-n", fleet.namespace, "get", "events", "--field-selector", selector, "-o", "json")
        return next((e for e in json.loads(out.stdout)["items"] if e["reason"] == "SamplesFailed"), None)

    seen = wait_for(event, 60, what="an Event saying why the request failed")
    assert seen["type"] == "Warning" and "vocab" in seen["message"].lower(), seen
    assert st["counts"] == {"total": 4, "completed": 2, "aborted": 0, "failed": 2, "inFlight": 0}, st
    rows = {(r["prompt"], r["sample"]): r for r in results(fleet, name)}
    assert len(rows) == 4
    for sample in range(2):
        good, refused = rows[(0, sample)], rows[(1, sample)]
        assert good["error"] is None and len(good["token_ids"]) == 4
        assert refused["error"].startswith("HTTP 400") and "vocab" in refused["error"].lower(), refused


def test_results_keep_the_logprob_of_every_token_whatever_the_prompts_form(fleet: LiveFleet) -> None:
    prompts = [{"text": "logprobs, text"}, {"tokenIds": [5, 6, 7]}, {"messages": [{"role": "user", "content": "hi"}]}]
    name, _ = create(fleet, prompts, 2, sampling={"maxTokens": 8, "ignoreEos": True, "logprobs": 0})
    wait_phase(fleet, name, "Succeeded", timeout=120)
    rows = results(fleet, name)
    assert len(rows) == 6
    for r in rows:
        assert len(r["token_ids"]) == 8 and len(r["logprobs"]) == 8, r
        assert all(lp <= 0.0 for lp in r["logprobs"]), r["logprobs"]
    plain, _ = create(fleet, 1, 1, sampling={"maxTokens": 4, "ignoreEos": True})
    wait_phase(fleet, plain, "Succeeded", timeout=120)
    assert results(fleet, plain)[0]["logprobs"] is None  # not asked, not stored


def test_abort_by_annotation_stops_every_in_flight_sample_on_the_engines(fleet: LiveFleet) -> None:
    tokens = 300
    name, uid = create(fleet, 16, 4, parallelism=16, sampling={"maxTokens": tokens, "ignoreEos": True})
    # Mid-run: a first wave completed, the next one decoding on the engines.
    wait_for(
        lambda: status(fleet, name).get("counts", {}).get("completed", 0) >= 1 and running(fleet, uid),
        300,
        interval=0.2,
        what="completed samples and samples in flight",
    )
    fleet.cluster.kubectl("-n", fleet.namespace, "annotate", "rr", name, f"{ANNOTATION_ABORT}=stop-1")
    wait_for(lambda: not running(fleet, uid), ABORT_LIVENESS_S, interval=0.1, what="engines to drop the samples")

    st = wait_phase(fleet, name, "Aborted", timeout=60)
    assert not running(fleet, uid), "a sample (in transit at the abort) runs on an engine"
    assert st["reason"] == "AbortRequested" and st["abort"]["token"] == "stop-1"
    assert st["abort"]["stopped"] >= 1
    rows = results(fleet, name)
    completed = [r for r in rows if r["finish_reason"] == "length"]
    aborted = [r for r in rows if r["finish_reason"] == "abort"]
    assert len(completed) == st["counts"]["completed"] >= 1 and len(aborted) == st["counts"]["aborted"] >= 1
    assert len(rows) == len(completed) + len(aborted) < 64  # samples never sent are not invented
    assert all(len(r["token_ids"]) == tokens for r in completed)
    for r in aborted:  # partial outputs kept, and the engine says it aborted them
        assert len(r["token_ids"]) < tokens
        assert (fleet.tracked(r["request_id"]) or {}).get("finish_reason") == "abort", r["request_id"]

    # The same value again (removed and put back): nothing more happens.
    fleet.cluster.kubectl("-n", fleet.namespace, "annotate", "rr", name, f"{ANNOTATION_ABORT}-")
    fleet.cluster.kubectl("-n", fleet.namespace, "annotate", "rr", name, f"{ANNOTATION_ABORT}=stop-1")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # observing that nothing changes takes a while by nature
        assert status(fleet, name) == st
        time.sleep(0.5)
    assert len(results(fleet, name)) == len(rows)


def test_a_deadline_shorter_than_the_work_fails_the_request_and_frees_the_engines(fleet: LiveFleet) -> None:
    name, uid = create(fleet, 8, 2, activeDeadlineSeconds=4, sampling={"maxTokens": LONG, "ignoreEos": True})
    wait_for(lambda: running(fleet, uid), 120, interval=0.2, what="samples on the engines")
    st = wait_phase(fleet, name, "Failed", timeout=120)
    assert st["reason"] == "DeadlineExceeded" and "activeDeadlineSeconds=4" in st["message"]
    assert st["abort"]["token"] == "deadline"
    assert not running(fleet, uid), "samples still run on the engines after the deadline"
    rows = results(fleet, name)
    assert rows and all(r["finish_reason"] == "abort" and len(r["token_ids"]) < LONG for r in rows)


def test_deleting_a_running_request_stops_its_samples_on_the_engines_and_its_runner(fleet: LiveFleet) -> None:
    name, uid = create(fleet, 8, 2, sampling={"maxTokens": LONG, "ignoreEos": True})
    wait_for(lambda: running(fleet, uid), 120, interval=0.2, what="samples on the engines")
    assert runner_pods(fleet, uid)
    fleet.cluster.kubectl("-n", fleet.namespace, "delete", "rr", name, "--wait=false")
    wait_for(lambda: not running(fleet, uid), ABORT_LIVENESS_S, interval=0.1, what="engines to drop the samples")
    # Checked at the engines: each sample that ran there ended by an abort, none finished its work.
    for rid in {f"{uid}-{p}-{s}" for p in range(8) for s in range(2)}:
        tracked = fleet.tracked(rid)
        assert tracked is None or tracked.get("finish_reason") == "abort", (rid, tracked)
    wait_for(lambda: not runner_pods(fleet, uid), 120, what="the runner pod gone with its request")


def test_operator_runners_then_gateway_killed_mid_run_still_one_result_per_sample(
    fleet: LiveFleet, tmp_path: Path
) -> None:
    """Runs last in this module: it replaces the operator pod, the requests' runner pods and both
    gateway pods, each while samples are in flight. Two requests run through it together, one keeping
    its results in ConfigMaps, one in a file on a claim (the local cluster's: a directory here)."""
    stores: list[dict[str, Any]] = [{}]
    with contextlib.ExitStack() as stack:
        if fleet.cluster.provider == "local":
            claim = stack.enter_context(host_path_claim(fleet, tmp_path))
            stores.append({"results": {"persistentVolumeClaim": {"claimName": claim}}})
        _kill_everything_mid_run(fleet, stores)


def _kill_everything_mid_run(fleet: LiveFleet, stores: list[dict[str, Any]]) -> None:
    # The runs must outlast three kills and what replaces them (a minute or so here): 8 waves of 16
    # samples (the engines' batches), 8 s each at the simulated engines' pace. The requests share the
    # batches (each its `parallelism`), so that each is mid-run at every kill.
    prompts, samples, tokens = 32 // len(stores), 4, 400
    sampling = {"maxTokens": tokens, "ignoreEos": True}
    made = [create(fleet, prompts, samples, sampling=sampling, parallelism=16 // len(stores), **s) for s in stores]
    kubectl = fleet.cluster.kubectl

    def completed() -> list[int]:
        return [int(status(fleet, name).get("counts", {}).get("completed", 0)) for name, _ in made]

    def each_moved_on(before: list[int]) -> bool:
        return all(now > was for now, was in zip(completed(), before, strict=True))

    def all_running() -> None:
        for name, _ in made:
            assert status(fleet, name)["phase"] == "Running", status(fleet, name)

    wait_for(
        lambda: all(c >= 4 for c in completed()) and all(running(fleet, uid) for _, uid in made),
        300,
        interval=0.2,
        what="the runs under way",
    )
    [op] = operator_pods(fleet.cluster)
    kubectl("-n", OPERATOR_NS, "delete", "pod", op["metadata"]["name"], "--grace-period=0", "--force")
    wait_for(
        lambda: any(
            p["metadata"]["uid"] != op["metadata"]["uid"] and p["status"].get("phase") == "Running"
            for p in operator_pods(fleet.cluster)
        ),
        300,
        what="a new operator pod",
    )
    before_runner_kill = completed()
    wait_for(lambda: each_moved_on(before_runner_kill), 300, what="the runs going on without an operator pod")
    all_running()

    # The runner pods, killed: each Job starts another, which stops what the first may have left running.
    runners = [runner_pods(fleet, uid) for _, uid in made]
    for [runner] in runners:
        kubectl("-n", fleet.namespace, "delete", "pod", runner["metadata"]["name"], "--grace-period=0", "--force")

    def replaced(runner: dict[str, Any], uid: str) -> bool:
        return any(p["metadata"]["uid"] != runner["metadata"]["uid"] for p in runner_pods(fleet, uid))

    for [runner], (_, uid) in zip(runners, made, strict=True):
        wait_for(lambda runner=runner, uid=uid: replaced(runner, uid), 300, what="a new runner pod")
    before_gateway_kill = completed()
    wait_for(lambda: each_moved_on(before_gateway_kill), 300, what="the new runners to carry the runs on")
    all_running()

    kubectl(
        "-n",
        fleet.namespace,
        "delete",
        "pod",
        "-l",
        f"rollfleet.dev/fleet={fleet.fleet.name},app.kubernetes.io/component=gateway",
        "--grace-period=0",
        "--force",
    )
    total = prompts * samples
    for name, uid in made:
        st = wait_phase(fleet, name, "Succeeded", timeout=600)
        assert st["counts"]["completed"] == total and st["counts"]["aborted"] == st["counts"]["failed"] == 0
        rows = results(fleet, name)
        keys = [(r["prompt"], r["sample"]) for r in rows]
        assert len(keys) == total and sorted(keys) == [(p, s) for p in range(prompts) for s in range(samples)]
        assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == tokens for r in rows)
        assert not running(fleet, uid)
