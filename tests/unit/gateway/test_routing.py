"""Sticky-least-loaded routing: sessions stick, spread, move on imbalance or loss, expire."""

from __future__ import annotations

import random

import pytest

from rollfleet.gateway.routing import Decision, NoEngine, Router, RoutingPolicy

ENGINES = ["e0", "e1"]


def test_sessionless_traffic_goes_to_the_least_outstanding_engine() -> None:
    router = Router()
    first = router.choose(ENGINES, None, now=0)
    second = router.choose(ENGINES, None, now=0)
    assert {first.engine, second.engine} == {"e0", "e1"}
    router.finish(first, now=1)
    assert router.choose(ENGINES, None, now=1).engine == first.engine


def test_sequential_sessionless_traffic_stays_on_the_engine_freed_last() -> None:
    """Its connection and state are warm: at 2,000 engines, ties going round served half the requests/s."""
    router = Router()
    engines = [f"e{i}" for i in range(20)]
    first = router.choose(engines, None, now=0)
    router.finish(first, now=0)
    for i in range(50):
        decision = router.choose(engines, None, now=i)
        assert decision.engine == first.engine
        router.finish(decision, now=i)


def test_new_sessions_spread_over_the_engines_even_one_at_a_time() -> None:
    router = Router()
    engines = [f"e{i}" for i in range(4)]
    counts = dict.fromkeys(engines, 0)
    for i in range(40):
        decision = router.choose(engines, f"session-{i}", now=i)
        counts[decision.engine] += 1
        router.finish(decision, now=i)
        router.finish(router.choose(engines, None, now=i), now=i)  # sessionless traffic between them
    assert counts == dict.fromkeys(engines, 10)


def test_an_engine_that_failed_a_request_is_not_the_next_ones_first_try() -> None:
    """A fast-failing engine (a 5xx is no ejection) would otherwise be freed first and tried first by every
    request."""
    router = Router()
    engines = ["e0", "e1", "e2"]
    bad = router.choose(engines, None, now=0)
    router.finish(bad, now=0, served=False)
    for i in range(10):
        decision = router.choose(engines, None, now=i)
        assert decision.engine != bad.engine
        router.finish(decision, now=i)


def test_a_new_session_passes_over_the_engine_that_failed_last() -> None:
    """New sessions take the engine freed longest ago, the end where a failed engine is put too."""
    router = Router()
    engines = ["e0", "e1", "e2"]
    bad = router.choose(engines, None, now=0)
    router.finish(bad, now=0, served=False)
    for i in range(2):
        decision = router.choose(engines, f"new-{i}", now=1)
        assert decision.engine != bad.engine
    router.finish(router.choose(engines, "third", now=2), now=2)  # only the failed engine was idle
    assert router.choose(engines, None, now=3).engine == bad.engine  # it served: freed last, warm again


def test_a_retry_leaves_out_what_it_tried_and_keeps_the_order_engines_were_freed_in() -> None:
    """A retry or a weight-lag bound filters the kept index: no index built per request, which cost O(n) at
    2,000 engines and forgot which engine was freed last."""
    router = Router()
    engines = [f"e{i}" for i in range(5)]
    warm = router.choose(engines, None, now=0)
    router.finish(warm, now=0)
    retry = router.choose(engines, None, now=1, allowed=lambda key: key != warm.engine)
    assert retry.engine != warm.engine
    router.finish(retry, now=1, served=False)
    assert router._indexed is engines
    assert router.choose(engines, None, now=2).engine == warm.engine
    # Where every idle engine is left out, a busy one is taken; where every engine is, there is none.
    only_busy = router.choose(engines, None, now=3, allowed=lambda key: key == warm.engine)
    assert only_busy.engine == warm.engine and router.load(warm.engine) == 2
    with pytest.raises(NoEngine):
        router.choose(engines, None, now=4, allowed=lambda key: False)


def test_a_session_moves_off_an_engine_the_try_leaves_out() -> None:
    router = Router()
    first = router.choose(ENGINES, "s", now=0)
    router.finish(first, now=0, served=False)
    retry = router.choose(ENGINES, "s", now=1, allowed=lambda key: key != first.engine)
    assert retry.moved_from == first.engine and retry.engine != first.engine
    assert router.choose(ENGINES, "s", now=2).engine == retry.engine  # it sticks where it moved


def test_a_new_session_goes_to_the_least_loaded_engine_and_then_sticks() -> None:
    router = Router()
    busy = [router.choose(ENGINES, None, now=0) for _ in range(3)]
    for d in busy[1:]:
        router.finish(d, now=0)
    loaded = busy[0].engine
    other = "e1" if loaded == "e0" else "e0"
    turn1 = router.choose(ENGINES, "s", now=1)
    assert turn1.engine == other
    router.finish(turn1, now=2)
    # Even when its engine is now the busier one (below the threshold), the session stays.
    for _ in range(3):
        router.choose(ENGINES, None, now=2)
    assert router.choose(ENGINES, "s", now=3).engine == other


