"""Weight sync end to end: operator from manifests/, real vLLM engines, a trainer pod with the sync sidecar.

The sidecar runs as a container of a trainer pod, in Kubernetes mode: it finds the
engine pods by label, keeps the push record on the RolloutFleet, and the operator turns
that record into `status.weightVersion` and engine phases (`kubectl get rf`). Weights
are checked by output: every engine's greedy tokens must equal transformers' with the
pushed set. The session's real fleet (`live`); tests run in file order, and the module after every other
user of that fleet (it pushes other weights, and its last test changes the fleet's model).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import re
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from tests.engine.calls import GREEDY_PROMPTS
from tests.engine.test_engine_live import _reference_greedy

from e2e.fleet_helpers import (
    OPERATOR_NS,
    REPO,
    SIDECAR_MODELS,
    Fleet,
    Stream,
    kill_engine_process,
    operator_metrics,
    signal_container,
    sync_sidecar_pod,
)
from e2e.fleet_helpers import (
    greedy as fleet_greedy,
)
from e2e.live_fleet import INITIAL_VERSION, NAME, LiveFleet, create, wait_phase
from e2e.provider import Cluster, wait_for
from rollfleet import dashboard
from rollfleet.api.admission import POLICY_NAME
from rollfleet.contract import (
    ANNOTATION_PHASE,
    ANNOTATION_RESUME,
    ANNOTATION_WEIGHT_GENERATION,
    COMPONENT_ENGINE,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_INDEX,
    OPERATOR_KEY_SECRET,
    RECORD_MODEL,
    RECORD_WEIGHT_GENERATION,
    RECORD_WEIGHT_VERSION,
    ROUTABLE_PHASES,
    SYNC_API_PORT,
    SYNC_HEALTH_PORT,
    engine_pod_name,
    engine_sa_name,
    gateway_name,
    secret_name,
    trainer_name,
    weights_record_name,
)
from rollfleet.sync.protocol import PushPhase, WeightsRef, decode_record
from rollfleet_client import AsyncRolloutClient, Generation
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import EngineStep, PushState, PushStatus
from rollfleet_dev import oneshot
from rollfleet_dev import prometheus as prom
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.tiny_model import LONG_GENERATION, WEIGHTS_B_DIR, ensure_tiny_model

pytestmark = [pytest.mark.cluster, pytest.mark.engine, pytest.mark.alters_live]

TRAINER = "trainer"
GREEDY_TOKENS = 12
ROLLOUT_TOKENS = 1500
ENGINES = [engine_pod_name(NAME, 0), engine_pod_name(NAME, 1)]
A = INITIAL_VERSION  # the label of the weights the fleet's engines start on (the tiny model's, set A)


@pytest.fixture(scope="module")
def live_ns(live: LiveFleet) -> str:
    live.ready()
    return live.namespace


@pytest.fixture(scope="module")
def fleet(live: LiveFleet, live_ns: str) -> Fleet:
    return live.fleet


def weights_record(cluster: Cluster, ns: str) -> dict[str, str]:
    """The data of the fleet's weight-sync record (the ConfigMap the sidecar writes)."""
    out = cluster.kubectl("-n", ns, "get", "configmap", weights_record_name(NAME), "-o", "json").stdout
    return dict(json.loads(out).get("data") or {})


