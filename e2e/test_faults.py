"""The fault matrix: one fault per case while a RolloutRequest runs through the operator and the gateway.

The fleet is the control-plane tier's (`sim_live`: simulated engines, `rollfleet_dev.sim_engine`);
the engine kill and the operator kill also run on the live fleet's real vLLM engines (`[vllm]`).

Each case runs a 64-sample RolloutRequest (16 prompts x 4 samples, 120 tokens each; 32 samples
on real engines) through the operator and the gateway, injects its fault once samples complete
and others decode, and then requires: the request Succeeded with exactly one whole result per sample (0 lost, 0
duplicated), no sample still running on any engine, and the fleet's status true again (every
engine pod Ready in status and in Kubernetes, gateways ready). The abort storm sends 1,000
abort calls with mixed ids while 64 samples stream. Each case prints its row of the table in
docs/operations.md ("Fault matrix"); the sync sidecar killed mid-push is
`e2e/test_sync.py::test_sidecar_killed_mid_push_ends_with_the_whole_fleet_on_one_version`.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kubernetes
import pytest

from e2e.fleet_helpers import OPERATOR_NS, Stream, operator_pods, sse, tokens_of
from e2e.live_fleet import ON_BOTH, LiveFleet, create, results, running, shared, wait_phase
from e2e.provider import wait_for
from rollfleet.contract import (
    ANNOTATION_PAUSE,
    COMPONENT_ENGINE,
    GROUP,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_INDEX,
    VERSION,
    disruption_budget_name,
)
from rollfleet.kube import FLEET
from rollfleet_dev import oneshot
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.tiny_model import LONG_GENERATION as LONG

pytestmark = pytest.mark.cluster

PROMPTS, SAMPLES, TOKENS = 16, 4, 120
# On real engines (two vLLM on CPU, the acceptance tier's) half the prompts: the fault still lands with samples
# done and others decoding, and the case is not the acceptance tier's longest.
REAL_PROMPTS = 8
PARALLELISM = 16
STREAM_TOKENS = 200  # each client stream beside the request: long enough to outlast the fault's start


@pytest.fixture(params=["sim"])
def fleet(request: pytest.FixtureRequest) -> LiveFleet:
    return shared(request)


def status_mismatch(fleet: LiveFleet) -> str | None:
    """How `kubectl get rf -o yaml` differs from the pods now (None: it tells the truth): the same engines,
    a pod being deleted shown Draining, every other one Ready in status and in Kubernetes."""
    st = fleet.fleet.status()
    pods = {p["metadata"]["name"]: p for p in fleet.fleet.pods()}
    engines = {e["name"]: e for e in st.get("engines", [])}
    if set(engines) != set(pods):
        return f"status lists {sorted(engines)}, the pods are {sorted(pods)}"
    for name, pod in pods.items():
        if pod["metadata"].get("deletionTimestamp"):
            if engines[name]["phase"] != "Draining":
                return f"{name} is being deleted but shows {engines[name]['phase']}"
            continue
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
        if not (ready and engines[name]["phase"] == "Ready"):
            return f"{name}: phase {engines[name]['phase']}, pod conditions {pod['status'].get('conditions')}"
    serving = sum(1 for p in pods.values() if not p["metadata"].get("deletionTimestamp"))
    if not st["readyReplicas"] == st["replicas"] == serving:
        return f"readyReplicas {st['readyReplicas']}, replicas {st['replicas']}, {serving} pods not being deleted"
    return None


def wait_status_true(fleet: LiveFleet) -> None:
    """Status is written at most once a second: wait until it agrees with the pods."""
    try:
        wait_for(lambda: status_mismatch(fleet) is None, 30, interval=0.5, what="the fleet's status to match its pods")
    except AssertionError as err:
        raise AssertionError(f"status not true: {status_mismatch(fleet)}") from err


class DisruptionWatch:
    """What a disruption did to the fleet, polled from the API server every half second while it runs: the most
    engines unavailable at once (as the PodDisruptionBudget counts them: not Ready, or being deleted)."""

    def __init__(self, fleet: LiveFleet) -> None:
        self.fleet = fleet
        self.most_unavailable = 0
        self.polls = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DisruptionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        api = self.fleet.cluster.api_client()
        core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        ns, name = self.fleet.namespace, self.fleet.fleet.name
        selector = f"{LABEL_FLEET}={name},{LABEL_COMPONENT}={COMPONENT_ENGINE}"
        try:
            while not self._stop.wait(0.5):
                replicas = custom.get_namespaced_custom_object(GROUP, VERSION, ns, FLEET.plural, name)["spec"][
                    "replicas"
                ]
                pods = [
                    api.sanitize_for_serialization(p)
                    for p in core.list_namespaced_pod(ns, label_selector=selector).items
                ]
                healthy = sum(
                    1
                    for p in pods
                    if not p["metadata"].get("deletionTimestamp")
                    and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
                )
                self.most_unavailable = max(self.most_unavailable, replicas - healthy)
                self.polls += 1
        except BaseException as err:  # the test thread reports it
            self.error = err


def disruption_budget(fleet: LiveFleet) -> int:
    """The engines the fleet's PodDisruptionBudget lets voluntary disruptions take down at once."""
    pdb = kubernetes.client.PolicyV1Api(fleet.cluster.api_client()).read_namespaced_pod_disruption_budget(
        disruption_budget_name(fleet.fleet.name), fleet.namespace
    )
    return int(pdb.spec.max_unavailable)


