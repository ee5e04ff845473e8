"""A NetworkPolicy agent for the kind cluster here: ingress policies enforced with iptables.

Why it exists: kind's kindnetd enforces policies through an nftables `queue` to userspace,
and this machine's kernel has no NFQUEUE; the enforcers that would work here (kube-router,
Calico) cannot be downloaded. So each kind node runs this agent (a DaemonSet, host network,
NET_ADMIN), shipped with kindnetd in the node image's CNI manifest.

What it enforces: the ingress half of networking.k8s.io/v1 NetworkPolicy, for pods on its
node: pod, namespace and combined selectors (matchLabels and matchExpressions), ipBlock
without `except`, numeric and named TCP/UDP/SCTP ports with endPort. Egress rules are not
enforced (Rollfleet's policies have none); a peer with `except` admits nothing, and says so.
Traffic of established connections and from the node itself (kubelet probes) passes, as with
other enforcers.

How: one chain, `ROLLFLEET-NETPOL`, jumped to from FORWARD (pods reach pods through the node's
routing with kindnetd's ptp plugin, same node or not) and rewritten whole with
`iptables-restore --noflush` whenever pods, namespaces or policies change. For each policed
pod: RETURN (continue as usual) for each admitted source and port, then REJECT.

Standard library only: it runs on Debian's python3 in the node image, without pip.
`render` is pure; the rest lists and watches the API server and calls iptables.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

CHAIN = "ROLLFLEET-NETPOL"
Obj = Mapping[str, Any]
log = logging.getLogger("netpol-agent")


# --- decisions (pure) ----------------------------------------------------------------------
def selects(selector: Obj | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector's verdict; an empty selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }.get(op)
        if not ok:
            return False
    return True


def _labels(obj: Obj) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _pod_ip(pod: Obj) -> str | None:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    ip: str | None = status.get("podIP")
    return ip


def policy_types(policy: Obj) -> list[str]:
    spec = policy.get("spec") or {}
    types: list[str] = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
    return types


def peer_sources(peer: Obj, policy_ns: str, pods: Iterable[Obj], namespaces: Mapping[str, Obj]) -> list[str]:
    """The source CIDRs a `from` peer admits."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        if block.get("except"):
            log.warning("ipBlock %s with except is not supported: the peer admits nothing", block["cidr"])
            return []
        return [str(ipaddress.ip_network(block["cidr"], strict=False))]
    ns_selector, pod_selector = peer.get("namespaceSelector"), peer.get("podSelector")
    out = []
    for pod in pods:
        ns = pod["metadata"]["namespace"]
        in_scope = selects(ns_selector, _labels(namespaces.get(ns, {}))) if ns_selector is not None else ns == policy_ns
        ip = _pod_ip(pod)
        if ip and in_scope and selects(pod_selector, _labels(pod)):
            out.append(f"{ip}/32")
    return sorted(set(out))


def _container_port(pod: Obj, name: str) -> int | None:
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return int(port["containerPort"])
    return None


def port_matches(pod: Obj, ports: list[Obj] | None) -> list[str] | None:
    """iptables match arguments per admitted port of `pod`; None admits every port."""
    if not ports:
        return None
    out = []
    for p in ports:
        proto = p.get("protocol", "TCP").lower()
        port = p.get("port")
        if port is None:
            out.append(f"-p {proto}")
            continue
        if isinstance(port, str) and not port.isdigit():
            resolved = _container_port(pod, port)
            if resolved is None:
                continue  # the pod has no such named port: the entry admits nothing for it
            port = resolved
        end = p.get("endPort")
        out.append(f"-p {proto} -m {proto} --dport {port}" + (f":{end}" if end else ""))
    return out


