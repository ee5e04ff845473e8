"""RolloutRequest end to end on a real cluster: the API server's validation, the operator's
verdicts on requests that cannot run, and the ConfigMap results store (written, read
back by `rollfleet results`, garbage-collected with its request).

The operator runs as a subprocess (`rollfleet operator -n <ns>`), scoped to a namespace
of this module, so it can be killed and restarted by tests without touching others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from e2e.fleet_helpers import fleet_manifest
from e2e.provider import Cluster, wait_for
from rollfleet.api.request import PLURAL
from rollfleet.controller.requests.plan import SampleResult
from rollfleet.controller.requests.results import CHUNK_LIMIT, ResultStore, list_chunks
from rollfleet.kube import Kube

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NO_ENDPOINTS = ("--health-port", "0", "--metrics-port", "0")


@pytest.fixture(scope="module")
def ns(cluster: Cluster, core: kubernetes.client.CoreV1Api) -> Iterator[str]:
    cluster.kubectl("apply", *(f"-f={p}" for p in sorted((ROOT / "crds").glob("rollout*.yaml"))))
    name = f"rr-e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextlib.contextmanager
def running_operator(cluster: Cluster, ns: str, log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`rollfleet operator -n ns` as a subprocess, its output in `log`."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    command = [str(BIN / "rollfleet"), "operator", "-n", ns, "--key-namespace", ns, *NO_ENDPOINTS, *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    proc.log = log  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def operator(cluster: Cluster, ns: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    with running_operator(cluster, ns, tmp_path_factory.mktemp("operator") / "operator.log") as proc:
        yield proc


def status_in(
    cluster: Cluster, ns: str, name: str, phase: str, operator: subprocess.Popen[bytes]
) -> dict[str, Any] | None:
    """The request's status once it is in `phase`; fails at once, with its log, if the operator exited."""
    if operator.poll() is not None:
        log = operator.log.read_text()[-3000:]  # type: ignore[attr-defined]
        raise AssertionError(f"the operator exited ({operator.returncode}):\n{log}")
    status = get_rr(cluster, ns, name).get("status") or {}
    return status if status.get("phase") == phase else None


def custom(cluster: Cluster) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(cluster.api_client())


def apply(cluster: Cluster, ns: str, name: str, spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    doc = {
        "apiVersion": "rollfleet.dev/v1alpha1",
        "kind": "RolloutRequest",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }
    return cluster.kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)


def get_rr(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return dict(custom(cluster).get_namespaced_custom_object("rollfleet.dev", "v1alpha1", ns, PLURAL, name))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"fleet": "tiny", "prompts": []}, "should have at least 1 items"),
        ({"fleet": "tiny"}, "set exactly one of prompts (inline) or promptsFrom"),
        ({"fleet": "tiny", "prompts": [{"text": "a", "tokenIds": [1]}]}, "exactly one of text, messages or tokenIds"),
        ({"fleet": "tiny", "prompts": [{"text": "x" * 60_000}] * 3}, "put larger sets in a ConfigMap"),
        ({"fleet": "tiny", "prompts": [{"text": "a"}], "sampling": {"topP": 0}}, "sampling.topP must be in (0, 1]"),
        ({"fleet": "tiny", "prompts": [{"text": "a"}], "sampling": {"temperature": -1}}, "greater than or equal to 0"),
        (
            {"fleet": "tiny", "prompts": [{"text": "a"}], "sampling": {"maxTokens": 4, "minTokens": 8}},
            "minTokens must not exceed sampling.maxTokens",
        ),
        ({"fleet": "tiny", "prompts": [{"text": "a"}], "sampling": {"topK": 0}}, "topK must be -1"),
    ],
    ids=["empty", "no-prompts", "two-forms", "oversized", "top-p", "temperature", "min-tokens", "top-k"],
)
def test_invalid_requests_are_refused_with_a_clear_message(
    cluster: Cluster, ns: str, spec: dict[str, Any], message: str
) -> None:
    proc = apply(cluster, ns, "bad", spec)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_spec_is_immutable(cluster: Cluster, ns: str) -> None:
    assert apply(cluster, ns, "frozen", {"fleet": "nosuch", "prompts": [{"text": "a"}]}).returncode == 0
    proc = apply(cluster, ns, "frozen", {"fleet": "nosuch", "prompts": [{"text": "b"}]})
    assert proc.returncode != 0 and "cannot change" in proc.stderr
    cluster.kubectl("-n", ns, "delete", "rr", "frozen")


