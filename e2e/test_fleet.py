"""RolloutFleet end to end: the operator deployed from manifests/, on simulated engines.

The engines are the control-plane tier's (`rollfleet_dev.sim_engine`, held to vLLM by
tests/engine/test_contract.py): the operator is under test here (admission, status, crash loops,
pause, drain, replacement, restarts), and a fleet of real engines on kind is the acceptance tier's
(e2e/test_faults.py, test_gateway.py, test_client.py). One fleet is shared by the module. Every
case that uses it starts from REPLICAS Ready engines with nothing paused, and its teardown
puts the fleet back whatever the case did (`SharedFleet`), so a failed case fails alone. Every
wait is on an observable condition (status, pods, token streams), never a fixed sleep.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest

from e2e.fleet_helpers import (
    ENGINE_START_S,
    OPERATOR_NS,
    Fleet,
    SharedFleet,
    Stream,
    deploy_operator,
    fault_point,
    fleet_manifest,
    kill_engine_process,
    operator_metrics,
    operator_pods,
    sim_engine,
)
from e2e.provider import Cluster, wait_for
from rollfleet.api.fleet import MAX_ENGINES
from rollfleet.contract import (
    ANNOTATION_CRASHES,
    ENGINE_PORT,
    REQUESTS_PATH,
    STATE_PATH,
    disruption_budget_name,
    engine_pod_name,
    gateway_name,
)
from rollfleet.controller.status import CRASH_BACKOFF_START_S, ENGINES_PAUSED_ALONE, parse_time
from rollfleet_dev import oneshot
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.tiny_model import LONG_GENERATION, TINY_MODEL_CONTEXT

pytestmark = pytest.mark.cluster
# 8,000 tokens (the pause case's) take 40 s: a pause lands in a few.
TOKEN_DELAY_MS = 5.0

NS = "rf-e2e"
NAME = "e2e"
REPLICAS = 2  # what every case of the shared fleet starts from, and finds again after the one before


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[None]:
    cluster.kubectl("create", "namespace", NS, check=False)
    deploy_operator(cluster, [NS])
    yield
    cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", check=False, timeout=320)


@pytest.fixture(scope="module")
def engine(cluster: Cluster) -> dict[str, Any]:
    """The module's fleets' `spec.engine`: simulated."""
    return sim_engine(cluster, TOKEN_DELAY_MS)


@pytest.fixture(scope="module")
def shared(cluster: Cluster, operator: None, engine: dict[str, Any]) -> SharedFleet:
    manifest = fleet_manifest(NAME, NS, replicas=REPLICAS, engine=engine)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    return SharedFleet(Fleet(cluster, NAME, NS), REPLICAS)


@pytest.fixture
def fleet(shared: SharedFleet, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """The shared fleet, Ready and not paused; put back so after the case, pass or fail."""
    yield shared.acquire()
    shared.restore(request.node.name)


def _create(cluster: Cluster, manifest: dict[str, Any]) -> str:
    proc = cluster.kubectl("create", "-f", "-", input=json.dumps(manifest), check=False)
    assert proc.returncode != 0, f"accepted: {json.dumps(manifest['spec'])}"
    return proc.stderr


INVALID: list[tuple[str, dict[str, Any], str]] = [
    # Engine shapes (issue 34): each refused with the rule it breaks.
    (
        "tp-not-dividing-gpus",
        {"engine": {"gpusPerEngine": 3, "tensorParallelSize": 2}},
        "must be a multiple of the ranks each pod runs",
    ),
    (
        "ranks-uneven-over-pods",
        {"engine": {"gpusPerEngine": 0, "tensorParallelSize": 3, "podsPerEngine": 2}},
        "must divide evenly among podsPerEngine pods",
    ),
    (
        "dp-local-not-dividing-dp",
        {"engine": {"gpusPerEngine": 0, "dataParallelSize": 4, "dataParallelSizeLocal": 3}},
        "dataParallelSizeLocal (data parallel ranks per pod) must divide engine.dataParallelSize",
    ),
    (
        "dp-local-against-pods",
        {"engine": {"gpusPerEngine": 0, "dataParallelSize": 4, "dataParallelSizeLocal": 2}},
        "it must equal engine.podsPerEngine",
    ),
    (
        "dp-replicas-split-over-pods",
        {"engine": {"gpusPerEngine": 0, "dataParallelSize": 2, "tensorParallelSize": 2, "podsPerEngine": 4}},
        "engine.dataParallelSize must be a multiple of podsPerEngine",
    ),
    ("ep-without-dp-or-tp", {"engine": {"enableExpertParallel": True}}, "needs tensorParallelSize or dataParallelSize"),
    ("too-many-pods", {"engine": {"podsPerEngine": 65}}, "less than or equal to 64"),
    ("reserved-parallel-flag", {"engine": {"args": ["--data-parallel-size=2"]}}, "engine.args must not set"),
    (
        "no-surge-no-unavailable",
        {"updateStrategy": {"maxUnavailable": 0, "maxSurge": 0}},
        "maxUnavailable must be at least 1 when maxSurge is 0",
    ),
    ("percent-zero", {"updateStrategy": {"maxUnavailable": "0%"}}, "maxUnavailable must be at least 1"),
    ("bad-percent", {"updateStrategy": {"maxSurge": "lots"}}, "should match"),
    ("reserved-flag", {"engine": {"args": ["--port=9000"]}}, "engine.args must not set"),
    ("gpu-in-resources", {"engine": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "set engine.gpusPerEngine"),
    ("negative-replicas", {"replicas": -1}, "greater than or equal to 0"),
    ("too-many-replicas", {"replicas": MAX_ENGINES + 1}, f"less than or equal to {MAX_ENGINES}"),
    ("bad-pull-policy", {"engine": {"imagePullPolicy": "Sometimes"}}, "Unsupported value"),
    (
        "toleration-exists-value",
        {"placement": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
        "leave value empty",
    ),
    ("drain-timeout", {"drainTimeoutSeconds": -5}, "greater than or equal to 0"),
    ("bad-backend", {"weightSync": {"backend": "carrier-pigeon"}}, "Unsupported value"),
    (
        "peer-ip-and-pods",
        {"networkPolicy": {"extraIngressFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
        "set ipBlock alone",
    ),
]


def test_invalid_fleets_are_refused_with_a_clear_message(cluster: Cluster, operator: None) -> None:
    for name, spec, message in INVALID:
        manifest = fleet_manifest(f"bad-{name}", NS, replicas=1)
        manifest["spec"].update(spec)
        err = _create(cluster, manifest)
        assert message in err, f"{name}: {err}"
    two_sources = fleet_manifest("bad-sources", NS, replicas=1)
    two_sources["spec"]["model"]["imagePath"] = "/opt/model"
    assert "set exactly one of hostPath, pvc or imagePath" in _create(cluster, two_sources)
    no_model = fleet_manifest("bad-no-model", NS, replicas=1)
    del no_model["spec"]["model"]
    assert "spec.model: Required value" in _create(cluster, no_model)
    assert "at most 40 characters" in _create(cluster, fleet_manifest("x" * 45, NS, replicas=1))
    assert "must start with a letter" in _create(cluster, fleet_manifest("1fleet", NS, replicas=1))
    listed = cluster.kubectl("-n", NS, "get", "rf", "-o", "name").stdout
    assert "bad-" not in listed


# Shapes the API server accepts: one GPU per rank, spread evenly over the pods.
VALID_SHAPES: list[dict[str, Any]] = [
    {"gpusPerEngine": 0, "tensorParallelSize": 2},  # CPU ranks (the CPU engine's gloo)
    {"gpusPerEngine": 1, "tensorParallelSize": 2, "podsPerEngine": 2},  # one replica across two pods
    {"gpusPerEngine": 4, "tensorParallelSize": 2, "dataParallelSize": 4, "podsPerEngine": 2},  # DP over pods
    {"gpusPerEngine": 8, "dataParallelSize": 8, "enableExpertParallel": True},  # wide expert parallel, one pod
    {"gpusPerEngine": 4, "tensorParallelSize": 2, "pipelineParallelSize": 4, "podsPerEngine": 2},
]


def test_engine_shapes_that_fit_are_accepted(cluster: Cluster, operator: None) -> None:
    for i, shape in enumerate(VALID_SHAPES):
        manifest = fleet_manifest(f"shape-{i}", NS, replicas=1)
        manifest["spec"]["engine"] = shape
        proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)
        assert proc.returncode == 0, f"{shape}: {proc.stderr}"


def test_a_multi_pod_fleet_without_leaderworkerset_is_degraded_naming_the_crd_and_makes_no_pod(
    cluster: Cluster, operator: None, engine: dict[str, Any]
) -> None:
    """LWS is a prerequisite of engines of several pods: without its CRD the operator says so and creates nothing."""
    fleet = Fleet(cluster, "two-pods", NS)
    manifest = fleet_manifest(fleet.name, NS, replicas=1, engine={**engine, "tensorParallelSize": 2})
    manifest["spec"]["engine"] |= {"podsPerEngine": 2, "gpusPerEngine": 1}
    manifest["spec"]["gateway"] = {"enabled": False}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    try:

        def degraded(st: dict[str, Any]) -> bool:
            return any(
                c["type"] == "Degraded" and c["reason"] == "LeaderWorkerSetMissing" for c in st.get("conditions", [])
            )

        st = fleet.wait(degraded, "Degraded: LeaderWorkerSetMissing", timeout=60)
        [cond] = [c for c in st["conditions"] if c["type"] == "Degraded"]
        assert cond["status"] == "True" and "leaderworkersets.leaderworkerset.x-k8s.io" in cond["message"], cond
        assert fleet.pods() == [] and st["readyReplicas"] == 0
        row = cluster.kubectl("-n", NS, "get", "rf", fleet.name, "--no-headers").stdout.split()
        assert row[1:4] == ["0/1", "1", "2"], row  # READY, DESIRED, PODS (per engine)
    finally:
        cluster.kubectl("-n", NS, "delete", "rf", fleet.name, "--wait=true", "--timeout=120s", check=False, timeout=150)


def test_an_engine_that_cannot_start_backs_off_says_why_and_recovers_once_the_spec_is_fixed(
    cluster: Cluster, operator: None, engine: dict[str, Any]
) -> None:
    """A context longer than the model's: the engine exits at start, every time, until the spec is fixed."""
    crashy = Fleet(cluster, "crashy", NS)
    manifest = fleet_manifest(crashy.name, NS, replicas=1, engine=dict(engine))
    manifest["spec"]["engine"]["maxModelLen"] = 10 * TINY_MODEL_CONTEXT
    manifest["spec"]["gateway"] = {"enabled": False}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    try:
        engine = engine_pod_name(crashy.name, 0)

        def crashed(times: int) -> Callable[[dict[str, Any]], bool]:
            def check(st: dict[str, Any]) -> bool:
                message = crashy.engine(engine).get("message") or ""
                return f"crashed {times} time(s) in a row" in message

            return check

        crashy.wait(crashed(1), "the first crash, with the engine's own words")
        message = crashy.engine(engine)["message"]
        assert "max_model_len" in message and "exited with code" in message, message
        assert crashy.condition("Degraded")["status"] == "True"
        [first] = crashy.pods()  # kept while it backs off
        exited = parse_time(first["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"])

        def replacement() -> dict[str, Any] | None:
            return next((p for p in crashy.pods() if p["metadata"]["uid"] != first["metadata"]["uid"]), None)

        second = wait_for(replacement, ENGINE_START_S, what="the replacement engine")
        assert second is not None
        assert second["metadata"]["annotations"][ANNOTATION_CRASHES] == "1"
        created = parse_time(second["metadata"]["creationTimestamp"])
        assert exited is not None and created is not None
        assert (created - exited).total_seconds() >= CRASH_BACKOFF_START_S - 1  # (timestamps are whole seconds)
        crashy.wait(crashed(2), "the second crash")

        fixed = {"spec": {"engine": {"maxModelLen": TINY_MODEL_CONTEXT}}}
        cluster.kubectl("-n", NS, "patch", "rf", crashy.name, "--type=merge", "-p", json.dumps(fixed))
        crashy.wait_ready(1)
        [pod] = crashy.pods()
        assert ANNOTATION_CRASHES not in pod["metadata"]["annotations"]  # a fixed spec counts afresh
    finally:
        cluster.kubectl(
            "-n", NS, "delete", "rf", crashy.name, "--wait=true", "--timeout=120s", check=False, timeout=150
        )


