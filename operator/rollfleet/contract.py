"""The contract between Rollfleet's components: every name, label, annotation, phase,
pause mode, port and path that one component writes and another reads.

Owns the API group, the labels and annotations on pods, fleets, requests and result
ConfigMaps, the `EnginePhase` enum and the phases the gateway routes to, the ports of
engines and gateways, the names of the objects a fleet owns (`<fleet>-engine-<i>`,
`<fleet>-gateway`, `<fleet>-admin-token`, ...), the engine pods' label selectors, and how
the admin token is stored in and read from its Secret.

Imported by the operator (fleet and request controllers), the gateway, the sync sidecar,
the CRD models (`rollfleet.api`), the demo, and the tests, e2e tests and benchmarks; none
of them re-declares what is here. The engine's own HTTP API (routes, headers, pause
modes) is owned by the engine package, `rollfleet_engine.protocol`, which must not
import `rollfleet`: this module re-exports what of it the other components use.

Pure: no I/O, no pydantic; cheap to import from every process.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from enum import StrEnum

# The gateway's public API, re-exported: the trainer client's distribution owns it and imports
# nothing of the operator's.
from rollfleet_client.protocol import COMPONENT_GATEWAY as COMPONENT_GATEWAY
from rollfleet_client.protocol import GATEWAY_PORT as GATEWAY_PORT
from rollfleet_client.protocol import INFERENCE_TOKEN_FILE as INFERENCE_TOKEN_FILE
from rollfleet_client.protocol import INFERENCE_TOKEN_MOUNT_DIR as INFERENCE_TOKEN_MOUNT_DIR
from rollfleet_client.protocol import TOKEN_FILE as TOKEN_FILE
from rollfleet_client.protocol import TOKEN_KEY as TOKEN_KEY
from rollfleet_client.protocol import TOKEN_MOUNT_DIR as TOKEN_MOUNT_DIR
from rollfleet_client.protocol import gateway_endpoint as gateway_endpoint
from rollfleet_client.protocol import gateway_name as gateway_name
from rollfleet_client.sync_protocol import SYNC_API_PORT as SYNC_API_PORT
from rollfleet_client.sync_protocol import SYNC_HEALTH_PORT as SYNC_HEALTH_PORT
from rollfleet_client.sync_protocol import SYNC_WEIGHTS_PORT as SYNC_WEIGHTS_PORT

# The engine's API, re-exported: the engine package owns it and cannot import this module.
from rollfleet_engine.protocol import ABORT_PATH as ABORT_PATH
from rollfleet_engine.protocol import COLLECTIVE_BACKENDS as COLLECTIVE_BACKENDS
from rollfleet_engine.protocol import ENGINE_PORT as ENGINE_PORT
from rollfleet_engine.protocol import HTTP_WEIGHT_BACKEND as HTTP_WEIGHT_BACKEND
from rollfleet_engine.protocol import PAUSE_MODES as PAUSE_MODES
from rollfleet_engine.protocol import READY_PATH as READY_PATH
from rollfleet_engine.protocol import REQUEST_ID_HEADER as REQUEST_ID_HEADER
from rollfleet_engine.protocol import REQUESTS_PATH as REQUESTS_PATH
from rollfleet_engine.protocol import STATE_PATH as STATE_PATH
from rollfleet_engine.protocol import PauseMode as PauseMode
from rollfleet_engine.protocol import parse_pause_mode as parse_pause_mode

# --- API group ----------------------------------------------------------------------
GROUP = "rollfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# --- labels -------------------------------------------------------------------------
# Every object Rollfleet creates carries these (the gateway and the sidecar select engines by them).
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_FLEET = f"{GROUP}/fleet"
LABEL_INDEX = f"{GROUP}/engine-index"
# On the result ConfigMaps: which request they belong to, and their order.
LABEL_REQUEST = f"{GROUP}/request"
LABEL_REQUEST_UID = f"{GROUP}/request-uid"
LABEL_CHUNK = f"{GROUP}/chunk"
# On a spare runner's objects: the results claim it mounts (its name, or a digest of a long one).
LABEL_RESULTS_CLAIM = f"{GROUP}/results-claim"

APP_NAME = "rollfleet"  # the value of LABEL_NAME
# The value of LABEL_MANAGED_BY, and the operator's field manager and Event source.
MANAGER = "rollfleet-operator"
# Values of LABEL_COMPONENT.
COMPONENT_ENGINE = "engine"
# The pods of a multi-pod engine other than its leader (which is the `engine` pod): vLLM's headless ranks.
COMPONENT_ENGINE_RANK = "engine-rank"
COMPONENT_ADMIN_TOKEN = "admin-token"
COMPONENT_INFERENCE_TOKEN = "inference-token"
COMPONENT_RESULTS = "results"  # a RolloutRequest's result ConfigMaps
# A RolloutRequest's runner: the Job that sends its samples, with its ServiceAccount and RBAC.
COMPONENT_RUNNER = "runner"
# A spare runner: a runner Job started ahead of the next request naming its fleet and results claim, which
# that request takes (its pod already running) instead of starting one of its own.
COMPONENT_SPARE_RUNNER = "runner-spare"
# The pods that run the sync sidecar (manifests/sync/trainer-job.yaml): with the fleet
# label, what the engines' NetworkPolicy admits as the fleet's trainers. Also the
# ServiceAccount and RBAC the operator makes for them.
COMPONENT_TRAINER = "trainer"
# The ConfigMap holding the fleet's weight-sync record: written by the sync sidecar, read
# by the operator, reset by it when spec.model changes.
COMPONENT_WEIGHTS = "weights"

# --- annotations --------------------------------------------------------------------
# On the engine pod (written by the operator, read by the gateway) ...
ANNOTATION_PHASE = f"{GROUP}/phase"
ANNOTATION_DRAINING_SINCE = f"{GROUP}/draining-since"
ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"
# The generation of the weights the engine serves (as it last reported them): the gateway routes a request
# with a staleness bound (X-Rollfleet-Max-Weight-Lag) only to engines within it of the newest.
ANNOTATION_WEIGHT_GENERATION = f"{GROUP}/weight-generation"
# How many engines of this index (and template) crashed in a row before this one: its backoff.
ANNOTATION_CRASHES = f"{GROUP}/crashes"
# ... on the RolloutFleet (written by people) ...
ANNOTATION_PAUSE = f"{GROUP}/pause"
ANNOTATION_RESUME = f"{GROUP}/resume"
# Optional, set by a person on the fleet: how many generations behind a request may run.
ANNOTATION_MAX_STALENESS = f"{GROUP}/max-staleness"
# ... and on the RolloutRequest, set by people: a new value aborts every in-flight sample
# once (the status records the value acted on).
ANNOTATION_ABORT = f"{GROUP}/abort"


# --- the weight-sync record: keys of the `<fleet>-weights` ConfigMap's data -----------
RECORD_SYNC_STATE = "sync-state"  # JSON: the whole record (rollfleet.sync.protocol)
RECORD_WEIGHT_VERSION = "weight-version"  # the committed version, repeated for people
RECORD_WEIGHT_GENERATION = "weight-generation"
RECORD_WEIGHTS_URL = "weights-url"
RECORD_MODEL = "model"  # the spec.model the record is for (written by the operator)
# The engine pod template the fleet rolls to (the operator's): a version is adopted from the
# engines only once every engine runs it, never from engines a rollout is replacing.
RECORD_ENGINE_TEMPLATE = "engine-template-hash"


# --- engine phases ------------------------------------------------------------------
class EnginePhase(StrEnum):
    """An engine's phase: in the fleet's status and on its pod's `rollfleet.dev/phase` annotation."""

    STARTING = "Starting"
    PENDING_SYNC = "PendingSync"
    READY = "Ready"
    PAUSED = "Paused"
    SYNCING = "Syncing"
    DRAINING = "Draining"
    FAILED = "Failed"


