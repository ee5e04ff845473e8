"""What a RolloutFleet should own, as Kubernetes objects built from its spec.

Pure: every function maps (fleet identity, spec) to manifests, so the operator's
`reconcile` only decides when to apply them. Owns the object names, labels, the engine
pod template (and its hash, which says whether a pod is up to date), the gateway
Deployment and Service, the admin-token Secret, ServiceAccounts, the gateway's and the
trainers' Roles, the weight-sync record's ConfigMap and the engines' NetworkPolicy.
Talks to nobody.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rollfleet.api.common import ROLLFLEET_IMAGE_UID
from rollfleet.api.fleet import PLURAL, PlacementSpec, RolloutFleetSpec
from rollfleet.contract import (
    ANNOTATION_CRASHES,
    ANNOTATION_PHASE,
    ANNOTATION_TEMPLATE_HASH,
    ANNOTATION_WEIGHT_GENERATION,
    APP_NAME,
    COLLECTIVE_BACKENDS,
    COMPONENT_ADMIN_TOKEN,
    COMPONENT_ENGINE,
    COMPONENT_ENGINE_RANK,
    COMPONENT_GATEWAY,
    COMPONENT_INFERENCE_TOKEN,
    COMPONENT_TRAINER,
    COMPONENT_WEIGHTS,
    ENGINE_PORT,
    GATEWAY_PORT,
    GROUP,
    HTTP_WEIGHT_BACKEND,
    INFERENCE_TOKEN_FILE,
    INFERENCE_TOKEN_MOUNT_DIR,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_INDEX,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LWS_API_VERSION,
    LWS_ENV_GROUP_SIZE,
    LWS_ENV_LEADER_ADDRESS,
    LWS_ENV_WORKER_INDEX,
    MANAGER,
    READY_PATH,
    TOKEN_FILE,
    TOKEN_MOUNT_DIR,
    EnginePhase,
    component_labels,
    disruption_budget_name,
    engine_pod_name,
    engine_sa_name,
    gateway_name,
    inference_secret_name,
    network_policy_name,
    secret_name,
    token_secret_data,
    trainer_name,
    weights_record_name,
)
from rollfleet.controller import plan
from rollfleet.controller.owner import FleetRef

Manifest = dict[str, Any]
ObjectKey = tuple[str, str]  # (kind, name) of an object in the fleet's namespace

MODEL_MOUNT = "/models"
# Set by the kubelet on every node: a pod anti-affinity's topology of one node.
HOSTNAME_LABEL = "kubernetes.io/hostname"
# Set by the API server on every namespace (Kubernetes 1.22+): how a policy names one namespace.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# A lost node's pods are evicted after this long (Kubernetes' default is 300 s); the
# operator then replaces them, so a fleet heals in about a minute, not five.
NODE_LOST_TOLERATION_SECONDS = 30


def _meta(ref: FleetRef, name: str, component: str, **extra: Any) -> Manifest:
    labels = component_labels(ref.name, component) | {LABEL_MANAGED_BY: MANAGER}
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": labels,
        "ownerReferences": [ref.owner_reference()],
        **extra,
    }


def template_hash(spec: RolloutFleetSpec) -> str:
    """Hash of everything that shapes an engine pod; a pod with another hash is rolled.

    Replicas, the gateway, the update strategy, the drain timeout and who may push
    weights are left out: changing them must not restart engines. `auth` is in: whether
    engines ask generation for a token is one of their arguments.
    """
    shaping = spec.model_dump(
        mode="json",
        by_alias=True,
        exclude_none=True,
        include={"model": True, "engine": True, "placement": True, "weight_sync": True, "auth": True},
        exclude={"weight_sync": {"trainer_service_accounts"}},
    )
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def model_key(spec: RolloutFleetSpec) -> str:
    """spec.model as one string: the weight-sync record is kept for one value of it."""
    return json.dumps(spec.model.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=True)


def engine_args(spec: RolloutFleetSpec, rank: bool = False) -> list[str]:
    """Arguments of `python -m rollfleet_engine` (the engine image's entrypoint): of the engine's pod, or of its
    group's pods (`spec.engine.podsPerEngine` above 1), the leader's or (`rank`) the other ranks'."""
    model, engine, sync = spec.model, spec.engine, spec.weight_sync
    model_dir = model.image_path if model.image_path else MODEL_MOUNT
    args = ["serve", "--model", model_dir, "--served-model-name", model.served_name]
    # vLLM's headless mode serves no HTTP: no port and no tokens.
    args += ["--headless"] if rank else ["--port", str(ENGINE_PORT), "--token-file", TOKEN_FILE]
    args += ["--weight-backend", sync.backend]
    if sync.initial_version:
        args += ["--weight-version", sync.initial_version]
    if _inference_token(spec) and not rank:
        args += ["--inference-token-file", INFERENCE_TOKEN_FILE]
    if engine.pods_per_engine > 1:
        # LWS's pod webhook sets these in each pod's environment; the kubelet expands $(VAR) in args.
        args += ["--group-leader", f"$({LWS_ENV_LEADER_ADDRESS})", "--group-pods", f"$({LWS_ENV_GROUP_SIZE})"]
        args += ["--pod-rank", f"$({LWS_ENV_WORKER_INDEX})"]
    vllm: list[str] = []
    for flag, size in (
        ("--tensor-parallel-size", engine.tensor_parallel_size),
        ("--pipeline-parallel-size", engine.pipeline_parallel_size),
        ("--data-parallel-size", engine.data_parallel_size),
    ):
        if size > 1:
            vllm += [flag, str(size)]
    if engine.enable_expert_parallel:
        vllm.append("--enable-expert-parallel")
    if engine.max_model_len is not None:
        vllm += ["--max-model-len", str(engine.max_model_len)]
    vllm += engine.args
    return args + (["--", *vllm] if vllm else [])


def token_volume(fleet: str, optional: bool = False) -> Manifest:
    """The fleet's admin-token Secret as a volume (`optional`: a pod may start before the Secret exists)."""
    return _secret_volume(TOKEN_VOLUME, secret_name(fleet), optional)


def _secret_volume(volume: str, secret: str, optional: bool = False) -> Manifest:
    """A token Secret as a volume, readable by the pod's group (fsGroup), not by others."""
    source: Manifest = {"secretName": secret, "defaultMode": 0o440}
    if optional:
        source["optional"] = True
    return {"name": volume, "secret": source}


TOKEN_VOLUME = "rollfleet-token"
TOKEN_MOUNT = {"name": TOKEN_VOLUME, "mountPath": TOKEN_MOUNT_DIR, "readOnly": True}
INFERENCE_TOKEN_VOLUME = "rollfleet-inference-token"
INFERENCE_TOKEN_MOUNT = {"name": INFERENCE_TOKEN_VOLUME, "mountPath": INFERENCE_TOKEN_MOUNT_DIR, "readOnly": True}


def _inference_token(spec: RolloutFleetSpec) -> bool:
    """Whether generation asks for a token (spec.auth.inference Token, the default)."""
    return spec.auth.inference == "Token"


def _token_volumes(fleet: str, spec: RolloutFleetSpec) -> tuple[list[Manifest], list[Manifest]]:
    """The admin token, and the inference token unless generation is open: volumes and mounts."""
    volumes, mounts = [token_volume(fleet)], [dict(TOKEN_MOUNT)]
    if _inference_token(spec):
        volumes.append(_secret_volume(INFERENCE_TOKEN_VOLUME, inference_secret_name(fleet)))
        mounts.append(dict(INFERENCE_TOKEN_MOUNT))
    return volumes, mounts


def _resources(requests: dict[str, Any] | None, limits: dict[str, Any] | None) -> Manifest:
    # Quantities are strings on the wire ("1", "500m", "8Gi"); the client refuses numbers.
    out: Manifest = {}
    if requests:
        out["requests"] = {k: str(v) for k, v in requests.items()}
    if limits:
        out["limits"] = {k: str(v) for k, v in limits.items()}
    return out


def _http_probe(path: str, port: str, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _engine_volumes(fleet: str, spec: RolloutFleetSpec, tokens: bool = True) -> tuple[list[Manifest], list[Manifest]]:
    """The engine pod's volumes and the container's mounts: tokens (not for a group's headless ranks), model,
    shared memory."""
    volumes, mounts = _token_volumes(fleet, spec) if tokens else ([], [])
    if spec.model.host_path:
        volumes.append({"name": "model", "hostPath": {"path": spec.model.host_path, "type": "Directory"}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif spec.model.pvc:
        pvc = spec.model.pvc
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only}}
        )
        mounts.append(
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": pvc.read_only}
            | ({"subPath": pvc.sub_path} if pvc.sub_path else {})
        )
    # vLLM's engine core and its workers talk through shared-memory queues even at tensor
    # parallel 1 (and TP workers exchange tensors there); a container's default 64 MiB /dev/shm
    # fails its start-up check. Found on kind: the local cluster's processes use the host's.
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


# What an engine pod's preStop hook leaves of its grace period for the engine's own shutdown.
SHUTDOWN_S = 5


def _engine_container(spec: RolloutFleetSpec, mounts: list[Manifest], rank: bool = False) -> Manifest:
    """The engine's container; of a group's other ranks (`rank`): headless, no port, no probes (the leader's
    readiness is the group's: vLLM's leader serves only once every rank has joined)."""
    engine = spec.engine
    requests = dict(engine.resources.requests or {}) if engine.resources else {}
    limits = dict(engine.resources.limits or {}) if engine.resources else {}
    if engine.gpus_per_engine:
        requests[engine.gpu_resource] = engine.gpus_per_engine
        limits[engine.gpu_resource] = engine.gpus_per_engine
    env = [e.wire() for e in engine.env]
    container: Manifest = {
        "name": "engine",
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "args": engine_args(spec, rank=rank),
        "env": env,
        "resources": _resources(requests, limits),
        "volumeMounts": mounts,
        # An engine that fails to start leaves its last log lines in its status: the fleet's says why.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if not rank:
        container |= {
            "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
            # The engine only listens once the model is loaded, so startup allows the whole load time. Probed
            # every second (a refused connection until then): an engine serves as soon as it can, not up to a
            # period later, then readiness every 2 s, like the gateway's. A replacement or a rolling update
            # waits on each of these.
            "startupProbe": _http_probe("/health", "http", 1, max(1, engine.startup_timeout_seconds)),
            "readinessProbe": _http_probe(READY_PATH, "http", 2, 3),
            "livenessProbe": _http_probe("/health", "http", 10, 6),
        }
    if engine.command:
        container["command"] = list(engine.command)
    elif not rank:
        # Deleted (an eviction, a drain), the engine serves on while the gateway moves its requests elsewhere:
        # the kubelet signals it once it holds none (rollfleet_engine.drain), within the grace period.
        wait = ["python", "-m", "rollfleet_engine", "wait-idle", "--port", str(ENGINE_PORT)]
        wait += ["--timeout-s", str(engine.termination_grace_period_seconds - SHUTDOWN_S)]
        container["lifecycle"] = {"preStop": {"exec": {"command": wait}}}
    return container


def _engine_tolerations(spec: RolloutFleetSpec) -> list[Manifest]:
    engine = spec.engine
    tolerations = [t.wire() for t in spec.placement.tolerations]
    if engine.gpus_per_engine:
        # What the ExtendedResourceToleration admission plugin would add: GPU nodes are tainted.
        tolerations.append({"key": engine.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations + [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": NODE_LOST_TOLERATION_SECONDS}
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]


def _placement_fields(placement: PlacementSpec, spread: Manifest | None = None) -> Manifest:
    """The pod spec fields a fleet's placement sets, only those it sets; `spread`: a pod anti-affinity term
    added to the placement's own."""
    affinity = dict(placement.affinity or {})
    if spread is not None:
        anti = dict(affinity.get("podAntiAffinity") or {})
        required = list(anti.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        affinity["podAntiAffinity"] = anti | {"requiredDuringSchedulingIgnoredDuringExecution": [*required, spread]}
    fields: Manifest = {
        "nodeSelector": dict(placement.node_selector) if placement.node_selector else None,
        "affinity": affinity,
        "priorityClassName": placement.priority_class_name,
        "schedulerName": placement.scheduler_name,
    }
    return {k: v for k, v in fields.items() if v}


def _engine_meta(ref: FleetRef, spec: RolloutFleetSpec, name: str, index: int, ready: bool, crashes: int) -> Manifest:
    """The engine pod's labels and the annotations the operator keeps its state in: phase Starting, or Ready at
    weight generation 0 for an engine born ready (`plan.born_ready`)."""
    annotations = {ANNOTATION_PHASE: EnginePhase.STARTING, ANNOTATION_TEMPLATE_HASH: template_hash(spec)}
    if ready:
        annotations |= {ANNOTATION_PHASE: EnginePhase.READY, ANNOTATION_WEIGHT_GENERATION: "0"}
    meta = _meta(ref, name, COMPONENT_ENGINE, annotations=annotations)
    if crashes:
        meta["annotations"][ANNOTATION_CRASHES] = str(crashes)
    meta["labels"][LABEL_INDEX] = str(index)
    return meta


def _engine_pod_spec(ref: FleetRef, spec: RolloutFleetSpec, index: int, rank: bool = False) -> Manifest:
    volumes, mounts = _engine_volumes(ref.name, spec, tokens=not rank)
    group = spec.engine.pods_per_engine > 1
    # An engine's pods, one per node: each holds its share of the GPUs (groups.pool_nodes counts such nodes).
    spread = (
        {
            "labelSelector": {"matchLabels": {LABEL_FLEET: ref.name, LABEL_INDEX: str(index)}},
            "topologyKey": HOSTNAME_LABEL,
        }
        if group
        else None
    )
    return {
        # Never: a dead engine is replaced by the operator (a fresh pod, drained and re-synced), not restarted
        # in place behind the fleet's back. A group's pods are LWS's StatefulSets', which restart them (Always
        # is all a StatefulSet allows): LWS then recreates the whole group, a fresh engine all the same.
        "restartPolicy": "Always" if group else "Never",
        "serviceAccountName": engine_sa_name(ref.name),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.engine.termination_grace_period_seconds,
        "containers": [_engine_container(spec, mounts, rank=rank)],
        "volumes": volumes,
        "tolerations": _engine_tolerations(spec),
        **_placement_fields(spec.placement, spread),
    }


def engine_pod(ref: FleetRef, spec: RolloutFleetSpec, index: int, ready: bool = False, crashes: int = 0) -> Manifest:
    """The pod of engine `index`: stable name, owner reference, GPUs, probes, token and model mounts.

    `ready`: born ready (`plan.born_ready`). `crashes`: how many engines of this index crashed in a row before it
    (its crash-loop backoff)."""
    meta = _engine_meta(ref, spec, engine_pod_name(ref.name, index), index, ready, crashes)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": _engine_pod_spec(ref, spec, index)}


def engine_group(ref: FleetRef, spec: RolloutFleetSpec, index: int, crashes: int = 0) -> Manifest:
    """Engine `index` of a fleet whose engines span `spec.engine.podsPerEngine` pods: a LeaderWorkerSet of one
    group (rollfleet.controller.groups). Its leader pod is the engine, as `engine_pod` would be (labels,
    annotations, the serving container); the other pods run vLLM's headless ranks. LWS places the group's pods
    together and recreates all of them when one fails."""
    name = engine_pod_name(ref.name, index)
    # Never born Ready: LWS makes a group's pods again from this template when one fails, after pushes maybe.
    leader_meta = _engine_meta(ref, spec, name, index, False, crashes)
    rank_labels = component_labels(ref.name, COMPONENT_ENGINE_RANK) | {LABEL_INDEX: str(index)}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _meta(ref, name, COMPONENT_ENGINE) | {"labels": leader_meta["labels"]},
        "spec": {
            "replicas": 1,  # one engine: the operator scales, drains and rolls engines itself
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.engine.pods_per_engine,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": leader_meta["labels"], "annotations": leader_meta["annotations"]},
                    "spec": _engine_pod_spec(ref, spec, index),
                },
                "workerTemplate": {
                    "metadata": {"labels": rank_labels | {LABEL_MANAGED_BY: MANAGER}},
                    "spec": _engine_pod_spec(ref, spec, index, rank=True),
                },
            },
        },
    }


def engine_object(ref: FleetRef, spec: RolloutFleetSpec, index: int, ready: bool, crashes: int = 0) -> Manifest:
    """What the operator creates for engine `index`: its pod (born Ready if `ready`), or its group's
    LeaderWorkerSet."""
    if spec.engine.pods_per_engine > 1:
        return engine_group(ref, spec, index, crashes)
    return engine_pod(ref, spec, index, ready, crashes)


def admin_secret(ref: FleetRef, token: str) -> Manifest:
    """The fleet's admin token (engine control routes, gateway abort, sync sidecars)."""
    return _token_secret(ref, secret_name(ref.name), COMPONENT_ADMIN_TOKEN, token)


def inference_secret(ref: FleetRef, token: str) -> Manifest:
    """The fleet's inference token: generation at the gateway and the engines, nothing else."""
    return _token_secret(ref, inference_secret_name(ref.name), COMPONENT_INFERENCE_TOKEN, token)


def _token_secret(ref: FleetRef, name: str, component: str, token: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(ref, name, component),
        "data": token_secret_data(token),
    }


def engine_service_account(ref: FleetRef) -> Manifest:
    # Engines never call the API server: no token is mounted.
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "automountServiceAccountToken": False,
        "metadata": _meta(ref, engine_sa_name(ref.name), COMPONENT_ENGINE),
    }


def _service_account(ref: FleetRef, name: str, component: str) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(ref, name, component)}


