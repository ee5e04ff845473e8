"""A failed container's termination message from its log (terminationMessagePolicy FallbackToLogsOnError)."""

from __future__ import annotations

from pathlib import Path

from rollfleet_dev.localcluster.nodeagent.logs import TAIL_BYTES, TAIL_LINES, log_tail


def test_the_message_is_the_last_80_lines_within_2048_bytes(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("".join(f"l{i}\n" for i in range(200)))
    tail = log_tail(log)
    assert tail.splitlines() == [f"l{i}" for i in range(200 - TAIL_LINES, 200)]
    log.write_text("x" * 5000 + "\nlast words\n")
    tail = log_tail(log)
    assert tail.endswith("last words") and len(tail.encode()) <= TAIL_BYTES


def test_a_missing_log_gives_no_message(tmp_path: Path) -> None:
    assert log_tail(tmp_path / "absent.log") == ""
