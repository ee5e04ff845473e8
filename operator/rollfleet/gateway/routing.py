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

from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
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


class LoadIndex:
    """Routable engines by outstanding requests, so that the least loaded is found in O(1) and kept as loads
    change: a scan of every engine per request cost the gateway most of its throughput at 2,000 engines.

    Within a load, engines are ordered by when they were last freed. A request without a session takes the one
    freed last: its connection and state are warm, where ties going round touched all 2,000 engines' connections
    and served 0.48-0.64 of 2 engines' requests/s against 0.97-1.03 (docs/architecture.md, "Scale"). A new session
    takes the one freed longest ago, so sessions spread over the engines (their prefix caches). An engine whose
    attempt failed goes to that end too, so that a fast-failing engine is not the first tried by every request, and
    a new session passes over it there (`Router`)."""

    def __init__(self, keys: Sequence[str], outstanding: Mapping[str, int], rotation: int) -> None:
        self.keys = frozenset(keys)
        self._load: dict[str, int] = {}
        self._buckets: dict[int, OrderedDict[str, None]] = {}  # first: freed last
        n = len(keys)
        for i in range(n):  # from `rotation` on: a list built anew for each request still spreads ties
            key = keys[(i + rotation) % n]
            if key not in self._load:
                self._load[key] = load = outstanding.get(key, 0)
                self._buckets.setdefault(load, OrderedDict())[key] = None
        self._low = min(self._buckets, default=0)

    def pick(
        self, allowed: Callable[[str], bool] | None = None, cold: bool = False, avoid: Container[str] = ()
    ) -> str | None:
        """A least-loaded engine that `allowed` admits (None: every one): the one freed last, or with `cold` the one
        freed longest ago; one in `avoid` only where its load has no other. None if `allowed` admits none.

        O(1) for a request's first try; a retry or a weight-lag bound passes over the engines it does not admit
        (a few) in load order, instead of building an index of the admitted ones per request, which cost O(n) and
        lost the order in which engines were freed."""
        if allowed is None and not cold:  # a request's first try: the hot path
            return next(iter(self._buckets[self._low])) if self._buckets else None
        for load in self._loads():
            bucket = self._buckets[load]
            fallback = None
            for key in reversed(bucket) if cold else bucket:
                if allowed is not None and not allowed(key):
                    continue
                if key not in avoid:
                    return key
                if fallback is None:
                    fallback = key
            if fallback is not None:
                return fallback
        return None

    def _loads(self) -> Iterator[int]:
        if not self._buckets:
            return
        yield self._low
        yield from sorted(load for load in self._buckets if load != self._low)  # distinct loads: a handful

    def moved(self, key: str, load: int, warm: bool = False) -> None:
        """`key`'s outstanding count is now `load` (no-op for an engine not in the index); `warm`: it was just freed
        by a request that it served, so it goes first among its load's engines, else last."""
        old = self._load.get(key)
        if old is None or old == load:
            return
        bucket = self._buckets[old]
        del bucket[key]
        if not bucket:
            del self._buckets[old]
        self._load[key] = load
        bucket = self._buckets.setdefault(load, OrderedDict())
        bucket[key] = None
        if warm:
            bucket.move_to_end(key, last=False)
        if load < self._low:
            self._low = load
        elif old == self._low and old not in self._buckets:
            self._low = min(self._buckets)  # over distinct loads: a handful


@dataclass
class Router:
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    sessions: dict[str, Session] = field(default_factory=dict)
    outstanding: dict[str, int] = field(default_factory=dict)
    _rotation: int = 0
    _last_sweep: float = float("-inf")
    # The index of the routable list last passed, kept while the same list object comes again (the
    # registry's, unchanged until its engine table changes).
    _index: LoadIndex | None = None
    _indexed: Sequence[str] | None = None
    # Engines whose last attempt failed (until one serves): a new session, which takes the engine freed longest
    # ago, would otherwise take the one that failed last, which the index puts at that same end.
    _failed: set[str] = field(default_factory=set)

    def load(self, engine: str) -> int:
        return self.outstanding.get(engine, 0)

    def choose(
        self,
        routable: Sequence[str],
        session: str | None,
        now: float,
        allowed: Callable[[str], bool] | None = None,
    ) -> Decision:
        """Pick an engine among `routable` that `allowed` admits (None: any; a retry leaves out the engines it
        tried) and count the request as started there. `routable` is read as it is now: a list changed in place
        after a call is a new one only if it is a new object."""
        index = self._index_of(routable)
        least = index.pick(allowed)
        if least is None:
            raise NoEngine("no routable engine")
        self._maybe_sweep(now)
        if session is None:
            self._start(least)
            return Decision(least, None)
        entry = self.sessions.get(session)
        if entry is None and len(self.sessions) >= self.policy.max_sessions:
            self._start(least)  # the table is full: no stickiness rather than unbounded memory
            return Decision(least, None)
        if entry is None:
            engine = index.pick(allowed, cold=True, avoid=self._failed)  # new sessions spread over the engines
            assert engine is not None  # `least` is admitted
            self.sessions[session] = Session(engine, now, active=1)
            self._start(engine)
            return Decision(engine, session)
        moved_from = None
        admitted = entry.engine in index.keys and (allowed is None or allowed(entry.engine))
        if not admitted or self._imbalanced(entry.engine, least):
            moved_from, entry.engine = entry.engine, least
        entry.last_used = now
        entry.active += 1
        self._start(entry.engine)
        return Decision(entry.engine, session, moved_from)

    def finish(self, decision: Decision, now: float, end_session: bool = False, served: bool = True) -> None:
        """The request routed by `decision` is over; `served`: its engine did not fail it."""
        self._set(decision.engine, max(0, self.load(decision.engine) - 1), warm=served)
        if served:
            self._failed.discard(decision.engine)
        else:
            self._failed.add(decision.engine)
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
        self._failed.discard(engine)
        self._index = self._indexed = None

    def _index_of(self, routable: Sequence[str]) -> LoadIndex:
        if routable is not self._indexed or self._index is None:
            self._rotation += 1
            self._index, self._indexed = LoadIndex(routable, self.outstanding, self._rotation), routable
        return self._index

    def _start(self, engine: str) -> None:
        self._set(engine, self.load(engine) + 1)

    def _set(self, engine: str, load: int, warm: bool = False) -> None:
        self.outstanding[engine] = load
        if self._index is not None:
            self._index.moved(engine, load, warm)

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
