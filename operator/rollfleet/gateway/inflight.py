"""Requests in flight at this gateway replica: which engine runs each caller id, and how far it got.

Owns the per-request record the proxy writes and the abort route reads: the caller
id, the engines tried so far (an id is never sent twice to one engine), the tokens
generated so far (what a failover continues from), the weight versions seen, and why
the request is being stopped (admin abort, client gone, deadline). Finished ids are
remembered (bounded) so that a late abort can answer "finished" or "aborted".

No I/O; the proxy owns the tasks and connections, this module only the facts.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rollfleet.errors import RollfleetError

ABORT = "abort"


class StopReason(StrEnum):
    ADMIN = "admin"  # POST /v1/abort
    DISCONNECT = "disconnect"  # the client went away
    DEADLINE = "deadline"  # the request passed its deadline


class IdInUse(RollfleetError):
    """A request with this caller id is still in flight here; ids must not be reused while they may run."""


@dataclass
class Choice:
    """One output sequence: what the client has been given so far."""

    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0  # completions only: where the next logprob's text_offset starts
    finish_reason: str | None = None


@dataclass
class InFlight:
    request_id: str
    # Resolved when the request must stop: the proxy's attempt waits on it next to its
    # upstream exchange (a future, not an Event, so waiting costs no extra task).
    stopping: asyncio.Future[None]
    # Resolved when the request is over (a future, not an Event: one is made per request).
    ended: asyncio.Future[None]
    # Sent to engines with the request (X-Rollfleet-Attempt), and with every abort this replica makes for it:
    # the engine ends a request only for the sender that started it, whatever id a client reuses.
    attempt: str = ""
    engine: str | None = None  # the engine running the current attempt
    engines: list[str] = field(default_factory=list)  # every engine that ran an attempt, in order
    tried: set[str] = field(default_factory=set)  # their instances (pod uids): never send the id there again
    prompt_token_ids: list[int] | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    versions: list[str] = field(default_factory=list)
    # Which of the client's output tokens came from which version: start -> {"version", "start", "end"}.
    segments: dict[int, dict[str, Any]] = field(default_factory=dict)
    stop: StopReason | None = None
    finish_reason: str | None = None
    unconfirmed: str | None = None  # why the engine never confirmed this request's end, if it did not

    def choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice())

    @property
    def generated(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def add_versions(self, versions: list[str]) -> None:
        for v in versions:
            if v and v not in self.versions:
                self.versions.append(v)

    def add_segments(self, segments: list[dict[str, Any]], tokens_before: int = 0) -> None:
        """Segments an engine told for one attempt, whose output begins `tokens_before` tokens into the client's."""
        for s in segments:
            start, end = int(s["start"]) + tokens_before, int(s["end"]) + tokens_before
            self.segments[start] = {"version": str(s["version"]), "start": start, "end": end}

    def request_stop(self, reason: StopReason) -> None:
        """Stop after the current attempt (no failover); the first reason wins."""
        if self.stop is None:
            self.stop = reason


@dataclass
class Finished:
    finish_reason: str | None
    unconfirmed: str | None = None


class InFlightTable:
    def __init__(self, keep_finished: int = 8192) -> None:
        self._active: dict[str, InFlight] = {}
        self._finished: OrderedDict[str, Finished] = OrderedDict()
        self._keep_finished = keep_finished
        # Unique per replica (a random prefix) and per request (a counter); not secret: only the gateway,
        # holding the admin token, can ask an engine to abort.
        self._attempt_prefix = f"gw-{secrets.token_hex(6)}-"
        self._attempts = itertools.count()

    def open(self, request_id: str, loop: asyncio.AbstractEventLoop) -> InFlight:
        if request_id in self._active:
            raise IdInUse(request_id)
        self._finished.pop(request_id, None)
        attempt = f"{self._attempt_prefix}{next(self._attempts)}"
        entry = InFlight(request_id, loop.create_future(), loop.create_future(), attempt)
        self._active[request_id] = entry
        return entry

    def close(self, entry: InFlight, finish_reason: str | None) -> None:
        entry.finish_reason = finish_reason
        if not entry.ended.done():
            entry.ended.set_result(None)
        if self._active.get(entry.request_id) is entry:
            del self._active[entry.request_id]
        self._finished[entry.request_id] = Finished(finish_reason, entry.unconfirmed)
        while len(self._finished) > self._keep_finished:
            self._finished.popitem(last=False)

    def get(self, request_id: str) -> InFlight | None:
        return self._active.get(request_id)

    def ids(self) -> list[str]:
        """The ids in flight now."""
        return list(self._active)

    def finished(self, request_id: str) -> Finished | None:
        return self._finished.get(request_id)

    def __len__(self) -> int:
        return len(self._active)


def segments_report(
    segments: dict[int, dict[str, Any]], versions: list[str], tokens: int
) -> list[dict[str, Any]] | None:
    """The segments of a one-sequence answer of `tokens` tokens, when they are known end to end: told by the
    engines (contiguous from 0, adjacent ones of one version merged), or one version for all. None otherwise
    (an attempt before a failover that nobody asked): the versions alone are then the truth to report."""
    if not segments:
        return [{"version": versions[0], "start": 0, "end": tokens}] if len(versions) == 1 and tokens else None
    merged: list[dict[str, Any]] = []
    for s in (segments[k] for k in sorted(segments)):
        if s["start"] != (merged[-1]["end"] if merged else 0):
            return None
        if merged and merged[-1]["version"] == s["version"]:
            merged[-1] = {**merged[-1], "end": s["end"]}
        else:
            merged.append(dict(s))
    return merged if merged[-1]["end"] == tokens else None
