"""One real engine (vLLM on CPU with the tiny model) for the tests of this package, as a subprocess.

Engine start costs 30-60 s on a 2-core host, so every test in tests/engine shares it;
tests that change its state (pause, weights) restore what the next test relies on. It stops
when the package's tests end (package scope), not at the end of the session: an engine holds
about 3 GB, and the end-to-end suite that runs next needs that memory for its own fleets (with
three such engines left running, the API server stalled for minutes under memory pressure).
"""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from rollfleet_engine.protocol import HTTP_WEIGHT_BACKEND
from rollfleet_engine.tiny_model import TINY_MODEL_CONTEXT, ensure_tiny_model

START_TIMEOUT_S = 300
TOKEN = "engine-test-token"
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


@dataclass(frozen=True)
class Engine:
    url: str
    token: str
    model: str
    model_dir: Path
    log: Path
    # One client for the tests' own calls, made before any stream starts. A client made per call
    # builds a TLS context (certifi's bundle) first; in a process whose threads read streams at
    # hundreds of chunks/s that took up to 4.9 s (measured), and the engine kept decoding meanwhile:
    # a pause "during" a stream could land after it ended. No keep-alive: the engine may close a
    # connection after an error answer, and a reused one would then be reset.
    client: httpx.Client = field(default_factory=lambda: httpx.Client(limits=NO_KEEPALIVE), compare=False, repr=False)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def free_loopback_address() -> tuple[str, int]:
    """A random 127.x.y.z address (every one is loopback on Linux) and a free port on it."""
    host = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.{random.randint(1, 254)}"
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if client.get(url + "/rollfleet/v1/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # polling a condition: the model is loading
    raise TimeoutError(f"engine not ready after {timeout_s} s:\n{log.read_text()[-4000:]}")


def engine_command(
    model_dir: Path,
    host: str,
    port: int | str,
    token_file: Path,
    weight_version: str,
    weight_backend: str = HTTP_WEIGHT_BACKEND,
) -> list[str]:
    """The launcher's command for a test engine: the tiny model (float32 on CPU), a small batch, loopback."""
    return [
        sys.executable,
        "-m",
        "rollfleet_engine",
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        host,
        "--port",
        str(port),
        "--token-file",
        str(token_file),
        "--weight-version",
        weight_version,
        "--weight-backend",
        weight_backend,
        "--",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        str(TINY_MODEL_CONTEXT),
        "--disable-uvicorn-access-log",
    ]


@contextlib.contextmanager
def process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`cmd` running for the duration (its output in `log`), stopped at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running(cmd: list[str], engine: Engine, timeout_s: float) -> Iterator[Engine]:
    """`engine`, served by `cmd` for the duration (its output in `engine.log`)."""
    with process(cmd, engine.log) as proc:
        try:
            wait_ready(engine.url, proc, engine.log, timeout_s)
            yield engine
        finally:
            engine.client.close()


@pytest.fixture(scope="package")
def real_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model_dir = ensure_tiny_model()
    tmp = tmp_path_factory.mktemp("engine")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    host, port = free_loopback_address()
    cmd = engine_command(model_dir, host, port, token_file, "a-0")
    engine = Engine(url=f"http://{host}:{port}", token=TOKEN, model="tiny", model_dir=model_dir, log=tmp / "engine.log")
    with running(cmd, engine, START_TIMEOUT_S) as ready:
        yield ready


def sim_command(model_dir: Path, host: str, port: int | str, token_file: Path, weight_version: str) -> list[str]:
    """The simulator's command with the real engine's flags (engine_command's): the same model, context and batch."""
    real = engine_command(model_dir, host, port, token_file, weight_version)
    vllm_args = real[real.index("--") :]
    cmd = [sys.executable, "-m", "rollfleet_dev.sim_engine", *real[3 : real.index("--")]]
    return [*cmd, "--token-delay-ms", str(SIM_TOKEN_DELAY_MS), *vllm_args]


# The simulator's decoding pace: about the real tiny engine's on this host (1,200-2,600 tokens/s
# alone, slower when shared), so that the contract's timing windows mean the same for both.
SIM_TOKEN_DELAY_MS = 2.0


@pytest.fixture(scope="package")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The simulator with the real engine's flags: the same token, served name and weight version."""
    tmp = tmp_path_factory.mktemp("sim-engine")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    host, port = free_loopback_address()
    model_dir = ensure_tiny_model()
    cmd = sim_command(model_dir, host, port, token_file, "a-0")
    engine = Engine(url=f"http://{host}:{port}", token=TOKEN, model="tiny", model_dir=model_dir, log=tmp / "engine.log")
    with running(cmd, engine, 60) as ready:
        yield ready
