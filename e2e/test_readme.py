"""The README's kubectl commands, run as written, in README order, each checked for what it says it does.

Issue 8's acceptance: every kubectl command in the README is exercised by a test. The
commands are read from the README's ```bash blocks at collection time, so a command added
there later runs here without a change to this file. What runs: every `kubectl` line
(pipelines included), `rollfleet results`, and `export` lines (checked for what they set);
`make` and `rollfleet cluster ...` lines are the machine's own lifecycle, covered by
`make demo` and the cluster lifecycle tests, and this module runs on the cluster they
start. Each command runs via bash from the repository root with KUBECONFIG and PATH set
as the walkthrough sets them, and must exit 0. A check keyed by the command's pattern
then waits (never sleeps) for the documented effect, looking at the engines themselves
where the README says "checked at the engines". Commands of the GPU-install section run
with `--dry-run=server`: this cluster's GPUs are pretend ones, and the API server still
validates those manifests against its schemas.

The README deploys the operator cluster-wide (`kubectl apply -k manifests/overlays/local`)
where other modules scope the shared one to their namespaces, so this module runs after
every other module (marker `cluster_wide`, see conftest.py). Local cluster only: the
walkthrough is `make demo`'s (the local overlay's images, the nodes' model directory).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.fleet_helpers import ENGINE_START_S, REPO, Fleet, deploy_operator
from e2e.provider import Cluster, wait_for
from rollfleet.controller.requests.plan import SampleResult
from rollfleet_dev import oneshot
from rollfleet_engine.protocol import REQUESTS_PATH, STATE_PATH, RequestsView

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.engine,
    pytest.mark.cluster_wide,
]

README = REPO / "README.md"
GPU_SECTION = "Install on a GPU cluster"
# A command itself (rollout status, a dry run) may take minutes on a busy 2-core machine.
COMMAND_S = 600.0
REQUEST_S = 600.0
# The binaries of the environment running this test: the README's `.venv/bin`.
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Command:
    """One command line of a README ```bash block, and the `## ` section it is in."""

    section: str
    text: str

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def runs_here(self) -> bool:
        """kubectl (any path to it), `rollfleet results` and `export` lines run; the rest is lifecycle."""
        words = self.words
        program = Path(words[0]).name
        return program in ("kubectl", "export") or (program == "rollfleet" and words[1:2] == ["results"])

    @property
    def as_run(self) -> str:
        """The bash line to run: as written, or as a server-side dry run in the GPU-install section."""
        if self.section != GPU_SECTION:
            return self.text
        words = self.words
        assert not {"|", "||", "&&", ";"} & set(words), f"a GPU-install command must be one kubectl call: {self.text}"
        return shlex.join([*words, "--dry-run=server"])

    def namespace(self) -> str:
        words = self.words
        for i, w in enumerate(words):
            if w in ("-n", "--namespace") and i + 1 < len(words):
                return words[i + 1]
            if w.startswith("--namespace="):
                return w.split("=", 1)[1]
        return "default"


def readme_commands(markdown: str) -> list[Command]:
    """Every command of the README's bash blocks in order (comments and blank lines dropped,
    backslash continuations joined)."""
    commands: list[Command] = []
    section, in_block, pending = "", False, ""
    for line in markdown.splitlines():
        if not in_block:
            if line.startswith("## "):
                section = line[3:].strip()
            in_block = line.strip() in ("```bash", "```sh", "```shell")
            continue
        if line.startswith("```"):
            in_block = False
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending and not pending.startswith("#"):
            commands.append(Command(section, pending))
        pending = ""
    return commands


COMMANDS = [c for c in readme_commands(README.read_text()) if c.runs_here]

# The walkthrough is written for the local cluster (`make demo`). On kind the same steps run
# with kind's kubeconfig and overlay, as the README says; every edit must find its text.
KIND_EDITS = {
    "rollfleet cluster kubeconfig": "rollfleet kind kubeconfig",
    "manifests/overlays/local": "manifests/overlays/kind",
}


def on_provider(cmd: Command, provider: str) -> Command:
    """The command as it runs on `provider`'s cluster."""
    if provider == "local":
        return cmd
    text = cmd.text
    for local, kind in KIND_EDITS.items():
        text = text.replace(local, kind)
    return replace(cmd, text=text)


