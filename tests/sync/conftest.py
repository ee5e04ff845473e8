"""Two real engines (vLLM on CPU, tiny model, weight set A labelled "A") and a sync sidecar in static mode.

The engines are local subprocesses started once for this package (30-60 s each on a 2-core
host; stopped when it ends, see tests/engine/conftest.py) and shared by every test; a test
that kills one restarts it. The sidecar is a subprocess too (``rollfleet sync --engines ...``),
so a test can kill it mid-push and start it again on the same record file and spool, as
Kubernetes restarts a container.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from bench.bench_sync import free_port
from bench.processes import stop

from rollfleet_client.sync import SyncClient
from rollfleet_engine import weights_client
from rollfleet_engine.protocol import HTTP_WEIGHT_BACKEND, STAGING_DIR_ENV
from rollfleet_engine.tiny_model import WEIGHTS_B_DIR, ensure_tiny_model
from tests.engine.conftest import START_TIMEOUT_S, Engine, engine_command, free_loopback_address, wait_ready

TOKEN = "sync-test-token"
INITIAL_VERSION = "A"


@dataclass
class EngineProcess:
    """One engine subprocess that a test may freeze, kill and start again at the same address."""

    engine: Engine
    cmd: list[str]
    core: int
    staging: Path  # its staging area, as a pod's memory-backed /dev/shm: a killed engine leaves it behind
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # vLLM's CPU backend binds every engine's threads to core 0 by default: two engines
        # on one core starve each other (one decodes, the other waits seconds for a token).
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(self.core), STAGING_DIR_ENV: str(self.staging)}
        with self.engine.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    def wait_ready(self) -> None:
        assert self.proc is not None
        wait_ready(self.engine.url, self.proc, self.engine.log, START_TIMEOUT_S)

    def signal_server(self, sig: signal.Signals) -> None:
        """Signal the HTTP server process only (SIGSTOP: it stops answering, the engine core lives on)."""
        assert self.proc is not None
        self.proc.send_signal(sig)  # not os.kill: Popen never signals a pid it has reaped

    def kill(self) -> None:
        """The whole engine (server, engine core, worker) dies at once, as when its pod is killed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:  # once reaped, its pid may be another process's (a container's group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None


@dataclass
class Sidecar:
    cmd: list[str]
    url: str
    log: Path
    spool: Path
    proc: subprocess.Popen[bytes] | None = None
    clients: list[SyncClient] = field(default_factory=list)

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
                try:
                    if http.get(self.url + "/healthz").status_code == 200:
                        return
                except httpx.TransportError:
                    time.sleep(0.1)  # polling a condition: the API is not bound yet
        raise TimeoutError(f"sidecar did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when the container is OOM-killed mid-push."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        """SIGTERM, as kubelet stops a container, then SIGKILL after 30 s: a sidecar left running after a failed
        test holds its ports, and every later sidecar of the session fails to bind them."""
        if self.proc is None:
            return
        stop(self.proc, timeout_s=30)
        self.proc = None

    def client(self, spool: Path | None = None) -> SyncClient:
        """A trainer's client; with `spool` (the sidecar's), one in a container that mounts the spool."""
        c = SyncClient(self.url, spool=spool)
        self.clients.append(c)
        return c


def _engine_cmd(engine: Engine, token_file: Path, backend: str) -> list[str]:
    host, port = engine.url.removeprefix("http://").split(":")
    return engine_command(engine.model_dir, host, port, token_file, INITIAL_VERSION, backend)


def write_token(tmp: Path) -> Path:
    path = tmp / "token"
    path.write_text(TOKEN + "\n")
    return path


def tiny_weights_dirs() -> dict[str, Path]:
    """The tiny model's two weight sets: A, which engines start with, and B."""
    root = ensure_tiny_model()
    return {"A": root, "B": root / WEIGHTS_B_DIR}


@pytest.fixture(scope="package")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token(tmp_path_factory.mktemp("sync-token"))


@contextlib.contextmanager
def running_fleet(tmp: Path, token_file: Path, backend: str = HTTP_WEIGHT_BACKEND) -> Iterator[list[EngineProcess]]:
    """Two engines with `backend`, started together (the start time is shared), killed at the end."""
    model_dir = ensure_tiny_model()
    fleet = []
    staging = Path(tempfile.mkdtemp(prefix="sync-test-staging-", dir=weights_client.staging_root().parent))
    for i in range(2):
        host, port = free_loopback_address()
        engine = Engine(
            url=f"http://{host}:{port}", token=TOKEN, model="tiny", model_dir=model_dir, log=tmp / f"e{i}.log"
        )
        cmd, core = _engine_cmd(engine, token_file, backend), i % (os.cpu_count() or 1)
        fleet.append(EngineProcess(engine, cmd, core, staging / f"e{i}"))
    try:
        for e in fleet:
            e.start()
        for e in fleet:
            e.wait_ready()
        yield fleet
    finally:
        for e in fleet:
            e.kill()
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def running_sidecar(tmp: Path, engines: list[EngineProcess], token_file: Path) -> Iterator[Sidecar]:
    """``rollfleet sync`` in static mode over `engines`, on a loopback address of its own."""
    host, port = free_loopback_address()
    spool = tmp / "spool"
    cmd = [
        sys.executable,
        "-m",
        "rollfleet.cli",
        "sync",
        "--fleet",
        "test",
        "--engines",
        ",".join(e.engine.url for e in engines),
        "--token-file",
        str(token_file),
        "--host",
        host,
        "--port",
        str(port),
        "--weights-host",
        host,
        "--weights-port",
        str(free_port(host)),  # the weights server binds the same loopback address, on its own port
        # Its health server listens on every address: a local cluster's sidecars on this host hold the default port.
        "--health-port",
        str(free_port("0.0.0.0")),
        "--spool-dir",
        str(spool),
        "--reconcile-interval",
        "0.5",
        "--transfer-timeout",
        "120",
        # The two engines relay to each other (the sidecar chains from 3 engines by default).
        "--relay-min-engines",
        "2",
    ]
    car = Sidecar(cmd=cmd, url=f"http://{host}:{port}", log=tmp / "sidecar.log", spool=spool)
    car.start()
    try:
        yield car
    finally:
        for c in car.clients:
            c.close()
        car.stop()


@pytest.fixture(scope="package")
def engines(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[list[EngineProcess]]:
    with running_fleet(tmp_path_factory.mktemp("sync-engines"), token_file) as fleet:
        yield fleet


@pytest.fixture(scope="package")
def sidecar(
    tmp_path_factory: pytest.TempPathFactory, engines: list[EngineProcess], token_file: Path
) -> Iterator[Sidecar]:
    with running_sidecar(tmp_path_factory.mktemp("sync-sidecar"), engines, token_file) as car:
        yield car


@pytest.fixture(scope="package")
def weights_dirs() -> dict[str, Path]:
    return tiny_weights_dirs()
