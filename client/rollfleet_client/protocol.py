"""The gateway's public HTTP contract: port, names, paths and headers. Pure constants.

The one place these are spelled: the gateway (`rollfleet.gateway`), the operator's
RolloutRequest runner and this client import them (through `rollfleet.contract` on the
operator's side). The engine package spells the headers it shares with the gateway
(`X-Request-Id`, `X-Rollfleet-Weight-Version`, `X-Rollfleet-Max-Weight-Lag`) in `rollfleet_engine.protocol`; a unit
test holds the two equal, since this distribution depends on nothing of Rollfleet's.
"""

from __future__ import annotations

GATEWAY_PORT = 8080
COMPONENT_GATEWAY = "gateway"

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
GENERATE_PATH = "/inference/v1/generate"  # vLLM's token-in/token-out route
ABORT_PATH = "/v1/abort"  # needs the fleet's admin token
# The trainer's control routes (the fleet's admin token): the fleet's state, and its pause. A pause
# asked for here is the `rollfleet.dev/pause` annotation on the RolloutFleet, set by the gateway as
# the field manager CALLER_MANAGER_PREFIX/<caller>: the same path as `kubectl annotate`.
FLEET_PATH = "/v1/fleet"
FLEET_PAUSE_PATH = "/v1/fleet/pause"
FLEET_RESUME_PATH = "/v1/fleet/resume"
CALLER_HEADER = "X-Rollfleet-Caller"  # who asks (the trainer's pod name by default): [A-Za-z0-9._-]{1,100}
CALLER_MANAGER_PREFIX = "rollfleet-client"
READY_PATH = "/ready"
# TRL's VLLMClient (GRPOTrainer's vllm_mode="server"; TRL 1.11+ speaks `vllm serve`'s own routes)
# takes the gateway under this prefix as one vLLM server for generation: base_url=<gateway>/trl.
# The TRL_* paths are relative to it: vLLM's own route names, as TRL calls them.
TRL_PREFIX = "/trl"
TRL_HEALTH_PATH = "/health"  # 200 while an engine is routable
TRL_MODELS_PATH = "/v1/models"
TRL_WORLD_SIZE_PATH = "/get_world_size"  # engines serve it too: the gateway answers the sum of theirs
TRL_RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"  # ... and this one: the gateway calls every routable engine's
# Answered 501: vLLM's NCCL weight transfer (Rollfleet syncs weights through its sync sidecar; the
# last three are rollfleet_engine.protocol's paths, held equal by a unit test), and multimodal features.
TRL_WEIGHT_SYNC_PATHS = (
    "/server_info",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
TRL_MULTIMODAL_PATHS = (f"{CHAT_PATH}/render", GENERATE_PATH)
# vLLM's RL control routes, answered at the gateway's root (and under TRL_PREFIX) with the fleet's meaning
# (rollfleet.gateway.vllm_api); with TRL_WORLD_SIZE_PATH and TRL_RESET_PREFIX_CACHE_PATH, vLLM's names.
VLLM_PAUSE_PATH = "/pause"  # ?mode=abort|wait|keep: the fleet's pause
VLLM_RESUME_PATH = "/resume"
VLLM_IS_PAUSED_PATH = "/is_paused"
VLLM_ABORT_REQUESTS_PATH = "/abort_requests"
VLLM_WEIGHT_INFO_PATH = "/weight_info"
VLLM_UPDATE_WEIGHT_VERSION_PATH = "/update_weight_version"  # answered 501: a fleet's versions come from its pushes

REQUEST_ID_HEADER = "X-Request-Id"  # the caller's id: the key of abort, everywhere
WEIGHT_VERSION_HEADER = "X-Rollfleet-Weight-Version"  # every weight version that produced the answer
SESSION_HEADER = "X-Session-Id"  # a multi-turn session stays on one engine
GROUP_HEADER = "X-Group-Id"  # GRPO: the n samples of one prompt share one engine (and its prefix cache)
SESSION_END_HEADER = "X-Session-End"
TIMEOUT_HEADER = "X-Rollfleet-Timeout"  # seconds: the gateway stops the request at the engine after this
# Generations the request's tokens may lag the fleet's newest weights: routed within it, aborted at a push past it.
MAX_WEIGHT_LAG_HEADER = "X-Rollfleet-Max-Weight-Lag"
# W3C Trace Context: the gateway forwards a well-formed pair to the engine (vLLM's spans join the caller's trace).
TRACEPARENT_HEADER, TRACESTATE_HEADER = "traceparent", "tracestate"

# Where a pod that mounts the fleet's admin-token Secret finds the token.
TOKEN_MOUNT_DIR = "/var/run/secrets/rollfleet"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_MOUNT_DIR}/{TOKEN_KEY}"
# ... and the inference-token Secret (`<fleet>-inference-token`, the same key): generation only, at the
# gateway and the engines. A pod that only generates mounts this one; the admin token opens inference too.
INFERENCE_TOKEN_MOUNT_DIR = "/var/run/secrets/rollfleet-inference"
INFERENCE_TOKEN_FILE = f"{INFERENCE_TOKEN_MOUNT_DIR}/{TOKEN_KEY}"


def gateway_name(fleet: str) -> str:
    """The gateway's Deployment, Service, ServiceAccount and Role."""
    return f"{fleet}-{COMPONENT_GATEWAY}"


def gateway_endpoint(fleet: str, namespace: str) -> str:
    """The in-cluster URL of the fleet's gateway Service."""
    return f"http://{gateway_name(fleet)}.{namespace}.svc:{GATEWAY_PORT}"