def run_with_fault(
    fleet: LiveFleet,
    case: str,
    inject: Callable[[], object],
    after: Callable[[], object] = lambda: None,
    prompts: int | None = None,
    streams: int = 0,
    busy: str | None = None,
) -> None:
    """The case's request, its fault injected mid-run, and every promise checked; prints its table row. With
    `streams`, that many clients stream a completion through the gateway across the fault too: each must get
    every token it asked for, without an error. With `busy`, the fault waits until that engine runs some of the
    request's samples (a case that counts the samples moved off it has none to count otherwise)."""
    # In waves (16 of the 64 in flight at once): the fault must land while some samples are done and others
    # decode, and samples that all start together on an engine also end together.
    spec = {"sampling": {"maxTokens": TOKENS, "ignoreEos": True}, "parallelism": PARALLELISM}
    prompts = prompts or (REAL_PROMPTS if fleet.real else PROMPTS)
    name, uid = create(fleet, prompts, SAMPLES, **spec)

    def mid_run() -> bool:
        # Counted at the engines as they end, not from the request's status: the runner writes that at most once a
        # second after its results, and a fast fleet decoded a whole wave in that lag (CI of f1829cb).
        on, ended = fleet.requests(f"{uid}-")
        return ended >= 8 and (bool(on.get(busy)) if busy else any(on.values()))

    wait_for(mid_run, 300, interval=0.2, what=f"samples completed and others decoding{f' on {busy}' if busy else ''}")
    clients = [
        Stream(fleet.gateways[i % len(fleet.gateways)].url, max_tokens=STREAM_TOKENS, auth=fleet.inference).start()
        for i in range(streams)
    ]
    t0 = time.monotonic()
    inject()
    st = wait_phase(fleet, name, "Succeeded", timeout=900)
    finished_s = time.monotonic() - t0
    for c in clients:
        c.wait(600)
        # Counted by the usage, not by chunks: a loaded engine may send two tokens in one chunk.
        assert c.error is None and c.finish == {0: "length"} and c.tokens() > 0, (c.error, c.finish)
        assert c.completion_tokens == STREAM_TOKENS, c.completion_tokens
    after()
    fleet.ready()
    wait_status_true(fleet)
    healed_s = time.monotonic() - t0
    rows = results(fleet, name)
    keys = [(r["prompt"], r["sample"]) for r in rows]
    total = prompts * SAMPLES
    lost, duplicated = total - len(set(keys)), len(keys) - len(set(keys))
    short = [
        (r["prompt"], r["sample"], r["finish_reason"], len(r["token_ids"]))
        for r in rows
        if len(r["token_ids"]) != TOKENS
    ]
    print(
        f"\n| {case} | {total} | {st['counts']['completed']} | {lost} | {duplicated} "
        f"| {finished_s:.1f} s | {healed_s:.1f} s |"
    )
    assert lost == duplicated == 0 and not short, (lost, duplicated, short[:5])
    assert st["counts"]["completed"] == total and st["counts"]["failed"] == st["counts"]["aborted"] == 0
    assert not running(fleet, uid), "a sample still runs on an engine"


@ON_BOTH
def test_an_engine_killed_mid_rollout(fleet: LiveFleet) -> None:
    key = fleet.engines[0].key
    old_uid = fleet.fleet.pod(key)["metadata"]["uid"]
    run_with_fault(
        fleet,
        "kill an engine mid-rollout",
        lambda: fleet.kill_engine(key),
        # The request can end before the kubelet reports the killed pod Failed (the other engine finishes it):
        # the fleet is healed once the replacement is Ready, not while a status from before the kill says so.
        after=lambda: wait_for(lambda: fleet.fleet.replaced(key, old_uid, ready=True), 600, what=f"a new {key} Ready"),
    )


