"""200 engines on KWOK's fake GPU nodes (`rollfleet cluster kwok up`; every engine answered by
`rollfleet_dev.engine_host`, the control-plane tier's simulator at each pod's IP): the operator, in its pod,
brings all of them to Ready, pauses every one and resumes every one, and the status says so at each step; then
the trainer's sync sidecar, in its pod, pushes new weights down its relay tree to every one (each engine stages
with the engine's own stager and proves the bytes). Correctness only, no timing: the timings at 200 to 2,000
engines are bench/bench_scale.py's. Local cluster only (KWOK and the engine host run beside its control plane);
the module stops both again."""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from e2e.fleet_helpers import SIDECAR_MODELS, Fleet, deploy_operator, live_pods, sync_sidecar_pod
from e2e.provider import Cluster, wait_for
from rollfleet.contract import (
    ANNOTATION_PAUSE,
    ANNOTATION_PHASE,
    ANNOTATION_WEIGHT_GENERATION,
    API_VERSION,
    SYNC_API_PORT,
    engine_pod_name,
    engine_selector,
)
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


class PhaseWatch:
    """Each of the fleet's engine pods' (`rollfleet.dev/phase`, pod Ready) pairs, as a watch shows every change
    from its start on."""

    def __init__(self, cluster: Cluster) -> None:
        self._core = kubernetes.client.CoreV1Api(cluster.api_client())
        self._watch = kubernetes.watch.Watch()
        self._seen: dict[str, set[tuple[str | None, bool]]] = defaultdict(set)
        self._broken: Exception | None = None
        self._stopped = threading.Event()

    def __enter__(self) -> PhaseWatch:
        since = self._core.list_namespaced_pod(NS, label_selector=engine_selector(FLEET)).metadata.resource_version
        threading.Thread(target=self._run, args=(since,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._watch.stop()  # the stream ends at its next event, or when the namespace goes

    def _run(self, since: str) -> None:
        selector = engine_selector(FLEET)
        try:
            for event in self._watch.stream(
                self._core.list_namespaced_pod, NS, label_selector=selector, resource_version=since
            ):
                pod = event["object"]
                ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
                self._seen[pod.metadata.name].add(((pod.metadata.annotations or {}).get(ANNOTATION_PHASE), ready))
        except Exception as err:  # what a broken stream missed must not pass for nothing having happened
            if not self._stopped.is_set():
                self._broken = err

    def shown(self) -> dict[str, set[tuple[str | None, bool]]]:
        if self._broken is not None:
            raise AssertionError(f"the pod watch broke: {self._broken}")
        return {name: set(pairs) for name, pairs in list(self._seen.items())}


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
    fleet = Fleet(cluster, FLEET, NS)
    names = {engine_pod_name(FLEET, i) for i in range(ENGINES)}
    with PhaseWatch(cluster) as watch:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        fleet.wait_ready(ENGINES, timeout=TIMEOUT_S)

        def all_shown_ready() -> bool:
            shown = watch.shown()
            return all(("Ready", True) in shown.get(name, ()) for name in names)

        wait_for(all_shown_ready, 60, what="the watch to show every engine's pod Ready")
        shown = watch.shown()
    # Neither pushed to nor paused, each engine was born Ready at weight generation 0 (plan.born_ready): its pod
    # was annotated Ready while it loaded (not Ready), and the operator wrote it no other phase on the way.
    assert shown.keys() == names
    born = {name: pairs for name, pairs in shown.items() if pairs != {("Ready", False), ("Ready", True)}}
    assert not born, f"{len(born)} engines not born Ready: {sorted(born.items())[:5]}"
    pods = live_pods(cluster, NS, engine_selector(FLEET))
    assert {p["metadata"]["annotations"].get(ANNOTATION_WEIGHT_GENERATION) for p in pods} == {"0"}
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
