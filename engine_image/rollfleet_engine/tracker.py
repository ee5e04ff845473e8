"""In-flight requests by caller id: which vLLM requests serve it, and how each ended.

The caller's id (``X-Request-Id`` or the body ``request_id``) is the key everywhere in
Rollfleet. vLLM derives its own ids from it (``cmpl-<id>-<i>``, ``chatcmpl-<id>``, a
random suffix inside the engine); rather than re-deriving those rules, the launcher
records the exact id that each serving handler passes to ``EngineClient.generate``
(see ``engine_hooks``), and this module keeps the map and the observed outcome.

No vLLM import: the engine glue feeds plain values in, so this is unit-tested alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from rollfleet_engine.protocol import RequestPhase, RequestsView, TrackedRequest, WeightSegment

ABORT = "abort"
# Finish reason for a caller request that ended without reaching the engine (e.g. a 400).
REJECTED = "rejected"


@dataclass
class _EngineRequest:
    output_tokens: int = 0
    finish_reason: str | None = None
    versions: list[str] = field(default_factory=list)
    segments: list[WeightSegment] = field(default_factory=list)
    several: bool = False  # it has several sequences (n > 1)

    def grow(self, version: str) -> None:
        """The tokens up to ``output_tokens`` not in a segment yet came from ``version``."""
        last = self.segments[-1] if self.segments else None
        if last is not None and last.version == version:
            last.end = self.output_tokens
        elif self.output_tokens > (last.end if last else 0):
            self.segments.append(WeightSegment(version=version, start=last.end if last else 0, end=self.output_tokens))


@dataclass
class _Entry:
    request_id: str
    opened_at: float
    attempt: str | None = None  # the sender's X-Rollfleet-Attempt, if it sent one
    max_weight_lag: int | None = None  # the sender's X-Rollfleet-Max-Weight-Lag, if it sent one
    engine: dict[str, _EngineRequest] = field(default_factory=dict)
    closed: bool = False

    @property
    def finished(self) -> bool:
        if self.engine and all(e.finish_reason is not None for e in self.engine.values()):
            return True
        return self.closed

    @property
    def finish_reason(self) -> str | None:
        reasons = [e.finish_reason for e in self.engine.values() if e.finish_reason is not None]
        if ABORT in reasons:
            return ABORT
        if reasons:
            return reasons[0]
        if not self.closed:
            return None
        # The exchange ended with no finish from vLLM: a request that reached the engine was cut (its
        # client went away; vLLM aborts it once its output generator closes, which may come later),
        # one that never did was refused before it.
        return ABORT if self.engine else REJECTED

    def _segments(self) -> list[WeightSegment]:
        """Segments of a request of one sequence, served by one vLLM request (n > 1 has none)."""
        if len(self.engine) != 1:
            return []
        (only,) = self.engine.values()
        return [] if only.several else [s.model_copy() for s in only.segments]

    def view(self) -> TrackedRequest:
        tokens = sum(e.output_tokens for e in self.engine.values())
        if self.finished:
            phase = RequestPhase.FINISHED
        elif self.engine:
            phase = RequestPhase.RUNNING
        else:
            phase = RequestPhase.QUEUED
        versions = list(dict.fromkeys(v for e in self.engine.values() for v in e.versions))
        return TrackedRequest(
            request_id=self.request_id,
            phase=phase,
            finish_reason=self.finish_reason if self.finished else None,
            engine_request_ids=list(self.engine),
            output_tokens=tokens,
            weight_versions=versions,
            max_weight_lag=self.max_weight_lag,
            weight_segments=self._segments(),
        )


class RequestTracker:
    """Caller requests from the moment the HTTP request arrives until its response ends."""

    def __init__(self, keep_finished: int = 4096) -> None:
        self._active: dict[str, _Entry] = {}
        # Finished ones are kept (bounded) so that a late abort can answer "finished"/"aborted".
        self._finished: OrderedDict[str, _Entry] = OrderedDict()
        self._keep_finished = keep_finished
        self._changed = asyncio.Event()

    # --- fed by the HTTP middleware -------------------------------------------------
    def open(self, request_id: str, attempt: str | None = None, max_weight_lag: int | None = None) -> bool:
        """Start tracking; False if a request with this id is still in flight (ids must not be reused)."""
        if request_id in self._active:
            return False
        self._finished.pop(request_id, None)
        self._active[request_id] = _Entry(request_id, time.monotonic(), attempt, max_weight_lag)
        self._notify()
        return True

    def close(self, request_id: str) -> None:
        """The HTTP exchange is over: the request is finished whatever the engine said."""
        entry = self._active.pop(request_id, None)
        if entry is None:
            return
        entry.closed = True
        self._finished[request_id] = entry
        while len(self._finished) > self._keep_finished:
            self._finished.popitem(last=False)
        self._notify()

    # --- fed by the EngineClient.generate hook --------------------------------------
    def attach(self, request_id: str, engine_request_id: str) -> None:
        entry = self._active.get(request_id)
        if entry is not None:
            entry.engine.setdefault(engine_request_id, _EngineRequest())
            self._notify()

    def on_output(
        self,
        request_id: str,
        engine_request_id: str,
        *,
        output_tokens: int,
        cumulative: bool,
        finish_reason: str | None,
        versions: list[str] | None = None,
        spans: list[WeightSegment] | None = None,
        sequences: int = 1,
    ) -> None:
        """An output of one of the request's vLLM requests: its tokens, the versions that made them and, at the
        end, vLLM's own spans of versions (which replace the segments tracked meanwhile)."""
        entry = self._active.get(request_id)
        if entry is None:
            return
        er = entry.engine.setdefault(engine_request_id, _EngineRequest())
        er.output_tokens = output_tokens if cumulative else er.output_tokens + output_tokens
        if versions:
            er.versions = list(dict.fromkeys([*er.versions, *versions]))
        if sequences > 1:
            er.several = True  # token counts are summed over sequences: no segments to tell
        elif spans:
            er.segments = list(spans)
        elif versions:
            er.grow(versions[-1])
        if finish_reason is not None and er.finish_reason is None:
            er.finish_reason = finish_reason
        self._notify()

    def on_engine_end(self, request_id: str, engine_request_id: str, reason: str) -> None:
        """The generator stopped without a final output (client gone): vLLM aborted it."""
        entry = self._active.get(request_id)
        if entry is None:
            return
        er = entry.engine.setdefault(engine_request_id, _EngineRequest())
        if er.finish_reason is None:
            er.finish_reason = reason
            self._notify()

    # --- read side ------------------------------------------------------------------
    def get(self, request_id: str) -> TrackedRequest | None:
        entry = self._active.get(request_id) or self._finished.get(request_id)
        return entry.view() if entry else None

    def sent_with(self, request_id: str, attempt: str) -> bool:
        """Whether the request this id names here (in flight, or finished and remembered) came with `attempt`."""
        entry = self._active.get(request_id) or self._finished.get(request_id)
        return entry is not None and entry.attempt == attempt

    def unfinished_engine_ids(self, request_id: str) -> list[str]:
        entry = self._active.get(request_id)
        if entry is None:
            return []
        return [eid for eid, er in entry.engine.items() if er.finish_reason is None]

    def counts(self) -> tuple[int, int]:
        """(running, waiting) caller requests."""
        views = [e.view() for e in self._active.values()]
        running = sum(v.phase is RequestPhase.RUNNING for v in views)
        waiting = sum(v.phase is RequestPhase.QUEUED for v in views)
        return running, waiting

    def view(self, recent: int = 50) -> RequestsView:
        finished = list(self._finished.values())[-recent:] if recent > 0 else []
        return RequestsView(
            in_flight=[e.view() for e in self._active.values() if not e.finished],
            recently_finished=[e.view() for e in finished] + [e.view() for e in self._active.values() if e.finished],
        )

    async def wait_changed(self, max_wait_s: float) -> None:
        """Return when anything changes, or after ``max_wait_s`` seconds."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max_wait_s)

    def _notify(self) -> None:
        # A fresh event per change: waiters woken by the old one re-check and wait on the new.
        self._changed.set()
        self._changed = asyncio.Event()
