"""One long-lived task per watched object (each RolloutFleet, each RolloutRequest), driven by kopf's events.

The controller's one idiom for both kinds: kopf owns the watches (`on.event`) and the indexes,
the shared clients live in kopf's memo, and each object gets one task here, started on the
first event that wants one, handed the newest body on every event, and stopped when the object
is deleted or the operator exits. A task that fails is run again after a backoff that doubles
with each failure in a row (2 s up to 30 s), unless its object is gone; one that ends on its own is
not started again.

Why not `kopf.daemon`, which does the same: kopf ties every daemon to a finalizer, so a deleted
object waits for the operator. With no operator, or when kopf (in namespaced mode) stops
watching a namespace being deleted before its objects' finalizers are removed (kopf issue
#1088; seen here with kopf 1.45.2 and Kubernetes 1.37: the namespace stays Terminating for
ever), deletion hangs. Without finalizers the garbage collector removes what an object owns,
and its task learns of the deletion from the watch.

Owns the tasks and their stop flags; talks to nobody (a task's own `exists` asks the API server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("rollfleet.operator")

MAX_BACKOFF_S = 30.0
STOP_TIMEOUT_S = 30.0  # how long stopping waits for a task to end on its own before cancelling it


def backoff_s(failures: int) -> float:
    """Seconds before the next try after `failures` failures in a row (1 or more): 2, 4, 8, ... 30."""
    return min(MAX_BACKOFF_S, 2.0**failures)


class Stop:
    """Set when an object's task must end: the object was deleted, or the operator exits."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.deleted = False

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self, deleted: bool) -> None:
        self.deleted = self.deleted or deleted
        self._event.set()

    def wait(self, timeout: float | None = None) -> Awaitable[bool]:
        """True once set; False when `timeout` passed first."""
        return self._wait(timeout)

    async def _wait(self, seconds: float | None) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), seconds)
        return self._event.is_set()


class LiveBody(Mapping[str, Any]):
    """The object as the watch delivered it last: every event replaces what it holds."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self._raw = raw

    def replace(self, raw: Mapping[str, Any]) -> None:
        self._raw = raw

    def __getitem__(self, key: str) -> Any:
        return self._raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


class ObjectRun(Protocol):
    """What a task runs for one object: `run` until done (or stopped), raising to be run again."""

    async def run(self, stop: Stop) -> None: ...

    async def close(self) -> None: ...

    async def exists(self) -> bool:
        """Whether its object is still there (asked after a failed run: kopf in namespaced mode stops watching a
        namespace being deleted, and never reports its objects' deletion)."""
        ...


async def _still_there(work: ObjectRun) -> bool:
    try:
        return await work.exists()
    except Exception:  # cannot tell (the API server may be what failed): it is run again
        return True


@dataclass
class _Task:
    body: LiveBody
    stop: Stop
    task: asyncio.Task[None] | None = None


class ObjectTasks:
    """The tasks of one kind of object, by uid."""

    def __init__(self, kind: str, wanted: Callable[[Mapping[str, Any]], bool] = lambda _: True) -> None:
        self.kind = kind
        self._wanted = wanted
        self._tasks: dict[str, _Task] = {}
        self._done: set[str] = set()  # uids whose task ended on its own: never started again
        self._uid_of: dict[tuple[str | None, str | None], str] = {}  # (namespace, name) -> uid of its task

    def on_event(self, event_type: str | None, raw: Mapping[str, Any], make: Callable[[LiveBody], ObjectRun]) -> None:
        """A watch event: start the object's task, hand it the new body, or stop it."""
        meta = raw["metadata"]
        uid = meta["uid"]
        gone = event_type == "DELETED" or meta.get("deletionTimestamp") is not None
        entry = self._tasks.get(uid)
        if entry is not None:
            entry.body.replace(raw)
            if gone:
                entry.stop.set(deleted=True)
            return
        if gone:
            self._done.discard(uid)
            return
        if uid in self._done or not self._wanted(raw):
            return
        key = (meta.get("namespace"), meta.get("name"))
        earlier = self._tasks.get(self._uid_of.get(key, ""))
        if earlier is not None:
            # The same name with another uid: the earlier object is gone, though its deletion never came (kopf
            # stops watching a namespace being deleted; the namespace then made again holds the new object).
            # Its task must not act on the new object's pods.
            earlier.stop.set(deleted=True)
        self._uid_of[key] = uid
        entry = self._tasks[uid] = _Task(LiveBody(raw), Stop())
        name = f"{self.kind} {meta.get('namespace')}/{meta.get('name')}"
        entry.task = asyncio.create_task(self._supervise(uid, key, entry, make(entry.body), name), name=name)

    async def _supervise(
        self, uid: str, key: tuple[str | None, str | None], entry: _Task, work: ObjectRun, name: str
    ) -> None:
        failures = 0
        try:
            while not entry.stop:
                try:
                    await work.run(entry.stop)
                except Exception:
                    failures += 1
                    if not await _still_there(work):
                        # Run again, it would act for ever on what is gone: a fleet of 200 tried to create its
                        # 200 pods every 30 s in a namespace deleted minutes before.
                        log.warning("%s failed and is gone, though no deletion was reported: its task ends", name)
                        entry.stop.set(deleted=True)
                        continue
                    delay = backoff_s(failures)
                    log.exception("%s failed (%d in a row), retrying in %.0fs", name, failures, delay)
                    await entry.stop.wait(delay)
                    continue
                if not entry.stop:
                    self._done.add(uid)
                return
        finally:
            await work.close()
            if self._tasks.get(uid) is entry:
                del self._tasks[uid]
            if self._uid_of.get(key) == uid:
                del self._uid_of[key]

    async def stop_all(self) -> None:
        """The operator exits: stop every task (each may finish its step), then cancel what is left."""
        tasks = [e.task for e in self._tasks.values() if e.task is not None]
        for e in self._tasks.values():
            e.stop.set(deleted=False)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
