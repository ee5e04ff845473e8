"""Who may call which route: route classes, token files and the access decision.

Pure apart from reading token files. The rule is deny by default: a route that is
not known to be open or inference is a control route and needs the control token, so
a route added by a future vLLM is protected without anyone noticing it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from rollfleet_engine.protocol import READY_PATH, REQUESTS_PATH, STATE_PATH


class RouteClass(StrEnum):
    OPEN = "open"  # health, metrics, model list, read-only state
    INFERENCE = "inference"  # generation; needs the inference token when one is configured
    CONTROL = "control"  # anything that changes the engine; needs the control token
    UNSAFE = "unsafe"  # runs arbitrary code or reshapes the cluster; off unless enabled


_OPEN_EXACT = {
    "/health",
    "/ping",
    "/version",
    "/load",
    "/v1/models",
    "/is_paused",
    "/is_sleeping",
    "/weight_info",
    "/get_world_size",
    STATE_PATH,
    READY_PATH,
}
_OPEN_GET_PREFIXES = ("/metrics", REQUESTS_PATH)
_UNSAFE_EXACT = {"/collective_rpc", "/scale_elastic_ep"}
_INFERENCE_EXACT = {"/inference/v1/generate", "/invocations", "/tokenize", "/detokenize", "/generative_scoring"}
# Under /v1/ everything is inference except what changes the server.
_V1_CONTROL = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}


def classify(method: str, path: str) -> RouteClass:
    """The class of a request, from its method and path alone."""
    path = path.rstrip("/") or "/"
    if path in _UNSAFE_EXACT:
        return RouteClass.UNSAFE
    if (path in _OPEN_EXACT and method in ("GET", "HEAD")) or path in ("/health", "/ping"):
        return RouteClass.OPEN
    if method in ("GET", "HEAD") and any(path == p or path.startswith(p + "/") for p in _OPEN_GET_PREFIXES):
        return RouteClass.OPEN
    if path in _INFERENCE_EXACT or (path.startswith("/v1/") and path not in _V1_CONTROL):
        return RouteClass.INFERENCE
    return RouteClass.CONTROL


def read_token(path: str | Path) -> str:
    """The token in a mounted secret file; an empty token is refused (it would accept empty headers)."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def token_matches(presented: str | None, expected: str) -> bool:
    # Constant-time: the comparison must not leak how many leading characters matched.
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


@dataclass(frozen=True)
class AccessPolicy:
    control_token: str
    inference_token: str | None = None
    allow_unsafe_routes: bool = False

    def decide(self, method: str, path: str, authorization: str | None) -> tuple[int, str] | None:
        """None when the request may proceed, else (HTTP status, reason)."""
        kind = classify(method, path)
        if kind is RouteClass.OPEN:
            return None
        presented = bearer(authorization)
        if kind is RouteClass.UNSAFE and not self.allow_unsafe_routes:
            return 403, f"{path} runs arbitrary code; start the engine with --allow-unsafe-routes to enable it"
        if token_matches(presented, self.control_token):
            return None
        if kind is RouteClass.INFERENCE and (
            self.inference_token is None or token_matches(presented, self.inference_token)
        ):
            return None
        return 401, "missing or wrong bearer token"
