"""RolloutFleet: N vLLM rollout engines on GPU node pools behind one gateway.

The pydantic models here are the one source of truth for the RolloutFleet CRD
(`crdgen` generates `crds/rolloutfleet.yaml` and `docs/crds.md` from them). Field
descriptions become `kubectl explain` text; CEL rules carry the messages a person
reads when the API server refuses a fleet. Pure: talks to nobody.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, StringConstraints

from rollfleet.api.common import (
    DEFAULT_ENGINE_IMAGE,
    DEFAULT_ROLLFLEET_IMAGE,
    ApiModel,
    Condition,
    CrdInfo,
    EnvVar,
    FreeForm,
    IntOrPercent,
    PrinterColumn,
    ResourceRequirements,
    cel,
    validations,
)
from rollfleet.contract import API_VERSION, EnginePhase, PauseMode

KIND = "RolloutFleet"
PLURAL = "rolloutfleets"
# Engines a fleet may have: 2,000 are measured (bench/bench_scale.py); the status stays within etcd's object limit
# past that (docs/architecture.md, "Scale").
MAX_ENGINES = 4096
# Engines the status lists by name: each entry is 130-250 bytes, and 2,000 listed whole were 300 KB before
# any push (the status is one object; etcd holds at most 1.5 MiB).
LISTED_ENGINES_MAX = 256

PullPolicy = Literal["Always", "IfNotPresent", "Never"]

# vLLM flags the operator derives from the spec; setting them in engine.args would fight it.
RESERVED_ENGINE_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--data-parallel-size",
    "--data-parallel-size-local",
    "--enable-expert-parallel",
    "--max-model-len",
    "--weight-transfer-config",
)
_RESERVED_LIST = "[" + ", ".join(f"'{f}'" for f in RESERVED_ENGINE_FLAGS) + "]"
# An engine's ranks (one GPU each), as CEL reads the engine spec.
_RANKS = "(self.tensorParallelSize * self.pipelineParallelSize * self.dataParallelSize)"
# Bounded so that CEL rules over argument lists stay within the API server's cost budget.
Arg = Annotated[str, StringConstraints(max_length=1024)]
# No CEL rule reads the command: an inline script (`python3 -c ...`, `sh -c ...`) may be longer.
CommandPart = Annotated[str, StringConstraints(max_length=16384)]


class PvcSource(ApiModel):
    """Weights on a PersistentVolumeClaim in the fleet's namespace."""

    claim_name: str = Field(min_length=1, max_length=253, description="Name of the PersistentVolumeClaim.")
    sub_path: str | None = Field(
        default=None, max_length=1024, description="Directory inside the volume holding the model (default: its root)."
    )
    read_only: bool = Field(default=True, description="Mount read-only (engines never write weights to disk).")


