"""The engine pod's preStop hook: wait until the engine holds no request, bounded, and never for a dead engine."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollfleet_engine.drain import wait_idle
from rollfleet_engine.protocol import STATE_PATH


class _State:
    def __init__(self) -> None:
        self.running, self.waiting = 0, 0


@pytest.fixture
def engine() -> Iterator[tuple[str, _State]]:
    """An HTTP server answering the engine's state route with counts the test sets."""
    state = _State()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"running": state.running, "waiting": state.waiting}).encode()
            self.send_response(200 if self.path == STATE_PATH else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", state
    finally:
        server.shutdown()


def test_it_returns_once_the_engine_holds_no_request(engine: tuple[str, _State]) -> None:
    url, state = engine
    state.running, state.waiting = 1, 1
    timer = threading.Timer(0.3, lambda: (setattr(state, "running", 0), setattr(state, "waiting", 0)))
    timer.start()
    start = time.monotonic()
    assert wait_idle(url, timeout_s=10, poll_s=0.02) == "no request left on the engine"
    assert 0.3 <= time.monotonic() - start < 5


def test_it_gives_up_at_its_timeout_and_says_what_is_left(engine: tuple[str, _State]) -> None:
    url, state = engine
    state.running = 2
    start = time.monotonic()
    assert (
        wait_idle(url, timeout_s=0.3, poll_s=0.02) == "2 request(s) still on the engine after 0.3 s: it stops with them"
    )
    assert 0.3 <= time.monotonic() - start < 5


def test_the_hook_ends_at_once_when_no_engine_answers() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rollfleet_engine", "wait-idle", "--port", str(port), "--timeout-s", "20"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "does not answer" in done.stdout and time.monotonic() - start < 15
