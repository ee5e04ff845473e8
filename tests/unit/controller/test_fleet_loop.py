"""When a fleet's loop passes again: on changes kopf's indexes show, on its timer, never while stopped.

The loop's I/O is not run here (the e2e suite does that); only its waiting between passes,
against plain dicts standing in for kopf's indexes.
"""

from __future__ import annotations

import asyncio
import functools
import time
from types import SimpleNamespace
from typing import Any

import pytest
from tests.unit.controller.fleet_fixtures import obs, state

from rollfleet.controller import plan
from rollfleet.controller.owned import OwnedObjects
from rollfleet.controller.reconciler import FAN_OUT_BATCH, PASS_MIN_INTERVAL_S, FleetLoop, Shared, WeightsRecord
from rollfleet.controller.status import GatewayObs
from rollfleet.controller.tasks import MAX_BACKOFF_S, Stop, backoff_s
from rollfleet.engine_client import EngineCallError, EngineRef
from rollfleet_engine.protocol import EngineState

KEY = ("ns", "f")
FLEET = {"metadata": {"name": "f", "namespace": "ns", "uid": "u-f", "resourceVersion": "1"}}


def pod(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"u-{name}", "resourceVersion": rv}}


def loop_with(
    pods: dict[tuple[str, str], list[dict[str, Any]]],
    gateways: dict[Any, list[GatewayObs]],
    records: dict[Any, list[WeightsRecord]] | None = None,
) -> FleetLoop:
    shared: Shared = SimpleNamespace(owned=OwnedObjects())  # type: ignore[assignment]  # waiting touches no client
    return FleetLoop(shared, FLEET, pods, gateways, {} if records is None else records)


async def waited(loop: FleetLoop, change: Any, latest_s: float, stopped: Stop | None = None) -> float:
    """Seconds `_wait` took when `change()` runs just after it starts."""
    if stopped is None:  # (an unset Stop is falsy: no `or` here)
        stopped = Stop()
    seen = loop._fingerprint()
    start = time.monotonic()
    waiting = asyncio.create_task(loop._wait(stopped, seen, start + PASS_MIN_INTERVAL_S, start + latest_s))
    await asyncio.sleep(0)
    change()
    await waiting
    return time.monotonic() - start


def test_a_pod_change_wakes_the_loop_but_not_before_the_minimum_interval() -> None:
    pods = {KEY: [pod("f-engine-0", "1")]}
    loop = loop_with(pods, {})
    took = asyncio.run(waited(loop, lambda: pods[KEY].append(pod("f-engine-1", "2")), latest_s=10.0))
    assert PASS_MIN_INTERVAL_S <= took < 2.0


def test_a_pod_replaced_in_the_index_wakes_the_loop_and_one_stored_again_unchanged_does_not() -> None:
    """kopf stores a new object for each change of a pod: the loop wakes on it. An object equal to the one it
    replaces (a re-list's copy) is no change."""
    pods = {KEY: [pod("f-engine-0", "1"), pod("f-engine-1", "1")]}
    loop = loop_with(pods, {})
    took = asyncio.run(waited(loop, lambda: pods[KEY].__setitem__(1, pod("f-engine-1", "2")), latest_s=10.0))
    assert PASS_MIN_INTERVAL_S <= took < 2.0
    took = asyncio.run(waited(loop, lambda: pods[KEY].__setitem__(1, pod("f-engine-1", "2")), latest_s=1.0))
    assert took >= 1.0  # the timer, not the copy


def test_a_deleted_pod_wakes_the_loop() -> None:
    pods = {KEY: [pod("f-engine-0", "1"), pod("f-engine-1", "1")]}
    loop = loop_with(pods, {})
    took = asyncio.run(waited(loop, lambda: pods[KEY].pop(), latest_s=10.0))
    assert took < 2.0


def test_a_gateway_change_wakes_the_loop() -> None:
    gateways = {KEY: [GatewayObs(1, 0)]}
    loop = loop_with({}, gateways)
    took = asyncio.run(waited(loop, lambda: gateways.__setitem__(KEY, [GatewayObs(1, 1)]), latest_s=10.0))
    assert took < 2.0


