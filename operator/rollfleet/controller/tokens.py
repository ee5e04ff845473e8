"""Fleets' admin tokens, derived from one operator key, so the operator never reads a Secret back.

The operator keeps a random key in the Secret `rollfleet-operator-key` of its own namespace,
made at its first start. A fleet's token is HMAC-SHA256(key, "<namespace>/<name>/<uid>"):
the operator writes it once into the fleet's Secret `<fleet>-admin-token`, which engines,
gateways and trainer pods mount, and after a restart derives it again instead of reading
that Secret. Its inference token (generation only) is HMAC-SHA256(key, ".../<uid>/inference"),
in `<fleet>-inference-token`. So its ServiceAccount may create Secrets anywhere but read only its key (a Role
with `resourceNames`, manifests/base/rbac.yaml). A RolloutRequest's runner, which has no key,
reads the token from its fleet's Secret mounted in its pod (`FileTokens`). Talks to
kube-apiserver (the key Secret, through `rollfleet.kube`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
from pathlib import Path
from typing import Any, Protocol

from rollfleet.contract import OPERATOR_KEY_DATA, OPERATOR_KEY_SECRET
from rollfleet.errors import RollfleetError
from rollfleet.kube import SECRET, ApiError, Kube

KEY_BYTES = 32
INFERENCE = "inference"  # the purpose of a fleet's inference token


class OperatorKeyError(RollfleetError, RuntimeError):
    """The operator's key Secret cannot be read or made: the message says what to fix."""


def fleet_token(key: bytes, namespace: str, name: str, uid: str, purpose: str = "") -> str:
    """The admin token of the fleet with this identity (a new fleet of the same name gets another one); with
    `purpose` ("inference"), another token of the same fleet, which the admin token cannot be derived from."""
    message = f"{namespace}/{name}/{uid}" + (f"/{purpose}" if purpose else "")
    digest = hmac.new(key, message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def key_secret(namespace: str, key: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": OPERATOR_KEY_SECRET, "namespace": namespace},
        "data": {OPERATOR_KEY_DATA: base64.b64encode(key).decode()},
    }


class FleetTokens(Protocol):
    """Where a fleet's admin token comes from; None while the fleet has none yet."""

    async def token(self, kube: Kube, namespace: str, name: str, uid: str) -> str | None: ...


class FileTokens:
    """The token of the one fleet whose Secret is mounted at `path`, read each time: the kubelet
    updates the file when the Secret changes (a re-created fleet) or appears (a new one)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    async def token(self, kube: Kube, namespace: str, name: str, uid: str) -> str | None:
        try:
            return self.path.read_text().strip() or None
        except FileNotFoundError:
            return None


class OperatorKey:
    """The key, read (or made) once, on first use."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._key: bytes | None = None
        self._lock = asyncio.Lock()

    async def token(self, kube: Kube, namespace: str, name: str, uid: str) -> str:
        return fleet_token(await self._get(kube), namespace, name, uid)

    async def inference_token(self, kube: Kube, namespace: str, name: str, uid: str) -> str:
        return fleet_token(await self._get(kube), namespace, name, uid, INFERENCE)

    async def _get(self, kube: Kube) -> bytes:
        async with self._lock:
            if self._key is None:
                self._key = await self._load(kube)
            return self._key

    async def _load(self, kube: Kube) -> bytes:
        where = f"Secret {self.namespace}/{OPERATOR_KEY_SECRET}"
        try:
            # Made before read (kept if it exists), so two operators starting at once agree on the first one.
            await kube.create_kept(key_secret(self.namespace, secrets.token_bytes(KEY_BYTES)))
            secret = await kube.get(SECRET, self.namespace, OPERATOR_KEY_SECRET)
        except ApiError as err:
            raise OperatorKeyError(
                f"cannot make or read {where} ({err.status} {err.reason}): the operator derives every fleet's "
                "token from it. Create the namespace, grant the operator `get` on that Secret "
                "(manifests/base/rbac.yaml), or pass --key-namespace"
            ) from err
        key = base64.b64decode((secret.get("data") or {}).get(OPERATOR_KEY_DATA, ""))
        if len(key) < KEY_BYTES:
            raise OperatorKeyError(f"{where} holds no key of {KEY_BYTES} bytes under {OPERATOR_KEY_DATA!r}")
        return key