def _moves(fleet: LiveFleet) -> float:
    """Requests the fleet's gateway replicas moved off engines whose pods were going."""
    return sum(engine_metric(g.url, "rollfleet_gateway_moves_total") for g in fleet.gateways)


@ON_BOTH
def test_the_node_of_an_engine_drained_mid_rollout(fleet: LiveFleet) -> None:
    """`kubectl drain` of an engine's node (its engine pods only): evicted within the fleet's PodDisruptionBudget,
    the engine serves on while the gateway moves its samples to the other engine from their tokens (a real
    engine's preStop hook holds it until it holds none), and its replacement starts on another node."""
    key = fleet.engines[0].key
    old = fleet.fleet.pod(key)
    node = old["spec"]["nodeName"]
    before = _moves(fleet)
    # That engine's pods only: an earlier case's replacement may share its node, and this case drains one engine.
    index = old["metadata"]["labels"][LABEL_INDEX]
    engine = f"{LABEL_FLEET}={fleet.fleet.name},{LABEL_COMPONENT}={COMPONENT_ENGINE},{LABEL_INDEX}={index}"

    # An engine's /dev/shm is an emptyDir: drain must be told that its data may go.
    drain = ("drain", node, "--pod-selector", engine, "--ignore-daemonsets", "--delete-emptydir-data")

    def replaced_elsewhere() -> None:
        wait_for(lambda: fleet.fleet.replaced(key, old["metadata"]["uid"]), 120, what=f"a new {key} pod")
        wait_for(lambda: fleet.fleet.pod(key)["spec"].get("nodeName"), 120, what=f"the new {key} scheduled")
        assert fleet.fleet.pod(key)["spec"]["nodeName"] != node
        fleet.cluster.kubectl("uncordon", node)

    try:
        with DisruptionWatch(fleet) as watch:
            run_with_fault(
                fleet,
                "drain the node of an engine (kubectl drain)",
                lambda: fleet.cluster.kubectl(*drain, "--timeout=300s", timeout=320),
                after=replaced_elsewhere,
                prompts=PROMPTS,
                streams=4,
                busy=key,
            )
    finally:
        fleet.cluster.kubectl("uncordon", node)
    assert watch.error is None and watch.polls > 0, watch.error
    # The budget held: never more engines down at once than it allows (the replacement counted until Ready).
    assert 0 < watch.most_unavailable <= disruption_budget(fleet), (watch.most_unavailable, disruption_budget(fleet))
    if fleet.real:  # a simulated engine stops at once: its streams may break before the gateway moves them
        assert _moves(fleet) > before


@ON_BOTH
def test_an_engine_preempted_with_a_30_s_notice_mid_rollout(fleet: LiveFleet) -> None:
    """A preemption notice (a spot node's handler deletes the pod with the provider's grace period): within its
    30 s the gateway moves the engine's samples elsewhere from their tokens, and the engine is replaced."""
    key = fleet.engines[0].key
    old_uid = fleet.fleet.pod(key)["metadata"]["uid"]
    before = _moves(fleet)
    delete = ("-n", fleet.namespace, "delete", "pod", key, "--grace-period=30", "--wait=false")
    run_with_fault(
        fleet,
        "preempt an engine (pod deleted, 30 s grace)",
        lambda: fleet.cluster.kubectl(*delete),
        after=lambda: wait_for(lambda: fleet.fleet.replaced(key, old_uid, ready=True), 600, what=f"a new {key} Ready"),
        # All the prompts, as the drain case: real engines decode half of them in seconds (since bd3267a), and the
        # engine ran none by the time the gateway saw its pod go (no sample moved, CI of 1008812).
        prompts=PROMPTS,
        streams=4,
        busy=key,
    )
    if fleet.real:
        assert _moves(fleet) > before


@ON_BOTH
def test_the_operator_killed_mid_rollout(fleet: LiveFleet) -> None:
    def kill() -> None:
        [op] = operator_pods(fleet.cluster)
        fleet.cluster.kubectl("-n", OPERATOR_NS, "delete", "pod", op["metadata"]["name"], "--grace-period=0", "--force")

    run_with_fault(fleet, "kill the operator", kill)


def test_a_gateway_replica_killed_mid_rollout(fleet: LiveFleet) -> None:
    pod = fleet.gateways[0].key
    kill = ("-n", fleet.namespace, "delete", "pod", pod, "--grace-period=0", "--force")
    run_with_fault(fleet, "kill a gateway replica", lambda: fleet.cluster.kubectl(*kill))


def test_the_api_server_restarted_mid_rollout(fleet: LiveFleet) -> None:
    def restart() -> None:
        try:
            fleet.cluster.restart_api_server()
        except RuntimeError as err:
            pytest.skip(str(err))

    run_with_fault(fleet, "restart the API server", restart)


