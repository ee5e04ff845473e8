"""The gateway's public HTTP contract: port, names, paths and headers. Pure constants.

The one place these are spelled: the gateway (`rollfleet.gateway`), the operator's
RolloutRequest runner and this client import them (through `rollfleet.contract` on the
operator's side). The engine package spells the headers it shares with the gateway
(`X-Request-Id`, `X-Rollfleet-Weight-Version`) in `rollfleet_engine.protocol`; a unit
test holds the two equal, since this distribution depends on nothing of Rollfleet's.
"""

from __future__ import annotations

GATEWAY_PORT = 8080
COMPONENT_GATEWAY = "gateway"

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
GENERATE_PATH = "/inference/v1/generate"  # vLLM's token-in/token-out route
ABORT_PATH = "/v1/abort"  # needs the fleet's admin token
READY_PATH = "/ready"

REQUEST_ID_HEADER = "X-Request-Id"  # the caller's id: the key of abort, everywhere
WEIGHT_VERSION_HEADER = "X-Rollfleet-Weight-Version"  # every weight version that produced the answer
SESSION_HEADER = "X-Session-Id"  # a multi-turn session stays on one engine
GROUP_HEADER = "X-Group-Id"  # GRPO: the n samples of one prompt share one engine (and its prefix cache)
SESSION_END_HEADER = "X-Session-End"
TIMEOUT_HEADER = "X-Rollfleet-Timeout"  # seconds: the gateway stops the request at the engine after this

# Where a pod that mounts the fleet's admin-token Secret finds the token.
TOKEN_MOUNT_DIR = "/var/run/secrets/rollfleet"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_MOUNT_DIR}/{TOKEN_KEY}"


def gateway_name(fleet: str) -> str:
    """The gateway's Deployment, Service, ServiceAccount and Role."""
    return f"{fleet}-{COMPONENT_GATEWAY}"


def gateway_endpoint(fleet: str, namespace: str) -> str:
    """The in-cluster URL of the fleet's gateway Service."""
    return f"http://{gateway_name(fleet)}.{namespace}.svc:{GATEWAY_PORT}"
