"""Desired objects from a fleet spec: engine pods, gateway, RBAC, NetworkPolicy, names and the template hash."""

from __future__ import annotations

from typing import Any

import pytest

from rollfleet import contract
from rollfleet.api.fleet import RolloutFleetSpec
from rollfleet.contract import ANNOTATION_PHASE, ANNOTATION_TEMPLATE_HASH, ANNOTATION_WEIGHT_GENERATION, TOKEN_FILE
from rollfleet.controller import desired
from rollfleet.controller.owner import FleetRef

REF = FleetRef(name="tiny", namespace="team", uid="uid-1")


def spec(**over: Any) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate({"model": {"servedName": "tiny", "hostPath": "/models/tiny"}, **over})


def test_engine_pod_has_stable_name_owner_labels_and_gpu_request() -> None:
    pod = desired.engine_pod(REF, spec(engine={"gpusPerEngine": 2, "tensorParallelSize": 2}), 3)
    meta = pod["metadata"]
    assert meta["name"] == "tiny-engine-3"
    assert meta["labels"] == {
        "app.kubernetes.io/name": "rollfleet",
        "app.kubernetes.io/component": "engine",
        "rollfleet.dev/fleet": "tiny",
        "app.kubernetes.io/managed-by": "rollfleet-operator",
        "rollfleet.dev/engine-index": "3",
    }
    assert meta["annotations"][ANNOTATION_PHASE] == "Starting"
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "rollfleet.dev/v1alpha1",
            "kind": "RolloutFleet",
            "name": "tiny",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    c = pod["spec"]["containers"][0]
    assert c["name"] == "engine" and "command" not in c
    assert c["resources"] == {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert pod["spec"]["restartPolicy"] == "Never"
    # vLLM's core and workers need more shared memory than a container's 64 MiB, at any TP size.
    for tp in (1, 2):
        one = desired.engine_pod(REF, spec(engine={"tensorParallelSize": tp, "gpusPerEngine": tp}), 0)
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in one["spec"]["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in one["spec"]["containers"][0]["volumeMounts"]


def test_an_engine_born_ready_carries_its_phase_and_weight_generation_and_a_group_never_does() -> None:
    born = desired.engine_object(REF, spec(), 0, ready=True)["metadata"]["annotations"]
    assert (born[ANNOTATION_PHASE], born[ANNOTATION_WEIGHT_GENERATION]) == ("Ready", "0")
    starting = desired.engine_object(REF, spec(), 0, ready=False)["metadata"]["annotations"]
    assert starting[ANNOTATION_PHASE] == "Starting" and ANNOTATION_WEIGHT_GENERATION not in starting
    # LWS makes a group's pods again from its template, maybe after pushes: its leader is always born Starting.
    group = desired.engine_object(REF, spec(engine={"podsPerEngine": 2}), 0, ready=True)
    leader = group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["annotations"]
    assert leader[ANNOTATION_PHASE] == "Starting" and ANNOTATION_WEIGHT_GENERATION not in leader


def test_engine_args_follow_the_engine_cli_contract() -> None:
    s = spec(engine={"maxModelLen": 512, "args": ["--enforce-eager"]}, weightSync={"initialVersion": "step-0"})
    args = desired.engine_pod(REF, s, 0)["spec"]["containers"][0]["args"]
    # No --host: the engine binds every address of its pod.
    assert args[:10] == [
        "serve",
        "--model",
        "/models",
        "--served-model-name",
        "tiny",
        "--port",
        "8000",
        "--token-file",
        TOKEN_FILE,
        "--weight-backend",
    ]
    assert args[args.index("--weight-version") + 1] == "step-0"
    assert args[args.index("--") + 1 :] == ["--max-model-len", "512", "--enforce-eager"]


def test_an_engines_parallelism_becomes_vllms_own_flags() -> None:
    shape = {"tensorParallelSize": 2, "pipelineParallelSize": 2, "dataParallelSize": 2, "enableExpertParallel": True}
    args = desired.engine_args(spec(engine={**shape, "gpusPerEngine": 8}))
    assert args[args.index("--") + 1 :] == [
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
    ]
    assert "--" not in desired.engine_args(spec())  # sizes of 1 are vLLM's defaults: not passed


def test_model_sources_mount_or_point_into_the_image() -> None:
    host = desired.engine_pod(REF, spec(), 0)["spec"]
    assert {"name": "model", "hostPath": {"path": "/models/tiny", "type": "Directory"}} in host["volumes"]
    pvc_spec = RolloutFleetSpec.model_validate(
        {"model": {"servedName": "m", "pvc": {"claimName": "weights", "subPath": "llama"}}}
    )
    pvc = desired.engine_pod(REF, pvc_spec, 0)["spec"]
    mount = next(m for m in pvc["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount["subPath"] == "llama" and mount["readOnly"] is True
    image_spec = RolloutFleetSpec.model_validate({"model": {"servedName": "m", "imagePath": "/opt/m"}})
    image = desired.engine_pod(REF, image_spec, 0)["spec"]
    assert not any(v["name"] == "model" for v in image["volumes"])
    assert image["containers"][0]["args"][2] == "/opt/m"


def test_cpu_engines_request_no_gpu_and_keep_placement() -> None:
    s = spec(
        engine={
            "gpusPerEngine": 0,
            "command": ["python3", "-c", "pass"],
            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        },
        placement={
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "x", "operator": "Exists"}],
            "priorityClassName": "rollouts",
        },
    )
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
    # Opening generation drops an engine argument (and its token's mount): the engines are replaced.
    assert desired.template_hash(spec(auth={"inference": "Open"})) != base
    pod = desired.engine_pod(REF, spec(), 0)
    assert pod["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH] == base


def test_engine_index_round_trips_and_rejects_other_names() -> None:
    assert contract.engine_index(contract.engine_pod_name("tiny", 12), "tiny") == 12
    for other in ("tiny-engine-", "tiny-engine-01", "tiny-engine-x", "tinier-engine-1", "tiny-gateway-1"):
        assert contract.engine_index(other, "tiny") is None


def owned(fleet: RolloutFleetSpec) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in desired.owned_objects(REF, fleet, "rollfleet-system")}


def test_gateway_follows_the_contract_and_has_least_privilege() -> None:
    objects = {kind: o for (kind, name), o in owned(spec()).items() if name == "tiny-gateway"}
    assert set(objects) == {"ServiceAccount", "Role", "RoleBinding", "Service", "Deployment"}
    dep = objects["Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["metadata"]["name"] == "tiny-gateway"
    assert c["args"][:7] == ["gateway", "--fleet", "tiny", "--namespace", "team", "--port", "8080"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert objects["Service"]["spec"]["ports"][0]["port"] == 8080
    rules = objects["Role"]["rules"]
    writes = [r for r in rules if not set(r["verbs"]) <= {"get", "list", "watch"}]
    # It writes one thing: its own fleet (the pause annotation; the admission policy refuses the rest).
    assert writes == [
        {
            "apiGroups": [contract.GROUP],
            "resources": ["rolloutfleets"],
            "verbs": ["get", "patch"],
            "resourceNames": ["tiny"],
        }
    ]
    assert all(r.get("resourceNames") for r in rules if r["resources"] != ["pods"])
    assert contract.gateway_endpoint(REF.name, REF.namespace) == "http://tiny-gateway.team.svc:8080"
    no_gw = owned(spec(gateway={"enabled": False}))
    assert not [name for _, name in no_gw if name == "tiny-gateway"]
    assert no_gw["ServiceAccount", "tiny-engine"]["automountServiceAccountToken"] is False  # no API token mounted


def test_trainers_may_write_the_weights_record_and_nothing_that_runs_in_engines() -> None:
    objects = owned(spec(weightSync={"trainerServiceAccounts": ["verl-actor", "tiny-trainer"]}))
    record = objects["ConfigMap", "tiny-weights"]
    assert "data" not in record  # the operator applies only its metadata: the data is the record's writers'
    assert record["metadata"]["ownerReferences"][0]["uid"] == REF.uid
    rules = objects["Role", "tiny-trainer"]["rules"]
    writes = [r for r in rules if set(r["verbs"]) - {"get", "list", "watch"}]
    assert writes == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "patch"], "resourceNames": ["tiny-weights"]}
    ]
    assert not [r for r in rules if {"secrets", "rolloutfleets/status"} & set(r["resources"])]
    fleet_rule = next(r for r in rules if r["resources"] == ["rolloutfleets"])
    assert fleet_rule["verbs"] == ["get"] and fleet_rule["resourceNames"] == ["tiny"]
    subjects = objects["RoleBinding", "tiny-trainer"]["subjects"]
    assert [s["name"] for s in subjects] == ["tiny-trainer", "verl-actor"]  # no repeats
    assert {s["namespace"] for s in subjects} == {"team"}
    # Who may push is not part of an engine: changing it restarts none.
    assert desired.template_hash(spec(weightSync={"trainerServiceAccounts": ["x"]})) == desired.template_hash(spec())
    no_sync = owned(spec(weightSync={"backend": "none"}))
    assert not [name for _, name in no_sync if name in ("tiny-trainer", "tiny-weights")]


ENGINES = {
    "app.kubernetes.io/name": "rollfleet",
    "app.kubernetes.io/component": "engine",
    "rollfleet.dev/fleet": "tiny",
}
GATEWAY = {
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/name": "rollfleet",
            "app.kubernetes.io/component": "gateway",
            "rollfleet.dev/fleet": "tiny",
        }
    }
}
TRAINERS = {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "trainer", "rollfleet.dev/fleet": "tiny"}}}
OPERATOR = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rollfleet-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rollfleet", "app.kubernetes.io/component": "operator"}},
}


