"""Helpers of the RolloutFleet end-to-end tests: deploy the operator, write fleets, watch them.

Cluster-agnostic like the rest of `e2e/`: everything goes through `Cluster` (kubectl,
the API client, `reach` for pod ports); only killing an engine's process differs
between the local cluster (a local process) and kind (`kubectl exec`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import pytest
import yaml
from starlette.routing import Route

from e2e.provider import Cluster, kubectl_unanswered, unanswered, wait_for
from rollfleet import jsonl
from rollfleet.api.common import DEFAULT_ROLLFLEET_IMAGE
from rollfleet.contract import (
    ANNOTATION_PAUSE,
    ANNOTATION_RESUME,
    ENGINE_PORT,
    GROUP,
    LABEL_FLEET,
    LWS_LABEL_NAME,
    OPERATOR_METRICS_PORT,
    REQUEST_ID_HEADER,
    REQUESTS_PATH,
    STATE_PATH,
    SYNC_API_PORT,
    SYNC_HEALTH_PORT,
    VERSION,
    inference_secret_name,
    secret_name,
    secret_token,
    trainer_name,
)
from rollfleet.gateway.app import GatewayConfig, build_app
from rollfleet.kube import FLEET
from rollfleet.kubectl import KubectlError
from rollfleet_client.protocol import TRL_PREFIX
from rollfleet_client.sync import SyncClient
from rollfleet_dev import oneshot
from rollfleet_engine.tiny_model import NODE_MODEL_DIR, TINY_MODEL_CONTEXT

REPO = Path(__file__).resolve().parents[1]
OPERATOR_NS = "rollfleet-system"
# Engines load a model in 30-60 s on an idle 2-core machine; much longer when it is shared.
ENGINE_START_S = 600.0


IMAGE_ID_ANNOTATION = "rollfleet.dev/e2e-image-id"


def local_image_id(image: str) -> str | None:
    """The id Docker here has for `image` (what `kind up` loaded); None without Docker or the image."""
    try:
        out = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def overlay() -> Path:
    name = os.environ.get("ROLLFLEET_E2E_OVERLAY") or (
        "local" if os.environ.get("ROLLFLEET_E2E_PROVIDER", "local") == "local" else "kind"
    )
    return REPO / "manifests" / "overlays" / name


def served_namespaces(cluster: Cluster) -> set[str]:
    """The namespaces the deployed operator serves now (none when it is not deployed)."""
    out = cluster.kubectl(
        "-n",
        OPERATOR_NS,
        "get",
        "deployment/rollfleet-operator",
        "-o",
        "jsonpath={.spec.template.spec.containers[0].args}",
        check=False,
    )
    if out.returncode != 0 or not out.stdout.strip():
        return set()
    prefix = "--namespace="
    return {a[len(prefix) :] for a in json.loads(out.stdout) if a.startswith(prefix)}


def deploy_operator(cluster: Cluster, namespaces: list[str]) -> None:
    """The operator from manifests/ (CRDs, RBAC, Deployment), rolled out and running.

    It serves `namespaces` and those it already served (modules share the one operator;
    other suites on the same cluster run operators of their own, scoped elsewhere).
    """
    served = sorted(served_namespaces(cluster) | set(namespaces))
    docs = list(yaml.safe_load_all(cluster.kubectl("kustomize", str(overlay())).stdout))
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "rollfleet-operator":
            template = doc["spec"]["template"]
            template["spec"]["containers"][0]["args"] += [f"--namespace={n}" for n in served]
            image_id = local_image_id(template["spec"]["containers"][0]["image"])
            if image_id:
                # The tag stays 0.1.0 while `kind up` loads rebuilt images under it: a changed image id
                # rolls the operator, which would otherwise keep running the code of an earlier build.
                template["metadata"].setdefault("annotations", {})[IMAGE_ID_ANNOTATION] = image_id
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(docs), timeout=180
    )
    cluster.kubectl(
        "-n", OPERATOR_NS, "rollout", "status", "deployment/rollfleet-operator", "--timeout=300s", timeout=320
    )


def live_pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods of `selector` not being deleted, read through the API client: waits poll this, and a kubectl
    process per poll costs about 0.12 s of CPU."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    pods = cluster.read(core.list_namespaced_pod, namespace, label_selector=selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def group_pods(cluster: Cluster, namespace: str, group: str) -> list[dict[str, Any]]:
    """The live pods of a LeaderWorkerSet group (an engine of several pods)."""
    return live_pods(cluster, namespace, f"{LWS_LABEL_NAME}={group}")


def operator_pods(cluster: Cluster) -> list[dict[str, Any]]:
    return live_pods(cluster, OPERATOR_NS, "app.kubernetes.io/component=operator")


@contextlib.contextmanager
def operator_metrics(cluster: Cluster) -> Iterator[str]:
    """The running operator's metrics endpoint (docs/metrics.md), as a base URL for `engine_metric`."""
    pod = operator_pods(cluster)[0]["metadata"]["name"]
    with cluster.reach(OPERATOR_NS, pod, OPERATOR_METRICS_PORT) as url:
        yield url


