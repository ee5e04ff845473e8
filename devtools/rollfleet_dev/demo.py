"""`rollfleet demo` (`make demo`): the whole product on one machine, step by step.

Brings up the local cluster, deploys the operator from `manifests/`, applies the
2-engine CPU fleet of `manifests/samples/` (the tiny model, which `cluster up` puts on the
nodes), and walks through what the README shows with the same sample files: rollouts,
abort by annotation, pause keep and resume, scale, a weight push and the results. Every
step prints the kubectl command it runs and what it showed, with timings. It leaves the
cluster up. Talks to: the local cluster (kubectl, HTTP to the gateway and engines by their
loopback addresses).
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rollfleet import jsonl
from rollfleet.api.request import TERMINAL_PHASES
from rollfleet.contract import (
    ANNOTATION_ABORT,
    ANNOTATION_PAUSE,
    STATE_PATH,
    engine_discovery_selector,
    engine_url,
    gateway_name,
    inference_secret_name,
    secret_token,
)
from rollfleet.errors import RollfleetError
from rollfleet.kubectl import Kubectl, KubectlError
from rollfleet_dev import oneshot
from rollfleet_dev.engine_metrics import engine_metric
from rollfleet_engine.tiny_model import NODE_MODEL_DIR, WEIGHTS_B_DIR

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
NS = "rollfleet-demo"
FLEET = "tiny"
T = TypeVar("T")


class DemoFailed(RollfleetError, RuntimeError):
    """A step did not show what it should; the message says what was seen."""


class Walkthrough:
    """Numbered steps with timings; each prints the commands it runs and their output."""

    def __init__(self, kubectl: Kubectl, total: int) -> None:
        self.k = kubectl
        self.total = total
        self.n = 0

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.n += 1
        t0 = time.monotonic()
        print(f"\n\033[1m[{self.n}/{self.total}] {title}\033[0m", flush=True)
        yield
        print(f"    done in {time.monotonic() - t0:.1f}s", flush=True)

    def say(self, text: str) -> None:
        print(f"    {text}", flush=True)

    def sh(self, *args: str, input: str | None = None, show: bool = True) -> str:
        """Run `kubectl args` the way a person would, printing the command and its output."""
        # Paths as the README writes them (relative to the repository root).
        print(f"    $ kubectl {' '.join(a.removeprefix(f'{REPO}/') for a in args)}", flush=True)
        out = self.k.run(*args, input=input, timeout=300).stdout
        if show:
            for line in out.rstrip().splitlines():
                print(f"      {line}")
        return out

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float, every: float = 1.0) -> T:
        """Poll until `probe` returns something truthy, printing how long it has waited."""
        t0 = time.monotonic()
        while True:
            result = probe()
            if result:
                back = "\r" if sys.stdout.isatty() else ""
                print(f"{back}    ✓ {what} ({time.monotonic() - t0:.0f}s)   ", flush=True)
                return result
            waited = time.monotonic() - t0
            if waited > timeout:
                raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")
            if sys.stdout.isatty():
                print(f"\r    … waiting for {what} ({waited:.0f}s)", end="", flush=True)
            elif int(waited) // 15 != int(waited - every) // 15:  # a log file: a line every 15 s
                print(f"    … waiting for {what} ({waited:.0f}s)", flush=True)
            time.sleep(every)

    def get(self, *args: str) -> Any:
        return self.k.json("-n", NS, "get", *args)


def _gateway_url(w: Walkthrough) -> str:
    svc = w.get("service", gateway_name(FLEET))
    return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"


def _inference_auth(w: Walkthrough) -> dict[str, str]:
    """The header generation needs: the fleet's inference token (its Secret, as a client mounts it)."""
    token = secret_token(w.get("secret", inference_secret_name(FLEET)).get("data"))
    if token is None:
        raise DemoFailed(f"the Secret {inference_secret_name(FLEET)} holds no token")
    return {"Authorization": f"Bearer {token}"}


