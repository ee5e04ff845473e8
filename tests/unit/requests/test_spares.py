"""Spare runners as objects (pure): what a spare is made of and may do, and how a request takes one."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from rollfleet.api.fleet import PLURAL as FLEET_PLURAL
from rollfleet.contract import (
    COMPONENT_SPARE_RUNNER,
    GROUP,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_REQUEST,
    LABEL_REQUEST_UID,
    LABEL_RESULTS_CLAIM,
    RUNNER_ACCOUNT_PREFIX,
    SPARE_RUNNER_PREFIX,
    gateway_name,
    results_claim_label,
)
from rollfleet.controller.owner import FleetRef, RequestRef
from rollfleet.controller.requests import spares
from rollfleet.controller.requests.results_volume import RESULTS_MOUNT

FLEET = FleetRef("tiny", "team-a", "f0000000-0000-0000-0000-000000000000")
REQUEST = RequestRef("grpo-step-8", "team-a", "0a1b2c3d-0000-0000-0000-000000000000")
NAME = SPARE_RUNNER_PREFIX + "0123456789"


def job() -> dict[str, Any]:
    made = spares.spare_job(NAME, FLEET, "results", "rollfleet/rollfleet:9", "IfNotPresent")
    return made | {"metadata": made["metadata"] | {"uid": "j0000000"}}


def test_a_spare_is_a_job_of_its_fleet_waiting_as_its_own_account_with_the_claim_mounted() -> None:
    made = job()
    [owner] = made["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RolloutFleet", "tiny", True)
    labels = made["metadata"]["labels"]
    assert labels[LABEL_COMPONENT] == COMPONENT_SPARE_RUNNER and labels[LABEL_FLEET] == "tiny"
    assert labels[LABEL_RESULTS_CLAIM] == "results" and LABEL_REQUEST_UID not in labels
    pod = made["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["args"] == ["request-runner", "--namespace", "team-a", "--spare", NAME]
    assert pod["serviceAccountName"] == NAME and not NAME.startswith(RUNNER_ACCOUNT_PREFIX)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["results"] and {"name": "results", "mountPath": RESULTS_MOUNT} in container["volumeMounts"]
    assert made["spec"]["ttlSecondsAfterFinished"] == spares.SPARE_TTL_AFTER_FINISHED_S
    assert made["spec"]["activeDeadlineSeconds"] > spares.SPARE_IDLE_S  # a backstop for a pod that never waits


def test_until_taken_a_spare_may_read_watch_and_expire_its_assignment_and_read_its_fleet_and_nothing_else() -> None:
    made = {m["kind"]: m for m in spares.spare_identity(job())}
    assert sorted(made) == ["ConfigMap", "Role", "RoleBinding", "ServiceAccount"]
    for m in made.values():
        [owner] = m["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", NAME, "j0000000")  # deleted with it
        assert m["metadata"]["name"] == NAME
    assert made["Role"]["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "verbs": ["get", "list", "watch", "patch"],
            "resourceNames": [NAME],
        },
        {"apiGroups": [GROUP], "resources": [FLEET_PLURAL], "verbs": ["get"], "resourceNames": ["tiny"]},
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get"], "resourceNames": [gateway_name("tiny")]},
    ]
    assert made["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": "team-a"}]
    assert made["ConfigMap"]["data"] == {spares.KEY_STATE: spares.WAITING}


def test_taking_a_spare_is_a_patch_that_applies_only_while_it_waits_and_names_the_request() -> None:
    [waiting] = [m for m in spares.spare_identity(job()) if m["kind"] == "ConfigMap"]
    assert waiting["data"] == {spares.KEY_STATE: spares.WAITING} and spares.assignment(waiting) is None
    ops = spares.take(REQUEST)
    assert ops[0] == {"op": "test", "path": "/data/state", "value": "waiting"}  # refused whole once not waiting
    taken = jsonpatch.apply_patch(waiting, ops)
    assert spares.assignment(taken) == spares.Assignment("grpo-step-8", REQUEST.uid, "tiny")
    assert taken["metadata"]["labels"][LABEL_REQUEST_UID] == REQUEST.uid  # the request finds its spare again
    with pytest.raises(jsonpatch.JsonPatchTestFailed):  # neither taken twice, nor expired once taken
        jsonpatch.apply_patch(taken, spares.take(RequestRef("other", "team-a", "u-2")))
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(taken, spares.expire())


def test_an_expired_spare_is_not_taken_nor_an_ended_one_tried() -> None:
    [waiting] = [m for m in spares.spare_identity(job()) if m["kind"] == "ConfigMap"]
    expired = jsonpatch.apply_patch(waiting, spares.expire())
    assert expired["data"] == {spares.KEY_STATE: spares.EXPIRED} and spares.assignment(expired) is None
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(expired, spares.take(REQUEST))
    for end in ("Complete", "Failed"):
        assert spares.finished(job() | {"status": {"conditions": [{"type": end, "status": "True"}]}})
    assert not spares.finished(job() | {"status": {"conditions": [{"type": "Suspended", "status": "True"}]}})


def test_a_taken_spare_belongs_to_its_request_and_is_kept_once_it_ends() -> None:
    patch = spares.taken_job_patch(REQUEST)
    [owner] = patch["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("RolloutRequest", REQUEST.uid, True)
    assert patch["metadata"]["labels"] == {LABEL_REQUEST: "grpo-step-8", LABEL_REQUEST_UID: REQUEST.uid}
    # Its request's supervision reads how it ended; it runs as long as the request does.
    assert patch["spec"] == {"ttlSecondsAfterFinished": None, "activeDeadlineSeconds": None}


def test_spares_are_found_by_fleet_and_claim_untaken_and_a_long_claim_name_fits_a_label() -> None:
    assert spares.untaken_selector("tiny", "results").endswith(f",!{LABEL_REQUEST_UID}")
    assert f"{LABEL_FLEET}=tiny" in spares.untaken_selector("tiny", "results")
    assert (
        spares.taken_selector(REQUEST)
        == f"{LABEL_COMPONENT}={COMPONENT_SPARE_RUNNER},{LABEL_REQUEST_UID}={REQUEST.uid}"
    )
    long = "c" * 200
    assert len(results_claim_label(long)) <= 63 and results_claim_label(long) != results_claim_label(long + "d")
    assert results_claim_label("results") == "results"