class ModelSpec(ApiModel):
    """The model every engine serves, and where its weights come from (set exactly one source)."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "(has(self.hostPath) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.imagePath) ? 1 : 0) == 1",
                "model: set exactly one of hostPath, pvc or imagePath (where the engines read the weights from)",
            ),
        )
    }

    served_name: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
        description="Model name clients send in requests (vLLM --served-model-name).",
    )
    host_path: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^/",
        description="Absolute directory on the node holding the model (mounted read-only).",
    )
    pvc: PvcSource | None = Field(default=None, description="A PersistentVolumeClaim holding the model.")
    image_path: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^/",
        description="Absolute directory inside the engine image holding the model.",
    )


class EngineSpec(ApiModel):
    """The vLLM engine each pod runs."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            # The engine's shape (docs/engine.md, "Engines across pods"): tensor x pipeline x data parallel ranks,
            # one GPU each, spread evenly over podsPerEngine pods. Each rule guards on the ones before it, so a
            # bad shape is refused with the rule it breaks first.
            # Static messages: the API server refuses messageExpressions that format numbers into the text here
            # (their estimated cost is over its budget).
            cel(
                f"{_RANKS} % self.podsPerEngine == 0",
                "engine: the ranks (tensorParallelSize x pipelineParallelSize x dataParallelSize) must divide evenly "
                "among podsPerEngine pods",
            ),
            cel(
                f"self.gpusPerEngine == 0 || {_RANKS} % self.podsPerEngine != 0 || "
                f"self.gpusPerEngine % ({_RANKS} / self.podsPerEngine) == 0",
                "engine.gpusPerEngine (GPUs per pod) must be a multiple of the ranks each pod runs (tensorParallelSize "
                "x pipelineParallelSize x dataParallelSize / podsPerEngine): each rank uses one GPU",
            ),
            cel(
                "self.dataParallelSize == 1 || self.dataParallelSize % self.podsPerEngine == 0",
                "engine.dataParallelSize must be a multiple of podsPerEngine: a data parallel engine holds whole "
                "replicas in each pod (its tensor and pipeline ranks span pods only when dataParallelSize is 1)",
            ),
            cel(
                "!has(self.dataParallelSizeLocal) || self.dataParallelSize % self.dataParallelSizeLocal == 0",
                "engine.dataParallelSizeLocal (data parallel ranks per pod) must divide engine.dataParallelSize",
            ),
            cel(
                "!has(self.dataParallelSizeLocal) || self.dataParallelSize % self.dataParallelSizeLocal != 0 || "
                "self.dataParallelSize / self.dataParallelSizeLocal == self.podsPerEngine",
                "engine.dataParallelSize / dataParallelSizeLocal is the number of pods that hold data parallel ranks: "
                "it must equal engine.podsPerEngine (or leave dataParallelSizeLocal out)",
            ),
            cel(
                "!self.enableExpertParallel || self.tensorParallelSize * self.dataParallelSize > 1",
                "engine.enableExpertParallel spreads a MoE model's experts over the tensor x data parallel ranks: it "
                "needs tensorParallelSize or dataParallelSize above 1",
            ),
            cel(
                f"!has(self.args) || self.args.all(a, !{_RESERVED_LIST}.exists(f, a == f || a.startsWith(f + '=')))",
                "engine.args must not set "
                + ", ".join(RESERVED_ENGINE_FLAGS)
                + ": the operator sets them from spec.model and spec.engine",
                field_path=".args",
            ),
            cel(
                "!has(self.resources) || ((!has(self.resources.limits) || !(self.gpuResource in self.resources.limits))"
                " && (!has(self.resources.requests) || !(self.gpuResource in self.resources.requests)))",
                "do not request GPUs in engine.resources: set engine.gpusPerEngine (and engine.gpuResource)",
                field_path=".resources",
            ),
        )
    }

    image: str = Field(
        default=DEFAULT_ENGINE_IMAGE,
        min_length=1,
        max_length=512,
        description="Engine image (vLLM plus the rollfleet_engine package).",
    )
    image_pull_policy: PullPolicy = Field(default="IfNotPresent", description="When to pull the image.")
    command: list[CommandPart] | None = Field(
        default=None,
        max_length=16,
        description="Replaces the image's entrypoint, for stand-in engines in tests and benchmarks. The operator's "
        "arguments (serve --model ... --host ... --port ...) are still passed.",
    )
    args: list[Arg] = Field(
        default_factory=list,
        max_length=64,
        description="Extra vLLM arguments, passed after `--` (for example --enforce-eager, --dtype bfloat16).",
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment variables.")
    gpus_per_engine: int = Field(
        default=1,
        ge=0,
        le=64,
        description="GPUs each engine pod requests (an engine of podsPerEngine pods uses that many times as many); "
        "0 runs engines on CPU nodes.",
    )
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        min_length=1,
        max_length=253,
        description="Extended resource name of a GPU on this cluster's nodes.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="vLLM --tensor-parallel-size: each layer split over this many ranks."
    )
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="vLLM --pipeline-parallel-size: the model's layers split into this many stages (at most its "
        "layers; the engine refuses more at start).",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="vLLM --data-parallel-size: model replicas inside one engine, behind its one endpoint (with "
        "enableExpertParallel, a MoE model's experts are spread over them).",
    )
    data_parallel_size_local: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Data parallel ranks in each pod (vLLM --data-parallel-size-local); default dataParallelSize "
        "/ podsPerEngine.",
    )
    enable_expert_parallel: bool = Field(
        default=False,
        description="vLLM --enable-expert-parallel: a MoE model's experts sharded over the tensor x data parallel "
        "ranks.",
    )
    pods_per_engine: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Pods one engine spans, each on its own node of the pool: above 1 the engine is a "
        "LeaderWorkerSet group (LWS must be installed). The ranks (tensorParallelSize x pipelineParallelSize x "
        "dataParallelSize) are spread evenly over them.",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, le=10_000_000, description="Maximum context length (vLLM --max-model-len)."
    )
    resources: ResourceRequirements | None = Field(
        default=None, description="CPU and memory of the engine container (GPUs come from gpusPerEngine)."
    )
    startup_timeout_seconds: int = Field(
        default=900,
        ge=30,
        le=86400,
        description="How long an engine may take to load its model before it counts as failed and is replaced.",
    )
    termination_grace_period_seconds: int = Field(
        default=30,
        ge=10,
        le=3600,
        description="How long a deleted engine pod (an eviction, kubectl drain, a preemption notice) keeps serving "
        "while the gateway moves its requests to other engines: its preStop hook waits until it holds none, at most "
        "this less 5 s, then the engine is stopped. Keep it within a spot provider's notice.",
    )


