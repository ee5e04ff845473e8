"""Pools file, addresses, probes' thresholds, downward API, nodes, service proxy, logs, control."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from rollfleet_dev.localcluster.nodeagent import config, control, ipam, podnet
from rollfleet_dev.localcluster.nodeagent.downward import FieldError, field_value, parse_quantity
from rollfleet_dev.localcluster.nodeagent.logs import LogsError, find_log, logs_command
from rollfleet_dev.localcluster.nodeagent.nodes import merge_taints, node_status
from rollfleet_dev.localcluster.nodeagent.pods import hosts_file
from rollfleet_dev.localcluster.nodeagent.probes import ProbeTiming, Tracker
from rollfleet_dev.localcluster.nodeagent.serviceproxy import backends, reset, splice, wanted_listeners


def test_default_pools() -> None:
    pools = config.load()
    assert pools.node_names() == ["gpu-0", "gpu-1", "cpu-0"]
    gpu = pools.pools[0]
    assert gpu.capacity["nvidia.com/gpu"] == "8" and gpu.labels["nvidia.com/gpu.present"] == "true"
    assert [t.to_api() for t in gpu.taints] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert not pools.pools[1].taints


@pytest.mark.parametrize(
    ("image", "entrypoint"),
    [
        ("rollfleet/engine:dev", ["python", "-m", "rollfleet_engine"]),
        ("ghcr.io/acme/rollfleet/operator:1.0", ["rollfleet"]),
        ("docker.io/library/busybox:1.36", []),
    ],
)
def test_image_rules(image: str, entrypoint: list[str]) -> None:
    rule = config.load().image_rule(image)
    assert rule is not None and rule.entrypoint == entrypoint


def test_unknown_image_has_no_rule() -> None:
    assert config.load().image_rule("nginx:1.27") is None


def test_pools_file_rejects_typos() -> None:
    with pytest.raises(ValueError, match="capacty"):
        config.PoolsFile.model_validate({"pools": [{"name": "x", "nodes": 1, "capacty": {}}]})


def test_addresses() -> None:
    assert ipam.node_ip(0) == "127.10.0.1" and ipam.node_ip(2) == "127.12.0.1"
    ips = ipam.PodIPs(1)
    assert ips.claim("198.18.8.7") and not ips.claim("198.18.8.7") and not ips.claim("198.18.0.7")
    a, b = ips.allocate(), ips.allocate()
    assert (a, b) == ("198.18.8.1", "198.18.8.2")
    ips.release(a)
    assert ips.allocate() == "198.18.8.3"  # not reused at once
    pods = ipaddress.ip_network(ipam.POD_CIDR)
    assert all(ipam.pod_network(i).subnet_of(pods) for i in (0, ipam.MAX_NODES - 1))  # type: ignore[arg-type]
    assert ipaddress.ip_address(ipam.FIRST_SERVICE_IP) in ipaddress.ip_network(ipam.SERVICE_CIDR)
    with pytest.raises(ValueError):
        ipam.pod_network(ipam.MAX_NODES)


def test_a_pods_network_commands_name_its_namespace_address_and_route() -> None:
    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    cmds = podnet.pod_up_commands(uid, "198.18.0.9")
    ns, veth = podnet.netns_name(uid), podnet.host_veth(uid)
    assert len(veth) <= 15 and ns.startswith(podnet.NETNS_PREFIX)
    assert cmds[0] == ["ip", "netns", "add", ns]
    assert ["ip", "-n", ns, "addr", "add", "198.18.0.9/32", "dev", "eth0"] in cmds
    assert cmds[-1] == ["ip", "route", "replace", "198.18.0.9/32", "dev", veth]
    assert podnet.pod_down_commands(uid) == [["ip", "netns", "delete", ns]]
    # Dead pods' addresses are unreachable (never routed off the machine); Services are local.
    up = podnet.host_up_commands(present_rules=[])
    assert ["ip", "route", "replace", "unreachable", ipam.POD_CIDR] in up
    # Pods forward to pods; what they send off the machine is refused at once (a DNS query fails fast).
    rules = [c[3:] for c in up if c[0] == "iptables"]
    assert ["FORWARD", "-i", "rfv+", "-o", "rfv+", "-j", "ACCEPT"] in rules
    assert ["FORWARD", "-i", "rfv+", "!", "-o", "rfv+", "-j", "REJECT"] in rules
    again = podnet.host_up_commands(present_rules=list(podnet.FORWARD_RULES))
    assert not any(c[0] == "iptables" for c in again)
    down = podnet.host_down_commands([], present_rules=list(podnet.FORWARD_RULES))
    assert [c[3:] for c in down if c[0] == "iptables"] == rules


def test_the_pod_and_service_ranges_must_not_be_in_use_on_the_machine() -> None:
    ours = [
        {"type": "unreachable", "dst": ipam.POD_CIDR},
        {"type": "local", "dst": ipam.SERVICE_CIDR, "dev": "lo"},
        {"dst": "198.18.0.9", "dev": podnet.host_veth("a-b")},
        {"dst": "default", "dev": "eth0"},
        {"dst": "10.0.0.0/8", "dev": "eth0"},
    ]
    assert podnet.clashes(ours, ["10.255.255.53"]) == []
    taken = [{"dst": "198.19.4.0/24", "dev": "wg0"}, {"dst": "198.16.0.0/12", "dev": "eth1"}]
    assert podnet.clashes(ours + taken, ["198.18.0.53"]) == [
        "the route to 198.19.4.0/24 (dev wg0)",
        "the route to 198.16.0.0/12 (dev eth1)",
        "the resolver 198.18.0.53",
    ]


def test_probe_thresholds() -> None:
    t = Tracker(ProbeTiming.of({"successThreshold": 2, "failureThreshold": 2}), initial=False)
    assert not t.record(True) and t.record(True) and t.result
    assert not t.record(False) and t.record(False) and not t.result and t.failed_out
    live = Tracker(ProbeTiming.of({}), initial=True)
    assert [live.record(False) for _ in range(3)] == [False, False, True] and live.failed_out
    assert ProbeTiming.of({}).period_s == 10 and ProbeTiming.of({}).timeout_s == 1


def test_quantities_and_fields() -> None:
    assert parse_quantity("500m") == Decimal("0.5") and parse_quantity("2Gi") == 2 * 2**30
    assert parse_quantity("1e3") == 1000 and parse_quantity(4) == 4
    with pytest.raises(FieldError):
        parse_quantity("3 apples")
    pod = {"metadata": {"annotations": {"x/y": "z"}}, "status": {"podIPs": [{"ip": "127.10.0.2"}]}}
    assert field_value(pod, "metadata.annotations['x/y']") == "z"
    assert field_value(pod, "status.podIPs") == "127.10.0.2"
    with pytest.raises(FieldError):
        field_value(pod, "spec.nope")


def test_node_status_and_taints() -> None:
    pool = config.load().pools[0]
    s = node_status(pool, "127.10.0.1", "v1.37.1", True, datetime(2026, 1, 1, tzinfo=UTC), "boot")
    ready = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and s["allocatable"]["nvidia.com/gpu"] == "8"
    assert s["addresses"] == [{"type": "InternalIP", "address": "127.10.0.1"}]
    unreachable = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    gpu = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    assert merge_taints([unreachable], [gpu]) == [unreachable, gpu]
    assert merge_taints([gpu], [gpu]) == [gpu]


def _svc(ip: str = "198.19.0.9", **spec: object) -> dict:
    return {
        "metadata": {"namespace": "ns", "name": "web"},
        "spec": {
            "clusterIP": ip,
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
            **spec,
        },
    }


def _pod(ip: str, ready: bool = True, **meta: object) -> dict:
    return {
        "metadata": {"namespace": "ns", "labels": {"app": "web"}, **meta},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_service_proxy_selection() -> None:
    assert {(k.ip, k.port) for k in wanted_listeners([_svc(), _svc(ip="10.0.0.1"), _svc(ip="None")])} == {
        ("198.19.0.9", 80)
    }
    pods = [
        _pod("127.10.0.3"),
        _pod("127.10.0.2"),
        _pod("127.10.0.4", ready=False),
        _pod("127.10.0.5", deletionTimestamp="now"),
        {**_pod("127.10.0.6"), "metadata": {"namespace": "other", "labels": {"app": "web"}}},
    ]
    assert backends(_svc(), "http", pods) == [("127.10.0.2", 8000), ("127.10.0.3", 8000)]
    assert backends(_svc(), "other-port", pods) == []


async def _proxied_exchange(upstream_ends: str) -> bytes:
    """Send a request through `splice` to an upstream that reads it and then ends as told."""

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)
        if upstream_ends == "reset":  # a killed pod with a request it never answered
            reset(writer)
        else:
            writer.write(b"answer")
            writer.close()

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await splice((reader, writer), await asyncio.open_connection("127.0.0.1", up_port))

    up = await asyncio.start_server(upstream, "127.0.0.1", 0)
    proxy = await asyncio.start_server(front, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    async with up, proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
        writer.write(b"hello")
        try:
            # The client waits for an answer, as an HTTP client does: it must learn the end.
            return await asyncio.wait_for(reader.read(), 10)
        except ConnectionResetError:
            return b"reset"
        finally:
            writer.close()


@pytest.mark.parametrize(("upstream_ends", "client_sees"), [("reset", b"reset"), ("answer", b"answer")])
def test_service_proxy_passes_an_upstream_reset_to_its_client(upstream_ends: str, client_sees: bytes) -> None:
    assert asyncio.run(_proxied_exchange(upstream_ends)) == client_sees


def test_logs_lookup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "pods" / "ns_web_uid1"
    d.mkdir(parents=True)
    (d / "pod.json").write_text('{"containers": ["app", "side"], "defaultContainer": null}')
    (d / "app.log").write_text("now\n")
    (d / "app.0.log").write_text("first\n")
    (d / "app.1.log").write_text("second\n")
    assert find_log(tmp_path / "pods", "ns", "web", None, False).read_text() == "now\n"
    assert find_log(tmp_path / "pods", "ns", "web", "app", True).read_text() == "second\n"
    with pytest.raises(LogsError):
        find_log(tmp_path / "pods", "ns", "web", "side", False)
    with pytest.raises(LogsError):
        find_log(tmp_path / "pods", "ns", "we", None, False)  # no prefix matches
    args = argparse.Namespace(
        state_dir=str(tmp_path), namespace="ns", pod="web", container=None, previous=True, follow=False
    )
    assert logs_command(args) == 0


def test_node_control_files(tmp_path: Path) -> None:
    control.set_stopped(tmp_path, "gpu-1", True)
    assert control.stopped_nodes(tmp_path) == {"gpu-1"}
    control.set_stopped(tmp_path, "gpu-1", False)
    assert control.stopped_nodes(tmp_path) == set()


def test_a_pods_hosts_file_names_it_at_its_ip_as_kubelets_does() -> None:
    pod = {"metadata": {"name": "e-0", "namespace": "ns"}, "spec": {"subdomain": "fleet"}}
    lines = hosts_file(pod, "198.18.0.7").splitlines()
    assert "127.0.0.1\tlocalhost" in lines and lines[-1] == "198.18.0.7\te-0.fleet.ns.svc.cluster.local\te-0"
    assert hosts_file({"metadata": {"name": "p"}, "spec": {}}, "198.18.0.8").splitlines()[-1] == "198.18.0.8\tp"