def test_requests_that_cannot_run_fail_with_the_reason(
    cluster: Cluster, ns: str, operator: subprocess.Popen[bytes]
) -> None:
    assert (
        apply(
            cluster, ns, "nofleet", {"fleet": "nosuch", "prompts": [{"text": "hi"}], "samplesPerPrompt": 2}
        ).returncode
        == 0
    )
    # Prompts are the runner's to read: these name a fleet that exists (no engines, no gateway), so
    # the operator makes their runners, which find the prompts bad.
    empty = fleet_manifest("empty", ns, replicas=0, gateway={"enabled": False})
    cluster.kubectl("apply", "-f", "-", input=json.dumps(empty))
    assert apply(cluster, ns, "nocm", {"fleet": "empty", "promptsFrom": [{"name": "missing"}]}).returncode == 0
    cluster.kubectl("-n", ns, "create", "configmap", "badprompts", '--from-literal=prompts.jsonl={"text": 1}\n')
    assert apply(cluster, ns, "badcm", {"fleet": "empty", "promptsFrom": [{"name": "badprompts"}]}).returncode == 0
    expected = {
        "nofleet": ("FleetNotFound", "RolloutFleet 'nosuch' does not exist"),
        "nocm": ("InvalidPrompts", "ConfigMap 'missing' (spec.promptsFrom) does not exist"),
        "badcm": ("InvalidPrompts", "ConfigMap badprompts/prompts.jsonl line 1: not a prompt"),
    }
    for name, (reason, message) in expected.items():
        status = wait_for(
            lambda n=name: status_in(cluster, ns, n, "Failed", operator), timeout=120, what=f"{name} Failed"
        )
        assert status["reason"] == reason and message in status["message"], status
        failed = [c for c in status["conditions"] if c["type"] == "Failed"]
        assert failed and failed[0]["status"] == "True" and status["completionTime"]
    table = cluster.kubectl("-n", ns, "get", "rr", "nofleet").stdout
    assert "Failed" in table and "0/2" in table