class Toleration(ApiModel):
    """A toleration, as in a Pod."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "self.operator != 'Exists' || !has(self.value) || self.value == ''",
                "a toleration with operator Exists matches every value: leave value empty",
            ),
            cel(
                "has(self.key) || self.operator == 'Exists'",
                "a toleration without a key must use operator Exists (it then tolerates every taint)",
            ),
        )
    }

    key: str | None = Field(default=None, max_length=317, description="Taint key; empty with Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="For NoExecute: how long the pod stays bound after the taint."
    )


class PlacementSpec(ApiModel):
    """Where engine pods may run. GPU engines also tolerate the GPU taint automatically."""

    node_selector: dict[str, str] | None = Field(default=None, description="Node labels an engine's node must have.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Extra tolerations.")
    affinity: FreeForm | None = Field(default=None, description="Pod affinity rules, as in a Pod's spec.affinity.")
    priority_class_name: str | None = Field(default=None, max_length=253, description="PriorityClass of engine pods.")
    scheduler_name: str | None = Field(
        default=None, max_length=253, description="Scheduler for engine pods (for example a gang scheduler)."
    )


class GatewaySpec(ApiModel):
    """The per-fleet gateway (Deployment and Service `<fleet>-gateway`) that routes requests to engines."""

    enabled: bool = Field(default=True, description="Deploy the gateway.")
    replicas: int = Field(default=1, ge=1, le=32, description="Gateway replicas.")
    image: str = Field(
        default=DEFAULT_ROLLFLEET_IMAGE,
        min_length=1,
        max_length=512,
        description="Image that runs `rollfleet gateway`.",
    )
    image_pull_policy: PullPolicy = Field(default="IfNotPresent", description="When to pull the image.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Type of the gateway Service."
    )
    args: list[Arg] = Field(default_factory=list, max_length=32, description="Extra `rollfleet gateway` arguments.")
    resources: ResourceRequirements | None = Field(default=None, description="Resources of the gateway container.")


class UpdateStrategy(ApiModel):
    """How spec changes roll out: one engine at a time by default, draining each before it is deleted."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "!((self.maxUnavailable == 0 || self.maxUnavailable == '0%')"
                " && (self.maxSurge == 0 || self.maxSurge == '0%'))",
                "updateStrategy: maxUnavailable must be at least 1 when maxSurge is 0, or a rolling update could never "
                "replace an engine (GPU fleets usually keep maxSurge 0 and maxUnavailable 1)",
            ),
        )
    }

    max_unavailable: IntOrPercent = Field(
        default=1,
        description="Engines (or percent of replicas, rounded down) that may be unavailable during an update.",
    )
    max_surge: IntOrPercent = Field(
        default=0,
        description="Extra engines (or percent, rounded up) created during an update. Extra engines need "
        "spare GPUs, so the default is 0.",
    )