# Phases in which an engine serves requests (or holds them, while paused): the gateway
# routes only to these, and the fleet counts them as ready.
ROUTABLE_PHASES: frozenset[str] = frozenset({EnginePhase.READY, EnginePhase.PAUSED})

# --- ports (ENGINE_PORT and GATEWAY_PORT, above, are the engine's and the gateway's) ----
# The sync sidecar's (SYNC_API_PORT, SYNC_WEIGHTS_PORT, SYNC_HEALTH_PORT) are re-exported above
# from rollfleet_client.sync_protocol, which owns the sidecar's trainer API.
OPERATOR_HEALTH_PORT = 8081  # kopf's liveness probe
OPERATOR_METRICS_PORT = 8082  # Prometheus /metrics (docs/metrics.md)

# --- the admin token ----------------------------------------------------------------
# Where the admin-token Secret is mounted (TOKEN_FILE, above: trainer pods read it too), and its one key.

# The operator's own key, from which it derives every fleet's token (rollfleet.controller.tokens):
# a Secret in the operator's namespace, the one Secret the operator may read.
OPERATOR_NAMESPACE = "rollfleet-system"  # manifests/base; where an operator outside a pod keeps its key
OPERATOR_KEY_SECRET = "rollfleet-operator-key"
OPERATOR_KEY_DATA = "key"


