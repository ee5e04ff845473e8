"""Which engine serves a request: sticky-least-loaded for sessions, least-outstanding otherwise.

Pure: no I/O and no clock of its own (callers pass ``now``), so every decision is
unit-tested. Owned state: the session table (session key -> engine, last use, active
requests) and the outstanding-request count per engine as this gateway replica sees it.

Why sticky-least-loaded rather than consistent hashing: a hash pins hot sessions to
a saturated engine (prime-rl #3255); here a new session goes to the least-loaded
engine and then stays there, so its prefix cache stays warm, and it moves only when
its engine stops being routable or the load gap passes the imbalance threshold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rollfleet.errors import RollfleetError


class NoEngine(RollfleetError):
    """No routable engine is left for this request (after exclusions)."""


@dataclass(frozen=True)
class RoutingPolicy:
    session_ttl_s: float = 600.0
    # A session moves off its engine only when both hold (like SGLang's cache-aware
    # balance thresholds): the absolute gap in outstanding requests between its engine
    # and the least-loaded one exceeds `imbalance_abs`, and its engine carries more
    # than `imbalance_rel` times the least-loaded one's load.
    imbalance_abs: int = 8
    imbalance_rel: float = 1.5
    # Sweeping the session table is O(sessions); do it at most this often.
    sweep_interval_s: float = 5.0
    # Callers choose session keys: past this many, a new session is routed as a request without one.
    max_sessions: int = 100_000


@dataclass
class Session:
    engine: str
    last_used: float
    active: int = 0


@dataclass
class Decision:
    engine: str
    session: str | None
    moved_from: str | None = None  # the session's previous engine, when it was moved


@dataclass
class Router:
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    sessions: dict[str, Session] = field(default_factory=dict)
    outstanding: dict[str, int] = field(default_factory=dict)
    _rotation: int = 0
    _last_sweep: float = float("-inf")

    def load(self, engine: str) -> int:
        return self.outstanding.get(engine, 0)

    def choose(self, routable: Iterable[str], session: str | None, now: float) -> Decision:
        """Pick an engine among `routable` and count the request as started there."""
        candidates = list(routable)
        if not candidates:
            raise NoEngine("no routable engine")
        self._maybe_sweep(now)
        least = self._least_loaded(candidates)
        if session is None:
            self._start(least)
            return Decision(least, None)
        entry = self.sessions.get(session)
        if entry is None and len(self.sessions) >= self.policy.max_sessions:
            self._start(least)  # the table is full: no stickiness rather than unbounded memory
            return Decision(least, None)
        if entry is None:
            self.sessions[session] = Session(least, now, active=1)
            self._start(least)
            return Decision(least, session)
        moved_from = None
        if entry.engine not in candidates or self._imbalanced(entry.engine, least):
            moved_from, entry.engine = entry.engine, least
        entry.last_used = now
        entry.active += 1
        self._start(entry.engine)
        return Decision(entry.engine, session, moved_from)

    def finish(self, decision: Decision, now: float, end_session: bool = False) -> None:
        """The request routed by `decision` is over (any outcome)."""
        self.outstanding[decision.engine] = max(0, self.load(decision.engine) - 1)
        if decision.session is None:
            return
        entry = self.sessions.get(decision.session)
        if entry is None:
            return
        entry.active = max(0, entry.active - 1)
        entry.last_used = now
        if end_session and entry.active == 0:
            del self.sessions[decision.session]

    def forget_engine(self, engine: str) -> None:
        """An engine left the fleet: its sessions re-stick on their next request."""
        self.outstanding.pop(engine, None)

    def _start(self, engine: str) -> None:
        self.outstanding[engine] = self.load(engine) + 1

    def _least_loaded(self, candidates: list[str]) -> str:
        # Ties rotate: with sequential traffic every engine has load 0, and always
        # taking the first would send everything to one engine.
        loads = [self.outstanding.get(e, 0) for e in candidates]  # (load(), inlined: every request runs this)
        low = min(loads)
        tied = [e for e, n in zip(candidates, loads, strict=True) if n == low]
        self._rotation += 1
        return tied[self._rotation % len(tied)]

    def _imbalanced(self, engine: str, least: str) -> bool:
        mine, low = self.load(engine), self.load(least)
        return mine - low > self.policy.imbalance_abs and mine > self.policy.imbalance_rel * low

    def _maybe_sweep(self, now: float) -> None:
        if now - self._last_sweep < self.policy.sweep_interval_s:
            return
        self._last_sweep = now
        ttl = self.policy.session_ttl_s
        for key in [k for k, s in self.sessions.items() if s.active == 0 and now - s.last_used > ttl]:
            del self.sessions[key]