def test_generation_needs_the_inference_token_unless_the_spec_opens_it_and_the_status_says_which(
    cluster: Cluster, operator: None, engine: dict[str, Any]
) -> None:
    """spec.auth.inference Open: the engines generate for anyone and status.auth says Open; back to Token (the
    default), the engine is replaced and asks for the fleet's inference token, and the status says Token."""
    fleet = Fleet(cluster, "open", NS)
    manifest = fleet_manifest(fleet.name, NS, replicas=1, engine=dict(engine), auth={"inference": "Open"})
    manifest["spec"]["gateway"] = {"enabled": False}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    pod = engine_pod_name(fleet.name, 0)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    try:
        st = fleet.wait_ready(1)
        assert st["auth"] == "Open", st
        with cluster.reach(NS, pod, ENGINE_PORT) as url:
            assert oneshot.get(url + STATE_PATH, timeout=10).json()["inference_open"] is True
            assert oneshot.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        [before] = fleet.pods()

        token = {"spec": {"auth": {"inference": "Token"}}}
        cluster.kubectl("-n", NS, "patch", "rf", fleet.name, "--type=merge", "-p", json.dumps(token))

        def replaced_and_locked(st: dict[str, Any]) -> bool:
            pods = fleet.pods()
            new = [p for p in pods if p["metadata"]["uid"] != before["metadata"]["uid"]]
            return st.get("auth") == "Token" and len(pods) == 1 and bool(new) and st["readyReplicas"] == 1

        fleet.wait(replaced_and_locked, "the engine replaced, asking for the inference token", ENGINE_START_S)
        with cluster.reach(NS, pod, ENGINE_PORT) as url:
            assert oneshot.get(url + STATE_PATH, timeout=10).json()["inference_open"] is False
            assert oneshot.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
            r = oneshot.post(url + "/v1/completions", json=body, headers=fleet.inference(), timeout=60)
            assert r.status_code == 200, r.text
    finally:
        cluster.kubectl("-n", NS, "delete", "rf", fleet.name, "--wait=true", "--timeout=120s", check=False, timeout=150)