def _role(ref: FleetRef, name: str, component: str, rules: list[Manifest]) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(ref, name, component),
        "rules": rules,
    }


def _role_binding(ref: FleetRef, name: str, component: str, accounts: list[str]) -> Manifest:
    """Binds the Role `name` to these ServiceAccounts of the fleet's namespace (listed once each)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(ref, name, component),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {"kind": "ServiceAccount", "name": a, "namespace": ref.namespace} for a in dict.fromkeys(accounts)
        ],
    }


def gateway_service_account(ref: FleetRef) -> Manifest:
    return _service_account(ref, gateway_name(ref.name), COMPONENT_GATEWAY)


def gateway_role(ref: FleetRef) -> Manifest:
    """The gateway lists and watches engine pods (to route on their phase annotations). For the trainer's
    control routes it reads its fleet and that fleet's weights record, and patches the fleet's pause
    annotation: the admission policy `rollfleet-gateway-pause-only` (rollfleet.api.admission) refuses any
    other change it could make with `patch`."""
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "patch"], "resourceNames": [ref.name]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "verbs": ["get"],
            "resourceNames": [weights_record_name(ref.name)],
        },
    ]
    return _role(ref, gateway_name(ref.name), COMPONENT_GATEWAY, rules)


def gateway_role_binding(ref: FleetRef) -> Manifest:
    name = gateway_name(ref.name)
    return _role_binding(ref, name, COMPONENT_GATEWAY, [name])


def weights_record(ref: FleetRef) -> Manifest:
    """The ConfigMap the sync sidecar keeps the push record in (rollfleet.sync.store). The operator
    applies only its metadata: its data belongs to the record's writers."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(ref, weights_record_name(ref.name), COMPONENT_WEIGHTS),
    }


