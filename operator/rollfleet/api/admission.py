"""The admission policies that finish what RBAC cannot say. Pure.

- `rollfleet-gateway-pause-only`: the gateway may patch its RolloutFleet (Role: `patch`,
  resourceNames the fleet) because a trainer's pause through it is the `rollfleet.dev/pause`
  annotation. RBAC cannot say "only that annotation", and a fleet's spec runs in its engines,
  so the policy refuses any other change made as a fleet's gateway ServiceAccount.
- `rollfleet-runner-results-only`: a request's runner creates its result ConfigMaps as the run
  goes, and RBAC cannot limit `create` by name, so the policy refuses any ConfigMap a runner's
  account makes but its own request's result chunks (a runner could otherwise make the
  `<fleet>-weights` record, which says where engines pull weights from).

`crdgen` writes them to `crds/`; the API server enforces them (Kubernetes 1.30+).
"""

from __future__ import annotations

from typing import Any

from rollfleet.api.fleet import PLURAL
from rollfleet.contract import (
    ANNOTATION_PAUSE,
    ANNOTATION_RESUME,
    COMPONENT_GATEWAY,
    COMPONENT_RESULTS,
    GROUP,
    LABEL_COMPONENT,
    LABEL_REQUEST,
    LABEL_REQUEST_UID,
    RUNNER_ACCOUNT_KEEP,
    RUNNER_ACCOUNT_PREFIX,
)

POLICY_NAME = "rollfleet-gateway-pause-only"
RUNNER_POLICY_NAME = "rollfleet-runner-results-only"
ADMISSION_API = "admissionregistration.k8s.io/v1"


def gateway_policy() -> list[dict[str, Any]]:
    """The policy and its binding (Deny): every fleet, every namespace."""
    allowed = ", ".join(f"'{a}'" for a in (ANNOTATION_PAUSE, ANNOTATION_RESUME))
    return _policy(
        POLICY_NAME,
        {"apiGroups": [GROUP], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": [PLURAL]},
        {
            # Only requests made as this fleet's gateway (`<fleet>-gateway` in its namespace).
            "matchConditions": [
                {
                    "name": "made-by-the-fleets-gateway",
                    "expression": "request.userInfo.username == 'system:serviceaccount:' + object.metadata.namespace"
                    f" + ':' + object.metadata.name + '-{COMPONENT_GATEWAY}'",
                }
            ],
            "variables": [
                {"name": "allowed", "expression": f"[{allowed}]"},
                {"name": "new", "expression": "object.metadata.?annotations.orValue({})"},
                {"name": "old", "expression": "oldObject.metadata.?annotations.orValue({})"},
            ],
            "validations": [
                {
                    "expression": "object.spec == oldObject.spec",
                    "message": "a fleet's gateway may not change its spec",
                    "reason": "Forbidden",
                },
                {
                    "expression": "variables.new.all(k, k in variables.allowed || "
                    "(k in variables.old && variables.old[k] == variables.new[k])) && "
                    "variables.old.all(k, k in variables.allowed || k in variables.new)",
                    "message": f"a fleet's gateway may change only the annotations {allowed}",
                    "reason": "Forbidden",
                },
                {
                    "expression": "object.metadata.?labels.orValue({}) == oldObject.metadata.?labels.orValue({}) && "
                    "object.metadata.?finalizers.orValue([]) == oldObject.metadata.?finalizers.orValue([]) && "
                    "object.metadata.?ownerReferences.orValue([]) == oldObject.metadata.?ownerReferences.orValue([])",
                    "message": "a fleet's gateway may not change labels, finalizers or owners",
                    "reason": "Forbidden",
                },
            ],
        },
    )


def runner_policy() -> list[dict[str, Any]]:
    """The policy and its binding (Deny): a runner's account creates only its own request's result chunks."""
    account = f"'system:serviceaccount:' + request.namespace + ':{RUNNER_ACCOUNT_PREFIX}'"
    # contract.runner_account: the request's name, or for a very long one its start and a digest.
    keep = RUNNER_ACCOUNT_KEEP
    return _policy(
        RUNNER_POLICY_NAME,
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["configmaps"]},
        {
            # Only requests made as a runner: no other account's name has the prefix (docs/security.md).
            "matchConditions": [
                {"name": "made-by-a-request-runner", "expression": f"request.userInfo.username.startsWith({account})"}
            ],
            "variables": [
                {"name": "labels", "expression": "object.metadata.?labels.orValue({})"},
                {"name": "request", "expression": f"variables.labels[?'{LABEL_REQUEST}'].orValue('')"},
                {"name": "uid", "expression": f"variables.labels[?'{LABEL_REQUEST_UID}'].orValue('')"},
            ],
            "validations": [
                {
                    "expression": f"variables.request != '' && (request.userInfo.username == {account} + "
                    f"variables.request || (size(variables.request) > {keep} && request.userInfo.username."
                    f"startsWith({account} + variables.request.substring(0, {keep}))))",
                    "message": "a request's runner may create only ConfigMaps of its own request "
                    f"(label {LABEL_REQUEST})",
                    "reason": "Forbidden",
                },
                {
                    "expression": f"variables.labels[?'{LABEL_COMPONENT}'].orValue('') == '{COMPONENT_RESULTS}' && "
                    "size(variables.uid) >= 8 && object.metadata.name.startsWith(variables.request + '-' + "
                    "variables.uid.substring(0, 8) + '-') && object.metadata.name.matches('-[0-9]{4}$')",
                    "message": "a request's runner may create only its result chunks: <request>-<uid[:8]>-<index>, "
                    f"labelled {LABEL_COMPONENT}={COMPONENT_RESULTS}",
                    "reason": "Forbidden",
                },
            ],
        },
    )


def _policy(name: str, rule: dict[str, Any], checks: dict[str, Any]) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy on `rule`'s requests (failing closed) with `checks` (its matchConditions,
    variables and validations), and its binding (Deny)."""
    policy = {
        "apiVersion": ADMISSION_API,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [rule]}, **checks},
    }
    binding = {
        "apiVersion": ADMISSION_API,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    return [policy, binding]
