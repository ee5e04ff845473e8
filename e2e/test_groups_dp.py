"""A data parallel engine across two pods on real vLLM, on kind (issue 34): one engine of data parallel 2, a
LeaderWorkerSet group of two pods on the two nodes of the GPU pool, one engine core in each; the leader's API
server balances over both (vLLM's DP coordinator), and vLLM's `X-data-parallel-rank` header pins a request to a
rank. Each guarantee is checked at both ranks, by vLLM's own counters, which the leader reports per rank
(`engine="0"`, `engine="1"`): both serve transformers' tokens; abort by id ends requests on both ranks at once
(abort under data parallel must not deadlock); a client that leaves frees its rank; pause keep holds both ranks
and loses no token; a weight push loads on both; a rolling update drains the group and replaces it whole, the
new group on the fleet's weights.

On kind only (the fixture `lws_on_kind`), like e2e/test_groups.py (tensor parallel across pods).
docs/engine.md, "Engines across pods".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from tests.engine.calls import GREEDY_PROMPTS
from tests.engine.test_engine_live import _reference_greedy

from e2e.fleet_helpers import (
    ENGINE_START_S,
    SIDECAR_MODELS,
    Fleet,
    Stream,
    all_engines_on,
    deploy_operator,
    fleet_manifest,
    greedy,
    group_pods,
    sidecar_client,
)
from e2e.live_fleet import INITIAL_VERSION
from e2e.provider import Cluster, wait_for
from rollfleet.contract import (
    ANNOTATION_PAUSE,
    ENGINE_PORT,
    GATEWAY_PORT,
    REQUEST_ID_HEADER,
    engine_group_leader,
    engine_pod_name,
)
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import PushState
from rollfleet_dev import oneshot
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.protocol import ABORT_PATH, REQUESTS_PATH, STATE_PATH
from rollfleet_engine.tiny_model import WEIGHTS_B_DIR, ensure_tiny_model

pytestmark = [pytest.mark.cluster, pytest.mark.engine, pytest.mark.after_live]
NS = "rf-e2e-groups-dp"
NAME = "dp"
TRAINER = "trainer"  # the sync sidecar's pod
GROUP = engine_pod_name(NAME, 0)
LEADER = engine_group_leader(GROUP)
RANKS = ("0", "1")
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's: the data parallel rank that serves this request
RUNNING = "vllm:num_requests_running"
GREEDY_TOKENS = 8
A, B = INITIAL_VERSION, "b-1"


def pin(rank: str) -> dict[str, str]:
    return {DP_RANK_HEADER: rank}


@pytest.fixture(scope="module")
def fleet(cluster: Cluster, lws_on_kind: None) -> Iterator[Fleet]:
    cluster.kubectl("create", "namespace", NS, check=False)
    deploy_operator(cluster, [NS])
    manifest = fleet_manifest(NAME, NS, replicas=1, weightSync={"initialVersion": A})
    manifest["spec"]["engine"] |= {"dataParallelSize": 2, "podsPerEngine": 2, "gpusPerEngine": 1}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    fleet = Fleet(cluster, NAME, NS)
    try:
        fleet.wait_ready(1, timeout=ENGINE_START_S)
        yield fleet
    finally:
        cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", check=False, timeout=320)


@pytest.fixture(scope="module")
def engine(cluster: Cluster, fleet: Fleet) -> Iterator[str]:
    """The engine's own port: its leader's, which serves both ranks."""
    with cluster.reach(NS, LEADER, ENGINE_PORT) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(cluster: Cluster, fleet: Fleet) -> Iterator[str]:
    [pod] = [p["metadata"]["name"] for p in fleet.pods("gateway") if not p["metadata"].get("deletionTimestamp")][:1]
    with cluster.reach(NS, pod, GATEWAY_PORT) as url:
        yield url


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    root = str(ensure_tiny_model())
    return {
        v: _reference_greedy(d, GREEDY_PROMPTS, GREEDY_TOKENS) for v, d in ((A, root), (B, f"{root}/{WEIGHTS_B_DIR}"))
    }


def running_at(engine: str, rank: str) -> float:
    return engine_metric(engine, RUNNING, engine=rank)


def tracked(engine: str, request_id: str) -> dict[str, Any]:
    return dict(oneshot.get(f"{engine}{REQUESTS_PATH}/{request_id}", timeout=30).raise_for_status().json())


def test_both_ranks_serve_transformers_tokens_behind_one_engine(
    cluster: Cluster, fleet: Fleet, engine: str, gateway: str, references: dict[str, list[list[int]]]
) -> None:
    assert [e["name"] for e in fleet.status()["engines"]] == [LEADER]  # one engine, named by its leader
    pods = group_pods(cluster, NS, GROUP)
    assert len(pods) == 2 and len({p["spec"]["nodeName"] for p in pods}) == 2, "one pod per GPU-pool node"
    for rank in RANKS:
        assert greedy(engine, fleet.inference() | pin(rank), GREEDY_PROMPTS, GREEDY_TOKENS) == references[A], rank
    assert greedy(gateway, fleet.inference(), GREEDY_PROMPTS, GREEDY_TOKENS) == references[A]


def test_abort_by_id_ends_requests_on_both_ranks_without_deadlock(fleet: Fleet, engine: str) -> None:
    streams = {
        rank: Stream(engine, max_tokens=2000, request_id=f"dp-abort-{rank}", auth=fleet.inference() | pin(rank)).start()
        for rank in RANKS
    }
    wait_for(lambda: all(s.tokens() >= 3 for s in streams.values()), timeout=120, what="both ranks decoding")
    assert all(running_at(engine, rank) == 1 for rank in RANKS)
    ids = [s.request_id for s in streams.values()]
    t0 = time.monotonic()
    r = oneshot.post(
        engine + ABORT_PATH,
        json={"request_ids": ids},
        headers={"Authorization": f"Bearer {fleet.admin_token()}"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["results"] == dict.fromkeys(ids, "aborted"), r.text
    wait_for(lambda: all(running_at(engine, rank) == 0 for rank in RANKS), 10, interval=0.05, what="both ranks idle")
    print(f"\ndata parallel abort of one request per rank: both ranks idle {time.monotonic() - t0:.2f}s after the call")
    for s in streams.values():
        s.wait(timeout=60)
        assert s.finish == {0: "abort"} and s.tokens() < 2000
        assert tracked(engine, str(s.request_id))["phase"] == "finished"


def test_a_client_that_leaves_frees_its_rank(fleet: Fleet, engine: str, gateway: str) -> None:
    rid = f"dp-gone-{uuid.uuid4().hex[:6]}"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    received = 0
    headers = {REQUEST_ID_HEADER: rid} | fleet.inference()
    with oneshot.stream("POST", gateway + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        for piece in r.iter_text():
            received += piece.count('"token_ids":[') - piece.count('"token_ids":[]')
            if received >= 20:
                break
    # Whichever rank the leader gave it to, nothing runs on either once the client is gone.
    wait_for(lambda: all(running_at(engine, rank) == 0 for rank in RANKS), 30, interval=0.05, what="both ranks idle")
    ended = tracked(engine, rid)
    assert ended["phase"] == "finished" and ended["finish_reason"] == "abort", ended


def test_pause_keep_holds_both_ranks_and_loses_no_token(cluster: Cluster, fleet: Fleet, engine: str) -> None:
    tokens = 60
    streams = [Stream(engine, max_tokens=tokens, auth=fleet.inference() | pin(rank)).start() for rank in RANKS]
    wait_for(lambda: all(s.tokens() >= 3 for s in streams), timeout=120, what="both ranks decoding")
    cluster.kubectl("-n", NS, "annotate", "rf", NAME, f"{ANNOTATION_PAUSE}=keep", "--overwrite")
    fleet.wait(lambda st: (st.get("pause") or {}).get("pausedEngines") == 1, "the engine paused", timeout=60)
    paused_at = time.monotonic()
    with httpx.Client(timeout=30) as client:
        assert client.get(engine + STATE_PATH).json()["paused"] is True
    time.sleep(1.5)  # the observation window: no token may arrive in it, from either rank
    resumed_at = time.monotonic()
    cluster.kubectl("-n", NS, "annotate", "rf", NAME, f"{ANNOTATION_PAUSE}-")
    for s in streams:
        s.wait(timeout=300)
        assert [t for t, _ in s.chunks if paused_at + 0.3 < t < resumed_at] == []
        assert s.finish == {0: "length"} and s.completion_tokens == tokens
    fleet.wait(lambda st: not st.get("pause"), "resumed", timeout=60)


@pytest.fixture(scope="module")
def sync(cluster: Cluster, fleet: Fleet) -> Iterator[SyncClient]:
    """The fleet's sync sidecar, kept for the module: it brings a new group to the fleet's version."""
    with sidecar_client(cluster, fleet, TRAINER, A) as client:
        yield client


def on_version(version: str) -> Callable[[dict[str, Any]], bool]:
    return all_engines_on(version, 1)


def test_a_push_loads_on_both_ranks(
    fleet: Fleet, engine: str, sync: SyncClient, references: dict[str, list[list[int]]]
) -> None:
    status = sync.push_dir(f"{SIDECAR_MODELS}/{WEIGHTS_B_DIR}", B)
    assert status.state is PushState.DONE, status
    fleet.wait(on_version(B), f"status shows {B} on the engine", timeout=120)
    for rank in RANKS:  # a rank on the old weights would give set A's tokens
        assert greedy(engine, fleet.inference() | pin(rank), GREEDY_PROMPTS, GREEDY_TOKENS) == references[B], rank


def test_a_rolling_update_drains_the_group_and_replaces_it_whole(
    cluster: Cluster, fleet: Fleet, gateway: str, sync: SyncClient, references: dict[str, list[list[int]]]
) -> None:
    fleet.wait(on_version(B), f"the engine on {B}", timeout=120)
    old = {p["metadata"]["uid"] for p in group_pods(cluster, NS, GROUP)}
    tokens = 400
    stream = Stream(gateway, max_tokens=tokens, request_id="dp-roll", auth=fleet.inference()).start()
    wait_for(lambda: stream.tokens() >= 3, timeout=120, what="the request decoding")
    patch = {"spec": {"engine": {"env": [{"name": "ROLLED", "value": "1"}]}}}
    cluster.kubectl("-n", NS, "patch", "rf", NAME, "--type=merge", "-p", json.dumps(patch))

    phases: set[str] = set()

    def rolled(st: dict[str, Any]) -> bool:
        phases.update(e["phase"] for e in st.get("engines", []))
        pods = group_pods(cluster, NS, GROUP)
        fresh = len(pods) == 2 and not {p["metadata"]["uid"] for p in pods} & old
        return fresh and st.get("updatedReplicas") == 1 and on_version(B)(st)

    fleet.wait(rolled, f"a new group, Ready on {B}", timeout=ENGINE_START_S)
    assert "Draining" in phases, phases  # the old group finished its request before it went
    assert phases & {"Starting", "PendingSync"}, phases  # the new one served only once on the fleet's version
    stream.wait(timeout=300)
    assert stream.finish == {0: "length"} and stream.completion_tokens == tokens
    with cluster.reach(NS, LEADER, ENGINE_PORT) as url:
        for rank in RANKS:  # both ranks of the new group on the fleet's weights
            assert greedy(url, fleet.inference() | pin(rank), GREEDY_PROMPTS, GREEDY_TOKENS) == references[B], rank
