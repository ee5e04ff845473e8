"""What a RolloutRequest's runner is made of: a ServiceAccount, a Role, a RoleBinding and a Job.

Pure. The operator applies these (`handlers`); the Job's pod runs `rollfleet request-runner`
(`worker`), which sends the request's samples through its fleet's gateway. Every object is
owned by the request: deleting the request deletes its runner.

The Role grants what one runner needs and no more: its own request (read, watch, status),
its fleet and that fleet's gateway Service (read), the prompt ConfigMaps its spec names
(read), its own result ConfigMaps unless its results go to a claim (mounted: no API access
needed), and Events. Result chunks are read and updated by name (`MAX_RESULT_CHUNKS` of
them); RBAC cannot limit `create` by name, so the runner's account (`runner_account`, a name
only runners have) may create only its own chunks: the admission policy
`rollfleet-runner-results-only` (`rollfleet.api.admission`). The fleet's admin token (for
the gateway's abort) is its Secret, mounted: the operator itself may not read Secrets, so it
cannot grant that either.
"""

from __future__ import annotations

from typing import Any

from rollfleet.api.common import ROLLFLEET_IMAGE_UID
from rollfleet.api.fleet import PLURAL as FLEET_PLURAL
from rollfleet.api.request import PLURAL, RolloutRequestSpec
from rollfleet.contract import (
    APP_NAME,
    COMPONENT_RUNNER,
    GROUP,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_REQUEST,
    LABEL_REQUEST_UID,
    MANAGER,
    MAX_RESULT_CHUNKS,
    gateway_name,
    results_chunk_name,
    runner_account,
    runner_name,
)
from rollfleet.controller.desired import TOKEN_MOUNT, token_volume
from rollfleet.controller.owner import RequestRef
from rollfleet.controller.requests.results_volume import RESULTS_MOUNT

Manifest = dict[str, Any]

# A failed runner pod is replaced this many times (each one adopts what the last one sent).
RUNNER_BACKOFF_LIMIT = 6
# Memory grows with the prompts and the results not yet written (a bounded number).
RUNNER_RESOURCES: Manifest = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}
RUNNER_CONTAINER = "runner"
RESULTS_VOLUME = "results"


def runner_labels(ref: RequestRef) -> dict[str, str]:
    return {
        LABEL_NAME: APP_NAME,
        LABEL_COMPONENT: COMPONENT_RUNNER,
        LABEL_REQUEST: ref.name,
        LABEL_REQUEST_UID: ref.uid,
    }


def _meta(ref: RequestRef) -> Manifest:
    return {
        "name": runner_name(ref.name),
        "namespace": ref.namespace,
        "labels": runner_labels(ref) | {LABEL_MANAGED_BY: MANAGER},
        # controller=True: the request is the one manager; the garbage collector deletes these with it.
        "ownerReferences": [ref.owner_reference()],
    }


def runner_service_account(ref: RequestRef) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(ref) | {"name": runner_account(ref.name)}}


def fleet_read_rules(fleet: str) -> list[Manifest]:
    """Reading the fleet and its gateway Service (`runner.read_fleet`): a runner's, and a spare's of its fleet."""
    return [
        {"apiGroups": [GROUP], "resources": [FLEET_PLURAL], "verbs": ["get"], "resourceNames": [fleet]},
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get"], "resourceNames": [gateway_name(fleet)]},
    ]


def runner_role(ref: RequestRef, spec: RolloutRequestSpec) -> Manifest:
    prompts = sorted({p.name for p in spec.prompts_from or []})
    rules: list[Manifest] = [
        # watch needs list; a list with the field selector metadata.name=<request> is allowed by resourceNames.
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch"], "resourceNames": [ref.name]},
        {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"], "resourceNames": [ref.name]},
        *fleet_read_rules(spec.fleet),
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
    if spec.results.persistent_volume_claim is None:
        # Its result chunks, by name: read back to adopt an earlier run's, updated as the run goes. Made
        # as it goes too: `create` cannot be limited by name, the admission policy limits it.
        chunks = [results_chunk_name(ref.name, ref.uid, i) for i in range(MAX_RESULT_CHUNKS)]
        rules += [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "update"], "resourceNames": chunks},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
        ]
    if prompts:
        rules.append({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": prompts})
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(ref), "rules": rules}


def runner_role_binding(ref: RequestRef, account: str | None = None) -> Manifest:
    """The binding of the request's Role to its runner's account: its own, or a spare runner's it took."""
    name = runner_name(ref.name)
    subject = {"kind": "ServiceAccount", "name": account or runner_account(ref.name), "namespace": ref.namespace}
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(ref),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [subject],
    }


def runner_job(ref: RequestRef, spec: RolloutRequestSpec, image: str, image_pull_policy: str) -> Manifest:
    """The Job whose pod runs the request: restarted pods adopt what earlier ones sent, so a pod
    that fails is simply replaced; the request's own status says how the run goes."""
    claim = spec.results.persistent_volume_claim
    return job_manifest(
        _meta(ref),
        runner_labels(ref),
        runner_account(ref.name),
        ["request-runner", "--namespace", ref.namespace, "--name", ref.name, "--uid", ref.uid],
        spec.fleet,
        claim.claim_name if claim is not None else None,
        image,
        image_pull_policy,
    )


def job_manifest(
    meta: Manifest,
    pod_labels: dict[str, str],
    account: str,
    args: list[str],
    fleet: str,
    claim: str | None,
    image: str,
    image_pull_policy: str,
) -> Manifest:
    """A runner Job (a request's own or a spare): `rollfleet <args>` as `account`, with the fleet's admin token
    and the results claim, if any, mounted."""
    # Optional: a request may name a fleet not made yet; the runner waits for it.
    volumes: list[Manifest] = [token_volume(fleet, optional=True)]
    mounts: list[Manifest] = [dict(TOKEN_MOUNT)]
    if claim is not None:
        volumes.append({"name": RESULTS_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": RESULTS_VOLUME, "mountPath": RESULTS_MOUNT})
    uid = ROLLFLEET_IMAGE_UID
    container: Manifest = {
        "name": RUNNER_CONTAINER,
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "args": args,
        "resources": RUNNER_RESOURCES,
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": RUNNER_BACKOFF_LIMIT,
            # A new pod only once the old one has ended: two runners would both send (and write) samples.
            "podReplacementPolicy": "Failed",
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": account,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": uid,
                        "runAsGroup": uid,
                        "fsGroup": uid,  # the mounted token (mode 0440) is readable to it
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def runner_objects(ref: RequestRef, spec: RolloutRequestSpec, image: str, image_pull_policy: str) -> list[Manifest]:
    """Everything the runner needs, in the order to apply it (the Job last: its pod needs the rest)."""
    return [
        runner_service_account(ref),
        runner_role(ref, spec),
        runner_role_binding(ref),
        runner_job(ref, spec, image, image_pull_policy),
    ]
