"""Which engine pods are routable, and how the engine table follows watch events."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollfleet.gateway.registry import (
    Engine,
    Registry,
    engine_from_pod,
    lag_floor,
    lag_label,
    newest_generation,
    within_lag,
)


def pod(
    name: str = "f-engine-0",
    phase: str | None = "Ready",
    ready: bool = True,
    ip: str | None = "127.10.0.5",
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "annotations": {}}
    if phase is not None:
        meta["annotations"]["rollfleet.dev/phase"] = phase
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


@pytest.mark.parametrize(
    ("spec", "routable"),
    [
        ({}, True),
        ({"phase": "Paused"}, True),  # a paused engine holds requests; it does not fail them
        ({"phase": "PendingSync"}, False),
        ({"phase": "Draining"}, False),
        ({"phase": "Syncing"}, False),
        ({"phase": None}, False),  # the operator has not said anything yet
        ({"ready": False}, False),
        ({"ip": None}, False),
        ({"deleting": True}, False),
    ],
)
def test_routable_only_when_ready_and_in_a_routable_phase(spec: dict[str, Any], routable: bool) -> None:
    engine = engine_from_pod(pod(**spec))
    assert engine.routable is routable
    assert engine.instance == "uid-f-engine-0"


def test_url_uses_the_pod_ip_and_engine_port() -> None:
    assert engine_from_pod(pod()).url == "http://127.10.0.5:8000"


def test_table_follows_events_and_ejection_is_temporary() -> None:
    async def scenario() -> None:
        registry = Registry(eject_s=0.05)
        removed: list[str] = []
        registry.on_removed.append(removed.append)
        registry.replace_all([engine_from_pod(pod("a")), engine_from_pod(pod("b", phase="PendingSync"))])
        assert registry.synced and [e.key for e in registry.routable()] == ["a"]
        registry.upsert(engine_from_pod(pod("b")))
        assert [e.key for e in registry.routable()] == ["a", "b"]
        registry.eject("a")
        assert [e.key for e in registry.routable()] == ["b"]
        await asyncio.sleep(0.06)
        assert [e.key for e in registry.routable()] == ["a", "b"]
        registry.remove("a")
        registry.replace_all([Engine("c", "http://c", True, "Ready", "c")])
        assert removed == ["a", "b"] and [e.key for e in registry.engines()] == ["c"]

    asyncio.run(scenario())


def test_an_engine_whose_pod_starts_to_go_is_announced_once() -> None:
    async def scenario() -> None:
        registry = Registry()
        leaving: list[str] = []
        registry.on_leaving.append(leaving.append)
        registry.replace_all([engine_from_pod(pod("a")), engine_from_pod(pod("b"))])
        registry.upsert(engine_from_pod(pod("a")))
        assert leaving == []
        registry.upsert(engine_from_pod(pod("a", deleting=True)))
        registry.upsert(engine_from_pod(pod("a", deleting=True, ready=False)))  # the same pod, still going
        assert leaving == ["a"] and not registry.get("a").routable  # type: ignore[union-attr]
        # A relist after the watch broke: b was deleted meanwhile, a is still going.
        registry.replace_all([engine_from_pod(pod("a", deleting=True)), engine_from_pod(pod("b", deleting=True))])
        assert leaving == ["a", "b"]

    asyncio.run(scenario())


def test_an_engine_s_weight_generation_comes_from_its_pod_and_bounds_a_request_s_lag() -> None:
    def at(name: str, generation: str | None) -> Engine:
        p = pod(name)
        if generation is not None:
            p["metadata"]["annotations"]["rollfleet.dev/weight-generation"] = generation
        return engine_from_pod(p)

    e0, e1, e2, odd = at("e0", "4"), at("e1", "3"), at("e2", None), at("e3", "-1")
    assert (e0.generation, e1.generation, e2.generation, odd.generation) == (4, 3, None, None)
    routable = [e0, e1, e2]
    newest = newest_generation(routable)
    assert [e for e in routable if within_lag(e, lag_floor(newest, 0))] == [e0]  # unknown weights: within no bound
    assert [e for e in routable if within_lag(e, lag_floor(newest, 1))] == [e0, e1]
    static = [at("s0", None), at("s1", None)]
    floor = lag_floor(newest_generation(static), 0)  # no generation known anywhere: nothing to bound by
    assert floor is None and all(within_lag(e, floor) for e in static)


def test_a_served_request_s_lag_is_a_bounded_label() -> None:
    def at(key: str, generation: int | None) -> Engine:
        return Engine(key=key, url="http://e", routable=True, generation=generation)

    newest, one, far, unknown = at("a", 7), at("b", 6), at("c", 2), at("d", None)
    routable = [newest, one, far, unknown]
    top = newest_generation(routable)
    assert [lag_label(e, top) for e in routable] == ["0", "1", "3+", "unknown"]
    assert lag_label(at("e", 5), top) == "2"
    assert lag_label(newest, newest_generation([unknown])) == "unknown"  # nothing known to measure from
    assert lag_label(None, top) == "unknown"  # its engine left the table
    assert lag_label(at("f", 9), top) == "0"  # newer than every routable one (they were just replaced)
    # The registry's newest, kept until its routable list changes.
    registry = Registry()
    registry.replace_all(routable)
    assert registry.newest_generation() == 7
    registry.upsert(at("g", 8))
    assert registry.newest_generation() == 8