def test_fleet_becomes_ready_on_gpu_nodes(cluster: Cluster, fleet: Fleet) -> None:
    table = cluster.kubectl("-n", NS, "get", "rf", NAME).stdout.splitlines()
    header = table[0].split()
    assert header[:8] == ["NAME", "READY", "DESIRED", "PODS", "UP-TO-DATE", "PAUSED", "WEIGHTS", "AGE"]
    assert table[1].split()[1:4] == ["2/2", "2", "1"]
    pods = fleet.pods()
    assert sorted(p["metadata"]["name"] for p in pods) == ["e2e-engine-0", "e2e-engine-1"]
    gpu_pool = set(cluster.kubectl("get", "nodes", "-l", "rollfleet.dev/pool=gpu", "-o", "name").stdout.split())
    for p in pods:
        assert f"node/{p['spec']['nodeName']}" in gpu_pool, (p["spec"]["nodeName"], gpu_pool)
        limits = p["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"nvidia.com/gpu": "1"}
        assert p["metadata"]["ownerReferences"][0]["kind"] == "RolloutFleet"
    st = fleet.status()
    assert st["selector"] == (
        "app.kubernetes.io/name=rollfleet,app.kubernetes.io/component=engine,rollfleet.dev/fleet=e2e"
    )
    assert {e["phase"] for e in st["engines"]} == {"Ready"}
    assert st["gateway"]["endpoint"] == f"http://e2e-gateway.{NS}.svc:8080"
    assert st["auth"] == "Token"  # the default: generation needs the fleet's inference (or admin) token
    reasons = {e["reason"] for e in fleet.events()}
    assert {"EngineCreated", "EngineReady", "ReadyTrue"} <= reasons
    for kind, name in (
        ("deployment", "e2e-gateway"),
        ("service", "e2e-gateway"),
        ("secret", "e2e-admin-token"),
        ("serviceaccount", "e2e-engine"),
        ("role", "e2e-gateway"),
        ("rolebinding", "e2e-gateway"),
    ):
        cluster.kubectl("-n", NS, "get", kind, name)
    policy = json.loads(cluster.kubectl("-n", NS, "get", "networkpolicy", "e2e-engine", "-o", "json").stdout)
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "rollfleet",
            "app.kubernetes.io/component": "engine",
            "rollfleet.dev/fleet": "e2e",
        }
    }
    # The operator in the cluster knows its namespace (POD_NAMESPACE from the downward API).
    assert {"kubernetes.io/metadata.name": OPERATOR_NS} in [
        (peer.get("namespaceSelector") or {}).get("matchLabels") for peer in policy["spec"]["ingress"][0]["from"]
    ]

    def switch_policy(enabled: bool) -> None:
        cluster.kubectl(
            "-n",
            NS,
            "patch",
            "rf",
            NAME,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"networkPolicy": {"enabled": enabled}}}),
        )
        wait_for(
            lambda: (
                (cluster.kubectl("-n", NS, "get", "networkpolicy", "e2e-engine", check=False).returncode == 0)
                == enabled
            ),
            timeout=60,
            what=f"the NetworkPolicy {'back' if enabled else 'deleted'}",
        )

    # Switched off, the operator deletes it; switched on again, it is back (no engine restarts either way).
    switch_policy(False)
    switch_policy(True)


