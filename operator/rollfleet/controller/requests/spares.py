"""Spare runners: a runner Job started ahead of the next RolloutRequest that names its fleet and results claim.

Pure. A request's own runner pod takes about a second to start and import (docs/requests.md), which a GRPO step's
batch of a few seconds cannot afford at every step. So when a request with its results on a claim ends, the
operator (`handlers`, `spare_pool`) makes sure a spare waits for the next one of that fleet and claim: a Job whose
pod runs `rollfleet request-runner --spare NAME` and waits. The next such request takes it: the operator writes
the request into the spare's assignment ConfigMap (a compare-and-swap, so two requests never take one spare),
binds the request's own Role (`desired.runner_role`) to the spare's account, and makes the request the Job's owner.
The pod then runs that one request and exits; a pod never runs two requests.

Until taken, a spare may read its assignment ConfigMap, and its fleet and the fleet's gateway Service (whose admin
token its pod holds already): it reads those as it learns of its request, beside the wait for the request's Role,
so that the run starts with them. One left idle for `SPARE_IDLE_S` marks
its ConfigMap expired (the same compare-and-swap: it cannot expire once taken) and exits, so that it holds no pod
and no claim (one whose pod never started is ended by its Job's deadline). Its Job is then deleted after
`SPARE_TTL_AFTER_FINISHED_S`, and its ServiceAccount, Role, RoleBinding and ConfigMap (owned by the Job) with it.
Requests with results in ConfigMaps take no spare: the admission policy `rollfleet-runner-results-only` knows a
request's runner by an account named for that request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollfleet.contract import (
    APP_NAME,
    COMPONENT_SPARE_RUNNER,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_REQUEST,
    LABEL_REQUEST_UID,
    LABEL_RESULTS_CLAIM,
    MANAGER,
    results_claim_label,
    selector,
)
from rollfleet.controller.owner import FleetRef, RequestRef
from rollfleet.controller.requests.desired import fleet_read_rules, job_manifest

Manifest = dict[str, Any]

SPARE_IDLE_S = 600.0  # a spare not taken in this long exits (GRPO steps come seconds to minutes apart)
SPARE_TTL_AFTER_FINISHED_S = 30  # an expired spare's Job (and what it owns) is deleted this long after it ends
# A spare whose pod never got to wait (it cannot start: its claim is gone, its image cannot be pulled) cannot
# expire itself: its Job ends it this long after it started. Taking the spare lifts the limit.
SPARE_DEADLINE_S = int(SPARE_IDLE_S) + 120
# The assignment ConfigMap: its state (waiting, then taken or expired) and, once taken, the request.
KEY_STATE, KEY_REQUEST, KEY_UID = "state", "request", "uid"
WAITING, TAKEN, EXPIRED = "waiting", "taken", "expired"


@dataclass(frozen=True)
class Assignment:
    """The request a spare runs."""

    name: str
    uid: str
    fleet: str | None = None  # the spare's (from its labels)


def spare_labels(fleet: str, claim: str) -> dict[str, str]:
    return {
        LABEL_NAME: APP_NAME,
        LABEL_COMPONENT: COMPONENT_SPARE_RUNNER,
        LABEL_FLEET: fleet,
        LABEL_RESULTS_CLAIM: results_claim_label(claim),
    }


def untaken_selector(fleet: str, claim: str) -> str:
    """The spare Jobs of this fleet and claim that no request took yet."""
    return f"{selector(spare_labels(fleet, claim))},!{LABEL_REQUEST_UID}"


def taken_selector(ref: RequestRef) -> str:
    """The assignment ConfigMap of the spare this request took, if it took one."""
    return selector({LABEL_COMPONENT: COMPONENT_SPARE_RUNNER, LABEL_REQUEST_UID: ref.uid})


def spare_job(name: str, fleet: FleetRef, claim: str, image: str, image_pull_policy: str) -> Manifest:
    """The spare's Job, owned by its fleet until a request takes it (made first: the rest is owned by it)."""
    labels = spare_labels(fleet.name, claim)
    meta = {
        "name": name,
        "namespace": fleet.namespace,
        "labels": labels | {LABEL_MANAGED_BY: MANAGER},
        "ownerReferences": [fleet.owner_reference()],
    }
    args = ["request-runner", "--namespace", fleet.namespace, "--spare", name]
    job = job_manifest(meta, labels, name, args, fleet.name, claim, image, image_pull_policy)
    job["spec"] |= {"ttlSecondsAfterFinished": SPARE_TTL_AFTER_FINISHED_S, "activeDeadlineSeconds": SPARE_DEADLINE_S}
    return job


def spare_identity(job: Mapping[str, Any]) -> list[Manifest]:
    """The spare's ServiceAccount, its Role and RoleBinding (its assignment ConfigMap: read, watch, and marked
    expired; its fleet and gateway Service: read), and that ConfigMap, waiting; all named as the Job and owned by
    it."""
    meta = job["metadata"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"], "controller": True}
    common = {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": meta["labels"],
        "ownerReferences": [owner],
    }
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": common},
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": common,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    # list and watch: a watch by name (field selector metadata.name) is allowed by resourceNames.
                    "verbs": ["get", "list", "watch", "patch"],
                    "resourceNames": [meta["name"]],
                },
                *fleet_read_rules(meta["labels"][LABEL_FLEET]),
            ],
        },
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": common,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": meta["name"], "namespace": meta["namespace"]}],
        },
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": common, "data": {KEY_STATE: WAITING}},
    ]


def assignment(config_map: Mapping[str, Any]) -> Assignment | None:
    data = config_map.get("data") or {}
    if data.get(KEY_STATE) == TAKEN:
        return Assignment(
            data[KEY_REQUEST], data[KEY_UID], (config_map["metadata"].get("labels") or {}).get(LABEL_FLEET)
        )
    return None


def finished(job: Mapping[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions)


def _from_waiting(data: dict[str, str]) -> list[Manifest]:
    """A JSON patch of the ConfigMap that applies only while the spare waits: the API server refuses it whole
    (422) once the spare was taken or expired, which makes it a compare-and-swap needing no read first."""
    return [
        {"op": "test", "path": f"/data/{KEY_STATE}", "value": WAITING},
        {"op": "replace", "path": "/data", "value": data},
    ]


def take(ref: RequestRef) -> list[Manifest]:
    """The patch giving the spare this request (labelled, so that the request finds its spare again)."""
    label = LABEL_REQUEST_UID.replace("~", "~0").replace("/", "~1")  # a JSON pointer's escapes
    given = {KEY_STATE: TAKEN, KEY_REQUEST: ref.name, KEY_UID: ref.uid}
    return [*_from_waiting(given), {"op": "add", "path": f"/metadata/labels/{label}", "value": ref.uid}]


def expire() -> list[Manifest]:
    """The patch with which a spare left idle withdraws."""
    return _from_waiting({KEY_STATE: EXPIRED})


def taken_job_patch(ref: RequestRef) -> Manifest:
    """What taking a spare changes on its Job: the request owns it (deleted with it, as a runner of its own is),
    its labels name the request (its supervision finds it by them), it runs as long as the request needs (the
    request's own activeDeadlineSeconds is the runner's to enforce), and it is kept once finished."""
    return {
        "metadata": {
            "labels": {LABEL_REQUEST: ref.name, LABEL_REQUEST_UID: ref.uid},
            "ownerReferences": [ref.owner_reference()],
        },
        "spec": {"ttlSecondsAfterFinished": None, "activeDeadlineSeconds": None},
    }