# A ServiceAccount's name, as Kubernetes accepts it (a DNS subdomain).
ServiceAccountName = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]


class WeightSyncSpec(ApiModel):
    """How engines receive new weights from the trainer (through the sync sidecar)."""

    backend: Literal["http", "nccl", "gloo", "none"] = Field(
        default="http",
        description="Weight transfer backend: http (portable: engines pull from the sidecar), nccl (GPU clusters: "
        "the trainer broadcasts, rollfleet_client.collective), gloo (the same broadcast on CPU), none (disabled).",
    )
    initial_version: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Version label of the weights engines load at start (engine --weight-version).",
    )
    require_sync: bool = Field(
        default=True,
        description="Engines whose weights are not at the fleet's version are PendingSync and get no "
        "traffic until the sync sidecar updates them.",
    )
    trainer_service_accounts: list[ServiceAccountName] = Field(
        default_factory=list,
        max_length=16,
        description="ServiceAccounts in the fleet's namespace whose pods may run the sync sidecar, besides "
        "<fleet>-trainer, which the operator makes: they may record pushes in the ConfigMap <fleet>-weights "
        "and list the engine pods, nothing else.",
    )


# Label values as Kubernetes accepts them: refused here rather than when the operator applies the policy.
LabelValue = Annotated[str, StringConstraints(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=317)]
Cidr = Annotated[str, StringConstraints(max_length=64, pattern=r"^[0-9A-Fa-f:.]+/[0-9]{1,3}$")]


class LabelSelectorRequirement(ApiModel):
    """One expression of a label selector, as in Kubernetes."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "(self.operator == 'In' || self.operator == 'NotIn') == (has(self.values) && size(self.values) > 0)",
                "matchExpressions: In and NotIn need values; Exists and DoesNotExist take none",
            ),
        )
    }

    key: LabelKey = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="In, NotIn, Exists or DoesNotExist.")
    values: list[LabelValue] | None = Field(default=None, max_length=64, description="Values for In and NotIn.")


class LabelSelector(ApiModel):
    """A label selector, as in Kubernetes: every term must match; an empty selector matches everything."""

    match_labels: dict[str, LabelValue] | None = Field(default=None, description="Labels that must all match.")
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=16, description="Expressions that must all match."
    )


class IPBlock(ApiModel):
    """A CIDR range, as in a NetworkPolicy peer (for sources that are not pods, or pods seen by address)."""

    cidr: Cidr = Field(description="The range admitted, for example 10.0.0.0/16.")
    # `except` is a Python keyword: the field is `except_` in Python, `except` on the wire.
    except_: list[Cidr] | None = Field(
        default=None,
        max_length=32,
        serialization_alias="except",
        validation_alias=AliasChoices("except", "except_"),
        description="Ranges inside cidr that are not admitted.",
    )


class NetworkPolicyPeer(ApiModel):
    """A source admitted to the engine port, as in a NetworkPolicy rule's `from`."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "has(self.ipBlock) != (has(self.podSelector) || has(self.namespaceSelector))",
                "networkPolicy.extraIngressFrom: set ipBlock alone, or podSelector and/or namespaceSelector",
            ),
        )
    }

    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods admitted (in the fleet's namespace, or in those namespaceSelector selects)."
    )
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces whose pods are admitted (all of them, or those podSelector selects)."
    )
    ip_block: IPBlock | None = Field(default=None, description="Addresses admitted.")


class NetworkPolicySpec(ApiModel):
    """The NetworkPolicy `<fleet>-engine`: who may open connections to the engine pods.

    Only the fleet's gateway pods, the operator's pods and the fleet's trainer pods (labelled
    `app.kubernetes.io/component=trainer` and `rollfleet.dev/fleet=<fleet>`, where the sync
    sidecar runs) reach the engine port; engine egress stays open. It takes effect only on a
    cluster whose network plugin enforces NetworkPolicies.
    """

    enabled: bool = Field(default=True, description="Create the NetworkPolicy; false deletes it.")
    extra_ingress_from: list[NetworkPolicyPeer] = Field(
        default_factory=list,
        max_length=16,
        description="More sources admitted to the engine port (for example a Prometheus namespace, or a trainer "
        "outside the cluster as an ipBlock).",
    )


