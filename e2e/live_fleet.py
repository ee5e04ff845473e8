"""The session's shared live fleet: the operator from manifests/, 2 engines, 2 gateway replicas.

Engine start is the expensive part of the suite (30-90 s each on a shared 2-core
machine), so the acceptance tests share one fleet of real engines (with weight sync), and
the control-plane tests one of simulated engines, created on first use and deleted at the
end of the session. Tests that break it (a killed engine) leave it to heal; every user
starts with `ready()`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import pytest

from e2e.fleet_helpers import (
    ENGINE_START_S,
    Fleet,
    deploy_operator,
    fleet_manifest,
    kill_engine_process,
    live_pods,
    read_token,
)
from e2e.provider import Cluster, wait_for
from rollfleet.contract import (
    ENGINE_PORT,
    GATEWAY_PORT,
    GROUP,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_REQUEST_UID,
    VERSION,
    inference_secret_name,
    secret_name,
)
from rollfleet.kube import JOB_NAME_LABEL, REQUEST
from rollfleet_dev import oneshot
from rollfleet_dev.localcluster import claims

NAME = "live"
INITIAL_VERSION = "A"  # the label of the weights a real fleet's engines start on (weight sync's tests push others)


@dataclass(frozen=True)
class Endpoint:
    """A pod of the fleet: its name (the gateway reports engines by pod name) and a URL this process reaches."""

    key: str
    url: str


@dataclass
class LiveFleet:
    cluster: Cluster
    namespace: str
    fleet: Fleet
    token: str  # the admin token
    inference_token: str  # what generation needs (the fleet's default: spec.auth.inference Token)
    stack: contextlib.ExitStack  # holds the ways in to pods (port-forwards on kind) until the session ends
    real: bool = True  # real vLLM engines (the `live` fleet), else simulated ones (`sim_live`)
    gateways: list[Endpoint] = field(default_factory=list)  # one per replica (session tables are per replica)
    engines: list[Endpoint] = field(default_factory=list)
    # The way in to each pod, by (component, pod uid), kept across `ready()` calls: one made per pod and per call
    # left 92 kubectl port-forwards running by the middle of the acceptance tier, and each took a second to make.
    ways_in: dict[tuple[str, str], tuple[str, contextlib.ExitStack]] = field(default_factory=dict)

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def inference(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.inference_token}"}

    def engine(self, key: str) -> Endpoint:
        return next(e for e in self.engines if e.key == key)

    def ready(self) -> None:
        """Both engines Ready and warm, both gateway replicas serving: wait for a healed fleet."""
        self.fleet.wait_ready(2)
        self.fleet.wait(lambda st: (st.get("gateway") or {}).get("readyReplicas") == 2, "2 gateway replicas ready")
        # Replaced gateway pods have new names and addresses.
        self.gateways, self.engines = self._reach("gateway", GATEWAY_PORT), self._reach("engine", ENGINE_PORT)
        assert len(self.gateways) == 2 and len(self.engines) == 2, (self.gateways, self.engines)
        for e in self.engines:
            # The first generation of a (re)started engine is slow: take it here, not inside a test.
            warm = functools.partial(_warm, e.url, self.inference)
            wait_for(warm, timeout=ENGINE_START_S, interval=1, what=f"engine {e.key} serving")
        for g in self.gateways:
            wait_for(lambda g=g: _ok(g.url + "/ready"), timeout=120, what=f"gateway {g.key} ready")
        # The warm-ups may have raced a status that had not yet seen an engine restart.
        self.fleet.wait_ready(2)

    def _reach(self, component: str, port: int) -> list[Endpoint]:
        selector = f"{LABEL_FLEET}={NAME},{LABEL_COMPONENT}={component}"
        pods = sorted(
            (p["metadata"]["name"], p["metadata"]["uid"]) for p in live_pods(self.cluster, self.namespace, selector)
        )
        # A pod replaced (a new uid, even under the same name: the local cluster reaches it by its IP) gets a new
        # way in; those of pods gone are closed.
        live = {(component, uid) for _, uid in pods}
        for key in [k for k in self.ways_in if k[0] == component and k not in live]:
            self.ways_in.pop(key)[1].close()
        for pod, uid in pods:
            if (component, uid) not in self.ways_in:
                own = contextlib.ExitStack()
                url = own.enter_context(self.cluster.reach(self.namespace, pod, port))
                self.stack.push(own)
                self.ways_in[(component, uid)] = (url, own)
        return [Endpoint(pod, self.ways_in[(component, uid)][0]) for pod, uid in pods]

    def kill_engine(self, key: str) -> None:
        kill_engine_process(self.cluster, self.namespace, key)

    def in_flight(self, prefix: str = "") -> dict[str, list[str]]:
        """Request ids each engine is running now (its own tracker), those starting with `prefix`."""
        return self.requests(prefix)[0]

    def requests(self, prefix: str = "") -> tuple[dict[str, list[str]], int]:
        """Request ids each engine is running now, and how many have ended on them (their own trackers, which
        remember the last 50 each), of those starting with `prefix`."""
        running, ended = {}, 0
        for e in self.engines:
            tracked = oneshot.get(e.url + "/rollfleet/v1/requests", timeout=10).raise_for_status().json()
            running[e.key] = [t["request_id"] for t in tracked["in_flight"] if t["request_id"].startswith(prefix)]
            ended += sum(t["request_id"].startswith(prefix) for t in tracked["recently_finished"])
        return running, ended

    def tracked(self, request_id: str) -> dict[str, object] | None:
        """The engine's record of a request (it ended or runs there), from whichever engine ran it."""
        for e in self.engines:
            r = oneshot.get(f"{e.url}/rollfleet/v1/requests/{request_id}", timeout=10)
            if r.status_code == 200:
                return dict(r.json())
        return None


