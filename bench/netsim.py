"""A simulated datacenter network on this machine, for bench_sync's fan-out part.

One network namespace per node, each with one link to a bridge that lives in a namespace
of its own (the switch), every link rate-limited both ways with ``tc`` (token bucket).
The benchmark creates it and tears it down; the nodes have only their subnet
(10.213.0.0/24, no default route), so nothing is routed beyond the namespaces it made.
Needs root, ``ip`` and ``tc`` (iproute2).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.213.0"


@dataclass(frozen=True)
class Node:
    netns: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def unavailable() -> str | None:
    """Why this machine cannot build the network, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)} (iproute2)" if missing else None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _shape(netns: str, device: str, rate: str) -> None:
    # burst >= rate / HZ, or the bucket cannot reach the rate; latency bounds the queue.
    _run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
         "burst", "1mb", "latency", "50ms")  # fmt: skip


@contextlib.contextmanager
def network(nodes: int, rate: str = "1gbit", first_rate: str | None = None) -> Iterator[list[Node]]:
    """`nodes` namespaces on one switch, each link limited to `rate` each way (the first node's to `first_rate`,
    if given: a trainer's node whose link is faster than an engine's); removed on exit."""
    tag = f"rfb{os.getpid() % 10_000_000}"  # interface names: at most 15 characters
    switch = f"{tag}-sw"
    made: list[str] = []
    try:
        _run("ip", "netns", "add", switch)
        made.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        result = []
        for i in range(nodes):
            node = Node(f"{tag}-n{i}", f"{SUBNET}.{i + 1}")
            _run("ip", "netns", "add", node.netns)
            made.append(node.netns)
            port = f"{tag}p{i}"
            _run("ip", "-n", node.netns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", switch)
            _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            for device in ("lo", "eth0"):
                _run("ip", "-n", node.netns, "link", "set", device, "up")
            _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            link = first_rate if i == 0 and first_rate else rate
            _shape(node.netns, "eth0", link)  # what the node sends
            _shape(switch, port, link)  # what it receives
            result.append(node)
        yield result
    finally:
        for netns in reversed(made):
            subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)
