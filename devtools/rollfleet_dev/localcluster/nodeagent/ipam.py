"""The local cluster's addresses (pure).

Nodes are the host itself, each with a loopback address of its own: node number i (in pools-file
order) is 127.(10+i).0.1. A pod has its own network namespace (`podnet`) and an address from its
node's /21 of POD_CIDR, routed from the host. Services get addresses from SERVICE_CIDR, which is
local to the host: the node agent's service proxy listens on them, and pods reach them through
their default route. Both are in 198.18.0.0/15, the range RFC 2544 sets aside for benchmarks, so
they clash with no network a machine is on (10/8 did: this machine's resolver is in it).
Talks to nobody.
"""

from __future__ import annotations

import ipaddress

FIRST_NODE_OCTET = 10
POD_CIDR = "198.18.0.0/16"
NODE_PREFIX = 21  # 2,046 pods a node
# The last 4 of POD_CIDR's 32 /21s are KWOK's fake nodes' (rollfleet_dev.kwok): their pods have no process
# here, and one process answers at all their addresses (rollfleet_dev.engine_host).
MAX_NODES = 2 ** (NODE_PREFIX - 16) - 4
KWOK_POD_CIDR = "198.18.224.0/19"
SERVICE_CIDR = "198.19.0.0/16"
FIRST_SERVICE_IP = "198.19.0.1"  # the `kubernetes` Service's


def node_ip(index: int) -> str:
    _check_index(index)
    return f"127.{FIRST_NODE_OCTET + index}.0.1"


def pod_network(index: int) -> ipaddress.IPv4Network:
    _check_index(index)
    return list(ipaddress.IPv4Network(POD_CIDR).subnets(new_prefix=NODE_PREFIX))[index]


def _check_index(index: int) -> None:
    if not 0 <= index < MAX_NODES:
        raise ValueError(f"node index {index} out of range (at most {MAX_NODES} nodes)")


class PodIPs:
    """Hands out one node's pod addresses, rotating so that a freed address is not reused at once
    (a client that still holds a dead pod's IP then gets "no route to host", not another pod)."""

    def __init__(self, index: int) -> None:
        self.network = pod_network(index)
        self._first = int(self.network.network_address) + 1
        self._last = int(self.network.broadcast_address) - 1
        self._next = self._first
        self._used: set[int] = set()

    def owns(self, ip: str) -> bool:
        try:
            addr = int(ipaddress.IPv4Address(ip))
        except ValueError:
            return False
        return self._first <= addr <= self._last

    def claim(self, ip: str) -> bool:
        """Keep an address a pod already had (the agent restarted); False if not ours or taken."""
        if not self.owns(ip) or int(ipaddress.IPv4Address(ip)) in self._used:
            return False
        self._used.add(int(ipaddress.IPv4Address(ip)))
        return True

    def allocate(self) -> str:
        size = self._last - self._first + 1
        for step in range(size):
            addr = self._first + (self._next - self._first + step) % size
            if addr not in self._used:
                self._used.add(addr)
                self._next = self._first + (addr - self._first + 1) % size
                return str(ipaddress.IPv4Address(addr))
        raise RuntimeError(f"no free pod address in {self.network}")

    def release(self, ip: str) -> None:
        self._used.discard(int(ipaddress.IPv4Address(ip)))