# A module's `fleet` fixture takes the shared fleet by parameter (`shared`): `sim` (the control-plane
# tier's simulated engines) by default; these marks run a case on real engines too, or only there.
ON_BOTH = pytest.mark.parametrize("fleet", ["sim", pytest.param("vllm", marks=pytest.mark.engine)], indirect=True)
REAL_ONLY = pytest.mark.parametrize("fleet", [pytest.param("vllm", marks=pytest.mark.engine)], indirect=True)


def shared(request: pytest.FixtureRequest) -> LiveFleet:
    """The session's fleet a case's parameter names (`sim`: `sim_live`, `vllm`: `live`), healed."""
    fleet: LiveFleet = request.getfixturevalue("sim_live" if request.param == "sim" else "live")
    fleet.ready()
    return fleet


# --- RolloutRequests on the live fleet ---------------------------------------------------

ROLLFLEET = str(Path(sys.executable).parent / "rollfleet")


def create(on: LiveFleet | Fleet, prompts: int | list[dict[str, Any]], samples: int, **spec: Any) -> tuple[str, str]:
    """A RolloutRequest on the fleet (`prompts` text prompts, or these prompts); its name and uid."""
    fleet = _fleet(on)
    name = f"rr-{uuid.uuid4().hex[:6]}"
    doc = {
        "apiVersion": "rollfleet.dev/v1alpha1",
        "kind": "RolloutRequest",
        "metadata": {"name": name, "namespace": fleet.namespace},
        "spec": {
            "fleet": fleet.name,
            "prompts": [{"text": f"rollout prompt {i}:"} for i in range(prompts)]
            if isinstance(prompts, int)
            else prompts,
            "samplesPerPrompt": samples,
            **spec,
        },
    }
    fleet.cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
    return name, get(fleet, name)["metadata"]["uid"]


def get(on: LiveFleet | Fleet, name: str) -> dict[str, Any]:
    fleet = _fleet(on)
    read = kubernetes.client.CustomObjectsApi(fleet.cluster.api_client()).get_namespaced_custom_object
    return fleet.cluster.read(read, GROUP, VERSION, fleet.namespace, REQUEST.plural, name)


def status(fleet: LiveFleet | Fleet, name: str) -> dict[str, Any]:
    return dict(get(fleet, name).get("status") or {})


def wait_phase(fleet: LiveFleet | Fleet, name: str, phase: str, timeout: float = 600) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        st = status(fleet, name)
        if st.get("phase") in ("Succeeded", "Failed", "Aborted") and st["phase"] != phase:
            raise AssertionError(f"{name} ended {st['phase']}, not {phase}: {st.get('message')}")
        return st if st.get("phase") == phase else None

    return dict(wait_for(reached, timeout, interval=0.5, what=f"{name} {phase}"))


