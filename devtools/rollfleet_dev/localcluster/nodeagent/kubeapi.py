"""A small asyncio client for the kube-apiserver: requests, list+watch, kubeconfig.

Why not the `kubernetes` package: its sync client needs a thread per watch and turns
every object into model classes, which costs real CPU on a 2-core machine shared with
the control plane and vLLM. Plain aiohttp with JSON dicts is enough for the handful of
endpoints the agent uses. Talks to: the kube-apiserver only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import yaml

from rollfleet.errors import RollfleetError

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class ApiError(RollfleetError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class KubeConfig:
    server: str
    token: str | None
    ssl: ssl.SSLContext

    @property
    def host_port(self) -> tuple[str, int]:
        """The API server's address, as in-pod clients see it (`KUBERNETES_SERVICE_HOST/PORT`)."""
        url = urlparse(self.server)
        return url.hostname or "127.0.0.1", url.port or 443


def load_kubeconfig(path: Path) -> KubeConfig:
    """The current context's server and credentials (token or client certificate)."""
    doc = yaml.safe_load(path.read_text())
    ctx_name = doc["current-context"]
    ctx = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
    user: dict[str, Any] = next((u["user"] for u in doc.get("users", []) if u["name"] == ctx.get("user")), {})

    def resolve(p: str) -> str:
        return str((path.parent / p).resolve())

    context = ssl.create_default_context()
    if cluster.get("insecure-skip-tls-verify"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif "certificate-authority-data" in cluster:
        context.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    elif "certificate-authority" in cluster:
        context.load_verify_locations(cafile=resolve(cluster["certificate-authority"]))
    if "client-certificate-data" in user or "client-certificate" in user:
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = Path(tmp, "c"), Path(tmp, "k")
            cert.write_bytes(
                base64.b64decode(user["client-certificate-data"])
                if "client-certificate-data" in user
                else Path(resolve(user["client-certificate"])).read_bytes()
            )
            key.write_bytes(
                base64.b64decode(user["client-key-data"])
                if "client-key-data" in user
                else Path(resolve(user["client-key"])).read_bytes()
            )
            context.load_cert_chain(cert, key)
    return KubeConfig(server=cluster["server"].rstrip("/"), token=user.get("token"), ssl=context)


class Api:
    """JSON over HTTPS to one API server, with the agent's (admin) credentials."""

    def __init__(self, config: KubeConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self._session = aiohttp.ClientSession(
            base_url=config.server,
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=config.ssl, limit=32),
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        limit_s: float = 30,
    ) -> Obj:
        data = None if body is None else json.dumps(body)
        async with self._session.request(
            method,
            path,
            data=data,
            params=params,
            headers={"Content-Type": content_type},
            timeout=aiohttp.ClientTimeout(total=limit_s),
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, text)
            return json.loads(text) if text else {}

    async def get(self, path: str, **params: str) -> Obj:
        return await self.request("GET", path, params=params or None)

    async def get_or_none(self, path: str) -> Obj | None:
        try:
            return await self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, path: str, body: Obj) -> Obj:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, body: Obj) -> Obj:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")

    async def strategic_patch(self, path: str, body: Obj) -> Obj:
        return await self.request("PATCH", path, body, content_type="application/strategic-merge-patch+json")

    async def delete(self, path: str, body: Obj | None = None) -> Obj:
        return await self.request("DELETE", path, body)

    async def _watch_stream(self, path: str, params: dict[str, str]) -> AsyncIterator[Obj]:
        async with self._session.get(
            path,
            params={**params, "watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": "300"},
            timeout=aiohttp.ClientTimeout(total=None, sock_read=330),
        ) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text())
            async for line in resp.content:
                if line.strip():
                    yield json.loads(line)

    async def informer(
        self,
        path: str,
        on_event: Callable[[str, Obj], Awaitable[None]],
        on_synced: Callable[[], Awaitable[None]] | None = None,
        **params: str,
    ) -> None:
        """List then watch `path` forever, calling `on_event(type, obj)` for ADDED/MODIFIED/DELETED.

        After a re-list (watch expired, connection lost) objects that vanished meanwhile are
        reported as DELETED, so the caller's view converges like a client-go informer's.
        """
        known: dict[str, Obj] = {}
        synced = False
        while True:
            try:
                listing = await self.get(path, **params)
                current = {o["metadata"]["uid"]: o for o in listing.get("items", [])}
                for uid, obj in list(known.items()):
                    if uid not in current:
                        del known[uid]
                        await on_event("DELETED", obj)
                for uid, obj in current.items():
                    if known.get(uid, {}).get("metadata", {}).get("resourceVersion") != obj["metadata"].get(
                        "resourceVersion"
                    ):
                        known[uid] = obj
                        await on_event("ADDED", obj)
                if not synced and on_synced is not None:
                    await on_synced()
                synced = True
                rv = listing["metadata"]["resourceVersion"]
                while True:
                    async for ev in self._watch_stream(path, {**params, "resourceVersion": rv}):
                        kind, obj = ev["type"], ev["object"]
                        if kind == "ERROR":
                            raise ApiError(obj.get("code", 500), obj.get("message", ""))
                        rv = obj["metadata"]["resourceVersion"]
                        if kind == "BOOKMARK":
                            continue
                        uid = obj["metadata"]["uid"]
                        if kind == "DELETED":
                            known.pop(uid, None)
                        else:
                            known[uid] = obj
                        await on_event(kind, obj)
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if e.status != 410:  # 410 Gone: our resourceVersion is too old; a re-list is the cure
                    log.warning("watch %s: %s", path, e)
                    await asyncio.sleep(1)
            except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
                log.warning("watch %s: %s; re-listing", path, e)
                await asyncio.sleep(1)
            except Exception:  # a handler's bug must not end the watch for good
                log.exception("watch %s: event handler failed; re-listing", path)
                await asyncio.sleep(1)