def token_secret_data(token: str) -> dict[str, str]:
    """The `data` of a token Secret (the admin token's or the inference token's) holding `token`."""
    return {TOKEN_KEY: base64.b64encode(token.encode()).decode()}


def secret_token(data: Mapping[str, str] | None) -> str | None:
    """The token in a token Secret's `data` (base64, as the API serves it), or None without one."""
    return base64.b64decode((data or {}).get(TOKEN_KEY, "")).decode() or None


# --- names of what a fleet owns -----------------------------------------------------
def engine_pod_name(fleet: str, index: int) -> str:
    return f"{fleet}-{COMPONENT_ENGINE}-{index}"


def engine_index(pod_name: str, fleet: str) -> int | None:
    """The index in `<fleet>-engine-<index>`, or in `<fleet>-engine-<index>-0` (the leader pod of a multi-pod
    engine's group, which LWS names after the group); None for a name that is not an engine of this fleet."""
    prefix = f"{fleet}-{COMPONENT_ENGINE}-"
    rest = pod_name[len(prefix) :] if pod_name.startswith(prefix) else ""
    rest = rest.removesuffix(GROUP_LEADER_SUFFIX)
    return int(rest) if rest.isdigit() and str(int(rest)) == rest else None


# A multi-pod engine's LeaderWorkerSet is named like a single-pod engine; LWS names its one group's leader pod
# `<LWS>-0` and the other ranks `<LWS>-0-<rank>`.
GROUP_LEADER_SUFFIX = "-0"
# LeaderWorkerSet's API (sigs.k8s.io/lws): what the operator creates for a multi-pod engine, the label LWS puts
# on every pod of it, and what its pod webhook tells each pod.
LWS_API_GROUP = "leaderworkerset.x-k8s.io"
LWS_API = (LWS_API_GROUP, "v1")
LWS_API_VERSION = "/".join(LWS_API)
LWS_PLURAL = "leaderworkersets"
LWS_LABEL_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_ENV_GROUP_SIZE = "LWS_GROUP_SIZE"
LWS_ENV_WORKER_INDEX = "LWS_WORKER_INDEX"


def engine_group_leader(group: str) -> str:
    """The leader pod (the engine, as the fleet's status names it) of the group `engine_pod_name` names."""
    return group + GROUP_LEADER_SUFFIX


def engine_sa_name(fleet: str) -> str:
    return f"{fleet}-{COMPONENT_ENGINE}"


def secret_name(fleet: str) -> str:
    """The admin-token Secret."""
    return f"{fleet}-{COMPONENT_ADMIN_TOKEN}"


def inference_secret_name(fleet: str) -> str:
    """The inference-token Secret: what a client needs to generate (unless spec.auth.inference is Open)."""
    return f"{fleet}-{COMPONENT_INFERENCE_TOKEN}"


def weights_record_name(fleet: str) -> str:
    """The ConfigMap holding the weight-sync record."""
    return f"{fleet}-{COMPONENT_WEIGHTS}"


def trainer_name(fleet: str) -> str:
    """The trainers' ServiceAccount, and the Role and RoleBinding of what their sync sidecar may do."""
    return f"{fleet}-{COMPONENT_TRAINER}"


# A Job's name is a label value on its pods (at most 63 characters), and they add 6 of their own.
MAX_JOB_NAME = 57


