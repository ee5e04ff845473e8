"""Builders of engine observations for the controller's unit tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rollfleet.controller.status import Engine, EngineObs, WeightView, classify
from rollfleet_engine.protocol import EngineState

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
HASH = "h-new"
NO_WEIGHTS = WeightView(version=None, pending_sync=frozenset(), syncing=False)


def state(
    paused: bool = False, running: int = 0, waiting: int = 0, version: str = "v0", mode: str | None = None
) -> EngineState:
    return EngineState(
        model="tiny",
        weight_version=version,
        paused=paused,
        pause_mode=mode,  # type: ignore[arg-type]
        running=running,
        waiting=waiting,
    )


def obs(
    index: int,
    *,
    fleet: str = "f",
    template_hash: str = HASH,
    phase: str = "Running",
    ready: bool = True,
    annotated: str | None = "Ready",
    engine: EngineState | None = None,
    **over: Any,
) -> EngineObs:
    fields: dict[str, Any] = dict(
        name=f"{fleet}-engine-{index}",
        index=index,
        template_hash=template_hash,
        pod_phase=phase,
        ready=ready,
        terminating=False,
        annotated_phase=annotated,
        draining_since=None,
        node="gpu-0",
        node_lost=False,
        pod_ip=f"127.10.0.{index + 1}",
        reason=None,
        state=engine if engine is not None else (state() if ready and phase == "Running" else None),
    )
    fields.update(over)
    return EngineObs(**fields)


def engine(index: int, weights: WeightView = NO_WEIGHTS, fleet_paused: bool = False, **over: Any) -> Engine:
    return classify(obs(index, **over), weights, fleet_paused, require_sync=True)


def draining(index: int, seconds_ago: float, in_flight: int, **over: Any) -> Engine:
    return engine(
        index,
        annotated="Draining",
        draining_since=NOW - timedelta(seconds=seconds_ago),
        engine=state(running=in_flight),
        **over,
    )