# Who may generate: Token (the default) asks every inference call, at the gateway and at the engines, for the
# fleet's inference token (Secret `<fleet>-inference-token`) or its admin token; Open asks nothing.
InferenceAuth = Literal["Token", "Open"]


class AuthSpec(ApiModel):
    """Credentials the fleet asks for. Control (abort, pause, weights) always needs the admin token."""

    inference: InferenceAuth = Field(
        default="Token",
        description="Token: generation at the gateway and the engines needs the fleet's inference token (Secret "
        "<fleet>-inference-token) or its admin token. Open: anyone who reaches them may generate (status.auth "
        "then says Open).",
    )


class RolloutFleetSpec(ApiModel):
    """The desired fleet: how many engines, serving what, where, and how changes roll out."""

    replicas: int = Field(default=1, ge=0, le=MAX_ENGINES, description="Number of engines.")
    model: ModelSpec = Field(description="The model every engine serves.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The engine each pod runs.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Where engine pods may run.")
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="The fleet's gateway.")
    update_strategy: UpdateStrategy = Field(default_factory=UpdateStrategy, description="How spec changes roll out.")
    drain_timeout_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="On scale-down and update, how long an engine may finish its in-flight requests before deletion.",
    )
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, description="Weight update settings.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Which pods may connect to the engines."
    )
    auth: AuthSpec = Field(default_factory=AuthSpec, description="Credentials the fleet asks for.")


class EngineStatus(ApiModel):
    """One engine as last observed."""

    name: str = Field(description="Pod name.")
    index: int = Field(ge=0, description="Stable index in the pod name <fleet>-engine-<index>.")
    phase: EnginePhase = Field(description="Starting, PendingSync, Ready, Paused, Syncing, Draining or Failed.")
    node: str | None = Field(default=None, description="Node the pod runs on.")
    # An explicit alias keeps Kubernetes' spelling; the choice keeps `pod_ip=` working for callers and mypy.
    pod_ip: str | None = Field(
        default=None,
        serialization_alias="podIP",
        validation_alias=AliasChoices("podIP", "pod_ip"),
        description="Pod IP.",
    )
    updated: bool = Field(default=True, description="Whether the pod matches the current spec.")
    weight_version: str | None = Field(default=None, description="Weight version the engine reports.")
    weights_manifest: str | None = Field(
        default=None,
        description="The proof of its bytes: the sha256 of the weight manifest that every tensor of its last "
        "update was verified against as it was loaded. An engine whose label is the fleet's version but whose "
        "manifest is not the one the push recorded is PendingSync. Empty: the weights it started with, or a "
        "collective push.",
    )
    in_flight: int | None = Field(default=None, ge=0, description="Requests running or waiting in the engine.")
    message: str | None = Field(default=None, description="Why the engine is in this phase, when not Ready.")


class PauseStatus(ApiModel):
    """The fleet's pause, while one is requested."""

    mode: PauseMode = Field(description="keep, wait or abort (from the rollfleet.dev/pause annotation).")
    since: datetime = Field(description="When the operator started pausing the fleet.")
    paused_engines: int = Field(default=0, ge=0, description="Engines that report being paused.")
    requested_by: str | None = Field(
        default=None,
        description="Who set the pause annotation: its field manager (kubectl-annotate, or "
        "rollfleet-client/<caller> when a trainer asked the gateway).",
    )


class GatewayStatus(ApiModel):
    """The gateway as last observed."""

    endpoint: str = Field(description="In-cluster URL of the gateway Service.")
    replicas: int = Field(default=0, ge=0, description="Gateway pods.")
    ready_replicas: int = Field(default=0, ge=0, description="Gateway pods that are ready.")