def fleet_manifest(name: str, namespace: str, replicas: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "rollfleet.dev/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            # The nodes' model directory, as in the samples: the local cluster maps it to its cache,
            # kind nodes mount it from there (`rollfleet cluster up` / `rollfleet kind up` build it).
            "model": {"servedName": "tiny", "hostPath": NODE_MODEL_DIR},
            # The tiny model is float32; a small batch keeps engines light on a shared CPU; its
            # whole context lets a test's stream last long enough to act on it.
            "engine": {"args": ["--dtype", "float32", "--max-num-seqs", "8"], "maxModelLen": TINY_MODEL_CONTEXT},
            # Long enough for a test's in-flight requests on a slow shared machine.
            "drainTimeoutSeconds": 600,
            **spec,
        },
    }


def sim_engine(cluster: Cluster, token_delay_ms: float) -> dict[str, Any]:
    """A fleet's `spec.engine` for the control-plane tier: `rollfleet_dev.sim_engine`, the engine's protocol
    without vLLM (held to the real engine by tests/engine/test_contract.py), `token_delay_ms` before each
    token. It starts in about a second, where a real engine takes 30-90 s. A local-cluster pod runs this
    interpreter; the simulator is development tooling, in no image, so elsewhere (kind) the case is skipped."""
    if cluster.provider != "local":
        pytest.skip("simulated engines run on the local cluster only: the simulator is in no image")
    return {
        "command": [sys.executable, "-m", "rollfleet_dev.sim_engine"],
        # The batch of the real fleets' engines (fleet_manifest): requests past it wait, as in vLLM.
        "args": ["--token-delay-ms", str(token_delay_ms), "--max-num-seqs", "8"],
        "maxModelLen": TINY_MODEL_CONTEXT,
    }


def describe_pod(pod: dict[str, Any]) -> str:
    """A pod in one line: node, phase, and each container's readiness, restarts and last termination."""
    st = pod.get("status") or {}
    parts = [pod["metadata"]["name"], f"on {pod['spec'].get('nodeName') or '-'}", st.get("phase", "?")]
    parts += [
        f"{c['type']}={c['status']}({c.get('message', '')})" for c in st.get("conditions", []) if c["status"] != "True"
    ]
    for c in st.get("containerStatuses") or []:
        state = next(iter(c.get("state") or {}), "?")
        reason = (c.get("state") or {}).get(state, {}).get("reason", "")
        last = (c.get("lastState") or {}).get("terminated") or {}
        ended = f" last: {last.get('reason')} exit {last.get('exitCode')}" if last else ""
        parts.append(f"[{c['name']} ready={c.get('ready')} restarts={c.get('restartCount')} {state} {reason}{ended}]")
    return " ".join(parts)