def test_network_policy_admits_only_gateway_trainers_and_operator_to_the_engine_port() -> None:
    policy = desired.engine_network_policy(REF, spec(), "rollfleet-system")
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["name"] == "tiny-engine" and policy["metadata"]["namespace"] == "team"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # The engine pods exactly (what the engine pod template carries and the scale selector says) ...
    assert policy["spec"]["podSelector"] == {"matchLabels": ENGINES}
    pod_labels = desired.engine_pod(REF, spec(), 0)["metadata"]["labels"]
    assert ENGINES.items() <= pod_labels.items()
    # ... ingress only (egress stays open: engines pull weights from the trainer pod) ...
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # ... and one rule: the engine port, from the fleet's gateway, trainers and engines (a push's relay
    # chain) and the operator's pods.
    assert policy["spec"]["ingress"] == [
        {
            "from": [GATEWAY, TRAINERS, {"podSelector": {"matchLabels": ENGINES}}, OPERATOR],
            "ports": [{"protocol": "TCP", "port": contract.ENGINE_PORT}],
        }
    ]
    gateway_pods = desired.gateway_deployment(REF, spec())["spec"]["template"]["metadata"]["labels"]
    assert GATEWAY["podSelector"]["matchLabels"].items() <= gateway_pods.items()


def test_network_policy_without_a_known_operator_namespace_names_no_operator_pod() -> None:
    sources = desired.engine_network_policy(REF, spec(), None)["spec"]["ingress"][0]["from"]
    assert sources == [GATEWAY, TRAINERS, {"podSelector": {"matchLabels": ENGINES}}]