def render(node: str, pods: list[Obj], namespaces: Mapping[str, Obj], policies: list[Obj]) -> list[str]:
    """The rules of CHAIN (without `-A CHAIN`) for the pods of `node`."""
    rules = ["-m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"]
    local = [
        p
        for p in pods
        if p.get("spec", {}).get("nodeName") == node and _pod_ip(p) and not p.get("spec", {}).get("hostNetwork")
    ]
    for pod in sorted(local, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"])):
        ns, ip = pod["metadata"]["namespace"], _pod_ip(pod)
        selecting = [
            pol
            for pol in policies
            if pol["metadata"]["namespace"] == ns
            and "Ingress" in policy_types(pol)
            and selects(pol["spec"].get("podSelector"), _labels(pod))
        ]
        if not selecting:
            continue
        comment = f'-m comment --comment "{ns}/{pod["metadata"]["name"]}"'
        for pol in selecting:
            for rule in pol["spec"].get("ingress") or []:
                peers = rule.get("from")
                sources: list[str | None] = (
                    [s for peer in peers for s in peer_sources(peer, ns, pods, namespaces)] if peers else [None]
                )
                matches = port_matches(pod, rule.get("ports"))
                for source in sources:
                    for match in matches if matches is not None else [None]:
                        parts = [f"-d {ip}/32", f"-s {source}" if source else "", match or "", comment, "-j RETURN"]
                        rules.append(" ".join(p for p in parts if p))
        rules.append(f"-d {ip}/32 -p tcp {comment} -j REJECT --reject-with tcp-reset")
        rules.append(f"-d {ip}/32 {comment} -j REJECT")
    return rules


def restore_input(rules: list[str]) -> str:
    """iptables-restore --noflush input that replaces CHAIN's rules atomically (declaring a chain flushes it)."""
    return "*filter\n" + f":{CHAIN} - [0:0]\n" + "".join(f"-A {CHAIN} {r}\n" for r in rules) + "COMMIT\n"


# --- I/O -----------------------------------------------------------------------------------
SA = "/var/run/secrets/kubernetes.io/serviceaccount"


class Api:
    """List and watch through the pod's service account (no client library in this image)."""

    def __init__(self) -> None:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        self.base = f"https://{host}:{port}"
        self.ctx = ssl.create_default_context(cafile=f"{SA}/ca.crt")

    def _open(self, path: str, timeout: float) -> Any:
        with open(f"{SA}/token") as f:  # re-read: projected tokens rotate
            token = f.read().strip()
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {token}"})
        return urllib.request.urlopen(req, context=self.ctx, timeout=timeout)

    def list(self, path: str) -> Obj:
        with self._open(path, 30) as resp:
            result: Obj = json.load(resp)
            return result

    def watch(self, path: str, version: str) -> Iterator[Obj]:
        sep = "&" if "?" in path else "?"
        with self._open(
            f"{path}{sep}watch=1&allowWatchBookmarks=true&resourceVersion={version}&timeoutSeconds=300", 330
        ) as resp:
            for line in resp:
                yield json.loads(line)


class Cache:
    """Every pod, namespace and policy; `changed` is set on any change."""

    KINDS = {
        "pods": "/api/v1/pods",
        "namespaces": "/api/v1/namespaces",
        "policies": "/apis/networking.k8s.io/v1/networkpolicies",
    }

    def __init__(self, api: Api) -> None:
        self.api = api
        self.objects: dict[str, dict[str, Obj]] = {k: {} for k in self.KINDS}
        self.synced: set[str] = set()
        self.lock = threading.Lock()
        self.changed = threading.Event()

    @staticmethod
    def _key(obj: Obj) -> str:
        meta = obj["metadata"]
        return f"{meta.get('namespace', '')}/{meta['name']}"

    def follow(self, kind: str) -> None:
        """List, then watch; list again after any failure or expiry. Runs forever in a thread."""
        path = self.KINDS[kind]
        while True:
            try:
                listed = self.api.list(path)
                with self.lock:
                    self.objects[kind] = {self._key(o): o for o in listed["items"]}
                    self.synced.add(kind)
                self.changed.set()
                version = listed["metadata"]["resourceVersion"]
                while True:
                    for event in self.api.watch(path, version):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise RuntimeError(obj.get("message", obj))
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] == "BOOKMARK":
                            continue
                        with self.lock:
                            if event["type"] == "DELETED":
                                self.objects[kind].pop(self._key(obj), None)
                            else:
                                self.objects[kind][self._key(obj)] = obj
                        self.changed.set()
            except Exception as err:  # the agent must outlive any API hiccup
                log.warning("%s: %s; listing again in 1s", kind, err)
                time.sleep(1)

    def snapshot(self) -> tuple[list[Obj], dict[str, Obj], list[Obj]] | None:
        with self.lock:
            if self.synced != set(self.KINDS):
                return None
            namespaces = {o["metadata"]["name"]: o for o in self.objects["namespaces"].values()}
            return list(self.objects["pods"].values()), namespaces, list(self.objects["policies"].values())


def iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True)


def replace_chain(rules: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["iptables-restore", "-w", "5", "--noflush"], input=restore_input(rules), capture_output=True, text=True
    )


def ensure_jump() -> None:
    if iptables("-C", "FORWARD", "-j", CHAIN).returncode != 0:
        iptables("-I", "FORWARD", "1", "-j", CHAIN)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    node = os.environ["NODE_NAME"]
    cache = Cache(Api())
    for kind in Cache.KINDS:
        threading.Thread(target=cache.follow, args=(kind,), daemon=True, name=kind).start()
    applied: list[str] | None = None
    while True:
        cache.changed.wait(timeout=30)  # the timeout re-checks the FORWARD jump now and then
        cache.changed.clear()
        snap = cache.snapshot()
        if snap is None:
            continue
        rules = render(node, *snap)
        proc = replace_chain(rules) if rules != applied else None
        if proc is not None and proc.returncode != 0:
            log.error("iptables-restore failed: %s", proc.stderr.strip())
            cache.changed.set()
            time.sleep(1)
            continue
        ensure_jump()
        if rules != applied:
            log.info("%d rules for %s", len(rules), node)
            applied = rules


if __name__ == "__main__":
    sys.exit(main())