def test_pause_keep_during_a_stream_loses_no_token(cluster: Cluster, fleet: Fleet) -> None:
    """Judged at the engine, whose core runs ahead of what the client has seen: while the fleet
    is paused the engine holds the request and produces no token; resumed, it finishes them all."""
    n, max_tokens = 2, 8000  # the core needs tens of seconds for these, the pause lands in a few
    with cluster.reach(NS, "e2e-engine-0", 8000) as url:
        stream = Stream(url, max_tokens=max_tokens, n=n, auth=fleet.inference()).start()
        wait_for(
            lambda: fleet.engine_state("e2e-engine-0")["running"] >= 1 or stream.done.is_set(),
            timeout=120,
            what="the request running on the engine",
        )
        cluster.kubectl("-n", NS, "annotate", "rf", NAME, "rollfleet.dev/pause=keep")
        st = fleet.wait(lambda s: (s.get("pause") or {}).get("pausedEngines") == 2, "both engines paused", 120)
        assert st["pause"]["mode"] == "keep"
        # The operator's metrics show the pause as the status does, and how long it has lasted.
        with operator_metrics(cluster) as metrics:

            def metrics_show_the_pause() -> bool:
                paused = engine_metric(metrics, "rollfleet_operator_engines", phase="Paused", namespace=NS, fleet=NAME)
                return (
                    paused == 2
                    and engine_metric(metrics, "rollfleet_operator_fleet_paused", namespace=NS, fleet=NAME) == 1
                )

            wait_for(metrics_show_the_pause, timeout=30, what="the operator's metrics to show the pause")
            assert engine_metric(metrics, "rollfleet_operator_fleet_paused_engines", namespace=NS, fleet=NAME) == 2
            assert engine_metric(metrics, "rollfleet_operator_fleet_pause_seconds", namespace=NS, fleet=NAME) > 0
        assert fleet.condition("Paused")["status"] == "True"
        header, row = cluster.kubectl("-n", NS, "get", "rf", NAME).stdout.splitlines()[:2]
        assert row[header.index("PAUSED") :].split()[0] == "keep"  # by position, as a person reads it
        # Outputs the core made before the pause may still be counting: wait until the count stands.
        counts: list[float] = []

        def count_stands() -> bool:
            counts.append(engine_metric(url, "vllm:generation_tokens_total"))
            return len(counts) >= 2 and counts[-1] == counts[-2]

        wait_for(count_stands, timeout=30, interval=1, what="the paused engine to stop producing tokens")
        produced = counts[-1]
        held = fleet.engine_state("e2e-engine-0")
        assert held["paused"] is True and held["running"] >= 1, f"the engine holds no request while paused: {held}"
        # Re-applying the same value changes nothing; an invalid one warns and changes nothing.
        cluster.kubectl("-n", NS, "annotate", "rf", NAME, "rollfleet.dev/pause=keep", "--overwrite")
        cluster.kubectl("-n", NS, "annotate", "rf", NAME, "rollfleet.dev/pause=sometimes", "--overwrite")
        fleet.wait(
            lambda s: any(c["reason"] == "InvalidPauseAnnotation" for c in s.get("conditions", [])),
            "the invalid value reported",
            60,
        )
        assert fleet.status()["pause"] == st["pause"]
        assert any(e["reason"] == "InvalidPauseAnnotation" and e["type"] == "Warning" for e in fleet.events())
        # No token was produced while the fleet was paused (the annotations above took seconds).
        assert engine_metric(url, "vllm:generation_tokens_total") == produced
        assert fleet.engine_state("e2e-engine-0")["running"] == held["running"]
        cluster.kubectl("-n", NS, "annotate", "rf", NAME, "rollfleet.dev/pause-")
        fleet.wait(lambda s: "pause" not in s and all(e["phase"] == "Ready" for e in s["engines"]), "resumed", 120)
        with operator_metrics(cluster) as metrics:
            wait_for(
                lambda: (
                    engine_metric(metrics, "rollfleet_operator_fleet_pause_seconds", namespace=NS, fleet=NAME) == 0
                    and engine_metric(metrics, "rollfleet_operator_engines", phase="Ready", namespace=NS, fleet=NAME)
                    == 2
                ),
                timeout=30,
                what="the operator's metrics to show the fleet resumed",
            )
        stream.wait(timeout=600)
    assert stream.finish == dict.fromkeys(range(n), "length")
    assert stream.completion_tokens == n * max_tokens, f"{stream.completion_tokens} of {n * max_tokens} tokens"
    # Annotating keep twice paused once: one "Paused" transition, after at most one "Pausing" (the
    # operator may see both engines paused at its first look, and then records no "Pausing"); the
    # lifted pause may show "Resuming" while an engine still reports paused, never "Paused" again.
    events = fleet.events()
    paused = [e["message"].split(":")[0] for e in events if e["reason"] == "PausedTrue"]
    story = sorted(f"{e['metadata']['creationTimestamp']} {e['reason']}: {e['message']}" for e in events)
    assert paused.count("Pausing") <= 1 and paused.count("Paused") == 1, "\n".join(story)


