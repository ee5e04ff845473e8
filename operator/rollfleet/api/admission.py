"""The admission policy that keeps a fleet's gateway to the pause annotations. Pure.

The gateway may patch its RolloutFleet (Role: `patch`, resourceNames the fleet) because a
trainer's pause through it is the `rollfleet.dev/pause` annotation. RBAC cannot say "only
that annotation", and a fleet's spec runs in its engines, so this ValidatingAdmissionPolicy
refuses any other change made as a fleet's gateway ServiceAccount. `crdgen` writes it to
`crds/gateway-policy.yaml`; the API server enforces it (Kubernetes 1.30+).
"""

from __future__ import annotations

from typing import Any

from rollfleet.api.fleet import PLURAL
from rollfleet.contract import ANNOTATION_PAUSE, ANNOTATION_RESUME, COMPONENT_GATEWAY, GROUP

POLICY_NAME = "rollfleet-gateway-pause-only"
ADMISSION_API = "admissionregistration.k8s.io/v1"


def gateway_policy() -> list[dict[str, Any]]:
    """The policy and its binding (Deny): every fleet, every namespace."""
    allowed = ", ".join(f"'{a}'" for a in (ANNOTATION_PAUSE, ANNOTATION_RESUME))
    policy = {
        "apiVersion": ADMISSION_API,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [GROUP], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": [PLURAL]}
                ]
            },
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
    }
    binding = {
        "apiVersion": ADMISSION_API,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME},
        "spec": {"policyName": POLICY_NAME, "validationActions": ["Deny"]},
    }
    return [policy, binding]
