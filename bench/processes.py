"""Stopping the processes a benchmark started: its figures are measured by then, and one process that
does not exit on SIGTERM must not lose them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGTERM, and SIGKILL (to its whole process group, if it leads one) if it has not exited after
    `timeout_s`, saying so."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
        return
    except subprocess.TimeoutExpired:
        print(f"{proc.args!r} did not exit {timeout_s:g} s after SIGTERM: killed", file=sys.stderr)
    try:
        leads_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:  # exited meanwhile
        leads_group = False
    if leads_group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
    proc.wait()
