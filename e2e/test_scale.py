"""200 engines on KWOK's fake GPU nodes (`rollfleet cluster kwok up`; every engine answered by
`rollfleet_dev.engine_host`, the control-plane tier's simulator at each pod's IP): the operator, in its pod,
brings all of them to Ready, pauses every one and resumes every one, and the status says so at each step; then
the trainer's sync sidecar, in its pod, pushes new weights down its relay tree to every one (each engine stages
with the engine's own stager and proves the bytes). Correctness only, no timing: the timings at 200 to 2,000
engines are bench/bench_scale.py's. Local cluster only (KWOK and the engine host run beside its control plane);
the module stops both again."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.fleet_helpers import SIDECAR_MODELS, Fleet, deploy_operator, sync_sidecar_pod
from e2e.provider import Cluster, wait_for
from rollfleet.contract import ANNOTATION_PAUSE, API_VERSION, SYNC_API_PORT, engine_pod_name
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import EngineStep, PushState
from rollfleet_dev import oneshot

pytestmark = pytest.mark.cluster
NS = "rf-e2e-scale"
FLEET = "wide"
ENGINES = 200
TIMEOUT_S = 600  # 200 pods through a 2-core machine's API server and scheduler
TRAINER = "trainer"
PUSHED = "s-2"


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
    return {e["pod"]: e for e in oneshot.get(url, timeout=30).json() if e["namespace"] == NS}


def test_200_engines_are_each_paused_resumed_and_pushed_and_none_is_missed(cluster: Cluster, fake_nodes: str) -> None:
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

    # A push through the trainer's sidecar: every engine staged (down the relay tree), paused, loaded, resumed.
    cluster.kubectl("apply", "-f", "-", input=json.dumps(sync_sidecar_pod(FLEET, NS, TRAINER)))
    cluster.kubectl("-n", NS, "wait", "--for=condition=Ready", f"pod/{TRAINER}", "--timeout=120s", timeout=130)
    with cluster.reach(NS, TRAINER, SYNC_API_PORT) as url, SyncClient(url) as sync:
        wait_for(lambda: sync.fleet_version().version == "v1", 120, what="the sidecar adopts the engines' version")
        status = sync.push_dir(SIDECAR_MODELS, PUSHED, timeout_s=TIMEOUT_S)
    assert status.state is PushState.DONE, status
    assert {e.name for e in status.engines} == names
    left = [f"{e.name}: {e.step.value} {e.error}" for e in status.engines if e.step is not EngineStep.RESUMED]
    assert not left, f"{len(left)} engines left out of the push: {left[:5]}"
    relayed = [e for e in status.engines if e.source is not None and e.relay_error is None]
    assert len(relayed) == ENGINES - 1, f"{ENGINES - 1 - len(relayed)} engines did not stage from a relay"
    # 200 engines and a model of a few 1 MiB pieces: two binary trees, each upstream relaying to two, the second
    # carrying the second half of the shard (its root from the sidecar).
    assert max(Counter(e.source for e in relayed).values()) == 2
    halves = Counter(e.second_source for e in relayed if e.second_source is not None)
    assert sum(halves.values()) >= ENGINES - 2 and max(halves.values()) == 2, halves
    assert not {e.source for e in relayed} & set(halves), "an engine relays in one tree only"
    engines = served(fake_nodes)
    manifests = {e["weights_manifest_sha256"] for e in engines.values()}
    not_pushed = sorted(n for n, e in engines.items() if e["weight_version"] != PUSHED or e["paused"])
    assert not not_pushed, f"{len(not_pushed)} engines not on {PUSHED} and serving: {not_pushed[:10]}"
    assert len(manifests) == 1 and None not in manifests, "every engine proves the same bytes"
    fleet.wait(
        lambda st: (
            st.get("weightVersion") == PUSHED
            and all(e["phase"] == "Ready" and e.get("weightVersion") == PUSHED for e in st["engines"])
        ),
        f"every engine Ready on {PUSHED} in the status",
        timeout=TIMEOUT_S,
    )