def trainer_service_account(ref: FleetRef) -> Manifest:
    """What trainer pods that run the sync sidecar run as."""
    return _service_account(ref, trainer_name(ref.name), COMPONENT_TRAINER)


def trainer_role(ref: FleetRef) -> Manifest:
    """The sync sidecar records pushes in the fleet's weights ConfigMap and finds the engine pods, and can
    do nothing else: not change the fleet (its spec runs in the engines), not write pods, not read Secrets
    (the fleet token reaches it as a mounted file). It reads the fleet for its max-staleness annotation."""
    record = weights_record_name(ref.name)
    rules = [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "patch"], "resourceNames": [record]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get"], "resourceNames": [ref.name]},
    ]
    return _role(ref, trainer_name(ref.name), COMPONENT_TRAINER, rules)


def trainer_role_binding(ref: FleetRef, spec: RolloutFleetSpec) -> Manifest:
    name = trainer_name(ref.name)
    return _role_binding(ref, name, COMPONENT_TRAINER, [name, *spec.weight_sync.trainer_service_accounts])


def gateway_deployment(ref: FleetRef, spec: RolloutFleetSpec) -> Manifest:
    """`rollfleet gateway` behind a readiness gate (/ready: its engine watch has synced)."""
    gw = spec.gateway
    labels = component_labels(ref.name, COMPONENT_GATEWAY)
    token_volumes, token_mounts = _token_volumes(ref.name, spec)
    container: Manifest = {
        "name": "gateway",
        "image": gw.image,
        "imagePullPolicy": gw.image_pull_policy,
        "args": [
            "gateway",
            "--fleet",
            ref.name,
            "--namespace",
            ref.namespace,
            "--port",
            str(GATEWAY_PORT),
            "--token-file",
            TOKEN_FILE,
            *(["--api-key-file", INFERENCE_TOKEN_FILE] if _inference_token(spec) else []),
            *(["--max-model-len", str(spec.engine.max_model_len)] if spec.engine.max_model_len else []),
            *gw.args,
        ],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/ready", "http", 2, 3),
        "livenessProbe": _http_probe("/health", "http", 10, 6),
        "volumeMounts": token_mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if gw.resources:
        container["resources"] = _resources(gw.resources.requests, gw.resources.limits)
    # Non-root as the image's user; fsGroup makes the token (mode 0440) readable to it.
    uid = ROLLFLEET_IMAGE_UID
    pod_security = {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ref, gateway_name(ref.name), COMPONENT_GATEWAY),
        "spec": {
            "replicas": gw.replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": gateway_name(ref.name),
                    "enableServiceLinks": False,
                    "securityContext": pod_security,
                    "containers": [container],
                    "volumes": token_volumes,
                },
            },
        },
    }


