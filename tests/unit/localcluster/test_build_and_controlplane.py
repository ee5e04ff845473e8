"""Pure parts of the control-plane build and start-up: go.mod generation, component flags."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollfleet_dev.localcluster import build, controlplane
from rollfleet_dev.localcluster.nodeagent.processes import start_ticks

UPSTREAM_GOMOD = """module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
\tgithub.com/foo/bar v1.2.3
\tk8s.io/api v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/streaming => ./staging/src/k8s.io/streaming
)
"""


def test_staging_modules_map_to_published_v0_twins() -> None:
    assert build.staging_replaces(UPSTREAM_GOMOD, "v1.37.1") == {
        "k8s.io/api": "v0.37.1",
        "k8s.io/client-go": "v0.37.1",
        "k8s.io/streaming": "v0.37.1",
    }


def test_generated_gomod_requires_release_and_keeps_its_go_lines() -> None:
    text = build.kubernetes_gomod("v1.37.1", UPSTREAM_GOMOD)
    assert "require k8s.io/kubernetes v1.37.1" in text
    assert "go 1.26.0" in text and "godebug default=go1.26" in text
    assert "\tk8s.io/client-go => k8s.io/client-go v0.37.1" in text
    assert "github.com/foo/bar" not in text  # MVS brings the release's own requirements


@pytest.mark.parametrize("bad", ["1.37.1", "v2.0.0", "v1.37"])
def test_unexpected_versions_are_refused_with_a_message(bad: str) -> None:
    with pytest.raises(build.BuildError, match=r"want v1\.N\.M"):
        build.staging_replaces(UPSTREAM_GOMOD, bad)


def test_gomod_without_staging_replaces_is_an_error() -> None:
    with pytest.raises(build.BuildError, match="no staging replaces"):
        build.staging_replaces("module x\n", "v1.37.1")


def test_component_flags_enable_tls_rbac_and_serviceaccounts(tmp_path: Path) -> None:
    layout = controlplane.Layout(tmp_path)
    bins = build.Binaries(*(tmp_path / n for n in ("etcd", "apiserver", "scheduler", "cm")))
    args = controlplane.component_args(layout, bins, tmp_path / "pools.yaml")
    api = args["kube-apiserver"]
    assert "--authorization-mode=RBAC" in api and "--anonymous-auth=false" in api
    assert any(a.startswith("--tls-cert-file=") for a in api)
    assert any("ServiceAccount" in a for a in api if a.startswith("--enable-admission-plugins="))
    assert f"--service-cluster-ip-range={controlplane.SERVICE_CIDR}" in api
    cm = args["kube-controller-manager"]
    assert "--use-service-account-credentials=true" in cm
    assert any(a.startswith("--service-account-private-key-file=") for a in cm)
    assert all(a.endswith("127.0.0.1") for a in (*api, *cm) if a.startswith("--bind-address="))
    assert args["node-agent"][1:3] == ["-m", "rollfleet_dev.localcluster.nodeagent"]


def test_a_pid_file_names_its_process_from_the_fork_on_and_never_a_later_process_with_its_pid(tmp_path: Path) -> None:
    """The host reuses pids: a pid file names a process by pid and start time. It holds from the fork (before
    the exec gives the process its own environment) until the process exits."""
    layout = controlplane.Layout(tmp_path)
    layout.pid_file("etcd").parent.mkdir(parents=True)
    with open(os.devnull, "wb") as out:
        proc = controlplane._spawn(["sleep", "30"], out, layout)  # start_component's two steps
    try:
        layout.pid_file("etcd").write_text(f"{proc.pid} {start_ticks(proc.pid)}")
        assert controlplane.running_pid(layout, "etcd") == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert controlplane.running_pid(layout, "etcd") is None
    # Another process now (this one) under the recorded pid, or a file of the old format: not ours.
    layout.pid_file("etcd").write_text(f"{os.getpid()} {start_ticks(os.getpid())}")
    assert controlplane.running_pid(layout, "etcd") == os.getpid()
    layout.pid_file("etcd").write_text(f"{os.getpid()} {(start_ticks(os.getpid()) or 0) + 1}")
    assert controlplane.running_pid(layout, "etcd") is None
    layout.pid_file("etcd").write_text(str(os.getpid()))
    assert controlplane.running_pid(layout, "etcd") is None


def test_stop_process_waits_for_a_process_that_exits_on_sigterm_and_kills_one_that_ignores_it() -> None:
    """`rollfleet cluster down` stops each component this way, following it by pid and start time."""
    run = "import signal, sys, time; signal.signal(signal.SIGTERM, {}); print(flush=True); time.sleep(30)"
    procs = []
    for handler in ("lambda *_: sys.exit(0)", "signal.SIG_IGN"):  # exits on SIGTERM; ignores it
        code = run.format(handler)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # its handler is in place
        procs.append(proc)
    try:
        t0 = time.monotonic()
        controlplane.stop_process(procs[0].pid, grace=20)
        assert time.monotonic() - t0 < 10 and procs[0].wait(5) == 0
        controlplane.stop_process(procs[1].pid, grace=0.5)
        assert procs[1].wait(5) == -signal.SIGKILL
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