def test_scale_up_during_a_pause_then_down(fleet: LiveFleet) -> None:
    """Pause keep, scale 2 -> 3 while paused (the new engine joins paused), resume; afterwards back to 2."""
    kubectl, ns, rf = fleet.cluster.kubectl, fleet.namespace, fleet.fleet.name

    def pause_and_scale() -> None:
        kubectl("-n", ns, "annotate", "rf", rf, f"{ANNOTATION_PAUSE}=keep")
        fleet.fleet.wait(lambda st: (st.get("pause") or {}).get("pausedEngines") == 2, "both engines paused", 120)
        kubectl("-n", ns, "scale", "rf", rf, "--replicas=3")

        def joined_paused(st: dict[str, Any]) -> bool:
            # A new engine in a paused fleet gets no traffic until it is paused too.
            third = [e for e in st.get("engines", []) if e["name"] == f"{rf}-engine-2"]
            assert not third or third[0]["phase"] != "Ready", third
            return bool(third) and third[0]["phase"] == "Paused"

        fleet.fleet.wait(joined_paused, "the third engine paused with the fleet", timeout=600)
        kubectl("-n", ns, "annotate", "rf", rf, f"{ANNOTATION_PAUSE}-")

    def back_to_two() -> None:
        fleet.fleet.wait_ready(3)
        kubectl("-n", ns, "scale", "rf", rf, "--replicas=2")

    run_with_fault(fleet, "scale 2 -> 3 during a pause", pause_and_scale, after=back_to_two)


def test_an_abort_storm_stops_exactly_the_named_requests(fleet: LiveFleet) -> None:
    """1,000 abort calls with mixed ids while 64 samples stream: 8 named streams end aborted (checked at
    the engines), the other 56 complete whole, and no answer claims more than is known."""
    ids = [f"storm-{i}-{uuid.uuid4().hex[:6]}" for i in range(64)]
    named, spared = ids[:8], ids[8:]
    tokens = {rid: LONG if rid in named else TOKENS for rid in ids}  # the named ones outlast the storm
    never_sent = [f"never-{i}" for i in range(50)]
    bodies: dict[str, str] = {}
    started = threading.Barrier(65)

    def stream(rid: str) -> None:
        body = {"model": "tiny", "prompt": rid, "max_tokens": tokens[rid], "ignore_eos": True, "stream": True}
        started.wait()
        headers = {"X-Request-Id": rid} | fleet.inference
        r = oneshot.post(fleet.gateways[0].url + "/v1/completions", json=body, headers=headers, timeout=900)
        assert r.status_code == 200, r.text[:300]
        bodies[rid] = r.text

    rng = random.Random(7)
    answers: list[dict[str, Any]] = []

    def storm() -> None:
        for n in range(1000):
            batch = rng.sample(named, 2) + rng.sample(never_sent, 3)
            gateway = fleet.gateways[n % len(fleet.gateways)]
            r = oneshot.post(gateway.url + "/v1/abort", json={"request_ids": batch}, headers=fleet.admin, timeout=60)
            assert r.status_code == 200, r.text[:300]
            answers.append(r.json())

    with ThreadPoolExecutor(64) as pool:
        streams = [pool.submit(stream, rid) for rid in ids]
        started.wait()
        wait_for(
            lambda: set(named) <= {rid for v in fleet.in_flight("storm-").values() for rid in v},
            120,
            what="the named streams on the engines",
        )
        t0 = time.monotonic()
        storm()
        storm_s = time.monotonic() - t0
        for s in streams:
            s.result(timeout=900)
    claims = {rid: {a["results"].get(rid) for a in answers} - {None} for rid in [*named, *never_sent]}
    assert all(claims[rid] == {"unknown"} for rid in never_sent), {r: claims[r] for r in never_sent[:3]}
    assert all("aborted" in claims[rid] for rid in named), {r: claims[r] for r in named}
    for rid in named:
        chunks = sse(bodies[rid])
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and len(tokens_of(chunks)) < LONG, rid
        assert (fleet.tracked(rid) or {}).get("finish_reason") == "abort", rid
    whole = [rid for rid in spared if len(tokens_of(sse(bodies[rid]))) == TOKENS]
    assert len(whole) == len(spared), sorted(set(spared) - set(whole))[:5]
    assert not any(fleet.in_flight("storm-").values()), "a stream still runs on an engine"
    fleet.ready()
    wait_status_true(fleet)
    row = "abort storm: 1,000 calls, 8 named of 64 streams | 64 | 56 whole, 8 aborted | 0 | 0"
    print(f"\n| {row} | {storm_s:.1f} s of calls | - |")
