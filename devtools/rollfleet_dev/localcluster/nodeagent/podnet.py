"""Each pod's own network namespace, as a CNI plugin gives it (routed, the way Calico does it).

A pod gets a named network namespace (`ip netns`), its own loopback, and one end of a veth pair
as `eth0` holding its address (/32). Its default route goes through a link-local gateway,
169.254.1.1, which the host's end of the pair holds; the host routes the pod's address to that
end. So pods reach each other and the host's Service addresses through the host, the host (the
tests, the agent's probes) reaches every pod at its IP, and servers in pods bind every address
or localhost as they do in any cluster.

Host-wide, once per cluster (`host_up`, `host_down`): POD_CIDR is unreachable except for live
pods' routes (a dead pod's address fails at once and never leaves the machine), SERVICE_CIDR is
local (the service proxy listens there), forwarding between pods is accepted (Docker sets the
FORWARD policy to DROP), and what a pod sends off the machine is rejected.
The command lists are pure; `run` executes them.
Talks to: the kernel, through `ip` and `iptables`; reads /etc/resolv.conf.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from rollfleet_dev.localcluster.nodeagent.ipam import POD_CIDR, SERVICE_CIDR

GATEWAY = "169.254.1.1"
NETNS_PREFIX = "rfpod-"
VETH_PREFIX = "rfv"  # the host's ends; Linux allows 15 characters
NETNS_DIR = Path("/run/netns")
FORWARD_RULES = (
    ["FORWARD", "-i", f"{VETH_PREFIX}+", "-o", f"{VETH_PREFIX}+", "-j", "ACCEPT"],
    # Nothing a pod sends leaves the machine, and it is refused at once, not dropped: a pod's DNS query
    # (the machine's resolver is not the cluster's) fails in a millisecond instead of timing out.
    ["FORWARD", "-i", f"{VETH_PREFIX}+", "!", "-o", f"{VETH_PREFIX}+", "-j", "REJECT"],
)


class PodNetError(RuntimeError):
    """A pod's network could not be set up; the message names the command and its error."""


def netns_name(uid: str) -> str:
    return NETNS_PREFIX + uid.replace("-", "")[:16]


def netns_path(uid: str) -> str:
    return str(NETNS_DIR / netns_name(uid))


def host_veth(uid: str) -> str:
    return VETH_PREFIX + uid.replace("-", "")[:12]


def pod_up_commands(uid: str, ip: str) -> list[list[str]]:
    """Create the pod's namespace and wire it to the host."""
    ns, veth = netns_name(uid), host_veth(uid)
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{ip}/32", "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ["ip", "-n", ns, "route", "add", GATEWAY, "dev", "eth0", "scope", "link"],
        ["ip", "-n", ns, "route", "add", "default", "via", GATEWAY, "dev", "eth0"],
        ["ip", "addr", "add", f"{GATEWAY}/32", "dev", veth, "scope", "link"],
        ["ip", "link", "set", veth, "up"],
        ["ip", "route", "replace", f"{ip}/32", "dev", veth],
    ]


def pod_down_commands(uid: str) -> list[list[str]]:
    """Delete the pod's namespace: its veth pair and the host's route to it go with it."""
    return [["ip", "netns", "delete", netns_name(uid)]]


def host_up_commands(present_rules: list[list[str]]) -> list[list[str]]:
    cmds = [
        ["ip", "route", "replace", "unreachable", POD_CIDR],
        ["ip", "route", "replace", "local", SERVICE_CIDR, "dev", "lo"],
    ]
    cmds += [["iptables", "-w", "-I", *rule] for rule in FORWARD_RULES if rule not in present_rules]
    return cmds


def host_down_commands(leftover_namespaces: list[str], present_rules: list[list[str]]) -> list[list[str]]:
    cmds = [["ip", "netns", "delete", ns] for ns in leftover_namespaces]
    cmds += [
        ["ip", "route", "delete", "unreachable", POD_CIDR],
        ["ip", "route", "delete", "local", SERVICE_CIDR, "dev", "lo"],
    ]
    cmds += [["iptables", "-w", "-D", *rule] for rule in present_rules]
    return cmds


def clashes(routes: list[dict[str, Any]], nameservers: list[str]) -> list[str]:
    """What on this machine already uses the pods' or the Services' range (routes from `ip -j route`,
    the resolvers of /etc/resolv.conf), but for the cluster's own routes; empty if nothing."""
    ours = {POD_CIDR, SERVICE_CIDR}
    ranges = [ipaddress.ip_network(POD_CIDR), ipaddress.ip_network(SERVICE_CIDR)]
    found = []
    for r in routes:
        dst = r.get("dst", "default")
        if dst == "default" or dst in ours or str(r.get("dev", "")).startswith(VETH_PREFIX):
            continue
        net = ipaddress.ip_network(dst, strict=False)
        if any(net.overlaps(x) for x in ranges):
            found.append(f"the route to {dst} (dev {r.get('dev', '?')})")
    found += [f"the resolver {ns}" for ns in nameservers if any(ipaddress.ip_address(ns) in x for x in ranges)]
    return found


def _machine_clashes() -> list[str]:
    routes = json.loads(
        subprocess.run(
            ["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True, text=True, check=True
        ).stdout
        or "[]"
    )
    resolv = Path("/etc/resolv.conf")
    lines = resolv.read_text().splitlines() if resolv.exists() else []
    nameservers = [w[1] for w in (line.split() for line in lines) if len(w) > 1 and w[0] == "nameserver"]
    return clashes(routes, [n for n in nameservers if ":" not in n])


def _run(cmd: list[str], check: bool) -> bool:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 and check:
        raise PodNetError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.returncode == 0


def run(cmds: list[list[str]], check: bool = True) -> None:
    """Run the commands in order; with `check`, stop at the first that fails (PodNetError)."""
    for cmd in cmds:
        _run(cmd, check)


def _present_rules() -> list[list[str]]:
    return [rule for rule in FORWARD_RULES if _run(["iptables", "-w", "-C", *rule], check=False)]


def leftover_namespaces() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob(NETNS_PREFIX + "*")) if NETNS_DIR.is_dir() else []


def host_up() -> None:
    """The host's part, before any pod starts (the cluster's `up`); what an earlier run left goes first."""
    if os.geteuid() != 0:
        raise PodNetError(
            "the local cluster gives each pod its own network namespace, which needs root: "
            "run it as root (CI does), or use the kind cluster (make kind-up)"
        )
    run([["ip", "netns", "delete", ns] for ns in leftover_namespaces()], check=False)
    found = _machine_clashes()
    if found:
        raise PodNetError(
            f"the local cluster's pod range {POD_CIDR} and Service range {SERVICE_CIDR} must be unused here, "
            f"but {', '.join(found)} is in them: free that range, or use the kind cluster (make kind-up)"
        )
    run(host_up_commands(_present_rules()))


def host_down() -> None:
    """Undo `host_up` and delete every pod namespace left (the cluster's `down`); never fails."""
    run(host_down_commands(leftover_namespaces(), _present_rules()), check=False)


async def pod_up(uid: str, ip: str) -> None:
    """The pod's namespace, made anew (an earlier agent's is deleted first: its processes are gone)."""
    await asyncio.to_thread(run, pod_down_commands(uid), False)
    await asyncio.to_thread(run, pod_up_commands(uid, ip))
