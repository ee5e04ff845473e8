"""On a CPU host the readers of vLLM's message queues (an engine's worker and engine core) recheck their queue
within milliseconds, where vLLM's own sleep until a notification that can be lost, or 5 s:
`rollfleet_engine.server.bound_message_queue_waits`, checked on vLLM's own `SpinCondition`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from rollfleet_engine.server import (
    QUEUE_IDLE_AFTER_S,
    QUEUE_RECHECK_BUSY_MS,
    QUEUE_RECHECK_IDLE_MS,
    bound_message_queue_waits,
)

pytestmark = pytest.mark.engine

TIMEOUT_MS = 2000  # what the reader's caller allows; long beside a loaded host's scheduling delays


@pytest.fixture
def spin_condition(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    # Restored after the test: the engine patches vLLM's class for its whole process.
    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    yield SpinCondition


def wait_unnotified(spin_condition: Any, since_read_s: float) -> tuple[float, list[int | None]]:
    """A reader that last read `since_read_s` ago waits, and no notification comes (as when one is lost): how long
    the wait took, and the timeouts it slept on its socket with (none: it spun)."""
    import zmq
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    context, address = zmq.Context(), get_open_zmq_ipc_path()
    try:
        spin_condition(is_reader=False, context=context, notify_address=address)
        reader = spin_condition(is_reader=True, context=context, notify_address=address)
        slept: list[int | None] = []
        poll = reader.poller.poll

        def recorded_poll(timeout: int | None = None) -> Any:
            slept.append(timeout)
            return poll(timeout=timeout)

        reader.poller.poll = recorded_poll
        reader.last_read = time.monotonic() - since_read_s
        t0 = time.monotonic()
        reader.wait(timeout_ms=TIMEOUT_MS)
        return time.monotonic() - t0, slept
    finally:
        context.destroy(linger=0)


def test_a_reader_whose_notification_is_lost_looks_again_within_milliseconds(spin_condition: Any) -> None:
    # vLLM's own: a reader spins for a second after a read, then sleeps until notified or timed out.
    assert wait_unnotified(spin_condition, 0.0)[1] == []
    took, slept = wait_unnotified(spin_condition, 1.5)
    assert slept == [TIMEOUT_MS] and took >= TIMEOUT_MS / 1000 * 0.9

    bound_message_queue_waits()
    # While steps come (a read within the last second) it sleeps a few milliseconds; once idle, a little longer.
    busy = QUEUE_IDLE_AFTER_S / 2
    assert wait_unnotified(spin_condition, busy)[1] == [QUEUE_RECHECK_BUSY_MS]
    took, slept = wait_unnotified(spin_condition, QUEUE_IDLE_AFTER_S + 0.5)
    assert slept == [QUEUE_RECHECK_IDLE_MS] and took < TIMEOUT_MS / 1000 / 2