@pytest.fixture(scope="module")
def sync(cluster: Cluster, fleet: Fleet, live_ns: str) -> Iterator[SyncClient]:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(sync_sidecar_pod(NAME, live_ns, TRAINER)))
    cluster.kubectl("-n", live_ns, "wait", "--for=condition=Ready", f"pod/{TRAINER}", "--timeout=120s", timeout=130)
    try:
        with cluster.reach(live_ns, TRAINER, SYNC_API_PORT) as url, SyncClient(url) as client:
            wait_for(lambda: client.fleet_version().version == A, timeout=60, what=f"the sidecar sees version {A}")
            yield client
    finally:
        cluster.kubectl("-n", live_ns, "delete", "pod", TRAINER, "--wait=false", check=False)


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, live: LiveFleet, live_ns: str, sync: SyncClient) -> Iterator[prom.Prometheus]:
    """A real Prometheus scraping the fleet as its PodMonitors (manifests/monitoring/) would: the operator, the
    gateways, the engines and the trainer's sync sidecar; from before the module's first push."""
    ours = {"namespace": live_ns, "fleet": NAME}
    with contextlib.ExitStack() as stack:
        targets = [prom.Target("rollfleet-operator", stack.enter_context(operator_metrics(cluster)), honor_labels=True)]
        targets += [prom.Target("rollfleet-gateways", g.url, ours | {"pod": g.key}) for g in live.gateways]
        targets += [prom.Target("rollfleet-engines", e.url, ours | {"pod": e.key}) for e in live.engines]
        sidecar = stack.enter_context(cluster.reach(live_ns, TRAINER, SYNC_HEALTH_PORT))
        targets.append(prom.Target("rollfleet-sync", sidecar, ours | {"pod": TRAINER}))
        p = stack.enter_context(prom.running(targets))

        def all_up() -> bool:
            up = p.targets_up()
            return len(up) == len(targets) and all(up.values())

        wait_for(all_up, timeout=60, what="Prometheus scraping every target")
        yield p


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    root = str(ensure_tiny_model())  # the bytes the nodes' directory holds, read here
    return {
        A: _reference_greedy(root, GREEDY_PROMPTS, GREEDY_TOKENS),
        "B": _reference_greedy(f"{root}/{WEIGHTS_B_DIR}", GREEDY_PROMPTS, GREEDY_TOKENS),
    }


def greedy(url: str, auth: dict[str, str]) -> list[list[int]]:
    return fleet_greedy(url, auth, GREEDY_PROMPTS, GREEDY_TOKENS)


def all_ready_on(version: str) -> Any:
    def check(st: dict[str, Any]) -> bool:
        engines = st.get("engines", [])
        return (
            st.get("weightVersion") == version
            and len(engines) == 2
            and all(e["phase"] == "Ready" and e.get("weightVersion") == version for e in engines)
        )

    return check


# What each component's ServiceAccount may do, asked of the API server (RBAC as installed):
# (account, verb, resource, namespace, allowed). Accounts: namespace:name; "NS" is the fleet's.
PRIVILEGES = [
    # The trainer records pushes in its fleet's ConfigMap and lists engines; nothing that runs in them.
    (f"NS:{trainer_name(NAME)}", "patch", f"configmaps/{weights_record_name(NAME)}", "NS", True),
    (f"NS:{trainer_name(NAME)}", "list", "pods", "NS", True),
    (f"NS:{trainer_name(NAME)}", "get", f"rolloutfleets/{NAME}", "NS", True),
    (f"NS:{trainer_name(NAME)}", "patch", f"rolloutfleets/{NAME}", "NS", False),
    (f"NS:{trainer_name(NAME)}", "patch", f"rolloutfleets.rollfleet.dev/{NAME}", "NS", False),
    (f"NS:{trainer_name(NAME)}", "update", "rolloutfleets", "NS", False),
    (f"NS:{trainer_name(NAME)}", "patch", "pods", "NS", False),
    (f"NS:{trainer_name(NAME)}", "create", "pods", "NS", False),
    (f"NS:{trainer_name(NAME)}", "get", "secrets", "NS", False),
    (f"NS:{trainer_name(NAME)}", "patch", "configmaps/other", "NS", False),
    # The gateway watches engine pods, reads its fleet and its record, and patches its fleet (the
    # admission policy rollfleet-gateway-pause-only lets through only the pause annotations).
    (f"NS:{gateway_name(NAME)}", "watch", "pods", "NS", True),
    (f"NS:{gateway_name(NAME)}", "patch", "pods", "NS", False),
    (f"NS:{gateway_name(NAME)}", "get", "secrets", "NS", False),
    (f"NS:{gateway_name(NAME)}", "get", "configmaps", "NS", False),
    (f"NS:{gateway_name(NAME)}", "get", f"configmaps/{weights_record_name(NAME)}", "NS", True),
    (f"NS:{gateway_name(NAME)}", "patch", f"configmaps/{weights_record_name(NAME)}", "NS", False),
    (f"NS:{gateway_name(NAME)}", "patch", f"rolloutfleets.rollfleet.dev/{NAME}", "NS", True),
    (f"NS:{gateway_name(NAME)}", "patch", "rolloutfleets.rollfleet.dev/other", "NS", False),
    (f"NS:{gateway_name(NAME)}", "patch", f"rolloutfleets.rollfleet.dev/{NAME}", "other", False),
    # Engines never call the API server.
    (f"NS:{engine_sa_name(NAME)}", "list", "pods", "NS", False),
    (f"NS:{engine_sa_name(NAME)}", "get", "secrets", "NS", False),
    # The operator creates Secrets and reads only its key.
    (f"{OPERATOR_NS}:rollfleet-operator", "create", "secrets", "NS", True),
    (f"{OPERATOR_NS}:rollfleet-operator", "get", "secrets", "NS", False),
    (f"{OPERATOR_NS}:rollfleet-operator", "list", "secrets", OPERATOR_NS, False),
    (f"{OPERATOR_NS}:rollfleet-operator", "get", f"secrets/{OPERATOR_KEY_SECRET}", OPERATOR_NS, True),
    (f"{OPERATOR_NS}:rollfleet-operator", "get", f"secrets/{secret_name(NAME)}", "NS", False),
]


