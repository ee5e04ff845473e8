"""Start, inspect and stop a local Kubernetes control plane on loopback.

Owns the processes of one cluster: etcd, kube-apiserver, kube-scheduler,
kube-controller-manager (built by `build.py`) and the node agent (`nodeagent/`),
each started in its own session with a pid file and a log under the state dir, and
makes sure the nodes have the tiny model (in the cache, see the pools file's extraMounts).
Talks to: the processes it starts (health endpoints) and nothing else.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from rollfleet.errors import RollfleetError
from rollfleet_dev.localcluster import build, pki
from rollfleet_dev.localcluster.nodeagent import podnet
from rollfleet_dev.localcluster.nodeagent.ipam import FIRST_SERVICE_IP, SERVICE_CIDR
from rollfleet_dev.localcluster.nodeagent.processes import start_ticks
from rollfleet_dev.localcluster.paths import cache_dir, state_dir

HOST = "127.0.0.1"
PORTS = {
    "etcd": 2379,
    "etcd-peer": 2380,
    "kube-apiserver": 6443,
    "kube-scheduler": 10259,
    "kube-controller-manager": 10257,
}
START_ORDER = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "node-agent")
DEFAULT_POOLS = Path(__file__).with_name("pools.yaml")
STATE_ENV = "ROLLFLEET_CLUSTER_STATE"  # in each component's environment: which cluster started it


class ClusterError(RollfleetError, RuntimeError):
    """Something about the local cluster is wrong; the message says what to do."""


@dataclass(frozen=True)
class Layout:
    """Where one cluster keeps its files."""

    root: Path = field(default_factory=state_dir)

    @property
    def pki(self) -> pki.Pki:
        return pki.Pki(self.root / "pki")

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def component_kubeconfig(self, identity: str) -> Path:
        return self.root / "kubeconfigs" / f"{identity}.kubeconfig"

    def pid_file(self, component: str) -> Path:
        return self.root / "run" / f"{component}.pid"

    def log_file(self, component: str) -> Path:
        return self.root / "logs" / f"{component}.log"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def nodes_dir(self) -> Path:
        return self.root / "nodes"


def server_url() -> str:
    return f"https://{HOST}:{PORTS['kube-apiserver']}"


def component_args(layout: Layout, bins: build.Binaries, pools: Path) -> dict[str, list[str]]:
    """The command line of every component (pure: no files touched)."""
    p = layout.pki
    etcd_url = f"http://{HOST}:{PORTS['etcd']}"
    return {
        "etcd": [
            str(bins.etcd),
            "--name=local",
            f"--data-dir={layout.etcd_data}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://{HOST}:{PORTS['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://{HOST}:{PORTS['etcd-peer']}",
            f"--initial-cluster=local=http://{HOST}:{PORTS['etcd-peer']}",
            "--unsafe-no-fsync",  # a throwaway test cluster: durability is not worth the fsyncs
            "--log-level=warn",
            "--quota-backend-bytes=4294967296",
        ],
        "kube-apiserver": [
            str(bins.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={HOST}",
            f"--advertise-address={HOST}",
            f"--secure-port={PORTS['kube-apiserver']}",
            f"--tls-cert-file={p.apiserver_crt}",
            f"--tls-private-key-file={p.apiserver_key}",
            f"--client-ca-file={p.ca_crt}",
            f"--token-auth-file={p.token_file}",
            "--authorization-mode=RBAC",
            "--anonymous-auth=false",
            f"--service-account-key-file={p.sa_pub}",
            f"--service-account-signing-key-file={p.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,"
            "ResourceQuota,NodeRestriction,PodSecurity",
            # Endpoints may not hold loopback addresses; pods reach the API server through
            # KUBERNETES_SERVICE_HOST/PORT set by the node agent instead.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ],
        "kube-scheduler": [
            str(bins.kube_scheduler),
            f"--kubeconfig={layout.component_kubeconfig('scheduler')}",
            f"--authentication-kubeconfig={layout.component_kubeconfig('scheduler')}",
            f"--authorization-kubeconfig={layout.component_kubeconfig('scheduler')}",
            "--leader-elect=false",
            f"--bind-address={HOST}",
            f"--secure-port={PORTS['kube-scheduler']}",
            "--profiling=false",
            "--v=1",
        ],
        "kube-controller-manager": [
            str(bins.kube_controller_manager),
            f"--kubeconfig={layout.component_kubeconfig('controller-manager')}",
            f"--authentication-kubeconfig={layout.component_kubeconfig('controller-manager')}",
            f"--authorization-kubeconfig={layout.component_kubeconfig('controller-manager')}",
            "--leader-elect=false",
            f"--bind-address={HOST}",
            f"--secure-port={PORTS['kube-controller-manager']}",
            f"--service-account-private-key-file={p.sa_key}",
            f"--root-ca-file={p.ca_crt}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={p.ca_crt}",
            f"--cluster-signing-key-file={p.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Faster than the defaults so node-loss tests take seconds, not minutes.
            "--node-monitor-grace-period=20s",
            "--node-monitor-period=2s",
            "--profiling=false",
            "--v=1",
        ],
        "node-agent": [
            sys.executable,
            "-m",
            "rollfleet_dev.localcluster.nodeagent",
            f"--kubeconfig={layout.component_kubeconfig('node-agent')}",
            f"--pools={pools}",
            f"--state-dir={layout.nodes_dir}",
        ],
    }


def running_pid(layout: Layout, component: str) -> int | None:
    """The component's process, if the one its pid file names still runs. The file names it by pid and start
    time: it outlives its process, and the host reuses pids (a kind container's first process leads its own
    process group: stopping a reused pid would kill that container)."""
    try:
        pid, ticks = (int(v) for v in layout.pid_file(component).read_text().split())
    except (OSError, ValueError):
        return None
    return pid if start_ticks(pid) == ticks else None


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _get(url: str, token: str | None = None, timeout: float = 2.0) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # health probes only; real clients verify against the CA
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def health_checks(layout: Layout) -> dict[str, Callable[[], bool]]:
    def admin_get(path: str) -> tuple[int, str]:
        return _get(server_url() + path, layout.pki.token("admin"))

    return {
        "etcd": lambda: _get(f"http://{HOST}:{PORTS['etcd']}/health")[0] == 200,
        "kube-apiserver": lambda: admin_get("/readyz")[0] == 200,
        "kube-scheduler": lambda: _get(f"https://{HOST}:{PORTS['kube-scheduler']}/healthz")[0] == 200,
        # Ready once it has made the default ServiceAccount: a pod created before then is refused.
        "kube-controller-manager": lambda: (
            _get(f"https://{HOST}:{PORTS['kube-controller-manager']}/healthz")[0] == 200
            and admin_get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
        ),
        "node-agent": lambda: _nodes_ready(admin_get),
    }


def _nodes_ready(admin_get: Callable[[str], tuple[int, str]]) -> bool:
    code, body = admin_get("/api/v1/nodes")
    if code != 200:
        return False
    nodes = json.loads(body)["items"]
    ready = [
        n
        for n in nodes
        for c in n.get("status", {}).get("conditions", [])
        if c["type"] == "Ready" and c["status"] == "True"
    ]
    return bool(nodes) and len(ready) == len(nodes)


def _log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


def _wait(what: str, check: Callable[[], bool], timeout: float, pid_of: Callable[[], int | None], log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if pid_of() is None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:]) if log.exists() else ""
            raise ClusterError(f"{what} exited during start-up; last lines of {log}:\n{tail}")
        time.sleep(0.3)
    raise ClusterError(f"{what} did not become healthy within {timeout:.0f}s; see {log}")


def _write_kubeconfigs(layout: Layout) -> None:
    p = layout.pki
    (layout.root / "kubeconfigs").mkdir(parents=True, exist_ok=True)
    for identity, (user, _) in pki.IDENTITIES.items():
        text = pki.kubeconfig(server_url(), p.ca_crt, p.token(identity), user)
        target = layout.kubeconfig if identity == "admin" else layout.component_kubeconfig(identity)
        target.write_text(text)
        target.chmod(0o600)


def is_up(layout: Layout | None = None) -> bool:
    layout = layout or Layout()
    return all(running_pid(layout, c) is not None for c in START_ORDER)


def ensure_node_model(pools: Path = DEFAULT_POOLS) -> Path:
    """The tiny model where the nodes' `/var/lib/rollfleet/models/tiny-v2` is on this machine.

    That node path is where the CPU engine image bakes the model and where the samples'
    hostPath volumes read it; the pools file's extraMounts put it in the cache. Built once
    (seconds), then found by its completion marker.
    """
    from rollfleet_dev.localcluster.nodeagent import config
    from rollfleet_engine.tiny_model import NODE_MODEL_DIR, ensure_tiny_model

    return ensure_tiny_model(config.load(pools).host_path(NODE_MODEL_DIR, cache_dir()))


def up(pools: Path = DEFAULT_POOLS, layout: Layout | None = None) -> Layout:
    """Build (once) and start a cluster, with the tiny model on its nodes; a running cluster is left as it is."""
    layout = layout or Layout()
    model = ensure_node_model(pools)
    _log(f"tiny model on the nodes: {model}")
    if is_up(layout):
        _log(f"already running; kubeconfig: {layout.kubeconfig}")
        return layout
    if any(running_pid(layout, c) for c in START_ORDER):
        _log("a previous cluster is half running: stopping it first")
        down(layout)
    busy = [f"{name} ({port})" for name, port in PORTS.items() if port_in_use(port)]
    if busy:
        raise ClusterError(
            f"ports already in use: {', '.join(busy)}. Another cluster or program holds them; "
            "stop it (`rollfleet cluster down`) or free the ports."
        )
    bins = build.ensure_built()
    started = time.monotonic()
    shutil.rmtree(layout.root, ignore_errors=True)
    for sub in ("run", "logs"):
        (layout.root / sub).mkdir(parents=True, exist_ok=True)
    pki.create(
        layout.pki.dir,
        [
            HOST,
            FIRST_SERVICE_IP,
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ],
    )
    _write_kubeconfigs(layout)
    args = component_args(layout, bins, pools)
    checks = health_checks(layout)
    try:
        podnet.host_up()
    except podnet.PodNetError as err:
        raise ClusterError(str(err)) from None
    try:
        for component in START_ORDER:
            t0 = time.monotonic()
            start_component(layout, component, args[component], checks[component])
            _log(f"{component} ready ({time.monotonic() - t0:.1f}s)")
    except BaseException:
        down(layout, purge=False)  # keep the logs that explain the failure
        raise
    _log(f"cluster up in {time.monotonic() - started:.1f}s; export KUBECONFIG={layout.kubeconfig}")
    return layout


def start_component(layout: Layout, component: str, argv: list[str], healthy: Callable[[], bool]) -> None:
    """Start one component and wait until it is healthy."""
    log = layout.log_file(component)
    with open(log, "ab") as out:
        proc = _spawn(argv, out, layout)
    layout.pid_file(component).write_text(f"{proc.pid} {start_ticks(proc.pid)}")
    _wait(component, healthy, 120, functools.partial(running_pid, layout, component), log)


def restart(component: str, pools: Path = DEFAULT_POOLS, layout: Layout | None = None) -> float:
    """Stop one running component (a fault the e2e suite injects: an API server restart) and start it
    again as `up` does; returns the seconds until it was healthy again."""
    layout = layout or Layout()
    pid = running_pid(layout, component)
    if pid is None:
        raise ClusterError(f"{component} is not running: start the cluster with `rollfleet cluster up`")
    t0 = time.monotonic()
    stop_process(pid, grace=10)
    start_component(
        layout,
        component,
        component_args(layout, build.ensure_built(), pools)[component],
        health_checks(layout)[component],
    )
    return time.monotonic() - t0


def _spawn(argv: list[str], out: BinaryIO, layout: Layout) -> subprocess.Popen[bytes]:
    env = {**os.environ, STATE_ENV: str(layout.root)}
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )


def stop_process(pid: int, grace: float) -> None:
    """SIGTERM the process group `pid` leads; SIGKILL it after `grace` seconds. The process is followed by pid
    and start time: pids here wrap at 32,768, and a freed one soon names a stranger."""
    ticks = start_ticks(pid)
    if ticks is None:
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and start_ticks(pid) == ticks:
        time.sleep(0.1)
    if start_ticks(pid) == ticks:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return


def _of_cluster(pid: int, root: Path) -> bool:
    """Whether the process was started for the cluster at `root` (`_spawn` marks their environment)."""
    try:
        return f"{STATE_ENV}={root}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def leftover_processes(root: Path) -> list[int]:
    """Processes started for this cluster (they carry its state dir in their environment)."""
    return [
        int(proc.name)
        for proc in Path("/proc").iterdir()
        if proc.name.isdigit()
        and int(proc.name) != os.getpid()
        and _of_cluster(int(proc.name), root)
        and start_ticks(int(proc.name)) is not None
    ]


def down(layout: Layout | None = None, purge: bool = True) -> None:
    """Stop every process of the cluster, free its ports, and (by default) delete its state."""
    layout = layout or Layout()
    for component in reversed(START_ORDER):
        pid = running_pid(layout, component)
        if pid is not None:
            stop_process(pid, grace=30 if component == "node-agent" else 10)
            _log(f"{component} stopped")
    for pid in leftover_processes(layout.root):
        stop_process(pid, grace=5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(port_in_use(p) for p in PORTS.values()):
        time.sleep(0.2)
    busy = [f"{n} ({p})" for n, p in PORTS.items() if port_in_use(p)]
    if busy:
        raise ClusterError(f"ports still in use after stopping the cluster: {', '.join(busy)}")
    podnet.host_down()
    if purge:
        shutil.rmtree(layout.root, ignore_errors=True)
    _log("cluster down")


def status(layout: Layout | None = None) -> dict[str, str]:
    """One line per component: running (pid, healthy or not) or stopped."""
    layout = layout or Layout()
    checks = health_checks(layout) if layout.pki.token_file.exists() else {}
    out = {}
    for component in START_ORDER:
        pid = running_pid(layout, component)
        if pid is None:
            out[component] = "stopped"
        else:
            healthy = checks[component]() if component in checks else False
            out[component] = f"running (pid {pid}, {'healthy' if healthy else 'not healthy'})"
    return out
