"""Desired objects from a fleet spec: engine pods, gateway, RBAC, names and the template hash."""

from __future__ import annotations

from typing import Any

from rollfleet.api.common import ANNOTATION_PHASE, ANNOTATION_TEMPLATE_HASH, TOKEN_FILE
from rollfleet.api.fleet import RolloutFleetSpec
from rollfleet.controller import desired

REF = desired.FleetRef(name="tiny", namespace="team", uid="uid-1")


def spec(**over: Any) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate({"model": {"servedName": "tiny", "hostPath": "/models/tiny"}, **over})


def test_engine_pod_has_stable_name_owner_labels_and_gpu_request() -> None:
    pod = desired.engine_pod(REF, spec(engine={"gpusPerEngine": 2, "tensorParallelSize": 2}), 3)
    meta = pod["metadata"]
    assert meta["name"] == "tiny-engine-3"
    assert meta["labels"] == {
        "app.kubernetes.io/name": "rollfleet", "app.kubernetes.io/component": "engine",
        "rollfleet.dev/fleet": "tiny", "app.kubernetes.io/managed-by": "rollfleet-operator",
        "rollfleet.dev/engine-index": "3",
    }
    assert meta["annotations"][ANNOTATION_PHASE] == "Starting"
    assert meta["ownerReferences"] == [{"apiVersion": "rollfleet.dev/v1alpha1", "kind": "RolloutFleet",
                                        "name": "tiny", "uid": "uid-1", "controller": True,
                                        "blockOwnerDeletion": True}]
    c = pod["spec"]["containers"][0]
    assert c["name"] == "engine" and "command" not in c
    assert c["resources"] == {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert any(v["name"] == "dshm" for v in pod["spec"]["volumes"])  # tensor parallel needs shared memory


def test_engine_args_follow_the_engine_cli_contract() -> None:
    s = spec(engine={"maxModelLen": 512, "args": ["--enforce-eager"]},
             weightSync={"initialVersion": "step-0"})
    args = desired.engine_pod(REF, s, 0)["spec"]["containers"][0]["args"]
    assert args[:12] == ["serve", "--model", "/models", "--served-model-name", "tiny", "--host", "$(POD_IP)",
                         "--port", "8000", "--token-file", TOKEN_FILE, "--weight-backend"]
    assert args[args.index("--weight-version") + 1] == "step-0"
    assert args[args.index("--") + 1:] == ["--max-model-len", "512", "--enforce-eager"]


def test_model_sources_mount_or_point_into_the_image() -> None:
    host = desired.engine_pod(REF, spec(), 0)["spec"]
    assert {"name": "model", "hostPath": {"path": "/models/tiny", "type": "Directory"}} in host["volumes"]
    pvc_spec = RolloutFleetSpec.model_validate(
        {"model": {"servedName": "m", "pvc": {"claimName": "weights", "subPath": "llama"}}})
    pvc = desired.engine_pod(REF, pvc_spec, 0)["spec"]
    mount = next(m for m in pvc["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount["subPath"] == "llama" and mount["readOnly"] is True
    image_spec = RolloutFleetSpec.model_validate({"model": {"servedName": "m", "imagePath": "/opt/m"}})
    image = desired.engine_pod(REF, image_spec, 0)["spec"]
    assert not any(v["name"] == "model" for v in image["volumes"])
    assert image["containers"][0]["args"][2] == "/opt/m"


def test_cpu_engines_request_no_gpu_and_keep_placement() -> None:
    s = spec(engine={"gpusPerEngine": 0, "command": ["python3", "-c", "pass"],
                     "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
             placement={"nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "x", "operator": "Exists"}],
                        "priorityClassName": "rollouts"})
    pod = desired.engine_pod(REF, s, 0)["spec"]
    c = pod["containers"][0]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
    assert c["command"] == ["python3", "-c", "pass"]
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["priorityClassName"] == "rollouts"
    assert not any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
    assert {"key": "x", "operator": "Exists"} in pod["tolerations"]


def test_template_hash_changes_with_the_pod_but_not_with_scale_or_gateway() -> None:
    base = desired.template_hash(spec())
    assert desired.template_hash(spec(replicas=7, drainTimeoutSeconds=5, gateway={"replicas": 3})) == base
    assert desired.template_hash(spec(engine={"args": ["--enforce-eager"]})) != base
    pod = desired.engine_pod(REF, spec(), 0)
    assert pod["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH] == base


def test_engine_index_round_trips_and_rejects_other_names() -> None:
    assert desired.engine_index(desired.engine_pod_name("tiny", 12), "tiny") == 12
    for other in ("tiny-engine-", "tiny-engine-01", "tiny-engine-x", "tinier-engine-1", "tiny-gateway-1"):
        assert desired.engine_index(other, "tiny") is None


def test_gateway_follows_the_contract_and_has_least_privilege() -> None:
    objects = {o["kind"]: o for o in desired.owned_objects(REF, spec())}
    assert set(objects) == {"ServiceAccount", "Role", "RoleBinding", "Service", "Deployment"}
    dep = objects["Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["metadata"]["name"] == "tiny-gateway"
    assert c["args"][:7] == ["gateway", "--fleet", "tiny", "--namespace", "team", "--port", "8080"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert objects["Service"]["spec"]["ports"][0]["port"] == 8080
    rules = objects["Role"]["rules"]
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in rules)
    assert desired.gateway_endpoint(REF) == "http://tiny-gateway.team.svc:8080"
    no_gw = desired.owned_objects(REF, spec(gateway={"enabled": False}))
    assert [o["kind"] for o in no_gw] == ["ServiceAccount"]  # the engines' own, with no token mounted
    assert no_gw[0]["automountServiceAccountToken"] is False


def test_admin_secret_holds_the_token() -> None:
    secret = desired.admin_secret(REF, "s3cret")
    assert secret["metadata"]["name"] == "tiny-admin-token"
    assert secret["data"] == {"token": "czNjcmV0"}
