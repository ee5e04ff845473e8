"""The runner of a RolloutRequest as objects (pure): its Job, identity and least RBAC, and what the
operator says of a runner that cannot start or failed for good."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from rollfleet.api.request import ResultsSpec, RolloutRequestSpec, RolloutRequestStatus
from rollfleet.contract import (
    LABEL_REQUEST_UID,
    MAX_RESULT_CHUNKS,
    TOKEN_MOUNT_DIR,
    runner_account,
    runner_name,
    secret_name,
)
from rollfleet.controller.owner import RequestRef
from rollfleet.controller.requests.desired import runner_objects
from rollfleet.controller.requests.results_volume import RESULTS_MOUNT
from rollfleet.controller.requests.status import Verdict, runner_pods_matter, runner_verdict, status_with_verdict

# Kubernetes' rule for object names such as a ServiceAccount's (RFC 1123 subdomain).
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
REF = RequestRef("grpo-step-7", "team-a", "0a1b2c3d-0000-0000-0000-000000000000")
SPEC = RolloutRequestSpec.model_validate(
    {"fleet": "f", "promptsFrom": [{"name": "math"}, {"name": "code", "key": "p.jsonl"}]}
)


def objects() -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in runner_objects(REF, SPEC, "rollfleet/rollfleet:9", "IfNotPresent")}


def test_every_runner_object_is_owned_by_its_request_and_the_job_comes_last() -> None:
    made = runner_objects(REF, SPEC, "img", "IfNotPresent")
    assert [m["kind"] for m in made] == ["ServiceAccount", "Role", "RoleBinding", "Job"]
    for m in made:
        [owner] = m["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "RolloutRequest",
            REF.name,
            REF.uid,
            True,
        )
        # The account is named for the admission policy to know it; the rest after the Job.
        name = "rollfleet-runner-grpo-step-7" if m["kind"] == "ServiceAccount" else "grpo-step-7-runner"
        assert m["metadata"]["name"] == name and m["metadata"]["namespace"] == "team-a"


def test_the_job_runs_this_request_by_uid_as_its_own_account_with_the_fleet_token_mounted() -> None:
    job = objects()["Job"]
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "rollfleet/rollfleet:9"
    assert container["args"] == ["request-runner", "--namespace", "team-a", "--name", REF.name, "--uid", REF.uid]
    assert pod["serviceAccountName"] == "rollfleet-runner-grpo-step-7" and pod["restartPolicy"] == "Never"
    assert job["spec"]["template"]["metadata"]["labels"][LABEL_REQUEST_UID] == REF.uid
    [volume] = pod["volumes"]
    assert volume["secret"] == {"secretName": secret_name("f"), "defaultMode": 0o440, "optional": True}
    assert container["volumeMounts"][0]["mountPath"] == TOKEN_MOUNT_DIR
    assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]


def test_the_runner_role_names_its_request_fleet_gateway_and_prompts_and_reads_no_secret() -> None:
    rules = objects()["Role"]["rules"]
    named = {(r["resources"][0], tuple(r["verbs"])): r.get("resourceNames") for r in rules}
    assert named[("rolloutrequests", ("get", "list", "watch"))] == [REF.name]
    assert named[("rolloutrequests/status", ("patch",))] == [REF.name]
    assert named[("rolloutfleets", ("get",))] == ["f"]
    assert named[("services", ("get",))] == ["f-gateway"]
    assert named[("configmaps", ("get",))] == ["code", "math"]
    # Its own result chunks by name (no list: it reads no other ConfigMap); create, which RBAC cannot
    # limit by name, is left to the admission policy.
    chunks = named[("configmaps", ("get", "update"))]
    assert chunks is not None and len(chunks) == MAX_RESULT_CHUNKS
    assert chunks[0] == "grpo-step-7-0a1b2c3d-0000"
    assert chunks[-1] == f"grpo-step-7-0a1b2c3d-{MAX_RESULT_CHUNKS - 1:04d}"
    assert named[("configmaps", ("create",))] is None
    assert not any("list" in r["verbs"] for r in rules if r["resources"] == ["configmaps"])
    assert not any("secrets" in r["resources"] for r in rules)
    assert not any(set(r["verbs"]) & {"delete", "*", "escalate", "bind"} for r in rules)
    binding = objects()["RoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rollfleet-runner-grpo-step-7", "namespace": "team-a"}
    ]


def job(failed: bool = False) -> dict[str, Any]:
    conditions = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "6 failures"}]
    return {"metadata": {"name": "r-runner"}, "status": {"conditions": conditions if failed else []}}


def pod(name: str, created: str, phase: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created}, "status": {"phase": phase, **status}}


def test_a_runner_that_cannot_start_is_reported_until_it_speaks_for_itself() -> None:
    pulling = pod(
        "r-runner-x",
        "2026-01-01T00:00:02Z",
        "Pending",
        containerStatuses=[{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}],
    )
    verdict = runner_verdict(job(), [pulling], phase=None)
    assert verdict is not None and (verdict.phase, verdict.reason) == ("Pending", "RunnerNotStarted")
    assert "r-runner-x cannot start: ImagePullBackOff: no such image" in verdict.message
    # Once the runner writes status, it speaks for itself; a pod merely starting is no news.
    assert runner_verdict(job(), [pulling], phase="Running") is None
    assert runner_verdict(job(), [pod("r-runner-y", "2026-01-01T00:00:03Z", "Pending")], phase=None) is None
    assert runner_verdict(None, [pulling], phase=None) is None


def test_a_failed_job_fails_the_request_naming_its_last_pods_end() -> None:
    first = pod("r-runner-a", "2026-01-01T00:00:01Z", "Failed")
    last = pod(
        "r-runner-b",
        "2026-01-01T00:00:09Z",
        "Failed",
        containerStatuses=[{"state": {"terminated": {"exitCode": 1, "reason": "Error", "message": "boom\nKeyError"}}}],
    )
    verdict = runner_verdict(job(failed=True), [last, first], phase="Running")
    assert verdict is not None and (verdict.phase, verdict.reason) == ("Failed", "RunnerFailed")
    assert "BackoffLimitExceeded: 6 failures" in verdict.message
    assert "runner exited with code 1 (Error): boom | KeyError" in verdict.message
    assert "kubectl logs job/r-runner" in verdict.message


def test_the_runners_pods_are_read_only_while_they_can_change_the_verdict() -> None:
    cases = [  # (job, request phase, whether the operator lists the runner's pods)
        (job(), None, True),
        (job(), "Pending", True),
        (job(failed=True), "Running", True),
        (job(), "Running", False),
        (job(), "Paused", False),
        (None, None, False),
    ]
    pulling = pod(
        "r-runner-x",
        "2026-01-01T00:00:02Z",
        "Pending",
        containerStatuses=[{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}],
    )
    for j, phase, matter in cases:
        assert runner_pods_matter(j, phase) is matter, (j, phase)
        if not matter:  # the verdict made without them is the one they would have given
            assert runner_verdict(j, [], phase) == runner_verdict(j, [pulling], phase)


def test_the_operators_verdict_keeps_what_the_runner_recorded() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    before = RolloutRequestStatus.model_validate(
        {
            "phase": "Running",
            "progress": "5/8",
            "counts": {"total": 8, "completed": 5, "inFlight": 3},
            "tokens": 640,
            "results": {"configMaps": ["r-0a1b2c3d-0000"], "samples": 5},
        }
    )
    failed = status_with_verdict(before, Verdict("Failed", "RunnerFailed", "gone"), 1, now, total=99)
    assert (failed["phase"], failed["reason"], failed["progress"], failed["tokens"]) == (
        "Failed",
        "RunnerFailed",
        "5/8",
        640,
    )
    assert failed["counts"] == {"total": 8, "completed": 5, "aborted": 0, "failed": 0, "inFlight": 0}
    assert failed["results"]["configMaps"] == ["r-0a1b2c3d-0000"] and failed["completionTime"]
    assert {c["type"]: c["status"] for c in failed["conditions"]} == {
        "Running": "False",
        "Paused": "False",
        "Failed": "True",
    }
    # A verdict on a request the runner never wrote: a Pending status from nothing.
    pending = status_with_verdict(None, Verdict("Pending", "RunnerNotStarted", "no image"), 1, now, total=8)
    assert (pending["phase"], pending["reason"], pending["progress"]) == ("Pending", "RunnerNotStarted", "0/8")
    assert pending["counts"]["total"] == 8 and "completionTime" not in pending


def test_runner_names_fit_a_job_whatever_the_request_name() -> None:
    assert runner_name("step-7") == "step-7-runner"
    long_a, long_b = "a" * 200 + "x", "a" * 200 + "y"
    assert len(runner_name(long_a)) <= 57 and runner_name(long_a) != runner_name(long_b)
    assert runner_name(long_a).startswith("aaaa") and runner_name(long_a).endswith("-runner")
    dotted = "a" * 39 + "." + "b" * 30
    assert ".-" not in runner_name(dotted)
    # The account: the request's whole name after the prefix the admission policy knows, up to 253.
    assert runner_account("step-7") == "rollfleet-runner-step-7"
    longest = "a" * 252 + "x"
    assert len(runner_account(longest)) == 253 and runner_account(longest) != runner_account("a" * 252 + "y")
    assert runner_account(longest).startswith("rollfleet-runner-" + "a" * 228)
    # Whatever character the kept start ends with, the account is a valid name (a DNS subdomain).
    for last in "a-.":
        name = "b" * 227 + last + "c" * 25
        assert DNS_SUBDOMAIN.fullmatch(runner_account(name)), runner_account(name)


def test_a_runner_with_a_results_claim_mounts_it_and_is_never_two_pods_at_once() -> None:
    spec = SPEC.model_copy(
        update={"results": ResultsSpec.model_validate({"persistentVolumeClaim": {"claimName": "data"}})}
    )
    job = {m["kind"]: m for m in runner_objects(REF, spec, "img", "IfNotPresent")}["Job"]
    pod = job["spec"]["template"]["spec"]
    assert pod["volumes"][1] == {"name": "results", "persistentVolumeClaim": {"claimName": "data"}}
    assert pod["containers"][0]["volumeMounts"][1] == {"name": "results", "mountPath": RESULTS_MOUNT}
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    assert len(objects()["Job"]["spec"]["template"]["spec"]["volumes"]) == 1  # no claim: ConfigMaps
    role = {m["kind"]: m for m in runner_objects(REF, spec, "img", "IfNotPresent")}["Role"]
    writes = [r for r in role["rules"] if r["resources"] == ["configmaps"] and "create" in r["verbs"]]
    assert writes == []  # results on the claim: no ConfigMap to write
