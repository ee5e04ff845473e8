"""Loopback addresses for nodes and pods (pure).

Every 127.0.0.0/8 address is loopback on Linux, so a pod "gets an IP" simply by its
processes binding to it. Node number i (in pools-file order) owns 127.(10+i).0.0/16:
the node itself is .0.1, its pods get the other addresses. Talks to nobody.
"""

from __future__ import annotations

import ipaddress

FIRST_NODE_OCTET = 10
MAX_NODES = 80  # 127.10-127.89; the local cluster's Service range starts at 127.96


def node_network(index: int) -> ipaddress.IPv4Network:
    if not 0 <= index < MAX_NODES:
        raise ValueError(f"node index {index} out of range (at most {MAX_NODES} nodes)")
    return ipaddress.IPv4Network(f"127.{FIRST_NODE_OCTET + index}.0.0/16")


def node_ip(index: int) -> str:
    return str(node_network(index).network_address + 1)


class PodIPs:
    """Hands out one node's pod addresses, rotating so that a freed address is not reused at once
    (a client that still holds a dead pod's IP then gets "connection refused", not another pod)."""

    def __init__(self, index: int) -> None:
        self.network = node_network(index)
        self._first = int(self.network.network_address) + 2
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