def test_each_component_may_do_what_it_needs_and_no_more(cluster: Cluster, fleet: Fleet, live_ns: str) -> None:
    def allowed(account: str, verb: str, resource: str, namespace: str) -> bool:
        user = "system:serviceaccount:" + account.replace("NS", live_ns)
        proc = cluster.kubectl(
            "auth", "can-i", verb, resource, "-n", namespace.replace("NS", live_ns), f"--as={user}", check=False
        )
        answer = proc.stdout.strip().split()[:1]
        assert answer in (["yes"], ["no"]), f"can-i {verb} {resource} as {user}: {proc.stdout} {proc.stderr}"
        return answer == ["yes"]

    wait_for(lambda: allowed(*PRIVILEGES[0][:4]), timeout=60, what="the operator to grant the fleet's trainers")
    wrong = [p for p in PRIVILEGES if allowed(*p[:4]) != p[4]]
    assert not wrong, f"(account, verb, resource, namespace, expected) that the API server answers otherwise: {wrong}"
    # And real requests: a trainer that tries to change what the engines run is refused by RBAC; the
    # gateway, which may patch its fleet, by the admission policy unless it changes only the pause.
    patch = json.dumps({"spec": {"engine": {"command": ["sh", "-c", "id"]}}})
    for account, by in ((trainer_name(NAME), "forbidden"), (gateway_name(NAME), POLICY_NAME)):
        as_account = f"--as=system:serviceaccount:{live_ns}:{account}"
        proc = cluster.kubectl("-n", live_ns, "patch", "rf", NAME, "--type=merge", "-p", patch, as_account, check=False)
        assert proc.returncode != 0 and "forbidden" in proc.stderr.lower() and by in proc.stderr, proc
    assert "command" not in fleet.get()["spec"]["engine"]
    as_gateway = f"--as=system:serviceaccount:{live_ns}:{gateway_name(NAME)}"
    label = cluster.kubectl("-n", live_ns, "label", "rf", NAME, "stolen=yes", as_gateway, check=False)
    assert label.returncode != 0 and POLICY_NAME in label.stderr, label
    resume = cluster.kubectl("-n", live_ns, "annotate", "rf", NAME, f"{ANNOTATION_RESUME}=", as_gateway, check=False)
    assert resume.returncode == 0, resume  # a one-shot resume of a running fleet: changes nothing else


