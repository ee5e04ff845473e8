"""A userspace service proxy for Services with ClusterIPs of the local cluster's range.

That range (SERVICE_CIDR) is local to the host (`podnet`), so pods reach it through their
default route. For each TCP port of each such Service the proxy listens on clusterIP:port
and forwards every connection to a ready pod of the Service, round robin. It selects the
backends as the EndpointSlice controller does: Ready, not terminating pods matching the
selector, `targetPort` resolved by number or container port name. The `kubernetes`
Service goes to the API server's own address (loopback, which the API server would not
put in an EndpointSlice). Services and pods come from watches;
`wanted_listeners` and `backends` are pure. Talks to: the kube-apiserver (watches) and
the pods it forwards to.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import itertools
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any

from rollfleet_dev.localcluster.nodeagent.ipam import SERVICE_CIDR
from rollfleet_dev.localcluster.nodeagent.kubeapi import Api

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


def in_service_range(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(SERVICE_CIDR)
    except ValueError:
        return False


def wanted_listeners(services: list[Obj]) -> set[ListenerKey]:
    out = set()
    for svc in services:
        spec = svc.get("spec", {})
        ips = spec.get("clusterIPs") or [spec.get("clusterIP", "")]
        for ip in ips:
            if not in_service_range(ip):
                continue
            for p in spec.get("ports") or []:
                if p.get("protocol", "TCP") == "TCP":
                    out.add(
                        ListenerKey(
                            ip, int(p["port"]), svc["metadata"]["namespace"], svc["metadata"]["name"], p.get("name", "")
                        )
                    )
    return out


def _target_port(pod: Obj, target: int | str) -> int | None:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for c in pod.get("spec", {}).get("containers", []):
        for p in c.get("ports") or []:
            if p.get("name") == target and p.get("protocol", "TCP") == "TCP":
                return int(p["containerPort"])
    return None


def backends(service: Obj, port_name: str, pods: list[Obj]) -> list[tuple[str, int]]:
    """Addresses of the Service's ready pods for its port named `port_name` (sorted, for round robin)."""
    spec = service.get("spec", {})
    selector = spec.get("selector") or {}
    sport = next((p for p in spec.get("ports") or [] if (p.get("name") or "") == port_name), None)
    if not selector or sport is None:
        return []
    target = sport.get("targetPort", sport["port"])
    out = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        if meta.get("namespace") != service["metadata"]["namespace"] or meta.get("deletionTimestamp"):
            continue
        labels = meta.get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
        port = _target_port(pod, target)
        if ready and status.get("podIP") and port is not None:
            out.append((status["podIP"], port))
    return sorted(out)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close: the other direction may still carry an answer."""
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    """Relay two connections both ways until both directions end.

    A reset on either side resets the other, as a dead pod's RST reaches a kube-proxy
    client: a client waiting for an answer would otherwise wait forever on a live proxy.
    """
    (a_reader, a_writer), (b_reader, b_writer) = a, b
    pipes = [asyncio.create_task(_pipe(a_reader, b_writer)), asyncio.create_task(_pipe(b_reader, a_writer))]
    broken = True
    try:
        await asyncio.gather(*pipes)
        broken = False
    except (ConnectionError, OSError):
        pass
    finally:
        for pipe in pipes:
            pipe.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        for w in (a_writer, b_writer):
            if broken:
                reset(w)
            else:
                w.close()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, not a FIN: the peer learns the connection broke, not that it ended."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class ServiceProxy:
    def __init__(self, api: Api, api_address: tuple[str, int]) -> None:
        self.api = api
        self.api_address = api_address
        self._services: dict[str, Obj] = {}
        self._pods: dict[str, Obj] = {}
        self._servers: dict[ListenerKey, asyncio.Server] = {}
        self._rr: dict[ListenerKey, itertools.count[int]] = {}

    async def run(self) -> None:
        try:
            await asyncio.gather(
                self.api.informer("/api/v1/services", self._on_service),
                self.api.informer("/api/v1/pods", self._on_pod),
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

    async def _on_pod(self, kind: str, obj: Obj) -> None:
        uid = obj["metadata"]["uid"]
        if kind == "DELETED":
            self._pods.pop(uid, None)
        else:
            self._pods[uid] = obj

    async def _sync_listeners(self) -> None:
        wanted = wanted_listeners(list(self._services.values()))
        for key in set(self._servers) - wanted:
            self._servers.pop(key).close()
            self._rr.pop(key, None)
        for key in wanted - set(self._servers):
            try:
                self._servers[key] = await asyncio.start_server(
                    functools.partial(self._forward, key), key.ip, key.port, reuse_address=True
                )
                self._rr[key] = itertools.count()
                log.info("service proxy: %s/%s on %s:%d", key.namespace, key.service, key.ip, key.port)
            except OSError as e:
                log.warning("service proxy: cannot listen on %s:%d: %s", key.ip, key.port, e)

    def _targets(self, key: ListenerKey) -> list[tuple[str, int]]:
        if (key.namespace, key.service) == ("default", "kubernetes"):
            return [self.api_address]
        service = next(
            (
                s
                for s in self._services.values()
                if s["metadata"]["namespace"] == key.namespace and s["metadata"]["name"] == key.service
            ),
            None,
        )
        return backends(service, key.port_name, list(self._pods.values())) if service else []

    async def _forward(self, key: ListenerKey, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        targets = self._targets(key)
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
        await splice((reader, writer), (up_reader, up_writer))
