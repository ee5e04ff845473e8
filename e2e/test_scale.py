"""200 engines on KWOK's fake GPU nodes (`rollfleet cluster kwok up`; every engine answered by
`rollfleet_dev.engine_host`, the control-plane tier's simulator at each pod's IP): the operator, in its pod,
brings all of them to Ready, pauses every one and resumes every one, and the status says so at each step.
Correctness only, no timing: the timings at 200 to 2,000 engines are bench/bench_scale.py's. Local cluster
only (KWOK and the engine host run beside its control plane); the module stops both again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from e2e.fleet_helpers import Fleet, deploy_operator
from e2e.provider import Cluster, wait_for
from rollfleet.contract import ANNOTATION_PAUSE, API_VERSION, engine_pod_name

pytestmark = pytest.mark.cluster
NS = "rf-e2e-scale"
FLEET = "wide"
ENGINES = 200
TIMEOUT_S = 600  # 200 pods through a 2-core machine's API server and scheduler


@pytest.fixture(scope="module")
def fake_nodes(cluster: Cluster) -> Iterator[str]:
    """KWOK's nodes, and the engine host's URL of what it serves."""
    if cluster.provider != "local":
        pytest.skip("KWOK and the engine host run beside the local cluster's control plane")
    from rollfleet_dev import engine_host, kwok

    kwok.up(1)
    cluster.kubectl("create", "namespace", NS, check=False)
    yield f"http://127.0.0.1:{engine_host.CONTROL_PORT}/engines"
    cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", check=False, timeout=320)
    kwok.down()


def served(url: str) -> dict[str, dict[str, Any]]:
    """The engines the host serves in this module's namespace, by pod name."""
    return {e["pod"]: e for e in httpx.get(url, timeout=30).json() if e["namespace"] == NS}


def test_200_engines_are_each_paused_and_resumed_and_none_is_missed(cluster: Cluster, fake_nodes: str) -> None:
    from rollfleet_dev import kwok

    deploy_operator(cluster, [NS])
    manifest = {
        "apiVersion": API_VERSION,
        "kind": "RolloutFleet",
        "metadata": {"name": FLEET, "namespace": NS},
        "spec": {
            "replicas": ENGINES,
            "model": {"servedName": "sim", "imagePath": "/nonexistent"},
            "engine": {"gpusPerEngine": 1},
            "placement": kwok.placement(),
            "gateway": {"enabled": False},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    fleet = Fleet(cluster, FLEET, NS)
    fleet.wait_ready(ENGINES, timeout=TIMEOUT_S)
    names = {engine_pod_name(FLEET, i) for i in range(ENGINES)}
    assert {e["name"] for e in fleet.status()["engines"]} == names
    assert set(wait_for(lambda: (s := served(fake_nodes)).keys() == names and s, 60, what="all engines served"))

    cluster.kubectl("-n", NS, "annotate", "rolloutfleet", FLEET, f"{ANNOTATION_PAUSE}=keep")

    def all_paused(st: dict[str, Any]) -> bool:
        return (st.get("pause") or {}).get("pausedEngines") == ENGINES and all(
            e["phase"] == "Paused" for e in st["engines"]
        )

    fleet.wait(all_paused, "every engine Paused in the status", timeout=TIMEOUT_S)
    # ... and at the engines themselves, each one, in keep mode.
    engines = served(fake_nodes)
    assert engines.keys() == names
    not_paused = sorted(name for name, e in engines.items() if not e["paused"] or e["paused_at"] is None)
    assert not not_paused, f"{len(not_paused)} engines not paused: {not_paused[:10]}"

    cluster.kubectl("-n", NS, "annotate", "rolloutfleet", FLEET, f"{ANNOTATION_PAUSE}-")
    fleet.wait(
        lambda st: st.get("pause") is None and all(e["phase"] == "Ready" for e in st["engines"]),
        "every engine Ready again in the status",
        timeout=TIMEOUT_S,
    )
    engines = served(fake_nodes)
    still = sorted(
        name
        for name, e in engines.items()
        if e["paused"] or e["resumed_at"] is None or e["resumed_at"] < e["paused_at"]
    )
    assert not still, f"{len(still)} engines not resumed: {still[:10]}"