def gateway_service(ref: FleetRef, spec: RolloutFleetSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, gateway_name(ref.name), COMPONENT_GATEWAY),
        "spec": {
            "type": spec.gateway.service_type,
            "selector": component_labels(ref.name, COMPONENT_GATEWAY),
            "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _pods(labels: dict[str, str]) -> Manifest:
    return {"podSelector": {"matchLabels": labels}}


def _engine_pods(ref: FleetRef, spec: RolloutFleetSpec) -> Manifest:
    """Every pod of the fleet's engines: the engine pods, and the other ranks' pods of multi-pod engines."""
    if spec.engine.pods_per_engine == 1:
        return _pods(component_labels(ref.name, COMPONENT_ENGINE))
    return {
        "podSelector": {
            "matchLabels": {LABEL_NAME: APP_NAME, LABEL_FLEET: ref.name},
            "matchExpressions": [
                {"key": LABEL_COMPONENT, "operator": "In", "values": [COMPONENT_ENGINE, COMPONENT_ENGINE_RANK]}
            ],
        }
    }


def engine_disruption_budget(ref: FleetRef, spec: RolloutFleetSpec) -> Manifest:
    """Voluntary disruptions (`kubectl drain`, a cluster autoscaler's evictions) take the fleet's engines down at most
    `plan.disruption_budget` at a time, as a rolling update would. Every pod of a multi-pod engine counts: evicting
    any restarts its whole group, whose pods are then all unavailable until it is back. Pods that are not Ready may
    always be evicted (`AlwaysAllow`): such an engine serves nothing, and must not hold up a node's drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(ref, disruption_budget_name(ref.name), COMPONENT_ENGINE),
        "spec": {
            "selector": _engine_pods(ref, spec)["podSelector"],
            "maxUnavailable": plan.disruption_budget(spec.update_strategy, spec.replicas),
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def engine_network_policy(ref: FleetRef, spec: RolloutFleetSpec, operator_namespace: str | None) -> Manifest:
    """Ingress to the engine pods: the engine port from the gateway, the operator, the trainers and (http
    weight sync) the other engines, nothing else.

    The fleet's gateway pods route requests; the operator's pods (in `operator_namespace`,
    unknown when the operator does not run in a pod: then no pod can be named for it) read
    engine state and pause, resume and drain; the fleet's trainer pods (component `trainer`,
    the sync sidecar) pause engines and push weights; with the http backend the fleet's
    engines relay a push's weights to each other. `extraIngressFrom` peers get the same
    port. With a collective backend (nccl, gloo) the trainer (rank 0) and the engines also open
    connections to each other on ports the library picks at run time, so those two may reach every port.
    Egress stays open: engines pull weights from the trainer pod's weights server. The
    kubelet's probes come from the node, which a NetworkPolicy cannot block.
    """
    trainers = _pods({LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_FLEET: ref.name})
    engines = _pods(component_labels(ref.name, COMPONENT_ENGINE))
    sources = [_pods(component_labels(ref.name, COMPONENT_GATEWAY)), trainers]
    if spec.weight_sync.backend == HTTP_WEIGHT_BACKEND:
        sources.append(engines)  # a push's relay chain: each engine stages from the one before it
    if operator_namespace:
        sources.append(
            {
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}},
                **_pods({LABEL_NAME: APP_NAME, LABEL_COMPONENT: "operator"}),
            }
        )
    sources += [peer.wire() for peer in spec.network_policy.extra_ingress_from]
    ingress: list[Manifest] = [{"from": sources, "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]}]
    if spec.weight_sync.backend in COLLECTIVE_BACKENDS:
        ingress.append({"from": [trainers, engines]})
    selected = _engine_pods(ref, spec)
    if spec.engine.pods_per_engine > 1:
        # A multi-pod engine's ranks (its leader and the headless pods) rendezvous on the leader and then talk on
        # ports vLLM and torch.distributed pick at run time: the fleet's engine pods reach each other on any.
        ingress.append({"from": [selected]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(ref, network_policy_name(ref.name), COMPONENT_ENGINE),
        "spec": {
            "podSelector": selected["podSelector"],
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def owned_objects(ref: FleetRef, spec: RolloutFleetSpec, operator_namespace: str | None) -> list[Manifest]:
    """Everything but the engine pods and the Secret, in the order they are applied."""
    objects = [engine_service_account(ref)]
    if spec.weight_sync.backend != "none":
        objects += [
            weights_record(ref),
            trainer_service_account(ref),
            trainer_role(ref),
            trainer_role_binding(ref, spec),
        ]
    objects.append(engine_disruption_budget(ref, spec))
    if spec.network_policy.enabled:
        objects.append(engine_network_policy(ref, spec, operator_namespace))
    if spec.gateway.enabled:
        objects += [
            gateway_service_account(ref),
            gateway_role(ref),
            gateway_role_binding(ref),
            gateway_service(ref, spec),
            gateway_deployment(ref, spec),
        ]
    return objects


def absent_objects(ref: FleetRef, spec: RolloutFleetSpec) -> list[ObjectKey]:
    """Objects the spec switched off that an earlier spec may have created: the operator deletes them."""
    return [] if spec.network_policy.enabled else [("NetworkPolicy", network_policy_name(ref.name))]