def runner_name(request: str) -> str:
    """The runner Job of a RolloutRequest, and its ServiceAccount, Role and RoleBinding. A request name
    too long for a Job keeps its start and gets a digest of the whole, so names stay unique."""
    name = f"{request}-{COMPONENT_RUNNER}"
    if len(name) <= MAX_JOB_NAME:
        return name
    digest = hashlib.sha256(request.encode()).hexdigest()[:8]
    return f"{request[: MAX_JOB_NAME - len(COMPONENT_RUNNER) - 10].rstrip('-.')}-{digest}-{COMPONENT_RUNNER}"


# A runner's ServiceAccount starts with this, and no other account may (docs/security.md): the
# admission policy `rollfleet-runner-results-only` knows runners by it.
RUNNER_ACCOUNT_PREFIX = f"{APP_NAME}-{COMPONENT_RUNNER}-"
MAX_ACCOUNT_NAME = 253
# Of a request name too long for its account, the characters kept before "<digest of 8>".
RUNNER_ACCOUNT_KEEP = MAX_ACCOUNT_NAME - len(RUNNER_ACCOUNT_PREFIX) - 8


def runner_account(request: str) -> str:
    """The ServiceAccount a RolloutRequest's runner runs as: `rollfleet-runner-<request>`; a request
    name too long for that keeps its start and gets a digest of the whole, joined with no separator:
    hex digits may follow any character of a name ("a.-1f" would not be a valid name, "a.1f" is)."""
    name = RUNNER_ACCOUNT_PREFIX + request
    if len(name) <= MAX_ACCOUNT_NAME:
        return name
    digest = hashlib.sha256(request.encode()).hexdigest()[:8]
    return f"{RUNNER_ACCOUNT_PREFIX}{request[:RUNNER_ACCOUNT_KEEP]}{digest}"


# A spare runner's Job, ServiceAccount, Role, RoleBinding and assignment ConfigMap share one name: this prefix
# and random hex. Not the runners' prefix: the admission policy must not take a spare for a request's runner.
SPARE_RUNNER_PREFIX = f"{APP_NAME}-spare-"


def results_claim_label(claim: str) -> str:
    """A results claim as a label value (at most 63 characters): its name, or for a longer one a digest."""
    return claim if len(claim) <= 63 else "sha256-" + hashlib.sha256(claim.encode()).hexdigest()[:40]


# Results in ConfigMaps stop at 16 MiB (api.request.CONFIG_MAP_RESULTS_LIMIT) in chunks of 900 KiB: 19,
# with room for what one flush writes past the limit before the run fails.
MAX_RESULT_CHUNKS = 32


def results_chunk_name(request: str, uid: str, index: int) -> str:
    """A chunk of a request's results in ConfigMaps (the uid part keeps a re-created request from
    meeting its predecessor's chunks)."""
    return f"{request}-{uid[:8]}-{index:04d}"


def network_policy_name(fleet: str) -> str:
    return f"{fleet}-{COMPONENT_ENGINE}"


def disruption_budget_name(fleet: str) -> str:
    """The PodDisruptionBudget of a fleet's engine pods."""
    return f"{fleet}-{COMPONENT_ENGINE}"


def engine_url(ip: str, port: int = ENGINE_PORT) -> str:
    """Base URL of the engine at a pod IP."""
    return f"http://{ip}:{port}"


# --- labels and selectors -----------------------------------------------------------
def component_labels(fleet: str, component: str) -> dict[str, str]:
    return {LABEL_NAME: APP_NAME, LABEL_COMPONENT: component, LABEL_FLEET: fleet}


def selector(labels: Mapping[str, str]) -> str:
    """A label selector matching every label given."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def engine_selector(fleet: str) -> str:
    """All labels of the fleet's engine pods, as the scale subresource (`status.selector`) wants it."""
    return selector(component_labels(fleet, COMPONENT_ENGINE))


def engine_discovery_selector(fleet: str) -> str:
    """How the gateway, the sync sidecar and the demo find the fleet's engine pods."""
    return selector({LABEL_FLEET: fleet, LABEL_COMPONENT: COMPONENT_ENGINE})