@pytest.mark.usefixtures("prometheus")  # scraping before the push: the next case reads it as Prometheus saw it
def test_push_during_rollouts_keeps_them_and_kubectl_shows_the_new_version(
    cluster: Cluster, fleet: Fleet, live_ns: str, sync: SyncClient, references: dict[str, list[list[int]]]
) -> None:
    auth = fleet.inference()  # generation at the engines asks for the fleet's inference token
    with cluster.reach(live_ns, ENGINES[0], 8000) as e0, cluster.reach(live_ns, ENGINES[1], 8000) as e1:
        assert greedy(e0, auth) == greedy(e1, auth) == references[A]
        rollouts = [Stream(url, max_tokens=ROLLOUT_TOKENS, auth=auth).start() for url in (e0, e1, e0, e1)]
        wait_for(lambda: all(r.tokens() >= 5 for r in rollouts), timeout=120, what="rollouts decoding")
        # Engines decode at uneven speeds on a loaded machine: one may finish before the push starts.
        assert not all(r.done.is_set() for r in rollouts)

        status = sync.push_dir(f"{SIDECAR_MODELS}/{WEIGHTS_B_DIR}", "b-1")

        assert status.state is PushState.DONE
        assert status.pause_window_s is not None and status.pause_window_s > 0
        assert sorted(e.name for e in status.engines if e.step is EngineStep.RESUMED) == ENGINES
        # The sidecar's metrics (its health port, docs/metrics.md) count the push as its status tells it.
        with cluster.reach(live_ns, TRAINER, SYNC_HEALTH_PORT) as health:
            assert engine_metric(health, "rollfleet_sync_pushes_total", result="done") >= 1
            assert engine_metric(health, "rollfleet_sync_generation") == status.generation
            assert engine_metric(health, "rollfleet_sync_push_phase_seconds_count", phase="pause_window") >= 1
            staged = sum(1 for e in status.engines if e.stage_s is not None)
            assert engine_metric(health, "rollfleet_sync_engine_stages_total") >= staged
            assert engine_metric(health, "rollfleet_sync_pushed_bytes_total") >= status.bytes > 0
        for r in rollouts:
            r.wait(timeout=300)
            assert r.finish == {0: "length"} and r.completion_tokens == ROLLOUT_TOKENS
        assert greedy(e0, auth) == greedy(e1, auth) == references["B"]
    fleet.wait(all_ready_on("b-1"), "status shows b-1 on every engine", timeout=60)
    header, row = cluster.kubectl("-n", live_ns, "get", "rf", NAME).stdout.splitlines()[:2]
    assert row[header.index("WEIGHTS") :].split()[0] == "b-1"  # by position: the PAUSED column is empty
    record = weights_record(cluster, live_ns)
    assert (record[RECORD_WEIGHT_VERSION], record[RECORD_WEIGHT_GENERATION]) == ("b-1", "1")


def test_a_real_prometheus_has_data_for_every_dashboard_panel_and_alert(
    live: LiveFleet, live_ns: str, prometheus: prom.Prometheus
) -> None:
    """Every query of the dashboard (manifests/monitoring/grafana/) and every alert's expression, its threshold
    left out (manifests/monitoring/prometheusrule.yaml), returns data on Prometheus after what the fleet just did:
    the push above (a pause, every engine staged and loaded), traffic, and now an abort and a RolloutRequest."""
    rid = f"prom-abort-{uuid.uuid4().hex[:6]}"
    # Long enough that only the abort ends it, however fast an idle engine decodes.
    stream = Stream(live.gateways[0].url, max_tokens=LONG_GENERATION, request_id=rid, auth=live.inference).start()
    wait_for(lambda: stream.tokens() >= 2, 120, what=f"{rid} decoding")
    body = {"request_ids": [rid]}
    aborted = oneshot.post(f"{live.gateways[0].url}/v1/abort", json=body, headers=live.admin, timeout=60)
    assert aborted.json()["results"] == {rid: "aborted"}, aborted.text
    stream.wait(60)
    assert stream.finish == {0: "abort"}, stream.finish
    name, _ = create(live, 2, 2, sampling={"maxTokens": 8, "ignoreEos": True})
    wait_phase(live, name, "Succeeded", timeout=300)
    panels = [q.replace("$namespace", live_ns).replace("$fleet", NAME) for q in dashboard.queries()]
    rule = yaml.safe_load((REPO / "manifests" / "monitoring" / "prometheusrule.yaml").read_text())
    alerts = [re.split(r"\s+(?:>|<|==|!=|>=|<=)\s+", r["expr"])[0] for g in rule["spec"]["groups"] for r in g["rules"]]
    empty: list[str] = []

    def every_one_has_data() -> bool:
        empty[:] = [q for q in panels + alerts if not prometheus.query(q)]
        return not empty

    wait_for(every_one_has_data, timeout=60, what=f"data for every panel and alert (none yet for {empty})")
    # And the figures are the fleet's: the push above counted once, both engines on its generation.
    assert prometheus.query('sum(rollfleet_sync_pushes_total{result="done"})')[0]["value"][1] == "1"
    by_engine = prometheus.query(f'rollfleet_operator_engine_weight_generation{{namespace="{live_ns}"}}')
    assert sorted(r["value"][1] for r in by_engine) == ["1", "1"], by_engine


