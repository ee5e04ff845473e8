"""The scale harness: KWOK's fake nodes, and how the engine host reads an operator's engine pod and its Secrets."""

from __future__ import annotations

import asyncio
import base64
import ipaddress

import pytest

from rollfleet import contract
from rollfleet.api.fleet import RolloutFleetSpec
from rollfleet.controller import desired
from rollfleet.controller.owner import FleetRef
from rollfleet_dev import engine_host, kwok, sim_engine
from rollfleet_dev.engine_host import PodSpecError, engine_argv, secret_file
from rollfleet_dev.localcluster.nodeagent import ipam


def test_fake_nodes_have_disjoint_pod_ranges_outside_the_node_agents() -> None:
    nodes = [kwok.node_manifest(i) for i in range(kwok.max_nodes())]
    ranges = [ipaddress.IPv4Network(n["spec"]["podCIDR"]) for n in nodes]
    assert len(set(ranges)) == len(ranges) == 16
    agents = [ipam.pod_network(i) for i in range(ipam.MAX_NODES)]
    assert not any(r.overlaps(a) for r in ranges for a in agents)
    assert all(r.subnet_of(ipaddress.IPv4Network(kwok.KWOK_POD_CIDR)) for r in ranges)  # type: ignore[arg-type]
    node = nodes[3]
    assert node["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert node["status"]["capacity"]["pods"] == "510" and node["status"]["capacity"]["nvidia.com/gpu"] == "510"
    # Only pods that tolerate the fake nodes' taint land on them: the placement the harness gives fleets.
    [taint] = node["spec"]["taints"]
    [toleration] = kwok.placement()["tolerations"]
    assert (toleration["key"], toleration["value"], toleration["effect"]) == (
        taint["key"],
        taint["value"],
        taint["effect"],
    )
    assert kwok.placement()["nodeSelector"].items() <= node["metadata"]["labels"].items()


def engine_pod() -> dict:
    spec = RolloutFleetSpec.model_validate(
        {
            "replicas": 1,
            "model": {"servedName": "sim", "imagePath": "/nonexistent"},
            "engine": {"args": ["--max-num-seqs", "4"]},
            "placement": kwok.placement(),
        }
    )
    return desired.engine_pod(FleetRef("f", "ns", "00000000-0000-0000-0000-000000000000"), spec, 0)


def test_the_engine_host_reads_an_operator_engine_pod_as_the_simulator_would() -> None:
    pod = engine_pod()
    container, argv = engine_argv(pod)
    args = sim_engine.parse_args(argv)
    assert args.port == 8000 and args.max_num_seqs == 4 and args.name == "sim"
    # Its token files come from the fleet's two Secrets (mount paths that share a prefix must not be confused).
    assert secret_file(pod, container, args.token_file) == (contract.secret_name("f"), "token")
    assert secret_file(pod, container, args.inference_token_file) == (contract.inference_secret_name("f"), "token")
    with pytest.raises(PodSpecError, match="no Secret volume"):
        secret_file(pod, container, "/etc/passwd")
    pod["spec"]["containers"][0]["name"] = "other"
    with pytest.raises(PodSpecError, match="no container named 'engine'"):
        engine_argv(pod)


class CountingApi:
    """The API server's Secret reads, counted: the engine host's only other call (its pod watch is not used here)."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    async def get(self, path: str) -> dict[str, object]:
        self.reads.append(path)
        return {"data": {"token": base64.b64encode(f"secret of {path}".encode()).decode()}}


def test_the_engine_host_reads_a_fleets_secrets_once_for_its_pods_and_again_once_they_may_have_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api, now = CountingApi(), [100.0]
    monkeypatch.setattr(engine_host.time, "monotonic", lambda: now[0])
    host = engine_host.Host(api)  # type: ignore[arg-type]
    pod = engine_pod()
    container, argv = engine_argv(pod)
    token_file = sim_engine.parse_args(argv).token_file

    async def read_for(pods: int) -> set[str]:
        return {await host._read_secret_file(pod, container, token_file) for _ in range(pods)}

    assert asyncio.run(read_for(2000)) == {f"secret of /api/v1/namespaces/ns/secrets/{contract.secret_name('f')}"}
    assert len(api.reads) == 1
    now[0] += engine_host.SECRET_CACHE_S + 1  # a token rotated meanwhile is read anew
    asyncio.run(read_for(1))
    assert len(api.reads) == 2