def test_a_runner_that_cannot_start_is_reported_with_its_pods_reason(
    cluster: Cluster, ns: str, core: kubernetes.client.CoreV1Api, tmp_path: Path
) -> None:
    """An operator whose runner image cannot run: the request stays Pending, saying why, with an Event."""
    other = f"{ns}-noimage"
    core.create_namespace({"metadata": {"name": other}})
    try:
        with running_operator(cluster, other, tmp_path / "operator.log", "--runner-image", "rollfleet/nosuch:0") as op:
            empty = fleet_manifest("empty", other, replicas=0, gateway={"enabled": False})
            cluster.kubectl("apply", "-f", "-", input=json.dumps(empty))
            assert apply(cluster, other, "stuck", {"fleet": "empty", "prompts": [{"text": "hi"}]}).returncode == 0
            status = wait_for(
                lambda: status_in(cluster, other, "stuck", "Pending", op), timeout=120, what="stuck Pending"
            )
            assert status["reason"] == "RunnerNotStarted", status
            # The local node agent's and kubelet's words for an image that cannot run.
            assert "the runner pod stuck-runner-" in status["message"], status
            assert any(w in status["message"] for w in ("ImageNotRunnableLocally", "ErrImagePull", "ImagePullBackOff"))
            events = json.loads(
                cluster.kubectl(
                    "-n", other, "get", "events", "--field-selector", "involvedObject.name=stuck", "-o", "json"
                ).stdout
            )["items"]
            assert any(e["reason"] == "RunnerNotStarted" and e["type"] == "Warning" for e in events), events
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_results_store_chunks_survive_a_reload_print_and_go_with_their_request(
    cluster: Cluster, ns: str, core: kubernetes.client.CoreV1Api
) -> None:
    # An owner the operator does not serve (a RolloutRequest named here but with no operator in the loop
    # would be run; so the owner is created in a namespace this module's operator does not watch).
    other = f"{ns}-store"
    core.create_namespace({"metadata": {"name": other}})
    try:
        assert (
            apply(
                cluster, other, "owner", {"fleet": "nosuch", "prompts": [{"text": "p"}] * 40, "samplesPerPrompt": 8}
            ).returncode
            == 0
        )
        uid = get_rr(cluster, other, "owner")["metadata"]["uid"]
        kube = Kube(cluster.api_client())
        store = ResultStore(kube, other, "owner", uid, limit=64 * 1024)
        text = "lorem ipsum " * 150  # ~1.8 KB per line with the token ids: several chunks of 64 KiB
        for p in range(40):
            for s in range(8):
                assert store.add(
                    SampleResult(
                        p,
                        s,
                        f"{uid}-{p}-{s}",
                        "length",
                        text=text,
                        token_ids=list(range(64)),
                        weight_version="v1",
                        weight_versions=["v1"],
                        started_at=1.0,
                        finished_at=2.0,
                    )
                )
            if p % 10 == 9:
                asyncio.run(store.flush())
        assert not store.add(SampleResult(0, 0, f"{uid}-0-0", "stop"))  # one result per sample
        chunks = asyncio.run(list_chunks(kube, other, uid))
        assert len(chunks) >= 3 and all(c.get("immutable") for c in chunks[:-1])
        assert all(len(c["data"]["samples.jsonl"].encode()) <= 64 * 1024 for c in chunks)
        assert CHUNK_LIMIT < 1024 * 1024 - 16 * 1024  # room for the ConfigMap's metadata

        reloaded = ResultStore(kube, other, "owner", uid, limit=64 * 1024)
        assert len(asyncio.run(reloaded.load())) == 320
        reloaded.add(SampleResult(99, 0, f"{uid}-99-0", "stop", text="late"))
        asyncio.run(reloaded.flush())  # appends to the open chunk, or opens the next one
        assert len(asyncio.run(ResultStore(kube, other, "owner", uid).load())) == 321

        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        out = subprocess.run(
            [str(BIN / "rollfleet"), "results", "rr/owner", "-n", other],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.splitlines()
        rows = [json.loads(line) for line in out]
        assert len(rows) == 321 and len({(r["prompt"], r["sample"]) for r in rows}) == 321
        assert rows[0]["prompt"] == 0 and rows[0]["sample"] == 0 and rows[-1]["text"] == "late"
        assert {"text", "token_ids", "finish_reason", "weight_version", "latency_s"} <= set(rows[0])

        cluster.kubectl("-n", other, "delete", "rr", "owner")
        wait_for(
            lambda: not asyncio.run(list_chunks(kube, other, uid)),
            timeout=90,
            what="result ConfigMaps garbage-collected",
        )
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_finished_requests_are_deleted_after_their_ttl(
    cluster: Cluster, ns: str, operator: subprocess.Popen[bytes]
) -> None:
    assert (
        apply(
            cluster, ns, "ttl", {"fleet": "nosuch", "prompts": [{"text": "hi"}], "ttlSecondsAfterFinished": 2}
        ).returncode
        == 0
    )
    wait_for(lambda: status_in(cluster, ns, "ttl", "Failed", operator), timeout=60, what="ttl request Failed")
    finished = time.monotonic()
    wait_for(
        lambda: "NotFound" in cluster.kubectl("-n", ns, "get", "rr", "ttl", check=False).stderr,
        timeout=60,
        what="request deleted after its TTL",
    )
    assert time.monotonic() - finished >= 1.0