def test_a_weight_sync_record_change_wakes_the_loop() -> None:
    records = {KEY: [WeightsRecord({}, "5")]}
    loop = loop_with({}, {}, records)
    change = WeightsRecord({"sync-state": "{}"}, "6")
    took = asyncio.run(waited(loop, lambda: records.__setitem__(KEY, [change]), latest_s=10.0))
    assert took < 2.0


def test_an_owned_object_changed_by_someone_else_wakes_the_loop() -> None:
    loop = loop_with({}, {})
    owned = loop.shared.owned
    took = asyncio.run(waited(loop, lambda: owned.saw(KEY, "Role/f-gateway", "9"), latest_s=10.0))
    assert took < 2.0
    took = asyncio.run(waited(loop, lambda: owned.saw(("ns", "g"), "Role/g-gateway", "9"), latest_s=1.0))
    assert took >= 1.0  # another fleet's: the timer


def test_another_fleets_pods_do_not_wake_the_loop() -> None:
    pods: dict[tuple[str, str], list[dict[str, Any]]] = {KEY: [pod("f-engine-0", "1")]}
    loop = loop_with(pods, {})
    took = asyncio.run(waited(loop, lambda: pods.__setitem__(("ns", "other"), [pod("other-engine-0", "5")]), 1.0))
    assert took >= 1.0  # the timer, not the change


def test_stopping_ends_the_wait_at_once() -> None:
    loop = loop_with({}, {})
    stopped = Stop()
    took = asyncio.run(waited(loop, lambda: stopped.set(deleted=True), latest_s=10.0, stopped=stopped))
    assert took < 1.0


def test_pods_a_listing_showed_gone_leave_the_loops_view() -> None:
    pods = {KEY: [pod("f-engine-0", "1"), pod("f-engine-1", "2")]}
    loop = loop_with(pods, {})
    loop._gone = {"u-f-engine-1"}
    assert [p["metadata"]["name"] for p in loop._index_pods()] == ["f-engine-0"]


@pytest.mark.parametrize(("failures", "delay"), [(1, 2.0), (2, 4.0), (4, 16.0), (5, 30.0), (50, MAX_BACKOFF_S)])
def test_task_backoff_doubles_up_to_its_cap(failures: int, delay: float) -> None:
    assert backoff_s(failures) == delay


def test_index_entries_of_a_deleted_namesake_fleet_are_not_this_fleets() -> None:
    """kopf missed the deletions of a namespace deleted and made again: its fleet's gateway and weights record stay
    in the indexes under the same key, owned by the old uid. The loop reads its own fleet's only (seen on kind:
    the old gateway's 0/0 replicas kept a new fleet's Ready False for good)."""
    stale, own = GatewayObs(0, 0, owner="u-old"), GatewayObs(1, 1, owner="u-f")
    old_record, record = WeightsRecord({"v": "old"}, "3", owner="u-old"), WeightsRecord({}, "9", owner="u-f")
    loop = loop_with({}, {KEY: [stale, own]}, {KEY: [old_record, record]})
    assert loop._gateway() == own and loop._weights_record() == record
    assert loop_with({}, {KEY: [stale]})._gateway() is None


def test_stale_states_are_read_in_the_background_and_a_missed_read_keeps_the_last_one() -> None:
    """A pass never waits for settled engines' answers (at 1,000 engines that held a pause back by seconds), and
    one slow answer does not make a serving engine look like a starting one."""
    answers: dict[str, EngineState | Exception] = {}
    asked: list[str] = []

    class Engines:
        async def state(self, ref: EngineRef) -> EngineState:
            asked.append(ref.name)
            answer = answers[ref.name]
            if isinstance(answer, Exception):
                raise answer
            return answer

    shared = SimpleNamespace(engines=Engines(), owned=OwnedObjects())
    loop = FleetLoop(shared, FLEET, {}, {}, {})  # type: ignore[arg-type]
    engines = [obs(0), obs(1)]
    ten_s = functools.partial(plan.state_max_age, busy=False, busy_s=1.0, idle_s=10.0)  # at rest
    busy = EngineCallError(EngineRef("f-engine-1", "http://x"), "GET", "/state", "no answer within 5s")

    async def go() -> None:
        answers.update({"f-engine-0": state(version="v1"), "f-engine-1": state(version="v1")})
        first = await loop._poll_states(engines, max_age=ten_s)  # an engine's first state: read in the pass
        assert {n: s and s.weight_version for n, s in first.items()} == {"f-engine-0": "v1", "f-engine-1": "v1"}
        for name, (at, st) in list(loop._states.items()):
            loop._states[name] = (at - 11, st)  # both stale now
        answers.update({"f-engine-0": state(version="v2"), "f-engine-1": busy})
        second = await loop._poll_states(engines, max_age=ten_s)
        assert {s and s.weight_version for s in second.values()} == {"v1"}  # the pass did not wait for them
        await asyncio.gather(*loop._refreshing.values())
        third = await loop._poll_states(engines, max_age=ten_s)
        assert third["f-engine-0"] is not None and third["f-engine-0"].weight_version == "v2"
        assert loop._wake_early  # a version changed: pass again soon
        assert third["f-engine-1"] is not None and third["f-engine-1"].weight_version == "v1"  # kept, asked again
        await asyncio.gather(*loop._refreshing.values())

    asyncio.run(go())
    assert asked.count("f-engine-1") == 3


