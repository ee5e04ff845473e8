"""Node objects: registration, Lease renewal and status heartbeats.

`node_object` / `node_status` are pure; `NodeKeeper` registers one node and keeps
it alive (Lease every 10 s, status every 30 s) until it is stopped. Talks to: the
kube-apiserver (nodes, nodes/status, coordination.k8s.io leases).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp

from rollfleet_dev.localcluster.nodeagent.config import Pool
from rollfleet_dev.localcluster.nodeagent.kubeapi import Api, ApiError
from rollfleet_dev.localcluster.nodeagent.status import rfc3339

log = logging.getLogger(__name__)

Obj = dict[str, Any]

LEASE_DURATION_S = 40
LEASE_RENEW_S = 10.0
STATUS_EVERY_S = 30.0
AGENT_VERSION = "rollfleet-nodeagent://0.1.0"


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def node_labels(pool: Pool, name: str) -> dict[str, str]:
    return {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": _arch(),
        "rollfleet.dev/node-agent": "local",
        **pool.labels,
    }


def node_status(pool: Pool, ip: str, kubelet_version: str, ready: bool, now: datetime, boot_id: str) -> Obj:
    """The node's status as its kubelet would post it."""
    ts = rfc3339(now)

    def cond(ctype: str, status: bool, reason: str, message: str) -> Obj:
        return {
            "type": ctype,
            "status": "True" if status else "False",
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": ts,
            "lastTransitionTime": ts,
        }

    return {
        "capacity": dict(pool.capacity),
        "allocatable": dict(pool.capacity),
        "conditions": [
            cond("MemoryPressure", False, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            cond("DiskPressure", False, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            cond("PIDPressure", False, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            cond(
                "Ready",
                ready,
                "KubeletReady" if ready else "KubeletNotReady",
                "rollfleet node agent is posting ready status" if ready else "node agent stopped",
            ),
        ],
        "addresses": [{"type": "InternalIP", "address": ip}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "machineID": boot_id.replace("-", ""),
            "systemUUID": boot_id,
            "bootID": boot_id,
            "kernelVersion": platform.release(),
            "osImage": "rollfleet local node",
            "containerRuntimeVersion": AGENT_VERSION,
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": kubelet_version,
            "operatingSystem": "linux",
            "architecture": _arch(),
        },
    }


def merge_taints(existing: list[Obj], wanted: list[Obj]) -> list[Obj]:
    """Existing taints (the node controller's not-ready/unreachable ones included) plus the pool's."""
    have = {(t["key"], t["effect"]) for t in existing}
    return existing + [t for t in wanted if (t["key"], t["effect"]) not in have]


class NodeKeeper:
    """Registers one node and keeps its Lease and status fresh while `running`."""

    def __init__(self, api: Api, pool: Pool, name: str, ip: str, kubelet_version: str) -> None:
        self.api = api
        self.pool = pool
        self.name = name
        self.ip = ip
        self.kubelet_version = kubelet_version
        self.boot_id = str(uuid.uuid4())
        self.running = False
        self._wake = asyncio.Event()
        self._uid = ""

    def set_running(self, running: bool) -> None:
        self.running = running
        self._wake.set()

    async def register(self) -> None:
        """Create the node, or bring an existing one (agent restart) up to the pools file."""
        path = f"/api/v1/nodes/{self.name}"
        wanted_taints = [t.to_api() for t in self.pool.taints]
        status = node_status(self.pool, self.ip, self.kubelet_version, True, datetime.now(UTC), self.boot_id)
        node = await self.api.get_or_none(path)
        if node is None:
            node = await self.api.create(
                "/api/v1/nodes",
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": self.name,
                        "labels": node_labels(self.pool, self.name),
                        "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                    },
                    "spec": {
                        "taints": wanted_taints,
                        "podCIDR": f"{self.ip.rsplit('.', 2)[0]}.0.0/16",
                        "podCIDRs": [f"{self.ip.rsplit('.', 2)[0]}.0.0/16"],
                    },
                    "status": status,
                },
            )
            log.info("node %s registered (%s)", self.name, self.ip)
        else:
            node = await self.api.merge_patch(
                path,
                {
                    "metadata": {"labels": node_labels(self.pool, self.name)},
                    "spec": {
                        "taints": merge_taints(node.get("spec", {}).get("taints") or [], wanted_taints),
                        "unschedulable": None,
                    },
                },
            )
            log.info("node %s already registered; labels and taints updated", self.name)
        self._uid = node["metadata"]["uid"]
        await self.post_status(True)

    async def post_status(self, ready: bool) -> None:
        status = node_status(self.pool, self.ip, self.kubelet_version, ready, datetime.now(UTC), self.boot_id)
        await self.api.strategic_patch(f"/api/v1/nodes/{self.name}/status", {"status": status})

    async def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            await self.api.merge_patch(
                path,
                {"spec": {"holderIdentity": self.name, "renewTime": now, "leaseDurationSeconds": LEASE_DURATION_S}},
            )
        except ApiError as e:
            if e.status != 404:
                raise
            await self.api.create(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self._uid}],
                    },
                    "spec": {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": now},
                },
            )

    async def keep_alive(self) -> None:
        """Renew the Lease every 10 s and post status every 30 s while the node runs; a stopped
        node posts nothing, so the node controller marks it NotReady as for a lost machine."""
        loop = asyncio.get_running_loop()
        next_status = 0.0
        while True:
            if self.running:
                try:
                    await self.renew_lease()
                    if loop.time() >= next_status:
                        await self.post_status(True)
                        next_status = loop.time() + STATUS_EVERY_S
                except (TimeoutError, ApiError, OSError, aiohttp.ClientError) as e:
                    log.warning("node %s: heartbeat failed: %s", self.name, e)
            else:
                next_status = 0.0  # when it runs again, post status at once
            self._wake.clear()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), LEASE_RENEW_S if self.running else None)