def _readme_namespace() -> str:
    created = [m.group(1) for c in COMMANDS if (m := re.search(r"\bcreate namespace (\S+)", c.text))]
    assert len(created) == 1, f"the walkthrough should create one namespace, found {created}"
    return created[0]


NS = _readme_namespace()


@dataclass
class Walk:
    """State shared by the module's steps, in README order."""

    cluster: Cluster
    failed: str | None = None  # the first command that failed: later ones would only time out
    # RolloutRequests that a later README command aborts: they are checked running, not finished.
    aborted_later: set[str] = field(
        default_factory=lambda: {
            m.group(1) for c in COMMANDS if (m := re.search(r"\bannotate rr[/ ](\S+) rollfleet\.dev/abort=", c.text))
        }
    )

    def fleet(self, name: str, namespace: str) -> Fleet:
        return Fleet(self.cluster, name, namespace)

    def get(self, namespace: str, *what: str) -> dict[str, Any]:
        return dict(json.loads(self.cluster.kubectl("-n", namespace, "get", *what, "-o", "json").stdout))

    def engine_get(self, fleet: Fleet, pod: str, path: str) -> Any:
        with self.cluster.reach(fleet.namespace, pod, 8000) as url:
            return oneshot.get(url + path, timeout=10).json()

    def request_in(self, namespace: str, name: str, phases: tuple[str, ...], timeout: float) -> dict[str, Any]:
        """Wait until the RolloutRequest's phase is one of `phases`; its status then."""

        def reached() -> dict[str, Any] | None:
            st = dict(self.get(namespace, "rr", name).get("status") or {})
            return st if st.get("phase") in phases else None

        st = wait_for(reached, timeout=timeout, interval=0.5, what=f"rr/{name} in {'|'.join(phases)}")
        assert st is not None
        return st

    def engines(self, fleet: Fleet) -> list[str]:
        return [p["metadata"]["name"] for p in fleet.pods() if not p["metadata"].get("deletionTimestamp")]