def test_network_policy_admits_extra_peers_on_the_engine_port() -> None:
    extra = [
        {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}},
        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
        {"podSelector": {"matchExpressions": [{"key": "role", "operator": "In", "values": ["bench"]}]}},
    ]
    policy = desired.engine_network_policy(REF, spec(networkPolicy={"extraIngressFrom": extra}), "ops")
    rule = policy["spec"]["ingress"][0]
    assert rule["from"][4:] == extra
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_collective_fleets_also_admit_trainers_and_engines_on_every_port(backend: str) -> None:
    policy = desired.engine_network_policy(REF, spec(weightSync={"backend": backend}), "rollfleet-system")
    engines = {"podSelector": {"matchLabels": ENGINES}}
    assert policy["spec"]["ingress"][1] == {"from": [TRAINERS, engines]}  # no ports: the library picks them


def test_http_fleets_admit_the_engine_port_only() -> None:
    assert len(desired.engine_network_policy(REF, spec(), "rollfleet-system")["spec"]["ingress"]) == 1


def test_engines_reach_each_others_engine_port_only_to_relay_http_pushes() -> None:
    engines = {"podSelector": {"matchLabels": ENGINES}}
    for backend in ("gloo", "none"):
        rule = desired.engine_network_policy(REF, spec(weightSync={"backend": backend}), "ops")["spec"]["ingress"][0]
        assert engines not in rule["from"]