def test_pause_abort_ends_in_flight_requests_checked_at_the_engines(cluster: Cluster, fleet: Fleet) -> None:
    """`pause=abort` ends what the engines run: the caller gets finish_reason abort with its partial
    output, and the engine itself records the request finished by an abort, with nothing running."""
    request_id = f"pause-abort-{uuid.uuid4().hex[:8]}"
    with cluster.reach(NS, "e2e-engine-0", 8000) as url:
        stream = Stream(url, max_tokens=LONG_GENERATION, request_id=request_id, auth=fleet.inference()).start()
        wait_for(
            lambda: fleet.engine_state("e2e-engine-0")["running"] >= 1 or stream.done.is_set(),
            timeout=120,
            what="the request running on the engine",
        )
        cluster.kubectl("-n", NS, "annotate", "rf", NAME, "rollfleet.dev/pause=abort")
        st = fleet.wait(lambda s: (s.get("pause") or {}).get("pausedEngines") == 2, "both engines paused", 120)
        assert st["pause"]["mode"] == "abort"
        stream.wait(timeout=120)
        assert stream.finish == {0: "abort"} and 0 < stream.tokens() < LONG_GENERATION, (stream.finish, stream.tokens())
        seen = oneshot.get(f"{url}{REQUESTS_PATH}/{request_id}", timeout=10).raise_for_status().json()
        assert seen["phase"] == "finished" and seen["finish_reason"] == "abort", seen
        assert fleet.engine_state("e2e-engine-0")["running"] == 0
    cluster.kubectl("-n", NS, "annotate", "rf", NAME, "rollfleet.dev/pause-")
    fleet.wait(lambda s: "pause" not in s and all(e["phase"] == "Ready" for e in s["engines"]), "resumed", 120)


