"""Where the end-to-end suite gets its cluster: the local one here, kind in users' CI.

The suite is cluster-agnostic: tests talk to the cluster through `Cluster`, and only
`Cluster.start()` differs by provider (`ROLLFLEET_E2E_PROVIDER=local|existing`).
With `existing` (kind), `KUBECONFIG` names the cluster and pods are reached through
`kubectl port-forward`; the local cluster routes pod IPs from this machine.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import kubernetes
import urllib3

from rollfleet.kubectl import Kubectl, KubectlError
from rollfleet_dev import oneshot

T = TypeVar("T")


@dataclass
class Cluster:
    provider: str
    kubeconfig: Path
    started_here: bool

    @classmethod
    def start(cls) -> Cluster:
        provider = os.environ.get("ROLLFLEET_E2E_PROVIDER", "local")
        if provider == "existing":
            kubeconfig = Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
            return cls(provider, kubeconfig, started_here=False)
        if provider != "local":
            raise ValueError(f"ROLLFLEET_E2E_PROVIDER={provider!r}: want 'local' or 'existing'")
        from rollfleet_dev.localcluster import controlplane

        was_up = controlplane.is_up()
        layout = controlplane.up()
        return cls(provider, layout.kubeconfig, started_here=not was_up)

    def stop(self) -> None:
        if self.provider == "local" and self.started_here:
            from rollfleet_dev.localcluster import controlplane

            if controlplane.is_up():
                controlplane.down()

    def api_client(self) -> kubernetes.client.ApiClient:
        return self._api

    @functools.cached_property
    def _api(self) -> kubernetes.client.ApiClient:
        # One client (one connection pool) for the session: polls through it cost a request each, where a
        # kubectl process costs about 0.12 s of CPU (2 cores are shared with the engines under test).
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def read(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The JSON of a read through the API client (`call`: a method of one of its APIs), shaped as
        `kubectl get -o json` shapes it (the client's own models rename fields)."""
        return dict(json.loads(call(*args, _preload_content=False, _request_timeout=60, **kwargs).data))

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return Kubectl(self.kubeconfig).run(*args, input=input, check=check, timeout=timeout)

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """A container's log: from the local node agent's files, else `kubectl logs`."""
        if self.provider == "local":
            from rollfleet_dev.localcluster.nodeagent.logs import find_log, nodes_state_dir

            path = find_log(nodes_state_dir() / "pods", namespace, pod, container, previous=False)
            return path.read_text() if path.exists() else f"(no log at {path})"
        proc = self.kubectl("-n", namespace, "logs", pod, "-c", container, check=False)
        return proc.stdout or proc.stderr

    def restart_api_server(self) -> None:
        """A fault to inject: kube-apiserver stops and starts again (the local cluster's process, or the
        container on kind's control-plane node, which kubelet restarts); returns once it is ready."""
        if self.provider == "local":
            from rollfleet_dev.localcluster import controlplane

            controlplane.restart("kube-apiserver")
            return
        from rollfleet_dev.kind.cluster import CLUSTER_NAME

        node = f"{CLUSTER_NAME}-control-plane"
        stop = "crictl stop $(crictl ps -q --name kube-apiserver)"
        if subprocess.run(["docker", "exec", node, "sh", "-c", stop], capture_output=True).returncode != 0:
            raise RuntimeError(f"no kind node {node} whose kube-apiserver this suite knows how to restart")
        wait_for(
            lambda: self.kubectl("get", "--raw=/readyz", check=False, timeout=10).returncode == 0,
            timeout=300,
            interval=1,
            what="kube-apiserver ready again",
        )

    @contextlib.contextmanager
    def reach(self, namespace: str, pod: str, port: int) -> Iterator[str]:
        """A base URL (http://host:port) that reaches `port` of a pod from this process."""
        if self.provider == "local":
            ip = kubernetes.client.CoreV1Api(self.api_client()).read_namespaced_pod(pod, namespace).status.pod_ip
            yield f"http://{ip}:{port}"
            return
        with _PortForward(self.kubeconfig, namespace, pod, port) as url:
            yield url


class _PortForward:
    """`kubectl port-forward` to a pod, restarted whenever it exits: kubectl ends a forward on the
    first failed connection (e.g. one made while the container was not listening yet), which
    would leave a long-lived URL dead for the rest of the session."""

    def __init__(self, kubeconfig: Path, namespace: str, pod: str, port: int) -> None:
        self.argv = [
            "kubectl",
            f"--kubeconfig={kubeconfig}",
            "-n",
            namespace,
            "port-forward",
            f"pod/{pod}",
            f"{_free_port()}:{port}",
        ]
        self.local_port = int(self.argv[-1].split(":")[0])
        self.what = f"{namespace}/{pod}:{port}"
        self.stop = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> str:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def _supervise(self) -> None:
        while not self.stop.is_set():
            assert self.proc is not None
            self.proc.wait()
            if not self.stop.wait(0.2):  # not asked to stop: kubectl gave up on its own
                self._start()
                if self.stop.is_set():  # stopped while restarting: __exit__ saw the old process
                    self.proc.terminate()

    def __enter__(self) -> str:
        line = self._start()
        if not re.search(r"Forwarding from", line):
            raise AssertionError(f"port-forward to {self.what} failed: {line}")
        threading.Thread(target=self._supervise, daemon=True, name=f"port-forward {self.what}").start()
        url = f"http://127.0.0.1:{self.local_port}"
        # kubectl says "Forwarding" before it has a stream into the pod; the first connection can still
        # be dropped (and kubectl then exits, to be restarted above). Every port forwarded here speaks
        # HTTP: the way in is usable once any HTTP answer comes back through it.
        wait_for(lambda: _answers(url), timeout=60, what=f"an HTTP answer through the port-forward to {self.what}")
        return url

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        oneshot.get(url + "/", timeout=5)
    except httpx.TransportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unanswered(err: Exception) -> bool:
    """Whether a read failed because the API server did not answer (a loaded host, a restart), not because
    it refused the request."""
    if isinstance(err, urllib3.exceptions.HTTPError):
        return True
    return isinstance(err, kubernetes.client.ApiException) and (err.status == 0 or err.status >= 500)


# What kubectl says when the API server did not answer (a loaded host): a poll tries again, as with `unanswered`.
KUBECTL_UNANSWERED = ("Unable to connect to the server", "TLS handshake timeout", "the server was unable to return")


def kubectl_unanswered(err: KubectlError) -> bool:
    """Whether a kubectl call failed because the API server did not answer, not because it refused."""
    return any(text in str(err) for text in KUBECTL_UNANSWERED)


def wait_for(predicate: Callable[[], T], timeout: float, *, interval: float = 0.2, what: str = "condition") -> T:
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout` s. `interval` and
    `what` by name only: a description passed where the interval goes failed a CI run (sleep of a str)."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
