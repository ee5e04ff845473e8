"""Which address a pod's server binds, for the two kinds of pod network Rollfleet runs on.

In a pod with a network namespace of its own (kind, any real cluster) a server binds every
address: its peers reach the pod IP, and `kubectl port-forward` connects to localhost inside
the pod. On the local cluster every pod shares the host's network, each with a loopback
address of its own (127.x.y.z) as its pod IP: a server there binds that address only, since
0.0.0.0 would collide with every other pod's. Shared by the engine, the gateway and the sync
sidecar (the engine package stands alone, so it lives here).
"""

from __future__ import annotations

import ipaddress

ALL_ADDRESSES = "0.0.0.0"
LOCALHOST = "127.0.0.1"


def _shared_host_network(pod_ip: str) -> bool:
    return ipaddress.ip_address(pod_ip).is_loopback


def serving_host(pod_ip: str | None) -> str:
    """A server that other pods call (engine, gateway): every address, or the pod's own on a shared network."""
    if pod_ip and _shared_host_network(pod_ip):
        return pod_ip
    return ALL_ADDRESSES


def pod_local_host(pod_ip: str | None) -> str:
    """A server for the pod's own containers (the sync sidecar's trainer API): localhost, or the pod's
    own address on a shared network (where localhost is every pod's)."""
    if pod_ip and _shared_host_network(pod_ip):
        return pod_ip
    return LOCALHOST