def test_scale_up_then_down_drains_in_flight_requests(cluster: Cluster, fleet: Fleet) -> None:
    """A scale-down drains: the engine leaving is deleted only once its requests finished. The
    requests are held at the engine by a pause of that engine alone, taken before they are sent, so
    they are in flight whatever the decoding speed. The fleet names such an engine, and the
    operator leaves its pause to whoever made it."""
    cluster.kubectl("-n", NS, "scale", "rf", NAME, "--replicas=3")
    fleet.wait_ready(3)
    fleet.engine_control("e2e-engine-2", "/pause?mode=keep")
    st = fleet.wait(
        lambda s: next(c for c in s["conditions"] if c["type"] == "Paused")["reason"] == ENGINES_PAUSED_ALONE,
        "the engine paused alone named in the Paused condition",
        60,
    )
    paused = next(c for c in st["conditions"] if c["type"] == "Paused")
    assert paused["status"] == "False" and "e2e-engine-2 (keep)" in paused["message"], paused
    assert "pause" not in st and fleet.engine("e2e-engine-2")["phase"] == "Paused"
    with cluster.reach(NS, "e2e-engine-2", 8000) as url:
        auth = fleet.inference()
        streams = [Stream(url, max_tokens=600, n=8, auth=auth).start() for _ in range(2)]

        def both_held() -> dict[str, Any] | None:
            state = fleet.engine_state("e2e-engine-2")
            return state if state["running"] + state["waiting"] == 2 else None

        held = wait_for(both_held, timeout=60, what="both requests held at the paused engine")
        assert held["paused"] and [s.tokens() for s in streams] == [0, 0], held
        fault_point("drain: scaled up, engine paused, requests held")
        cluster.kubectl("-n", NS, "scale", "rf", NAME, f"--replicas={REPLICAS}")

        def draining(st: dict[str, Any]) -> bool:
            e: dict[str, Any] = next((e for e in st["engines"] if e["name"] == "e2e-engine-2"), {})
            return bool(e.get("phase") == "Draining" and (e.get("inFlight") or 0) >= 1)

        fleet.wait(draining, "e2e-engine-2 draining with requests in flight", 60)
        # Draining while its requests are held: the engine is still there to finish them.
        assert "e2e-engine-2" in [p["metadata"]["name"] for p in fleet.pods()]
        fleet.engine_control("e2e-engine-2", "/resume")
        for s in streams:
            s.wait(timeout=300)
    # Every sequence ran to the end: the engine was deleted only after its requests finished.
    for s in streams:
        assert s.finish == dict.fromkeys(range(8), "length")
        assert s.completion_tokens == 8 * 600
    fleet.wait_ready(REPLICAS)
    wait_for(
        lambda: sorted(p["metadata"]["name"] for p in fleet.pods()) == ["e2e-engine-0", "e2e-engine-1"],
        timeout=120,
        what="only e2e-engine-0 and e2e-engine-1 left",
    )
    events = fleet.events()
    assert [e["reason"] for e in events].count("EngineDraining") >= 1
    alone = [e for e in events if e["reason"] == "PausedFalse" and ENGINES_PAUSED_ALONE in e["message"]]
    assert alone and alone[-1]["type"] == "Warning" and "e2e-engine-2" in alone[-1]["message"], alone
    drained = [e["message"] for e in events if e["reason"] == "EngineDeleted" and "e2e-engine-2" in e["message"]]
    assert drained and "drained" in drained[-1], drained


