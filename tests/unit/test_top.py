"""`rollfleet top`'s decisions (rollfleet.top): tokens per engine from the gateways' scrapes, rows and the screen.
Against a cluster: e2e/test_top.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import generate_latest

from rollfleet.api.common import Condition
from rollfleet.api.fleet import EngineStatus, PauseStatus, RolloutFleetStatus
from rollfleet.contract import EnginePhase
from rollfleet.gateway.metrics import Metrics
from rollfleet.top import FleetView, engine_rows, render, tokens_by_engine

NOW = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


def scrape(**tokens: int) -> str:
    m = Metrics()
    for engine, n in tokens.items():
        m.tokens_served(engine.replace("_", "-"), "0", n)
        m.tokens_served(engine.replace("_", "-"), "1", 1)  # every lag counts
    return generate_latest(m.registry).decode()


def status(paused: bool = False) -> RolloutFleetStatus:
    return RolloutFleetStatus(
        ready_replicas=1,
        weight_version="b-1",
        engines=[
            EngineStatus(
                name="f-engine-0", index=0, phase=EnginePhase.READY, weight_version="b-1", in_flight=4, node="w1"
            ),
            EngineStatus(name="f-engine-1", index=1, phase=EnginePhase.STARTING),
        ],
        pause=PauseStatus(mode="keep", since=NOW - timedelta(seconds=12), paused_engines=1) if paused else None,
        conditions=[Condition(type="Degraded", status="True", reason="EngineFailed")],
    )


def test_tokens_are_summed_over_the_gateway_replicas() -> None:
    assert tokens_by_engine([scrape(f_engine_0=100), scrape(f_engine_0=20, f_engine_1=5)]) == {
        "f-engine-0": 122.0,
        "f-engine-1": 6.0,
    }
    assert tokens_by_engine([]) == {}


def test_rows_give_tokens_per_second_between_two_scrapes() -> None:
    first = engine_rows(status(), {"f-engine-0": 100.0}, None, 0.0)
    assert [(r.name, r.phase, r.version, r.running, r.tokens_per_s, r.node) for r in first] == [
        ("f-engine-0", "Ready", "b-1", "4", "-", "w1"),  # one scrape: no rate yet
        ("f-engine-1", "Starting", "-", "-", "-", "-"),
    ]
    later = engine_rows(status(), {"f-engine-0": 160.0}, {"f-engine-0": 100.0}, 2.0)
    assert later[0].tokens_per_s == "30.0" and later[1].tokens_per_s == "-"  # no request sent to it yet
    restarted = engine_rows(status(), {"f-engine-0": 10.0}, {"f-engine-0": 100.0}, 2.0)
    assert restarted[0].tokens_per_s == "5.0"  # a gateway replica restarted: its counter from zero


def test_the_screen_has_a_headline_and_an_aligned_table_per_fleet() -> None:
    view = FleetView("rl", "f", status(paused=True), 2, engine_rows(status(), {}, None, 0.0))
    lines = render([view], NOW).splitlines()
    assert lines[0] == "rl/f: 1/2 ready; weights b-1; paused (keep) for 12s, 1 engine paused; Degraded"
    assert lines[1].split() == ["ENGINE", "PHASE", "WEIGHTS", "RUNNING", "TOKENS/S", "NODE"]
    assert lines[2].split() == ["f-engine-0", "Ready", "b-1", "4", "-", "w1"]
    assert lines[1].index("PHASE") == lines[2].index("Ready") == lines[3].index("Starting")
    assert render([], NOW) == "no RolloutFleet here\n"