def test_engine_killed_during_a_push_never_serves_old_weights_and_rejoins_on_the_new_version(
    cluster: Cluster, fleet: Fleet, live_ns: str, sync: SyncClient, references: dict[str, list[list[int]]]
) -> None:
    auth = fleet.inference()  # generation at the engines asks for the fleet's inference token
    killed = fleet.pod(ENGINES[1])["metadata"]["uid"]
    started = sync.push_dir(SIDECAR_MODELS, "a-2", wait=False)
    kill_engine_process(cluster, live_ns, ENGINES[1])  # a new pod replaces it, on the image's weights (A, label "A")
    status = sync.wait(started.generation, timeout_s=120)
    assert status.state is PushState.DONE

    def consistent(st: dict[str, Any]) -> bool:
        # Whatever the timing of the kill, no engine serves (Ready) other weights than the fleet's.
        stale = [
            e["name"]
            for e in st.get("engines", [])
            if e["phase"] == "Ready" and e.get("weightVersion") != st.get("weightVersion")
        ]
        assert not stale, f"routable on old weights: {stale} ({st})"
        return all_ready_on("a-2")(st)

    # The push may end before the kill shows in the fleet's status: what is awaited is the new pod, up.
    wait_for(lambda: fleet.replaced(ENGINES[1], killed, ready=True), timeout=600, what=f"a new {ENGINES[1]}, Ready")
    fleet.wait(consistent, "the new engine caught up to a-2", timeout=600)
    with cluster.reach(live_ns, ENGINES[0], 8000) as e0, cluster.reach(live_ns, ENGINES[1], 8000) as e1:
        assert greedy(e0, auth) == greedy(e1, auth) == references[A]
    version = sync.fleet_version()
    assert (version.version, version.pending_sync) == ("a-2", [])


def test_sidecar_killed_mid_push_ends_with_the_whole_fleet_on_one_version(
    cluster: Cluster, fleet: Fleet, live_ns: str, sync: SyncClient, references: dict[str, list[list[int]]]
) -> None:
    auth = fleet.inference()  # generation at the engines asks for the fleet's inference token
    weights_of = {"a-2": A, "b-3": "B"}  # the fleet serves a-2 (set A) after the previous test
    signal_container(cluster, live_ns, ENGINES[1], "engine", signal.SIGSTOP)  # the push waits on it
    try:
        started = sync.push_dir(f"{SIDECAR_MODELS}/{WEIGHTS_B_DIR}", "b-3", wait=False)
        # Engine 0 has staged b-3 (prefetch, while serving); the sidecar still waits on engine 1's staging.
        wait_for(
            lambda: any(
                e.name == ENGINES[0] and e.step is EngineStep.STAGED for e in sync.progress(started.generation).engines
            ),
            timeout=120,
            what=f"{ENGINES[0]} holding b-3, staged",
        )
        signal_container(cluster, live_ns, TRAINER, "rollfleet-sync")  # its container restarts
    finally:
        signal_container(cluster, live_ns, ENGINES[1], "engine", signal.SIGCONT)

    def resolved() -> str | None:
        """The fleet's version once the restarted sidecar has finished (or rolled back) the push."""
        record = decode_record(weights_record(cluster, live_ns))
        in_progress = record.push is not None and record.push.phase is PushPhase.IN_PROGRESS
        return None if in_progress or record.committed is None else record.committed.version

    final = wait_for(resolved, timeout=600, what="the restarted sidecar to finish or roll back the push")
    assert final in weights_of, final

    def truthful(st: dict[str, Any]) -> bool:
        # No engine is ever routable on other weights than the fleet's, in any status written meanwhile.
        mixed = [
            e["name"]
            for e in st.get("engines", [])
            if e["phase"] in ROUTABLE_PHASES and e.get("weightVersion") != st.get("weightVersion")
        ]
        assert not mixed, f"routable on other weights than {st.get('weightVersion')}: {mixed} ({st})"
        return all_ready_on(final)(st)

    with cluster.reach(live_ns, ENGINES[0], 8000) as e0, cluster.reach(live_ns, ENGINES[1], 8000) as e1:

        def serving_final() -> bool:  # as the engines themselves report it
            states = [oneshot.get(f"{u}/rollfleet/v1/state", timeout=10).json() for u in (e0, e1)]
            return all((s["weight_version"], s["paused"]) == (final, False) for s in states)

        wait_for(serving_final, timeout=300, what=f"both engines serving {final}")
        fleet.wait(truthful, f"status: every engine Ready on {final}", timeout=120)
        assert greedy(e0, auth) == greedy(e1, auth) == references[weights_of[final]]
    wait_for(lambda: sync.fleet_version().version == final, timeout=120, what="the restarted sidecar agrees")
    assert sync.fleet_version().pending_sync == []