def test_network_policy_can_be_switched_off_and_is_then_deleted() -> None:
    assert desired.absent_objects(REF, spec()) == []
    off = spec(networkPolicy={"enabled": False})
    assert "NetworkPolicy" not in [o["kind"] for o in desired.owned_objects(REF, off, "rollfleet-system")]
    assert desired.absent_objects(REF, off) == [("NetworkPolicy", "tiny-engine")]
    # Switching it, or its peers, never restarts an engine.
    assert desired.template_hash(off) == desired.template_hash(spec())


@pytest.mark.parametrize(
    ("replicas", "strategy", "budget"),
    [
        (2, {}, 1),  # the default: one engine at a time, as a rolling update
        (8, {"maxUnavailable": "25%"}, 2),
        (3, {"maxUnavailable": "25%", "maxSurge": 1}, 1),  # 0 engines: at least 1, or no drain could progress
        (4, {"maxUnavailable": 0, "maxSurge": 2}, 1),
        (10, {"maxUnavailable": 3}, 3),
    ],
)
def test_the_disruption_budget_takes_engines_as_an_update_does_and_at_least_one(
    replicas: int, strategy: dict[str, Any], budget: int
) -> None:
    pdb = desired.engine_disruption_budget(REF, spec(replicas=replicas, updateStrategy=strategy))
    assert pdb["apiVersion"] == "policy/v1" and pdb["metadata"]["name"] == "tiny-engine"
    assert pdb["spec"] == {
        "selector": {"matchLabels": ENGINES},
        "maxUnavailable": budget,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",  # an engine that is not Ready never holds up a drain
    }
    assert pdb in desired.owned_objects(REF, spec(replicas=replicas, updateStrategy=strategy), None)


def test_the_disruption_budget_of_multi_pod_engines_counts_every_pod_of_their_groups() -> None:
    shape = {"tensorParallelSize": 2, "podsPerEngine": 2, "gpusPerEngine": 1}
    selector = desired.engine_disruption_budget(REF, spec(engine=shape))["spec"]["selector"]
    assert selector == {
        "matchLabels": {"app.kubernetes.io/name": "rollfleet", "rollfleet.dev/fleet": "tiny"},
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": ["engine", "engine-rank"]}
        ],
    }


def test_admin_secret_holds_the_token() -> None:
    secret = desired.admin_secret(REF, "s3cret")
    assert secret["metadata"]["name"] == "tiny-admin-token"
    assert secret["data"] == {"token": "czNjcmV0"}


def test_a_deleted_engine_serves_until_its_requests_have_moved_within_its_grace_period() -> None:
    pod_spec = desired.engine_pod(REF, spec(), 0)["spec"]
    hook = pod_spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:4] == ["python", "-m", "rollfleet_engine", "wait-idle"]
    wait_s = float(hook[hook.index("--timeout-s") + 1])
    assert 0 < wait_s < pod_spec["terminationGracePeriodSeconds"] == 30  # SIGTERM still comes within the grace period
    # A spot provider's notice is longer (AWS: 2 minutes): the engine may use it to move its requests.
    longer = desired.engine_pod(REF, spec(engine={"terminationGracePeriodSeconds": 120}), 0)["spec"]
    hook = longer["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert longer["terminationGracePeriodSeconds"] == 120 and hook[hook.index("--timeout-s") + 1] == "115"
    # An engine of its own command (not the engine image's entrypoint) gets no hook it may not have.
    custom = desired.engine_pod(REF, spec(engine={"command": ["my-server"]}), 0)["spec"]["containers"][0]
    assert "lifecycle" not in custom