def _engine_urls(w: Walkthrough) -> dict[str, str]:
    pods = w.get("pods", "-l", engine_discovery_selector(FLEET))["items"]
    return {p["metadata"]["name"]: engine_url(p["status"]["podIP"]) for p in pods if p["status"].get("podIP")}


def _engines_running(w: Walkthrough) -> dict[str, int]:
    """Requests each engine itself says are running or waiting (its own view, not the operator's)."""
    out = {}
    for name, url in _engine_urls(w).items():
        state = oneshot.get(url + STATE_PATH, timeout=5).json()
        out[name] = int(state["running"]) + int(state["waiting"])
    return out


class _Stream:
    """A streaming completion through the gateway: how it ended and how many tokens it reported."""

    def __init__(self, url: str, max_tokens: int, auth: dict[str, str]) -> None:
        self.completion_tokens: int | None = None  # the final usage report
        self.auth = auth
        self.finish_reason: str | None = None
        self.error: str | None = None
        body = {
            "model": "tiny",
            "prompt": "def main():",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with oneshot.stream(
                "POST",
                url + "/v1/completions",
                json=body,
                timeout=600,
                headers={"X-Request-Id": f"demo-stream-{time.time_ns()}", **self.auth},
            ) as r:
                for line in jsonl.iter_lines(r.iter_bytes()):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        self.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except httpx.HTTPError as e:
            self.error = str(e)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _results(k: Kubectl, name: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "results", f"rr/{name}", "-n", NS, "--kubeconfig", str(k.kubeconfig)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in jsonl.lines(out)]


def _push_weights(w: Walkthrough) -> None:
    from rollfleet_dev.localcluster.nodeagent.logs import find_log, nodes_state_dir

    w.sh("-n", NS, "apply", "-f", str(SAMPLES / "demo-trainer.yaml"))

    def trainer_exit() -> dict[str, Any] | None:
        for c in w.get("pod", "demo-trainer").get("status", {}).get("containerStatuses", []):
            if c["name"] == "trainer" and "terminated" in c.get("state", {}):
                return dict(c["state"]["terminated"])
        return None

    ended = w.wait("the trainer's push to finish", trainer_exit, timeout=600)
    log = find_log(nodes_state_dir() / "pods", NS, "demo-trainer", "trainer", previous=False)
    w.say("trainer log:")
    for line in log.read_text().splitlines()[-6:]:
        w.say("  " + line[:200])
    if ended.get("exitCode") != 0:
        raise DemoFailed("the trainer's push failed (see its log above)")
    w.wait(
        "every engine serving weights step-1",
        lambda: (st := w.get("rf", FLEET)["status"]).get("weightVersion") == "step-1" and st.get("readyReplicas") == 2,
        timeout=120,
    )


def _engines_generated(w: Walkthrough) -> float:
    """Tokens the fleet's engines have produced, by their own counter (vllm:generation_tokens_total)."""
    return sum(engine_metric(url, "vllm:generation_tokens_total") for url in _engine_urls(w).values())


def _step_nodes(w: Walkthrough) -> None:
    with w.step("the nodes: GPU node pools, run by the node agent"):
        w.sh("get", "nodes", "-L", "rollfleet.dev/pool", "-L", "nvidia.com/gpu.product")


def _step_model(w: Walkthrough) -> None:
    from rollfleet_dev.localcluster import controlplane

    with w.step("the tiny model on the nodes (random weights, local tokenizer; a second weight set for the push)"):
        model_dir = controlplane.ensure_node_model()  # `up` built it; this says where it is
        w.say(f"nodes' {NODE_MODEL_DIR} is {model_dir} here  (weights B: {WEIGHTS_B_DIR}/)")


def _step_operator(w: Walkthrough) -> None:
    with w.step("deploy the operator from manifests/ (CRDs, RBAC, Deployment)"):
        w.sh("apply", "-k", str(REPO / "manifests" / "overlays" / "local"), show=False)
        w.sh("-n", "rollfleet-system", "rollout", "status", "deploy/rollfleet-operator", "--timeout=300s")
        w.sh("get", "crd", "rolloutfleets.rollfleet.dev", "rolloutrequests.rollfleet.dev")


def _step_fleet(w: Walkthrough) -> None:
    with w.step("apply a 2-engine fleet and watch it become Ready (vLLM on CPU: about a minute)"):
        # A fresh namespace, so a second run walks through the same steps (builds stay cached).
        w.k.run("delete", "namespace", NS, "--ignore-not-found", "--wait=true", "--timeout=180s")
        w.k.run("create", "namespace", NS)
        w.sh("-n", NS, "apply", "-f", str(SAMPLES / "tiny-fleet.yaml"))
        w.wait(
            "2/2 engines and the gateway",
            lambda: (
                (s := w.get("rf", FLEET).get("status", {})).get("readyReplicas") == 2
                and (s.get("gateway") or {}).get("readyReplicas", 0) >= 1
            ),
            timeout=900,
        )
        w.sh("-n", NS, "get", "rf")
        w.sh("-n", NS, "get", "pods", "-o", "wide")


def _step_batch(w: Walkthrough) -> None:
    with w.step("rollouts as a RolloutRequest: 16 prompts x 4 samples (a GRPO-style batch)"):
        w.sh("-n", NS, "apply", "-f", str(SAMPLES / "batch-request.yaml"))
        done = w.wait(
            "batch-1 to finish",
            lambda: (s := w.get("rr", "batch-1").get("status", {})).get("phase") in TERMINAL_PHASES and s,
            timeout=600,
        )
        if done["phase"] != "Succeeded":
            raise DemoFailed(f"batch-1 ended {done['phase']}: {json.dumps(done)[:2000]}")
        w.sh("-n", NS, "get", "rr")
        lines = _results(w.k, "batch-1")
        w.say(f"$ rollfleet results rr/batch-1 -n {NS}   → {len(lines)} samples; the first:")
        w.say("  " + json.dumps(lines[0])[:300])


def _step_abort(w: Walkthrough) -> None:
    with w.step("abort by annotation: every in-flight sample stops on the engines"):
        w.sh("-n", NS, "apply", "-f", str(SAMPLES / "long-request.yaml"))
        w.wait("samples running on the engines", lambda: sum(_engines_running(w).values()) > 0, timeout=300)
        w.say(f"engines report running requests: {_engines_running(w)}")
        w.sh("-n", NS, "annotate", "rr/long", f"{ANNOTATION_ABORT}=demo-1")
        st = w.wait(
            "phase Aborted",
            lambda: (s := w.get("rr", "long").get("status", {})).get("phase") == "Aborted" and s,
            timeout=60,
        )
        running = w.wait(
            "engines to show nothing running",
            lambda: (r := _engines_running(w)) and sum(r.values()) == 0 and r,
            timeout=30,
        )
        w.say(f"status.abort: {json.dumps(st.get('abort'))}")
        w.say(f"engines report running requests: {running}")


def _step_pause(w: Walkthrough) -> None:
    # Judged at the engines: their core runs ahead of what a client has received, so tokens a
    # client sees during a pause may have been made before it. The stream is long enough that
    # the engine still runs it when the pause lands.
    tokens = 4000
    with w.step("pause keep during a stream: the engines hold it and make no token; every token after resume"):
        stream = _Stream(_gateway_url(w), max_tokens=tokens, auth=_inference_auth(w))
        w.wait("the stream to run on an engine", lambda: sum(_engines_running(w).values()) > 0, timeout=120)
        w.sh("-n", NS, "annotate", "rf", FLEET, f"{ANNOTATION_PAUSE}=keep")
        w.wait(
            "every engine paused",
            lambda: (w.get("rf", FLEET)["status"].get("pause") or {}).get("pausedEngines") == 2,
            timeout=60,
        )
        w.sh("-n", NS, "get", "rf")
        counts = [_engines_generated(w)]

        def count_stands() -> bool:
            counts.append(_engines_generated(w))
            return counts[-1] == counts[-2]

        # Outputs made just before the pause may still be counting: wait until the count stands.
        w.wait("the engines' token count to stand", count_stands, timeout=30)
        time.sleep(2)  # the observation window itself: the count may not move while paused
        during = _engines_generated(w) - counts[-1]
        held = _engines_running(w)
        w.say(f"tokens the engines made during 2 s of pause: {during:.0f}; requests they hold: {held}")
        w.sh("-n", NS, "annotate", "rf", FLEET, f"{ANNOTATION_PAUSE}-")
        stream.join(300)
        total = stream.completion_tokens
        w.say(f"after resume the stream finished: {total} tokens, finish_reason={stream.finish_reason}")
        if during != 0 or sum(held.values()) == 0 or total != tokens or stream.error:
            raise DemoFailed(
                f"pause keep: {during:.0f} tokens made while paused, requests held {held}, "
                f"{total}/{tokens} in all, {stream.error}"
            )


def _step_scale(w: Walkthrough) -> None:
    with w.step("kubectl scale: 2 → 3 → 2 (scale-down drains the engine first)"):

        def converged(n: int) -> bool:
            st = w.get("rf", FLEET)["status"]
            return bool(st.get("readyReplicas") == n and st.get("replicas") == n)

        for n in (3, 2):
            w.sh("-n", NS, "scale", f"rf/{FLEET}", f"--replicas={n}")
            w.wait(f"{n}/{n} ready", functools.partial(converged, n), timeout=600)
            w.sh("-n", NS, "get", "rf")


def _step_push(w: Walkthrough) -> None:
    with w.step("push weights B from a trainer pod through the sync sidecar"):
        _push_weights(w)
        w.sh("-n", NS, "get", "rf")


def _step_top(w: Walkthrough) -> None:
    with w.step("rollfleet top: the fleet live (engines, phase, weights, running requests, tokens/s, pause)"):
        # Long enough to still decode through `top`'s start and its two scrapes.
        streams = [_Stream(_gateway_url(w), max_tokens=3000, auth=_inference_auth(w)) for _ in range(4)]
        w.wait("the streams to run on the engines", lambda: sum(_engines_running(w).values()) >= 2, timeout=120)
        argv = ["top", FLEET, "-n", NS, "--once", "--interval", "3"]
        print(f"    $ rollfleet {' '.join(argv)}", flush=True)
        out = subprocess.run(
            [sys.executable, "-m", "rollfleet.cli", *argv, "--kubeconfig", str(w.k.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        for line in out.rstrip().splitlines():
            print(f"      {line}")
        for s in streams:
            s.join(300)
        rates = [row.split()[4] for row in out.splitlines()[2:] if row.strip()]
        if not any(r != "-" and float(r) > 0 for r in rates):
            raise DemoFailed(f"rollfleet top showed no engine making tokens while 4 streams ran:\n{out}")


STEPS: list[Callable[[Walkthrough], None]] = [
    _step_nodes,
    _step_model,
    _step_operator,
    _step_fleet,
    _step_batch,
    _step_abort,
    _step_pause,
    _step_scale,
    _step_push,
    _step_top,
]


def run() -> None:
    from rollfleet_dev.localcluster import controlplane

    t_all = time.monotonic()
    print("\033[1m[0] the local cluster (built once, then seconds)\033[0m", flush=True)
    layout = controlplane.up()
    w = Walkthrough(Kubectl(layout.kubeconfig), total=len(STEPS))
    for step in STEPS:
        step(w)
    print(
        f"\n\033[1mDemo finished in {time.monotonic() - t_all:.0f}s.\033[0m The cluster is still up:\n"
        f"    export KUBECONFIG={layout.kubeconfig}\n    export PATH={REPO}/.venv/bin:$PATH\n"
        f"    kubectl -n {NS} get rf,rr,pods\n"
        f"    rollfleet results rr/batch-1 -n {NS} | head\n"
        "Stop it with: make down"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        run()
    except (DemoFailed, KubectlError) as e:
        print(f"\ndemo failed: {e}", file=sys.stderr)
        return 1
    return 0