def test_a_staleness_bound_of_0_keeps_samples_off_old_weights_and_1_serves_them_labelled(
    cluster: Cluster, live: LiveFleet, fleet: Fleet, live_ns: str, sync: SyncClient
) -> None:
    """Issue 35's staleness and segments cases, through the gateway and the trainer client: rollouts with a bound
    of 0 and of 1 are decoding when a push lands."""
    live.ready()  # the earlier cases killed an engine and stopped another: reach the pods there are now
    before = sync.fleet_version()
    old, generation = before.version, before.generation
    assert old is not None and generation is not None
    new, tag = f"lag-{generation + 1}", uuid.uuid4().hex[:6]
    ids = {(lag, i): f"lag{lag}-{i}-{tag}" for lag in (0, 1) for i in range(2)}

    def decoding() -> bool:
        return all(int((live.tracked(rid) or {}).get("output_tokens") or 0) >= 5 for rid in ids.values())

    async def run() -> tuple[PushStatus, dict[tuple[int, int], Generation], Generation]:
        async with AsyncRolloutClient(live.gateways[0].url, model="tiny", token=live.token) as client:
            calls = {
                key: asyncio.create_task(
                    client.generate(
                        [5, 6, 7], request_id=rid, max_tokens=ROLLOUT_TOKENS, ignore_eos=True, max_weight_lag=key[0]
                    )
                )
                for key, rid in ids.items()
            }
            await asyncio.to_thread(wait_for, decoding, 120, interval=0.2, what="all four rollouts decoding")
            status = await asyncio.to_thread(sync.push_dir, SIDECAR_MODELS, new)
            answers = {key: await call for key, call in calls.items()}
            after = await client.generate([5, 6, 7], max_tokens=4, ignore_eos=True, max_weight_lag=0)
        return status, answers, after

    status, answers, after = asyncio.run(run())
    assert status.state is PushState.DONE and status.aborted_stale == 2, status
    for i in range(2):
        # Bound 0: the old weights made some of its tokens, so the push ended it; nothing finished on them.
        strict = answers[(0, i)]
        assert strict.finish_reason == "abort" and len(strict.token_ids) < ROLLOUT_TOKENS, strict.finish_reason
        assert strict.weight_versions == [old]
        # Bound 1: it went on through the swap, labelled with both versions and their generations.
        loose = answers[(1, i)]
        assert loose.finish_reason == "length" and len(loose.token_ids) == ROLLOUT_TOKENS
        assert loose.weight_versions == [old, new] and loose.weight_generations == [generation, generation + 1]
        # Held by the push's pause (keep) and resumed on the new weights: which tokens each version made.
        cut = loose.weight_segments[0].end
        assert [s.model_dump() for s in loose.weight_segments] == [
            {"version": old, "start": 0, "end": cut},
            {"version": new, "start": cut, "end": ROLLOUT_TOKENS},
        ] and 0 < cut < ROLLOUT_TOKENS, loose.weight_segments
    assert after.weight_versions == [new] and after.weight_generations == [generation + 1]

    def annotated() -> bool:  # what the gateway routes bounded requests by
        return all(
            p["metadata"].get("annotations", {}).get(ANNOTATION_WEIGHT_GENERATION) == str(generation + 1)
            for p in fleet.pods()
        )

    wait_for(annotated, timeout=60, what=f"engine pods annotated with generation {generation + 1}")