class RolloutFleetStatus(ApiModel):
    """What the operator last observed; only the operator writes it."""

    observed_generation: int | None = Field(default=None, description="The .metadata.generation last acted on.")
    replicas: int = Field(default=0, ge=0, description="Engine pods that exist and are not being deleted.")
    ready_replicas: int = Field(default=0, ge=0, description="Engines that serve (Ready or Paused).")
    updated_replicas: int = Field(default=0, ge=0, description="Engine pods that match the current spec.")
    ready: str = Field(default="0/0", description="readyReplicas/spec.replicas, for kubectl get.")
    selector: str = Field(default="", description="Label selector of the engine pods (for the scale subresource).")
    weight_version: str | None = Field(default=None, description="Weight version of the fleet.")
    engines: list[EngineStatus] = Field(
        default_factory=list,
        description=f"Every engine pod, in a fleet of at most {LISTED_ENGINES_MAX} engines. In a larger one, only "
        "those that need a look (not Ready or Paused, not on the fleet's weight version, or not updated), at most "
        f"{LISTED_ENGINES_MAX}: see enginesUnlisted and enginePhases. The status is one object in etcd.",
        # As written (controller.status.listed); the operator's own view in memory holds every engine.
        json_schema_extra={
            "maxItems": LISTED_ENGINES_MAX,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )
    engines_unlisted: int | None = Field(
        default=None,
        ge=0,
        description="Engines left out of `engines` (a fleet of more than "
        f"{LISTED_ENGINES_MAX}); each pod carries its phase in its rollfleet.dev/phase annotation.",
    )
    engine_phases: dict[str, int] = Field(
        default_factory=dict, description="How many engines are in each phase, listed or not."
    )
    pause: PauseStatus | None = Field(default=None, description="Set while the fleet is paused.")
    gateway: GatewayStatus | None = Field(default=None, description="The gateway, when enabled.")
    auth: InferenceAuth | None = Field(
        default=None,
        description="What generation needs, as the engines and the gateway were configured: Token (the fleet's "
        "inference or admin token) or Open (nothing: spec.auth.inference is Open).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded and Paused.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class RolloutFleet(ApiModel):
    """A RolloutFleet as read from the API server."""

    api_version: str = Field(default=API_VERSION)
    kind: str = Field(default=KIND)
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RolloutFleetSpec
    status: RolloutFleetStatus | None = None


CRD = CrdInfo(
    kind=KIND,
    plural=PLURAL,
    short_names=("rf",),
    description="A fleet of vLLM rollout engines on GPU node pools, with a gateway in front. Pause it for a "
    "weight update with `kubectl annotate rf/NAME rollfleet.dev/pause=keep` (or wait, abort); remove the "
    "annotation to resume.",
    spec_model=RolloutFleetSpec,
    status_model=RolloutFleetStatus,
    printer_columns=(
        PrinterColumn("Ready", "string", ".status.ready", "Engines serving / desired."),
        PrinterColumn("Desired", "integer", ".spec.replicas", "Desired engines."),
        PrinterColumn("Pods", "integer", ".spec.engine.podsPerEngine", "Pods each engine spans."),
        PrinterColumn("Up-to-date", "integer", ".status.updatedReplicas", "Engines matching the current spec."),
        PrinterColumn("Paused", "string", ".status.pause.mode", "Pause mode while paused."),
        PrinterColumn("Weights", "string", ".status.weightVersion", "Weight version of the fleet."),
        PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation."),
        PrinterColumn("Gateway", "string", ".status.gateway.endpoint", "In-cluster gateway URL.", priority=1),
        PrinterColumn("Model", "string", ".spec.model.servedName", "Served model name.", priority=1),
        PrinterColumn("Paused-by", "string", ".status.pause.requestedBy", "Who asked for the pause.", priority=1),
    ),
    scalable=True,
    root_validations=(
        cel(
            "self.metadata.name.size() <= 40",
            "RolloutFleet names are at most 40 characters: engine pods are named <fleet>-engine-<index>",
            field_path=".metadata.name",
        ),
        cel(
            "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
            "RolloutFleet names must start with a letter and hold only lowercase letters, digits and '-': the "
            "gateway Service is named after the fleet",
            field_path=".metadata.name",
        ),
    ),
)