@dataclass
class Fleet:
    cluster: Cluster
    name: str
    namespace: str

    def get(self) -> dict[str, Any]:
        read = kubernetes.client.CustomObjectsApi(self.cluster.api_client()).get_namespaced_custom_object
        return self.cluster.read(read, GROUP, VERSION, self.namespace, FLEET.plural, self.name)

    def status(self) -> dict[str, Any]:
        return dict(self.get().get("status") or {})

    def condition(self, type_: str) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions", []) if c["type"] == type_), {})

    def wait(self, predicate: Any, what: str, timeout: float = ENGINE_START_S) -> dict[str, Any]:
        """Wait until `predicate(status)` holds; returns that status."""
        return self._wait(lambda obj: predicate(obj.get("status") or {}), what, timeout)

    def _wait(self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            try:
                obj = self.get()
            except Exception as err:
                if not unanswered(err):
                    raise
                return None  # the API server did not answer this poll (a loaded host): the deadline still holds
            return dict(obj.get("status") or {}) if predicate(obj) else None

        try:
            return dict(wait_for(check, timeout=timeout, interval=0.5, what=f"{self.name}: {what}"))
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        """Why the fleet is where it is, for a failed wait: its status, its pods as their kubelets report them,
        and the namespace's warnings (a wait that only says "timed out" leaves a CI run unexplained)."""
        try:
            lines = [f"{self.namespace}/{self.name} status:"]
            st = self.status()
            lines += [
                f"  {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}"
                for c in st.get("conditions", [])
            ]
            lines += [f"  engine {e['name']} {e.get('phase')} {e.get('message', '')}" for e in st.get("engines", [])]
            if not st:
                lines.append("  (none: no operator has reconciled it; does one serve this namespace?)")
            log = self.cluster.kubectl(
                "-n", OPERATOR_NS, "logs", "deploy/rollfleet-operator", "--tail=3000", check=False
            )
            about = [line for line in log.stdout.splitlines() if f"{self.namespace}/{self.name}" in line]
            lines += [f"  operator: {line[:400]}" for line in about[-10:]]
            core = kubernetes.client.CoreV1Api(self.cluster.api_client())
            pods = self.cluster.read(core.list_namespaced_pod, self.namespace)["items"]
            lines += [f"  pod {describe_pod(p)}" for p in pods]
            warnings = self.cluster.read(core.list_namespaced_event, self.namespace, field_selector="type=Warning")
            for e in warnings["items"][-15:]:
                said = f"{e['involvedObject'].get('name')} {e.get('reason')} x{e.get('count', 1)}: {e.get('message')}"
                lines.append(f"  event {said[:400]}")
            return "\n".join(lines)
        except Exception as err:  # a diagnosis must not hide the failure it explains
            return f"(no diagnosis: {err!r})"

    def wait_ready(self, replicas: int, timeout: float = ENGINE_START_S) -> dict[str, Any]:
        def ready(obj: dict[str, Any]) -> bool:
            st = obj.get("status") or {}
            conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
            return (
                st.get("readyReplicas") == replicas
                and st.get("replicas") == replicas
                and st.get("observedGeneration") == obj["metadata"]["generation"]
                and conds.get("Ready") == "True"
                and conds.get("Progressing") == "False"
            )

        return self._wait(ready, f"Ready with {replicas} engines", timeout)

    def pods(self, component: str = "engine") -> list[dict[str, Any]]:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        selector = f"{LABEL_FLEET}={self.name},app.kubernetes.io/component={component}"
        return list(self.cluster.read(core.list_namespaced_pod, self.namespace, label_selector=selector)["items"])

    def pod(self, name: str) -> dict[str, Any]:
        return next(p for p in self.pods() if p["metadata"]["name"] == name)

    def replaced(self, name: str, old_uid: str, ready: bool = False) -> bool:
        """Whether a pod named `name` other than the one of `old_uid` exists (and, with `ready`, is Ready as its
        kubelet sees it: the fleet's status may still show the old pod's last state for a moment)."""
        return any(
            p["metadata"]["name"] == name
            and p["metadata"]["uid"] != old_uid
            and (not ready or _condition(p, "Ready") == "True")
            for p in self.pods()
        )

    def engine(self, name: str) -> dict[str, Any]:
        return next((e for e in self.status().get("engines", []) if e["name"] == name), {})

    def events(self) -> list[dict[str, Any]]:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        about = f"involvedObject.kind=RolloutFleet,involvedObject.name={self.name}"
        return list(self.cluster.read(core.list_namespaced_event, self.namespace, field_selector=about)["items"])

    def engine_state(self, pod: str) -> dict[str, Any]:
        with self.cluster.reach(self.namespace, pod, ENGINE_PORT) as url:
            return dict(oneshot.get(f"{url}{STATE_PATH}", timeout=10).json())

    def admin_token(self) -> str:
        return read_token(self.cluster, self.namespace, secret_name(self.name))

    def inference_token(self) -> str:
        """What generation needs (a fleet's default: its inference token)."""
        return read_token(self.cluster, self.namespace, inference_secret_name(self.name))

    def inference(self) -> dict[str, str]:
        """The header generation needs."""
        return {"Authorization": f"Bearer {self.inference_token()}"}

    def engine_control(self, pod: str, path: str) -> None:
        """A control call (pause, resume) made straight to one engine, with the fleet's token."""
        with self.cluster.reach(self.namespace, pod, ENGINE_PORT) as url:
            r = oneshot.post(url + path, headers={"Authorization": f"Bearer {self.admin_token()}"}, timeout=60)
            assert r.status_code == 200, (path, r.status_code, r.text)


def _condition(pod: dict[str, Any], type_: str) -> str | None:
    return next((c["status"] for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def gateway_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the gateway serves, from its own route table: a route added later is checked
    by whichever test walks them (its generation routes are there too, as the server's direct routes)."""
    app = build_app(GatewayConfig(token="unused", engines=["http://127.0.0.1:9"]))
    return sorted((m, r.path) for r in app.routes if isinstance(r, Route) for m in r.methods or () if m != "HEAD")


def read_token(cluster: Cluster, namespace: str, secret: str) -> str:
    """The token in one of a fleet's token Secrets (admin, inference), read through the session's API client: a
    kubectl process costs about 0.12 s of CPU, and requests take the token anew each time."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    data = cluster.read(core.read_namespaced_secret, secret, namespace).get("data")
    token = secret_token(data or {})
    assert token, f"the Secret {secret} holds no token"
    return token


FAULT_ENV = "ROLLFLEET_E2E_FAULT"


def fault_point(name: str) -> None:
    """Fail here when ROLLFLEET_E2E_FAULT names this point: how a case that fails midway, with the
    shared fleet changed, is shown to leave the module's next cases green, and a fleet that cannot be
    put back to fail them at once."""
    if os.environ.get(FAULT_ENV) == name:
        raise AssertionError(f"fault injected at {name!r} ({FAULT_ENV})")


@dataclass
class SharedFleet:
    """A fleet that the cases of a module share.

    Each case starts from the same state (`replicas` engines Ready, nothing paused), and its
    teardown puts the fleet back whatever the case left behind: the pause annotations, engines
    paused at their own control route, the replica count. A fleet that cannot be put back makes the
    module's later cases fail at once, with the name of the case that left it so, instead of each
    waiting out a timeout.
    """

    fleet: Fleet
    replicas: int
    broken: str | None = None

    def acquire(self) -> Fleet:
        if self.broken is not None:
            pytest.fail(f"the shared fleet {self.fleet.name} is broken: {self.broken}", pytrace=False)
        try:
            self.fleet.wait_ready(self.replicas)
        except AssertionError as err:
            self.broken = f"it was never Ready with {self.replicas} engines ({err})"
            raise
        return self.fleet

    def restore(self, case: str) -> None:
        f = self.fleet
        try:
            fault_point(f"restore after {case}")
            # Resumed first: a draining engine whose requests a pause holds is deleted only once they end.
            unpause = {"metadata": {"annotations": {ANNOTATION_PAUSE: None, ANNOTATION_RESUME: None}}}
            f.cluster.kubectl("-n", f.namespace, "patch", "rf", f.name, "--type=merge", "-p", json.dumps(unpause))
            for pod in f.pods():
                if _condition(pod, "Ready") == "True" and f.engine_state(pod["metadata"]["name"])["paused"]:
                    f.engine_control(pod["metadata"]["name"], "/resume")
            f.cluster.kubectl("-n", f.namespace, "scale", "rf", f.name, f"--replicas={self.replicas}")
            f.wait_ready(self.replicas)
            f.wait(
                lambda s: (
                    all(e["phase"] == "Ready" for e in s["engines"])
                    and next(c for c in s["conditions"] if c["type"] == "Paused")["reason"] == "Running"
                ),
                "every engine Ready and none paused",
                120,
            )
        except Exception as err:
            self.broken = f"putting it back after {case} failed: {err}"
            raise


def sse(text: str) -> list[dict[str, Any]]:
    # SSE lines end at "\n" only: str.splitlines() would also split inside generated text
    # (U+2028, U+0085, ...), which the tiny random model does produce.
    data = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", f"stream did not end with [DONE]: {text[-300:]}"
    return [json.loads(d) for d in data[:-1]]


def tokens_of(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in chunks for ch in c.get("choices", []) for t in ch.get("token_ids") or []]


@dataclass
class Stream:
    """A streamed completion read in a thread, with the arrival time of every token chunk."""

    url: str
    max_tokens: int
    n: int = 1
    request_id: str | None = None  # the caller's id (X-Request-Id), to look the request up at the engine
    auth: dict[str, str] = field(default_factory=dict)  # the credential generation needs (Fleet.inference())
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, choice index)
    finish: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None  # from the final usage chunk
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": self.max_tokens,
            "n": self.n,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            headers = ({REQUEST_ID_HEADER: self.request_id} if self.request_id else {}) | self.auth
            with oneshot.stream(
                "POST", f"{self.url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(600)
            ) as r:
                r.raise_for_status()
                for line in jsonl.iter_lines(r.iter_bytes()):
                    self._event(line)
        except BaseException as err:  # the test thread reports it
            self.error = err
        finally:
            self.done.set()

    def _event(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            # One chunk per decoded token; its text may be empty (a partial UTF-8 sequence).
            self.chunks.append((time.monotonic(), choice["index"]))
            if choice.get("finish_reason"):
                self.finish[choice["index"]] = choice["finish_reason"]

    def tokens(self) -> int:
        return len(self.chunks)

    def wait(self, timeout: float) -> None:
        assert self.done.wait(timeout), f"stream not finished after {timeout:.0f}s ({self.tokens()} chunks)"
        assert self.error is None, f"stream failed after {self.tokens()} chunks: {self.error!r}"


def signal_container(
    cluster: Cluster,
    namespace: str,
    pod: str,
    container: str,
    sig: signal.Signals = signal.SIGKILL,
) -> None:
    """Signal a container's main process, found through its container runtime: SIGKILL as an OOM
    kill or a crash would, SIGSTOP as a hang.

    On the local cluster the runtime is the node agent, whose pid file per container names the
    process (its pid and start time, so a reused pid is never signalled). On kind the process is
    signalled from its node (a Docker container named after the node), by the pid crictl reports:
    inside the container it is PID 1, which ignores signals it has no handler for, even SIGKILL.
    """
    found = kubernetes.client.CoreV1Api(cluster.api_client()).read_namespaced_pod(pod, namespace)
    if cluster.provider != "local":
        _signal_on_kind_node(found, container, sig)
        return
    from rollfleet_dev.localcluster.nodeagent.logs import nodes_state_dir, pod_dir_name
    from rollfleet_dev.localcluster.nodeagent.processes import Identity

    pid_file = nodes_state_dir() / "pods" / pod_dir_name(namespace, pod, found.metadata.uid) / f"{container}.pid"
    try:
        ident = Identity(**json.loads(pid_file.read_text()))
    except FileNotFoundError:
        raise AssertionError(f"{namespace}/{pod} container {container} is not running ({pid_file} is absent)") from None
    assert ident.alive(), f"{namespace}/{pod} container {container}: process {ident.pid} has exited"
    os.kill(ident.pid, sig)


def _signal_on_kind_node(pod: Any, container: str, sig: signal.Signals) -> None:
    status = next(c for c in pod.status.container_statuses if c.name == container)
    container_id = status.container_id.split("://", 1)[1]
    node = pod.spec.node_name

    def on_node(*argv: str) -> str:
        return subprocess.run(["docker", "exec", node, *argv], capture_output=True, text=True, check=True).stdout

    pid = on_node("crictl", "inspect", "--output", "go-template", "--template", "{{.info.pid}}", container_id)
    on_node("kill", f"-{sig.name.removeprefix('SIG')}", pid.strip())


def kill_engine_process(cluster: Cluster, namespace: str, pod: str) -> None:
    signal_container(cluster, namespace, pod, "engine")


def greedy(url: str, auth: dict[str, str], prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """An engine's (or gateway's) greedy tokens for each prompt: what its weights say, to compare with
    transformers' on a known set (``tests.engine.test_engine_live._reference_greedy``)."""
    out = []
    for prompt in prompts:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        resp = oneshot.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120).raise_for_status()
        out.append(resp.json()["choices"][0]["token_ids"])
    return out


SIDECAR_MODELS = "/models/tiny"  # the tiny model's directory, mounted into the sidecar pod (push_dir reads it)


def sync_sidecar_pod(fleet: str, ns: str, pod: str) -> dict[str, Any]:
    """The documented sidecar (manifests/sync/trainer-job.yaml) of `fleet` in a plain pod named `pod`, its API on
    every address (not localhost only) for the test, which drives it from outside the pod, or for a trainer
    outside the cluster."""
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    args = ["sync", f"--fleet={fleet}", "--namespace=$(POD_NAMESPACE)", "--weights-host=$(POD_IP)"]
    args += ["--host=0.0.0.0", "--spool-dir=/var/lib/rollfleet-sync", "--reconcile-interval=0.5"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        # The labels the fleet's NetworkPolicy admits to the engines.
        "metadata": {
            "name": pod,
            "namespace": ns,
            "labels": {"app.kubernetes.io/component": "trainer", "rollfleet.dev/fleet": fleet},
        },
        "spec": {
            "serviceAccountName": trainer_name(fleet),  # made by the operator with the fleet
            "containers": [
                {
                    "name": "rollfleet-sync",
                    "image": DEFAULT_ROLLFLEET_IMAGE,
                    "args": args,
                    "env": env,
                    "readinessProbe": {"httpGet": {"path": "/healthz", "port": SYNC_HEALTH_PORT}, "periodSeconds": 1},
                    "volumeMounts": [
                        {"name": "fleet-token", "mountPath": "/var/run/secrets/rollfleet", "readOnly": True},
                        {"name": "sync-spool", "mountPath": "/var/lib/rollfleet-sync"},
                        {"name": "models", "mountPath": SIDECAR_MODELS, "readOnly": True},
                    ],
                },
                # Stands in for the trainer (the test process drives the sidecar): any image with `sleep`.
                {"name": "trainer", "image": DEFAULT_ROLLFLEET_IMAGE, "command": ["sleep", "86400"]},
            ],
            "volumes": [
                {"name": "fleet-token", "secret": {"secretName": secret_name(fleet)}},
                {"name": "sync-spool", "emptyDir": {"medium": "Memory"}},
                {"name": "models", "hostPath": {"path": NODE_MODEL_DIR, "type": "Directory"}},
            ],
        },
    }


def framework_env(name: str) -> Path:
    """An RL framework's own virtualenv (the released framework, rollfleet-client, no vLLM), made by the
    project's script (docs/frameworks.md); its root."""
    out = subprocess.run(
        [str(REPO / "hack" / "framework-env.sh"), name], capture_output=True, text=True, timeout=900, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


GRPO_EXAMPLE = REPO / "examples" / "grpo_tiny"
GRPO_TRAINER = "grpo-tiny-trainer"  # the pod in examples/grpo_tiny/trainer-pod.yaml


def run_grpo_example(
    cluster: Cluster, namespace: str, steps: int, max_staleness: int, *args: str
) -> list[dict[str, Any]]:
    """examples/grpo_tiny as its README says (train.py from a ConfigMap, its trainer pod beside the sync
    sidecar, against the fleet grpo-tiny), for `steps` steps with train.py's further `args`; it must succeed.
    The JSON lines it logged, one per step."""
    cluster.kubectl(
        "-n", namespace, "create", "configmap", "grpo-tiny-train", f"--from-file={GRPO_EXAMPLE / 'train.py'}"
    )
    pod = dict(yaml.safe_load((GRPO_EXAMPLE / "trainer-pod.yaml").read_text()))
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    trainer["command"] += [f"--steps={steps}", f"--max-staleness={max_staleness}", *args]
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(pod))

    def ended() -> dict[str, Any] | None:
        try:
            out = cluster.kubectl("-n", namespace, "get", "pod", GRPO_TRAINER, "-o", "json").stdout
        except KubectlError as err:
            if kubectl_unanswered(err):  # the API server on a loaded host: the next poll asks again
                return None
            raise
        for c in json.loads(out)["status"].get("containerStatuses") or []:
            if c["name"] == "trainer" and "terminated" in (c.get("state") or {}):
                return dict(c["state"]["terminated"])
        return None

    exit_ = wait_for(ended, timeout=1200, interval=2, what="the GRPO trainer to finish")
    logs = cluster.container_log(namespace, GRPO_TRAINER, "trainer")
    if exit_["exitCode"] != 0:
        pod_now = json.loads(cluster.kubectl("-n", namespace, "get", "pod", GRPO_TRAINER, "-o", "json").stdout)
        events = cluster.kubectl(
            "-n", namespace, "get", "events", f"--field-selector=involvedObject.name={GRPO_TRAINER}", check=False
        ).stdout
        sidecar = cluster.container_log(namespace, GRPO_TRAINER, "rollfleet-sync")
        raise AssertionError(
            f"the trainer ended {exit_}; pod {pod_now['metadata'].get('deletionTimestamp')=} "
            f"{pod_now['status'].get('phase')=} {pod_now['status'].get('reason')=}\n"
            f"events:\n{events}\ntrainer log:\n{logs[-3000:]}\nsidecar log:\n{sidecar[-2000:]}"
        )
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    print("\n".join(json.dumps(s) for s in lines))
    return lines


def in_flight(engine_url: str) -> list[str]:
    """The request ids an engine runs now (its own tracker)."""
    tracked = oneshot.get(engine_url + REQUESTS_PATH, timeout=10).raise_for_status().json()
    return [r["request_id"] for r in tracked["in_flight"]]


def running(fleet: Fleet) -> dict[str, list[str]]:
    """The request ids each engine of the fleet runs now (a group's: its leader's, which tracks them all)."""
    out = {}
    for engine in fleet.status()["engines"]:
        with fleet.cluster.reach(fleet.namespace, engine["name"], ENGINE_PORT) as url:
            out[engine["name"]] = in_flight(url)
    return out


def nothing_running(fleet: Fleet) -> None:
    assert not any(running(fleet).values()), running(fleet)


def trl_client(gateway_url: str, token: str) -> Any:
    """TRL's own VLLMClient as a user makes it: its one setting is the URL, which carries the fleet's token
    (requests sends it as HTTP Basic auth on every call, the constructor's own included; the gateway takes the
    password)."""
    from trl.generation.vllm_client import VLLMClient

    return VLLMClient(base_url=gateway_url.replace("://", f"://trl:{token}@") + TRL_PREFIX, connection_timeout=60)


@contextlib.contextmanager
def sidecar_client(cluster: Cluster, fleet: Fleet, pod: str, version: str) -> Iterator[SyncClient]:
    """A sync sidecar's pod for the fleet (`sync_sidecar_pod`), and a client of it once it sees the fleet on
    `version`."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(sync_sidecar_pod(fleet.name, fleet.namespace, pod)))
    cluster.kubectl("-n", fleet.namespace, "wait", "--for=condition=Ready", f"pod/{pod}", "--timeout=120s", timeout=130)
    with cluster.reach(fleet.namespace, pod, SYNC_API_PORT) as url, SyncClient(url) as client:
        wait_for(lambda: client.fleet_version().version == version, timeout=60, what=f"the sidecar sees {version}")
        yield client


def all_engines_on(version: str, engines: int) -> Callable[[dict[str, Any]], bool]:
    """A status check: the fleet's version is `version`, and so is each of its `engines` engines', all Ready (one
    entry per engine, however many pods each has)."""

    def check(st: dict[str, Any]) -> bool:
        listed = st.get("engines", [])
        return (
            st.get("weightVersion") == version
            and len(listed) == engines
            and all(e["phase"] == "Ready" and e.get("weightVersion") == version for e in listed)
        )

    return check