def test_an_engine_that_loaded_other_bytes_under_the_fleets_version_gets_no_traffic_until_loaded_again(
    cluster: Cluster,
    live: LiveFleet,
    fleet: Fleet,
    live_ns: str,
    sync: SyncClient,
    references: dict[str, list[list[int]]],
) -> None:
    """Issue 35's proof of the bytes: one engine is loaded, straight through its own control routes, with the
    other weight set under the fleet's version label. Its state reports the manifest it verified that set
    against, not the one the push recorded: the operator shows it PendingSync saying so, the gateway sends it nothing,
    and the sidecar loads the fleet's version into it again."""
    live.ready()
    version = sync.fleet_version().version
    pinned = decode_record(weights_record(cluster, live_ns)).committed
    assert version is not None and pinned is not None and pinned.manifest_sha256 is not None
    assert pinned.version == version and fleet.engine(ENGINES[1]).get("weightsManifest") == pinned.manifest_sha256
    # Which set the fleet's version is (the cases before pushed A or B): the engines' own greedy tokens say.
    ours = "B" if greedy(live.engine(ENGINES[0]).url, fleet.inference()) == references["B"] else A
    theirs = SIDECAR_MODELS if ours == "B" else f"{SIDECAR_MODELS}/{WEIGHTS_B_DIR}"
    # The other set served from the trainer pod (its sidecar's image and models), on a port of its own, for 5 min.
    log = "/var/lib/rollfleet-sync/other-bytes.log"
    serve = f"python -m rollfleet_engine.weights_server {theirs} --port 8479"
    in_sidecar = ("-n", live_ns, "exec", TRAINER, "-c", "rollfleet-sync", "--")
    cluster.kubectl(*in_sidecar, "sh", "-c", f"nohup timeout 300 {serve} > {log} 2>&1 &")
    printed = wait_for(
        lambda: (lines := cluster.kubectl(*in_sidecar, "cat", log, check=False).stdout.splitlines()[1:2]) and lines,
        timeout=60,
        what="the weights server of the other set",
    )
    other = ast.literal_eval(printed[0])  # its update_info: url and manifest_sha256
    assert other["manifest_sha256"] != pinned.manifest_sha256
    signal_container(cluster, live_ns, TRAINER, "rollfleet-sync", signal.SIGSTOP)  # no catch-up meanwhile
    try:
        control = {"Authorization": f"Bearer {live.token}"}
        with httpx.Client(base_url=live.engine(ENGINES[1]).url, headers=control, timeout=120) as engine:
            for path, body in (
                ("/start_weight_update", None),
                ("/update_weights", {"update_info": other}),
                ("/finish_weight_update", {"weight_version": version}),
            ):
                assert engine.post(path, json=body).status_code == 200, path
            said = engine.get("/rollfleet/v1/state").json()
        assert (said["weight_version"], said["weights_manifest_sha256"]) == (version, other["manifest_sha256"])

        def refused(st: dict[str, Any]) -> bool:
            e = next(e for e in st.get("engines", []) if e["name"] == ENGINES[1])
            return bool(e["phase"] == "PendingSync" and e.get("weightsManifest") == other["manifest_sha256"])

        fleet.wait(refused, f"{ENGINES[1]} PendingSync, its proof B's manifest", timeout=60)
        message = fleet.engine(ENGINES[1])["message"]
        assert f"labelled {version} but were not verified against {version}'s manifest" in message, message
        wait_for(
            lambda: fleet.pod(ENGINES[1])["metadata"]["annotations"].get(ANNOTATION_PHASE) == "PendingSync",
            timeout=60,
            what="the engine pod annotated PendingSync (what the gateway routes by)",
        )

        async def through_the_gateway() -> list[Generation]:
            async with AsyncRolloutClient(live.gateways[0].url, model="tiny", token=live.token) as client:
                calls = [
                    client.generate(p, max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
                    for p in GREEDY_PROMPTS * 2
                ]
                return list(await asyncio.gather(*calls))

        answers = asyncio.run(through_the_gateway())
        assert [g.engines for g in answers] == [[ENGINES[0]]] * len(answers)
        assert [g.token_ids for g in answers] == references[ours] * 2  # the fleet's bytes
    finally:
        signal_container(cluster, live_ns, TRAINER, "rollfleet-sync", signal.SIGCONT)

    def proven_again(st: dict[str, Any]) -> bool:
        e = next(e for e in st.get("engines", []) if e["name"] == ENGINES[1])
        return bool(e["phase"] == "Ready" and e.get("weightsManifest") == pinned.manifest_sha256)

    fleet.wait(proven_again, f"{ENGINES[1]} loaded with {version} again by the sidecar", timeout=300)
    assert greedy(live.engine(ENGINES[1]).url, fleet.inference()) == references[ours]


def test_a_drained_engines_replacement_takes_traffic_only_once_on_the_fleets_version_and_bytes(
    cluster: Cluster, fleet: Fleet, live_ns: str, sync: SyncClient
) -> None:
    """Issue 35's drain, on a fleet whose version was pushed: `kubectl drain` of one engine's node. Its replacement
    starts on another node on the image's weights, under another label; the sidecar loads the fleet's version into
    it, and only then is it routable. No status read meanwhile shows an engine routable on other weights or bytes."""
    pinned = decode_record(weights_record(cluster, live_ns)).committed
    assert pinned is not None and pinned.manifest_sha256 is not None and pinned.version != A, pinned
    key = ENGINES[1]
    old = fleet.pod(key)
    node, index = old["spec"]["nodeName"], old["metadata"]["labels"][LABEL_INDEX]
    engine = f"{LABEL_FLEET}={NAME},{LABEL_COMPONENT}={COMPONENT_ENGINE},{LABEL_INDEX}={index}"
    proof = (pinned.version, pinned.manifest_sha256)

    def truthful(st: dict[str, Any]) -> bool:
        for e in st.get("engines", []):
            if e["phase"] in ROUTABLE_PHASES:
                assert (e.get("weightVersion"), e.get("weightsManifest")) == proof, f"routable on other weights: {e}"
        return fleet.replaced(key, old["metadata"]["uid"], ready=True) and bool(all_ready_on(pinned.version)(st))

    try:
        # An engine's /dev/shm is an emptyDir: drain must be told that its data may go.
        drain = ("drain", node, "--pod-selector", engine, "--ignore-daemonsets", "--delete-emptydir-data")
        cluster.kubectl(*drain, "--timeout=300s", timeout=320)
        fleet.wait(truthful, f"a new {key} Ready on {pinned.version}, loaded by the sidecar", timeout=600)
    finally:
        cluster.kubectl("uncordon", node)
    assert fleet.pod(key)["spec"]["nodeName"] != node
    # It started on the image's weights: only the sidecar's load of the pushed version gives it the pinned manifest.
    assert (fleet.engine(key)["weightVersion"], fleet.engine(key).get("weightsManifest")) == proof


def test_a_model_change_forgets_the_old_models_weights_and_engines_serve_their_own(
    cluster: Cluster, fleet: Fleet, live_ns: str, sync: SyncClient
) -> None:
    """Runs last of the fleet's users (`alters_live`): the fleet changes model (a new served name over the
    same files), its engines roll."""
    before = {p["metadata"]["uid"] for p in fleet.pods()}
    pushed = decode_record(weights_record(cluster, live_ns)).history
    assert [v for v, _ in pushed][-1] != A, pushed  # earlier tests pushed versions of the old model
    patch = json.dumps({"spec": {"model": {"servedName": "tiny-b"}}})
    cluster.kubectl("-n", live_ns, "patch", "rf", NAME, "--type=merge", "-p", patch)

    def reset() -> bool:
        data = weights_record(cluster, live_ns)
        return json.loads(data.get(RECORD_MODEL, "{}")).get("servedName") == "tiny-b"

    wait_for(reset, timeout=60, what="the record to start over for the new model")
    assert decode_record(weights_record(cluster, live_ns)).committed in (None, WeightsRef(A, 0))
    wait_for(
        lambda: any(e["reason"] == "WeightsReset" for e in fleet.events()), timeout=60, what="a WeightsReset Event"
    )

    def rolled_on_own_weights(st: dict[str, Any]) -> bool:
        # Never PendingSync: new engines wait for no weights of the old model.
        waiting = [e["name"] for e in st.get("engines", []) if e["phase"] == "PendingSync"]
        assert not waiting, f"engines of the new model wait for the old model's weights: {waiting} ({st})"
        return st.get("updatedReplicas") == 2 and all_ready_on(A)(st)

    fleet.wait(rolled_on_own_weights, "both engines of the new model Ready on their own weights", timeout=3 * 600)
    assert not before & {p["metadata"]["uid"] for p in fleet.pods()}
    wait_for(lambda: sync.fleet_version().version == A, timeout=120, what="the sidecar to see the new fleet")
    assert sync.fleet_version().pending_sync == []
    record = decode_record(weights_record(cluster, live_ns))
    assert record.committed in (None, WeightsRef(A, 0)) and [v for v, _ in record.history] in ([], [A])