def run(text: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", text], cwd=REPO, env=env, capture_output=True, text=True, timeout=COMMAND_S)


def readme_env(cluster: Cluster) -> dict[str, str]:
    """What the walkthrough's first line sets: the cluster's kubeconfig, the project's binaries first."""
    return {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}


def table(out: str) -> list[dict[str, str]]:
    """kubectl's default table output as rows keyed by column header. Cells are cut at the
    headers' offsets: empty cells (a fleet that is not paused) leave only spaces."""
    header, *rows = out.rstrip().splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    return [
        {name: row[start:end].strip() for name, start, end in zip(names, starts, [*starts[1:], None], strict=True)}
        for row in rows
    ]


# Checks: a check runs before its command (to note what the command should change) and
# returns what verifies the command's effect afterwards, given the finished command.
After = Callable[[subprocess.CompletedProcess[str]], None]
Check = Callable[[Walk, Command, "re.Match[str]"], After]


def check_export(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """Run the line itself with KUBECONFIG unset: it must name this cluster's kubeconfig (and
    put the project's binaries first on PATH when it sets PATH)."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    probe = run(cmd.text + '\nprintf "%s\\n%s\\n" "$KUBECONFIG" "$(command -v kubectl)"', env)

    def after(_: subprocess.CompletedProcess[str]) -> None:
        assert probe.returncode == 0, probe.stderr
        kubeconfig, kubectl = probe.stdout.splitlines()
        assert Path(kubeconfig) == walk.cluster.kubeconfig
        if "PATH=" in cmd.text:
            assert Path(kubectl).resolve() == (REPO / ".venv" / "bin" / "kubectl").resolve()

    return after


def check_dry_run(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """A server-side dry run: the API server validated (and admitted) every object, persisting none."""

    def after(proc: subprocess.CompletedProcess[str]) -> None:
        lines = proc.stdout.strip().splitlines()
        assert lines and all(line.endswith("(server dry run)") for line in lines), proc.stdout

    return after


def check_namespace(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    def after(_: subprocess.CompletedProcess[str]) -> None:
        wait_for(
            lambda: walk.get("default", "namespace", m.group(1)).get("status", {}).get("phase") == "Active",
            timeout=60,
            what=f"namespace {m.group(1)} Active",
        )

    return after


def check_applied_file(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """What the applied manifests say they do: fleets become Ready, requests run or finish,
    a trainer pod's push moves the fleet's weight version."""
    namespace = cmd.namespace()
    docs = [d for d in yaml.safe_load_all((REPO / m.group(1)).read_text()) if d]
    trainer_fleets = {
        d["metadata"]["labels"]["rollfleet.dev/fleet"]
        for d in docs
        if d["kind"] == "Pod" and d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "trainer"
    }
    versions_before = {f: walk.fleet(f, namespace).status().get("weightVersion") for f in trainer_fleets}

    def after(_: subprocess.CompletedProcess[str]) -> None:
        for doc in docs:
            name = doc["metadata"]["name"]
            if doc["kind"] == "RolloutFleet":
                walk.fleet(name, namespace).wait_ready(int(doc["spec"].get("replicas", 1)))
            elif doc["kind"] == "RolloutRequest" and name in walk.aborted_later:
                wait_request_on_engines(walk, namespace, name)
            elif doc["kind"] == "RolloutRequest":
                wait_request_succeeded(walk, namespace, name)
            elif doc["kind"] == "Pod" and doc["metadata"]["labels"]["rollfleet.dev/fleet"] in trainer_fleets:
                fleet = doc["metadata"]["labels"]["rollfleet.dev/fleet"]
                wait_trainer_push(walk, namespace, name, walk.fleet(fleet, namespace), versions_before[fleet])

    return after


def wait_request_succeeded(walk: Walk, namespace: str, name: str) -> None:
    st = walk.request_in(namespace, name, ("Succeeded", "Failed", "Aborted"), timeout=REQUEST_S)
    total = st["counts"]["total"]
    assert st["phase"] == "Succeeded", st
    assert total > 0 and st["progress"] == f"{total}/{total}" and st["counts"]["completed"] == total, st
    assert st["results"]["samples"] == total and st["tokens"] > 0, st


def _request_ids(walk: Walk, fleet: Fleet, prefix: str) -> tuple[list[str], dict[str, str | None]]:
    """The engines' own view of a RolloutRequest's samples (ids `<rr-uid>-<prompt>-<sample>`):
    the ids in flight and the finished ones with their finish reason."""
    in_flight: list[str] = []
    finished: dict[str, str | None] = {}
    for pod in walk.engines(fleet):
        view = RequestsView.model_validate(walk.engine_get(fleet, pod, REQUESTS_PATH))
        in_flight += [r.request_id for r in view.in_flight if r.request_id.startswith(prefix)]
        finished |= {r.request_id: r.finish_reason for r in view.recently_finished if r.request_id.startswith(prefix)}
    return in_flight, finished


def wait_request_on_engines(walk: Walk, namespace: str, name: str) -> None:
    rr = walk.get(namespace, "rr", name)
    fleet = walk.fleet(rr["spec"]["fleet"], namespace)
    wait_for(
        lambda: _request_ids(walk, fleet, rr["metadata"]["uid"] + "-")[0],
        timeout=REQUEST_S,
        interval=0.5,
        what=f"rr/{name}'s samples running on the engines",
    )


def wait_trainer_push(walk: Walk, namespace: str, pod: str, fleet: Fleet, before: str | None) -> None:
    def trainer_ended() -> dict[str, Any] | None:
        for c in walk.get(namespace, "pod", pod).get("status", {}).get("containerStatuses", []):
            if c["name"] == "trainer" and "terminated" in c.get("state", {}):
                return dict(c["state"]["terminated"])
        return None

    ended = wait_for(trainer_ended, timeout=REQUEST_S, interval=1, what=f"{pod}'s trainer to exit")
    if ended is None or ended.get("exitCode") != 0:
        logs = {c: walk.cluster.container_log(namespace, pod, c)[-3000:] for c in ("trainer", "rollfleet-sync")}
        raise AssertionError(f"the trainer failed ({ended}):\n" + "\n".join(f"--- {c}:\n{t}" for c, t in logs.items()))
    spec_replicas = int(fleet.get()["spec"]["replicas"])
    st = fleet.wait(
        lambda s: s.get("weightVersion") not in (None, before) and s.get("readyReplicas") == spec_replicas,
        f"weightVersion past {before!r} on {spec_replicas} ready engines",
        timeout=REQUEST_S,
    )
    for pod_name in walk.engines(fleet):  # each engine serves the pushed weights, by its own word
        assert walk.engine_get(fleet, pod_name, STATE_PATH)["weight_version"] == st["weightVersion"], pod_name


def check_get_rf(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """The columns the README names, and every fleet's READY at its DESIRED count."""

    def after(proc: subprocess.CompletedProcess[str]) -> None:
        rows = table(proc.stdout)
        assert rows, "no fleet listed"
        assert {"NAME", "READY", "DESIRED", "PAUSED", "WEIGHTS", "AGE"} <= set(rows[0]), proc.stdout
        for row in rows:
            assert row["READY"] == f"{row['DESIRED']}/{row['DESIRED']}", proc.stdout

    return after


def check_get_rr(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """Each request's phase and progress as its status has them; finished ones complete."""

    def after(proc: subprocess.CompletedProcess[str]) -> None:
        rows = table(proc.stdout)
        assert rows, "no request listed"
        for row in rows:
            st = walk.get(cmd.namespace(), "rr", row["NAME"])["status"]
            if row["PHASE"] in ("Succeeded", "Aborted", "Failed"):  # settled: the table must match the status
                assert (row["PHASE"], row["PROGRESS"]) == (st["phase"], st["progress"]), proc.stdout
            if row["PHASE"] == "Succeeded":
                done, total = row["PROGRESS"].split("/")
                assert done == total != "0", proc.stdout

    return after


def check_results(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """JSONL of stored samples: text, token ids, a finish reason and the weight version, with the
    request's sample ids; `| head` shows the first ten."""
    name, namespace = m.group(1), cmd.namespace()

    def after(proc: subprocess.CompletedProcess[str]) -> None:
        rr = walk.get(namespace, "rr", name)
        samples = [SampleResult.from_line(line) for line in proc.stdout.splitlines() if line.strip()]
        stored = rr["status"]["results"]["samples"]
        assert len(samples) == (min(10, stored) if cmd.words[-2:] == ["|", "head"] else stored), proc.stdout
        for s in samples:
            assert s.request_id.startswith(rr["metadata"]["uid"] + "-"), s
            assert s.finish_reason in ("stop", "length") and s.token_ids and s.weight_version, s

    return after


def check_abort(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """The request ends Aborted with the token recorded, and the engines say so: none of its
    samples is still in flight there, and those they ran ended with finish_reason abort."""
    name, token, namespace = m.group(1), m.group(2), cmd.namespace()

    def after(_: subprocess.CompletedProcess[str]) -> None:
        st = walk.request_in(namespace, name, ("Aborted",), timeout=120)
        assert st["abort"]["token"] == token and st["abort"]["stopped"] >= 1, st["abort"]
        rr = walk.get(namespace, "rr", name)
        fleet = walk.fleet(rr["spec"]["fleet"], namespace)
        prefix = rr["metadata"]["uid"] + "-"
        wait_for(
            lambda: not _request_ids(walk, fleet, prefix)[0],
            timeout=60,
            what=f"no sample of rr/{name} in flight on the engines",
        )
        finished = _request_ids(walk, fleet, prefix)[1]
        assert "abort" in finished.values(), finished

    return after


def check_pause(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """The fleet status records the pause on every engine, and each engine reports it paused."""
    name, mode, namespace = m.group(1), m.group(2), cmd.namespace()

    def after(_: subprocess.CompletedProcess[str]) -> None:
        fleet = walk.fleet(name, namespace)
        replicas = int(fleet.get()["spec"]["replicas"])
        fleet.wait(
            lambda s: (s.get("pause") or {}).get("mode") == mode and s["pause"].get("pausedEngines") == replicas,
            f"pause {mode} on {replicas} engines",
            timeout=120,
        )
        for pod in walk.engines(fleet):
            state = walk.engine_get(fleet, pod, STATE_PATH)
            assert state["paused"] and state["pause_mode"] == mode, (pod, state)

    return after


def check_resume(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    """No pause left in the fleet status, every engine serving and none paused by its own word."""
    name, namespace = m.group(1), cmd.namespace()

    def after(_: subprocess.CompletedProcess[str]) -> None:
        fleet = walk.fleet(name, namespace)
        replicas = int(fleet.get()["spec"]["replicas"])
        fleet.wait(lambda s: not s.get("pause") and s.get("readyReplicas") == replicas, "resumed", timeout=120)
        for pod in walk.engines(fleet):
            assert not walk.engine_get(fleet, pod, STATE_PATH)["paused"], pod

    return after


def check_scale(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    def after(_: subprocess.CompletedProcess[str]) -> None:
        fleet = walk.fleet(m.group(1), cmd.namespace())
        fleet.wait_ready(int(m.group(2)), timeout=ENGINE_START_S)
        assert len(walk.engines(fleet)) == int(m.group(2))

    return after


def check_get_nodes(walk: Walk, cmd: Command, m: re.Match[str]) -> After:
    def after(proc: subprocess.CompletedProcess[str]) -> None:
        rows = table(proc.stdout)
        assert rows and all(r["STATUS"] == "Ready" for r in rows), proc.stdout

    return after


# First match wins; a command that matches none must still exit 0. The dry-run check comes
# first: a dry-run apply of a file must not wait for what a real apply would do.
CHECKS: list[tuple[str, Check]] = [
    (r"^export\b", check_export),
    (r"--dry-run=server", check_dry_run),
    (r"\bcreate namespace (\S+)", check_namespace),
    (r"\bapply -f (?!-)(\S+\.ya?ml)\b", check_applied_file),
    (r"\bget (?:rf|rolloutfleets?)\b", check_get_rf),
    (r"\bget (?:rr|rolloutrequests?)\b", check_get_rr),
    (r"^rollfleet results rr/(\S+)", check_results),
    (r"\bannotate rr[/ ](\S+) rollfleet\.dev/abort=(\S+)", check_abort),
    (r"\bannotate rf[/ ](\S+) rollfleet\.dev/pause=(\w+)", check_pause),
    (r"\bannotate rf[/ ](\S+) rollfleet\.dev/pause-", check_resume),
    (r"\bscale rf[/ ](\S+) --replicas=(\d+)", check_scale),
    (r"\bget nodes\b", check_get_nodes),
]


def check_for(cmd: Command) -> tuple[Check, re.Match[str]] | None:
    for pattern, check in CHECKS:
        if m := re.search(pattern, cmd.as_run):
            return check, m
    return None


@pytest.fixture(scope="module")
def walk(cluster: Cluster) -> Iterator[Walk]:
    """A clean start (a demo may have run on this cluster), and the README's namespace deleted after."""
    t0 = time.monotonic()
    if cluster.kubectl("get", "namespace", NS, check=False).returncode == 0:
        # Requests an older operator made carry kopf's finalizer, which an operator serving the
        # namespace removes (other modules may have scoped it elsewhere).
        deploy_operator(cluster, [NS])
        cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", timeout=320)
    yield Walk(cluster)
    cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", check=False, timeout=320)
    print(f"\nREADME walkthrough: {time.monotonic() - t0:.0f}s")


def test_readme_commands_are_found() -> None:
    """The walkthrough and the GPU-install block are both read (a renamed heading would drop one)."""
    sections = {c.section for c in COMMANDS}
    assert {"Walkthrough: what `make demo` does, as kubectl", GPU_SECTION} <= sections, sections
    assert any(c.as_run.endswith("--dry-run=server") for c in COMMANDS)
    walkthrough = "\n".join(c.text for c in COMMANDS if c.section != GPU_SECTION)
    assert all(local in walkthrough for local in KIND_EDITS), "a kind edit no longer applies to the README"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{i:02d} {c.text[:70]}" for i, c in enumerate(COMMANDS)])
def test_readme_command(walk: Walk, cmd: Command) -> None:
    cmd = on_provider(cmd, walk.cluster.provider)
    if walk.failed:
        pytest.skip(f"an earlier README command failed: {walk.failed}")
    walk.failed = cmd.text  # until this one is shown to work
    found = check_for(cmd)
    after = found[0](walk, cmd, found[1]) if found else None
    proc = run(cmd.as_run, readme_env(walk.cluster))
    assert proc.returncode == 0, f"`{cmd.as_run}` exited {proc.returncode}:\n{proc.stderr}\n{proc.stdout}"
    if after:
        after(proc)
    walk.failed = None