def test_killed_engine_process_is_replaced_and_degraded_meanwhile(cluster: Cluster, fleet: Fleet) -> None:
    old = fleet.pod("e2e-engine-0")
    kill_engine_process(cluster, NS, "e2e-engine-0")
    degraded = fleet.wait(
        lambda s: any(c["type"] == "Degraded" and c["status"] == "True" for c in s.get("conditions", [])),
        "Degraded",
        120,
    )
    assert degraded["readyReplicas"] == REPLICAS - 1
    assert next(c for c in degraded["conditions"] if c["type"] == "Ready")["status"] == "False"
    wait_for(lambda: fleet.replaced("e2e-engine-0", old["metadata"]["uid"]), timeout=120, what="a new e2e-engine-0 pod")
    fleet.wait_ready(REPLICAS)
    assert fleet.condition("Degraded")["status"] == "False"
    assert any(e["reason"] in ("EngineReplaced", "EngineFailed") for e in fleet.events())


def test_deleted_engine_pod_is_replaced_and_degraded_meanwhile(cluster: Cluster, fleet: Fleet) -> None:
    old = fleet.pod("e2e-engine-0")
    cluster.kubectl("-n", NS, "delete", "pod", "e2e-engine-0", "--wait=false")
    fleet.wait(
        lambda s: any(c["type"] == "Degraded" and c["status"] == "True" for c in s.get("conditions", [])),
        "Degraded",
        120,
    )
    wait_for(lambda: fleet.replaced("e2e-engine-0", old["metadata"]["uid"]), timeout=180, what="a new e2e-engine-0 pod")
    fleet.wait_ready(REPLICAS)
    assert fleet.condition("Degraded")["status"] == "False"


def _evict(core: kubernetes.client.CoreV1Api, pod: str) -> None:
    """What `kubectl drain` does to each pod: the Eviction API, which keeps PodDisruptionBudgets."""
    body = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=pod, namespace=NS))
    core.create_namespaced_pod_eviction(pod, NS, body)


