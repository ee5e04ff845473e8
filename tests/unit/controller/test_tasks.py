"""One task per object: started by a watch event, fed the newest body, stopped on deletion, retried on failure."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from rollfleet.controller.tasks import LiveBody, ObjectTasks, Stop


def fleet(uid: str = "u1", rv: str = "1", deleting: bool = False, **status: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "f", "namespace": "ns", "uid": uid, "resourceVersion": rv}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": status}


class Recorder:
    """A task body that records what it saw, and ends when told to (or fails once first)."""

    def __init__(self, body: LiveBody, fail_first: bool = False) -> None:
        self.body = body
        self.runs = 0
        self.started: list[float] = []  # loop time of each run's start
        self.retried = asyncio.Event()
        self.fail_first = fail_first
        self.finish = asyncio.Event()
        self.closed = False
        self.closing = asyncio.Event()
        self.stopped_deleted: bool | None = None
        self.present = True  # what `exists` says

    async def run(self, stop: Stop) -> None:
        self.runs += 1
        self.started.append(asyncio.get_running_loop().time())
        if self.runs == 2:
            self.retried.set()
        if self.fail_first and self.runs == 1:
            raise RuntimeError("API hiccup")
        while not stop and not self.finish.is_set():
            await stop.wait(0.01)
        self.stopped_deleted = stop.deleted if stop else None

    async def close(self) -> None:
        self.closed = True
        self.closing.set()

    async def exists(self) -> bool:
        return self.present


def recorder(made: list[Recorder], fail_first: bool = False) -> Callable[[LiveBody], Recorder]:
    """A task factory that keeps what it made in `made`."""

    def make(body: LiveBody) -> Recorder:
        made.append(Recorder(body, fail_first))
        return made[-1]

    return make


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.02)


def test_one_task_per_object_sees_the_newest_body_and_stops_when_it_is_deleted() -> None:
    async def main() -> None:
        tasks = ObjectTasks("fleet")
        made: list[Recorder] = []
        make = recorder(made)
        tasks.on_event(None, fleet(rv="1"), make)
        tasks.on_event("MODIFIED", fleet(rv="2"), make)
        await settle()
        assert len(made) == 1 and made[0].runs == 1
        assert made[0].body["metadata"]["resourceVersion"] == "2"
        tasks.on_event("DELETED", fleet(rv="3"), make)
        await settle()
        assert made[0].stopped_deleted is True and made[0].closed

    asyncio.run(main())


def test_a_deletion_mark_stops_the_task_too() -> None:
    async def main() -> None:
        tasks = ObjectTasks("fleet")
        made: list[Recorder] = []
        tasks.on_event(None, fleet(), recorder(made))
        await settle()
        tasks.on_event("MODIFIED", fleet(deleting=True), recorder([]))
        await settle()
        assert made[0].stopped_deleted is True

    asyncio.run(main())


def test_an_object_of_the_same_name_and_another_uid_stops_the_earlier_task() -> None:
    """The earlier fleet's deletion was never delivered (its namespace deleted and made again): its task stops
    once the new fleet of that name shows up, so that two tasks never act on one fleet's pods."""

    async def main() -> None:
        tasks = ObjectTasks("fleet")
        made: list[Recorder] = []
        tasks.on_event(None, fleet(uid="u1"), recorder(made))
        await settle()
        tasks.on_event("ADDED", fleet(uid="u2"), recorder(made))
        await settle()
        assert len(made) == 2 and made[0].stopped_deleted is True and made[0].closed
        assert made[1].runs == 1 and made[1].stopped_deleted is None  # the new one runs on

    asyncio.run(main())


def test_a_failed_task_whose_object_is_gone_ends_though_no_deletion_came() -> None:
    """kopf in namespaced mode stops watching a namespace being deleted: no DELETED comes for what it held."""

    async def main() -> None:
        tasks = ObjectTasks("fleet")
        made: list[Recorder] = []
        tasks.on_event(None, fleet(), recorder(made, fail_first=True))
        made[0].present = False
        # Ended at once, within its first backoff (2 s) and never run again.
        await asyncio.wait_for(made[0].closing.wait(), timeout=1.5)
        assert made[0].runs == 1
        assert made[0].stopped_deleted is None  # its run had failed: it never saw the stop

    asyncio.run(main())


def test_a_task_that_ends_on_its_own_is_not_started_again() -> None:
    async def main() -> None:
        tasks = ObjectTasks("request")
        made: list[Recorder] = []
        make = recorder(made)
        tasks.on_event(None, fleet(), make)
        await settle()
        made[0].finish.set()
        await settle()
        tasks.on_event("MODIFIED", fleet(rv="2"), make)  # e.g. its own last status write
        await settle()
        assert len(made) == 1 and made[0].closed

    asyncio.run(main())


def test_objects_not_wanted_get_no_task() -> None:
    async def main() -> None:
        def running(body: Mapping[str, Any]) -> bool:
            return bool(body["status"].get("phase") != "Succeeded")

        tasks = ObjectTasks("request", wanted=running)
        made: list[Recorder] = []
        tasks.on_event(None, fleet(phase="Succeeded"), recorder(made))
        await settle()
        assert made == []

    asyncio.run(main())


def test_a_failed_run_is_run_again_after_a_backoff_with_the_same_state() -> None:
    async def main() -> None:
        tasks = ObjectTasks("fleet")
        made: list[Recorder] = []
        tasks.on_event(None, fleet(), recorder(made, fail_first=True))
        await asyncio.wait_for(made[0].retried.wait(), 30)
        first, second = made[0].started
        assert len(made) == 1 and second - first >= 2.0  # the first backoff is 2 s
        await tasks.stop_all()
        assert made[0].stopped_deleted is False and made[0].closed  # the operator exits: not a deletion

    asyncio.run(main())
