"""A userspace service proxy for Services with loopback ClusterIPs (the local cluster's range).

For each TCP port of each such Service it listens on clusterIP:port and forwards every
connection to a ready endpoint of the Service's EndpointSlices, round robin. Services
and EndpointSlices come from watches. `wanted_listeners` and `backends` are pure.
Talks to: the kube-apiserver (watches), and the pods it forwards to.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from rollfleet.localcluster.nodeagent.kubeapi import Api

log = logging.getLogger(__name__)

Obj = dict[str, Any]
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ListenerKey:
    ip: str
    port: int
    namespace: str
    service: str
    port_name: str


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def wanted_listeners(services: list[Obj]) -> set[ListenerKey]:
    out = set()
    for svc in services:
        spec = svc.get("spec", {})
        ips = spec.get("clusterIPs") or [spec.get("clusterIP", "")]
        for ip in ips:
            if not is_loopback(ip):
                continue
            for p in spec.get("ports") or []:
                if p.get("protocol", "TCP") == "TCP":
                    out.add(ListenerKey(ip, int(p["port"]), svc["metadata"]["namespace"], svc["metadata"]["name"],
                                        p.get("name", "")))
    return out


def backends(slices: list[Obj], port_name: str) -> list[tuple[str, int]]:
    """Ready (or readiness-unknown) endpoint addresses for the service port named `port_name`."""
    out: list[tuple[str, int]] = []
    for s in slices:
        port = next((p.get("port") for p in s.get("ports") or [] if (p.get("name") or "") == port_name), None)
        if port is None:
            continue
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            out.extend((addr, int(port)) for addr in ep.get("addresses") or [])
    return sorted(set(out))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


class ServiceProxy:
    def __init__(self, api: Api) -> None:
        self.api = api
        self._services: dict[str, Obj] = {}
        self._slices: dict[str, Obj] = {}
        self._servers: dict[ListenerKey, asyncio.Server] = {}
        self._rr: dict[ListenerKey, itertools.count[int]] = {}

    async def run(self) -> None:
        try:
            await asyncio.gather(
                self.api.informer("/api/v1/services", self._on_service),
                self.api.informer("/apis/discovery.k8s.io/v1/endpointslices", self._on_slice),
            )
        finally:
            for server in self._servers.values():
                server.close()

    async def _on_service(self, kind: str, obj: Obj) -> None:
        uid = obj["metadata"]["uid"]
        if kind == "DELETED":
            self._services.pop(uid, None)
        else:
            self._services[uid] = obj
        await self._sync_listeners()

    async def _on_slice(self, kind: str, obj: Obj) -> None:
        uid = obj["metadata"]["uid"]
        if kind == "DELETED":
            self._slices.pop(uid, None)
        else:
            self._slices[uid] = obj

    async def _sync_listeners(self) -> None:
        wanted = wanted_listeners(list(self._services.values()))
        for key in set(self._servers) - wanted:
            self._servers.pop(key).close()
            self._rr.pop(key, None)
        for key in wanted - set(self._servers):
            try:
                self._servers[key] = await asyncio.start_server(
                    functools.partial(self._forward, key), key.ip, key.port, reuse_address=True)
                self._rr[key] = itertools.count()
                log.info("service proxy: %s/%s on %s:%d", key.namespace, key.service, key.ip, key.port)
            except OSError as e:
                log.warning("service proxy: cannot listen on %s:%d: %s", key.ip, key.port, e)

    def _slices_of(self, namespace: str, service: str) -> list[Obj]:
        return [s for s in self._slices.values() if s["metadata"]["namespace"] == namespace
                and (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name") == service]

    async def _forward(self, key: ListenerKey, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        targets = backends(self._slices_of(key.namespace, key.service), key.port_name)
        if not targets:
            writer.close()  # no ready endpoint: refuse, like kube-proxy's REJECT
            return
        start = next(self._rr[key]) if key in self._rr else 0
        for attempt in range(len(targets)):
            host, port = targets[(start + attempt) % len(targets)]
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
                break
            except (TimeoutError, OSError):
                continue
        else:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