def test_evictions_take_one_engine_at_a_time_and_the_evicted_one_is_replaced(
    cluster: Cluster, fleet: Fleet, core: kubernetes.client.CoreV1Api
) -> None:
    """The fleet's PodDisruptionBudget, from its update strategy (maxUnavailable 1), kept by the API server."""

    def counted() -> dict[str, Any] | None:
        out = cluster.kubectl("-n", NS, "get", "pdb", disruption_budget_name(NAME), "-o", "json").stdout
        pdb = json.loads(out)
        st = pdb.get("status") or {}
        return pdb if st.get("currentHealthy") == REPLICAS and st.get("disruptionsAllowed") == 1 else None

    pdb = wait_for(counted, 60, what="the disruption controller to count every engine healthy")
    assert pdb["spec"]["maxUnavailable"] == 1
    first, second = (fleet.pod(engine_pod_name(NAME, i)) for i in range(REPLICAS))
    _evict(core, first["metadata"]["name"])
    with pytest.raises(kubernetes.client.ApiException) as refused:
        _evict(core, second["metadata"]["name"])
    assert refused.value.status == 429 and "disruption budget" in str(refused.value.body), refused.value.body
    wait_for(
        lambda: fleet.replaced(first["metadata"]["name"], first["metadata"]["uid"]),
        timeout=120,
        what="the evicted engine replaced",
    )
    fleet.wait_ready(REPLICAS)
    assert fleet.pod(second["metadata"]["name"])["metadata"]["uid"] == second["metadata"]["uid"]


def test_operator_restart_mid_scale_converges_without_duplicates(cluster: Cluster, fleet: Fleet) -> None:
    [before] = operator_pods(cluster)
    cluster.kubectl("-n", NS, "scale", "rf", NAME, "--replicas=3")
    wait_for(lambda: len(fleet.pods()) >= 3, timeout=60, what="the scale-up under way")
    cluster.kubectl("-n", OPERATOR_NS, "delete", "pod", before["metadata"]["name"], "--wait=false")
    wait_for(
        lambda: any(
            p["metadata"]["uid"] != before["metadata"]["uid"] and p.get("status", {}).get("phase") == "Running"
            for p in operator_pods(cluster)
        ),
        timeout=300,
        what="a new operator pod running",
    )
    fleet.wait_ready(3)
    pods = fleet.pods()
    assert sorted(p["metadata"]["name"] for p in pods) == ["e2e-engine-0", "e2e-engine-1", "e2e-engine-2"]
    # No orphans: every engine pod in the namespace belongs to the fleet.
    everything = json.loads(
        cluster.kubectl("-n", NS, "get", "pods", "-l", "app.kubernetes.io/component=engine", "-o", "json").stdout
    )["items"]
    assert len(everything) == 3
    uid = fleet.get()["metadata"]["uid"]
    assert all(p["metadata"]["ownerReferences"][0]["uid"] == uid for p in everything)


def test_what_the_fleet_owns_is_put_back_when_someone_else_edits_or_deletes_it(cluster: Cluster, fleet: Fleet) -> None:
    """The operator watches what a fleet owns (controller-runtime's `Owns()`): an edit or a deletion is undone in
    seconds, where a timed re-apply took up to 5 minutes and made calls at rest."""
    role, budget = gateway_name(NAME), disruption_budget_name(NAME)

    def current(kind: str, name: str) -> dict[str, Any] | None:
        proc = cluster.kubectl("-n", NS, "get", kind, name, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    before, pdb = current("role", role), current("pdb", budget)
    assert before is not None and pdb is not None, "the fleet's gateway Role and PodDisruptionBudget"
    rules, old_uid, wanted = before["rules"], before["metadata"]["uid"], pdb["spec"]["maxUnavailable"]
    cluster.kubectl("-n", NS, "delete", "role", role)
    cluster.kubectl(
        "-n", NS, "patch", "pdb", budget, "--type=merge", "-p", json.dumps({"spec": {"maxUnavailable": 99}})
    )

    def put_back() -> bool:
        made, edited = current("role", role), current("pdb", budget)
        return bool(made and made["metadata"]["uid"] != old_uid and made["rules"] == rules) and bool(
            edited and edited["spec"]["maxUnavailable"] == wanted
        )

    wait_for(put_back, timeout=30, interval=0.5, what=f"the Role {role} made again and the PDB {budget} restored")


def test_deleting_the_fleet_removes_everything_it_created(cluster: Cluster, shared: SharedFleet) -> None:
    shared.acquire()
    cluster.kubectl("-n", NS, "delete", "rf", NAME, "--wait=true", "--timeout=120s", timeout=150)
    selector = f"rollfleet.dev/fleet={NAME}"
    kinds = "pods,deployments,replicasets,services,secrets,serviceaccounts,roles,rolebindings,networkpolicies,pdb"

    def gone() -> bool:
        out = cluster.kubectl("-n", NS, "get", kinds, "-l", selector, "-o", "name").stdout.strip()
        return out == ""

    wait_for(gone, timeout=300, what=f"everything labelled {selector} deleted")