def results(on: LiveFleet | Fleet, name: str) -> list[dict[str, Any]]:
    """`rollfleet results rr/<name>`: one JSON object per line."""
    fleet = _fleet(on)
    out = subprocess.run(
        [ROLLFLEET, "results", f"rr/{name}", "-n", fleet.namespace],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KUBECONFIG": str(fleet.cluster.kubeconfig)},
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def _fleet(on: LiveFleet | Fleet) -> Fleet:
    """The fleet a request helper acts on: the session's live fleet, or a module's own."""
    return on.fleet if isinstance(on, LiveFleet) else on


def may(fleet: LiveFleet, account: str, verb: str, resource: str) -> bool:
    """Whether the API server lets the fleet namespace's ServiceAccount `account` do `verb` on `resource`."""
    user = f"--as=system:serviceaccount:{fleet.namespace}:{account}"
    answer = fleet.cluster.kubectl("auth", "can-i", verb, resource, "-n", fleet.namespace, user, check=False)
    assert answer.stdout.strip() in ("yes", "no"), answer
    return answer.stdout.strip() == "yes"


def runner_pods(fleet: LiveFleet, uid: str) -> list[dict[str, Any]]:
    """The request's runner pods (its Job's: its own, or the spare runner it took) that are not being deleted."""
    jobs = fleet.cluster.kubectl("-n", fleet.namespace, "get", "jobs", "-l", f"{LABEL_REQUEST_UID}={uid}", "-o", "name")
    names = [job.removeprefix("job.batch/") for job in jobs.stdout.split()]
    return [p for name in names for p in live_pods(fleet.cluster, fleet.namespace, f"{JOB_NAME_LABEL}={name}")]


def running(fleet: LiveFleet, uid: str) -> list[str]:
    """The request's samples that some engine is running now."""
    return [rid for ids in fleet.in_flight(f"{uid}-").values() for rid in ids]


def _warm(url: str, headers: dict[str, str]) -> bool:
    body = {"model": "tiny", "prompt": "warm", "max_tokens": 2}
    try:
        return oneshot.post(url + "/v1/completions", json=body, headers=headers, timeout=300).status_code == 200
    except httpx.TransportError:
        return False


def _ok(url: str) -> bool:
    try:
        return oneshot.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def live_fleet(cluster: Cluster, engine: dict[str, Any] | None = None) -> Iterator[LiveFleet]:
    """The operator serving a fresh namespace, and a fleet there: 2 engines (real ones, or `engine` as the
    spec's `engine`), 2 gateway replicas."""
    namespace = f"{'live' if engine is None else 'sim'}-e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    deploy_operator(cluster, [namespace])
    spec: dict[str, Any] = {"engine": engine} if engine else {"weightSync": {"initialVersion": INITIAL_VERSION}}
    manifest = fleet_manifest(NAME, namespace, replicas=2, gateway={"replicas": 2}, **spec)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    fleet = Fleet(cluster, NAME, namespace)
    try:
        fleet.wait_ready(2)
        token = read_token(cluster, namespace, secret_name(NAME))
        inference = read_token(cluster, namespace, inference_secret_name(NAME))
        with contextlib.ExitStack() as stack:
            live = LiveFleet(cluster, namespace, fleet, token, inference, stack, real=engine is None)
            live.ready()
            yield live
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def release_live_engines(cluster: Cluster) -> None:
    """Scale the session's real fleet (if it was made) to no engine, and wait for its engine pods to go: for the
    modules that run big fleets of their own after its last user (marker `after_live`), on a machine whose memory
    holds one of them at a time (a vLLM CPU worker holds about 1.6 GiB)."""
    out = cluster.kubectl("get", "rf", "-A", "-o", "json").stdout
    for item in json.loads(out)["items"]:
        namespace = item["metadata"]["namespace"]
        if item["metadata"]["name"] == NAME and namespace.startswith("live-e2e-"):
            cluster.kubectl("-n", namespace, "patch", "rf", NAME, "--type=merge", "-p", '{"spec":{"replicas":0}}')
            fleet = Fleet(cluster, NAME, namespace)
            wait_for(lambda f=fleet: not f.pods(), ENGINE_START_S, what=f"{namespace}'s engines gone")


@contextlib.contextmanager
def host_path_claim(fleet: LiveFleet, directory: Path) -> Iterator[str]:
    """A PersistentVolumeClaim in the fleet's namespace, bound to a hostPath volume at `directory` (a directory of
    this machine, where the local cluster's pods run), deleted after; its name."""
    name = f"results-{uuid.uuid4().hex[:6]}"
    volume, claim = claims.host_path_claim(fleet.namespace, name, directory)
    kubectl = fleet.cluster.kubectl
    for doc in (volume, claim):
        kubectl("apply", "-f", "-", input=json.dumps(doc))

    def bound() -> bool:
        return kubectl("-n", fleet.namespace, "get", "pvc", name, "-o", "jsonpath={.status.phase}").stdout == "Bound"

    wait_for(bound, 60, what=f"claim {name} bound")
    try:
        yield name
    finally:
        kubectl("-n", fleet.namespace, "delete", "pvc", name, "--wait=false")
        kubectl("delete", "pv", volume["metadata"]["name"], "--wait=false")