def test_grpo_group_members_share_one_engine() -> None:
    router = Router()
    engines = {router.choose(ENGINES, "group-7", now=0).engine for _ in range(8)}
    assert len(engines) == 1


def test_session_moves_when_its_engine_is_no_longer_routable() -> None:
    router = Router()
    d = router.choose(ENGINES, "s", now=0)
    router.finish(d, now=0)
    remaining = [e for e in ENGINES if e != d.engine]
    moved = router.choose(remaining, "s", now=1)
    assert moved.engine == remaining[0] and moved.moved_from == d.engine


def test_session_moves_when_imbalance_passes_both_thresholds() -> None:
    router = Router(RoutingPolicy(imbalance_abs=4, imbalance_rel=2.0))
    d = router.choose(ENGINES, "s", now=0)
    router.finish(d, now=0)
    router.outstanding = {d.engine: 5, ("e1" if d.engine == "e0" else "e0"): 1}
    assert router.choose(ENGINES, "s", now=1).moved_from is None  # gap 4 is not > 4
    router.outstanding = {d.engine: 6, ("e1" if d.engine == "e0" else "e0"): 1}
    assert router.choose(ENGINES, "s", now=2).moved_from == d.engine


def test_idle_sessions_expire_after_the_ttl_but_active_ones_do_not() -> None:
    router = Router(RoutingPolicy(session_ttl_s=10, sweep_interval_s=0))
    idle = router.choose(ENGINES, "idle", now=0)
    router.finish(idle, now=0)
    router.choose(ENGINES, "busy", now=0)  # never finishes
    router.choose(ENGINES, None, now=11)
    assert "idle" not in router.sessions and "busy" in router.sessions


def test_ending_a_session_releases_it_once_its_requests_are_done() -> None:
    router = Router()
    a = router.choose(ENGINES, "s", now=0)
    b = router.choose(ENGINES, "s", now=0)
    router.finish(a, now=1, end_session=True)
    assert "s" in router.sessions
    router.finish(b, now=1, end_session=True)
    assert "s" not in router.sessions


def test_an_empty_fleet_raises_no_engine() -> None:
    router = Router()
    with pytest.raises(NoEngine):
        router.choose([], "s", now=0)


def test_outstanding_counts_return_to_zero() -> None:
    router = Router()
    decisions = [router.choose(ENGINES, f"s{i % 3}", now=i) for i in range(9)]
    for d in decisions:
        router.finish(d, now=10)
    assert all(v == 0 for v in router.outstanding.values())


def test_the_session_table_is_capped() -> None:
    """D9: callers choose session keys; 3,000 distinct ones of 60 KB kept 130 MB for the TTL."""
    router = Router(RoutingPolicy(max_sessions=2))
    for key in ("a", "b"):
        router.finish(router.choose(["e0", "e1"], key, now=0.0), now=0.0)
    third = router.choose(["e0", "e1"], "c", now=1.0)
    assert third.session is None and set(router.sessions) == {"a", "b"}  # routed, not remembered
    router.finish(third, now=1.0)
    assert router.load(third.engine) == 0
    assert router.choose(["e0", "e1"], "a", now=2.0).session == "a"  # known sessions still stick
    # Expired sessions make room again.
    later = 2.0 + RoutingPolicy().session_ttl_s + RoutingPolicy().sweep_interval_s
    router.finish(router.choose(["e0", "e1"], "a", now=2.0), now=2.0)
    assert router.choose(["e0", "e1"], "d", now=later + 10).session == "d"


def test_the_kept_load_index_always_picks_a_least_loaded_engine() -> None:
    """The index kept for the registry's list (no scan of 2,000 engines per request) decides as a scan would."""
    rng = random.Random(7)
    engines = [f"e{i}" for i in range(50)]
    router = Router()
    open_: list[Decision] = []
    picked: set[str] = set()
    for step in range(5000):
        if open_ and rng.random() < 0.45:
            router.finish(open_.pop(rng.randrange(len(open_))), now=step)
            continue
        low = min(router.load(e) for e in engines)
        d = router.choose(engines, None, now=step)
        assert router.load(d.engine) - 1 == low, (step, d.engine)
        open_.append(d)
        picked.add(d.engine)
    assert picked == set(engines)
    assert router._indexed is engines  # one index, kept for the one list
    # New sessions, one at a time, on a fresh index rotate too.
    fresh = Router()
    seen = []
    for i in range(4):
        d = fresh.choose(engines, f"s{i}", now=i)
        fresh.finish(d, now=i)
        seen.append(d.engine)
    assert len(set(seen)) == 4
