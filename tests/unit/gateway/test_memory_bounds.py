"""The gateway's memory stays bounded under the probes of issue 32 (D2, D6): a 64 MiB header value, and
requests for a million choices or for the most the gateway admits. The gateway and a simulated engine run
as processes of their own, as in a pod, so that the gateway's peak resident memory (VmHWM) is its alone."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2e.provider import wait_for
from tests.unit.gateway.conftest import free_port, sse_chunks

from rollfleet.gateway.dialects import MAX_N
from rollfleet_dev import oneshot

MAX_GROWTH_MIB = 50
KEY = "memory-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Gateway:
    url: str
    port: int
    proc: subprocess.Popen[bytes]

    def memory_kib(self, field: str) -> int:
        """A line of the process's /proc status: VmRSS (now) or VmHWM (its peak so far), in KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")


def _serving(url: str, proc: subprocess.Popen[bytes]) -> None:
    def health() -> bool:
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        try:
            return oneshot.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(health, timeout=60, interval=0.1, what=f"{url} serving")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("memory")
    (tmp / "token").write_text("memory-test-admin\n")
    (tmp / "key").write_text(KEY + "\n")
    engine_port, port = free_port(), free_port()
    engine = [sys.executable, "-m", "rollfleet_dev.sim_engine", "--host", "127.0.0.1", "--port", str(engine_port)]
    engine += ["--token-delay-ms", "20"]  # decoding, not a flood of tokens: the deadline stops it mid-way
    gateway = [sys.executable, "-m", "rollfleet.gateway", "--engines", f"http://127.0.0.1:{engine_port}"]
    gateway += ["--host", "127.0.0.1", "--port", str(port), "--token-file", str(tmp / "token")]
    gateway += ["--api-key-file", str(tmp / "key"), "--log-level", "warning"]
    procs = [subprocess.Popen(engine), subprocess.Popen(gateway)]
    try:
        _serving(f"http://127.0.0.1:{engine_port}", procs[0])
        _serving(f"http://127.0.0.1:{port}", procs[1])
        gw = Gateway(f"http://127.0.0.1:{port}", port, procs[1])
        # Warm: the first requests import and allocate what every later one reuses.
        for stream in (False, True):
            body = {"prompt": "x", "max_tokens": 4, "n": 2, "stream": stream}
            assert oneshot.post(gw.url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
        yield gw
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


def _growth_mib(gw: Gateway, baseline_kib: int) -> float:
    growth = (gw.memory_kib("VmHWM") - baseline_kib) / 1024
    print(f"\ngateway peak memory {growth:+.1f} MiB over {baseline_kib / 1024:.0f} MiB resident before the probe")
    return growth


def test_a_64_mib_header_value_leaves_the_gateways_peak_memory_under_50_mib_higher(
    gw_baseline: int, gateway: Gateway
) -> None:
    sent = 0
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nX-Big: ")
        sock.settimeout(0.01)
        answer = b""
        while sent < 64 * 1024 * 1024 and not answer:
            try:
                sock.sendall(b"a" * 65536)
                sent += 65536
                answer = sock.recv(64)
            except TimeoutError:
                continue
            except OSError:  # refused and closed while we were still sending
                break
        sock.settimeout(5)
        answer += _rest(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    assert _growth_mib(gateway, gw_baseline) < MAX_GROWTH_MIB
    assert oneshot.get(gateway.url + "/health", timeout=5).status_code == 200


def _rest(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except OSError:
        pass
    return out


def test_a_million_choices_are_refused_and_the_most_admitted_stays_under_50_mib(
    gw_baseline: int, gateway: Gateway
) -> None:
    huge = {"prompt": "x", "n": 1_000_000, "stream": True, "max_tokens": 100_000}
    r = oneshot.post(gateway.url + "/v1/completions", json=huge, headers=AUTH, timeout=30)
    assert r.status_code == 400 and f"from 1 to {MAX_N}" in r.json()["error"]["message"], r.text
    # The most it admits, stopped by a deadline: every choice gets its closing chunk.
    most = {"prompt": "x", "n": MAX_N, "stream": True, "max_tokens": 100_000}
    headers = AUTH | {"X-Rollfleet-Timeout": "1"}
    r = oneshot.post(gateway.url + "/v1/completions", json=most, headers=headers, timeout=60)
    finished = {c["index"]: c["finish_reason"] for chunk in sse_chunks(r.text) for c in chunk["choices"]}
    assert len(finished) == MAX_N and set(finished.values()) <= {"abort", "length"}
    assert _growth_mib(gateway, gw_baseline) < MAX_GROWTH_MIB
    assert oneshot.get(gateway.url + "/health", timeout=5).status_code == 200


@pytest.fixture
def gw_baseline(gateway: Gateway) -> int:
    """The gateway's resident memory before the case (KiB)."""
    return gateway.memory_kib("VmRSS")