class Connecting:
    """Engines whose pause and resume calls take two turns of the loop before they are sent (a connection opened,
    then the request written); an engine in `answers` answers once its event is set, the others at once."""

    def __init__(self, answers: dict[str, asyncio.Event] | None = None) -> None:
        self.answers = answers or {}
        self.log: list[tuple[str, str]] = []  # ("begun" | "sent", engine name), in order

    def with_token(self, _: str) -> Connecting:
        return self

    async def pause(self, ref: EngineRef, mode: str) -> None:
        await self._call(ref)

    async def resume(self, ref: EngineRef) -> None:
        await self._call(ref)

    async def _call(self, ref: EngineRef) -> None:
        self.log.append(("begun", ref.name))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.log.append(("sent", ref.name))
        if ref.name in self.answers:
            await self.answers[ref.name].wait()


def test_a_fan_out_sends_its_first_calls_before_it_begins_its_last() -> None:
    """Begun all at once, a pause's 2,000 calls each opened a connection before any sent its request: the first
    engine paused as late as the last (bench_scale)."""
    engines = Connecting()
    loop = FleetLoop(SimpleNamespace(engines=engines, owned=OwnedObjects()), FLEET, {}, {}, {})  # type: ignore[arg-type]
    n = FAN_OUT_BATCH * 4
    calls = [(plan.PauseCall(f"f-engine-{i}", "keep"), f"10.0.0.{i}") for i in range(n)]

    async def go() -> None:
        await loop._begin_calls([*calls, (plan.PauseCall("f-engine-no-ip", "keep"), None)], "token")
        await asyncio.gather(*loop._calls.values())

    asyncio.run(go())
    assert engines.log.index(("sent", "f-engine-0")) < engines.log.index(("begun", f"f-engine-{n - 1}"))
    assert sorted(name for what, name in engines.log if what == "sent") == sorted(c.name for c, _ in calls)


def test_the_loop_wakes_once_the_fan_outs_last_call_ends_not_at_each() -> None:
    """A wake-up for each call that ended made a pass of 2,000 engines every 0.25 s while the rest were going."""

    async def go() -> list[tuple[str, str]]:
        answers = {"f-engine-0": asyncio.Event(), "f-engine-1": asyncio.Event()}
        engines = Connecting(answers)
        loop = FleetLoop(SimpleNamespace(engines=engines, owned=OwnedObjects()), FLEET, {}, {}, {})  # type: ignore[arg-type]
        resume = (plan.ResumeCall("f-engine-0"), "10.0.0.1")
        await loop._begin_calls([resume, (plan.PauseCall("f-engine-1", "wait"), "10.0.0.2")], "token")
        await loop._begin_calls([resume], "token")  # in flight: not begun again
        answers["f-engine-0"].set()
        await loop._calls["f-engine-0"]
        assert not loop._wake_early  # f-engine-1's call goes on
        answers["f-engine-1"].set()
        await asyncio.gather(*loop._calls.values())
        assert loop._wake_early and not loop._calls
        return engines.log

    log = asyncio.run(go())
    assert [name for what, name in log if what == "begun"] == ["f-engine-0", "f-engine-1"]
