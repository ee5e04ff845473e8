"""The sync sidecar's metrics (rollfleet.sync.metrics): a push counted once, when it ends, as its status says."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from rollfleet.engine_client import EngineClient
from rollfleet.sync.engines import StaticDiscovery
from rollfleet.sync.metrics import PushMetrics
from rollfleet.sync.orchestrator import Orchestrator, Publisher
from rollfleet.sync.store import FileStore
from rollfleet_client.sync_protocol import EngineProgress, EngineStep, PushState, PushStatus


def ended_push(generation: int = 3) -> PushStatus:
    return PushStatus(
        generation=generation,
        version=f"v{generation}",
        state=PushState.DONE,
        bytes=1000,
        staging_s=0.5,
        prefetch_s=2.0,
        transfer_s=1.0,
        pause_window_s=1.25,
        total_s=4.0,
        aborted_stale=2,
        engines=[
            EngineProgress(name="e0", step=EngineStep.RESUMED, stage_s=1.5, transfer_s=0.75),
            EngineProgress(name="e1", step=EngineStep.RESUMED, stage_s=1.0, source="e0", transfer_s=0.5),
            EngineProgress(name="e2", step=EngineStep.PENDING_SYNC, error="unreachable"),
        ],
    )


def scrape(registry: CollectorRegistry) -> set[str]:
    return set(generate_latest(registry).decode().splitlines())


def test_an_ended_push_is_counted_by_result_phase_engine_step_and_source() -> None:
    metrics = PushMetrics(CollectorRegistry())
    metrics.ended(ended_push())
    lines = scrape(metrics.registry)
    for line in (
        'rollfleet_sync_pushes_total{result="done"} 1.0',
        'rollfleet_sync_push_phase_seconds_count{phase="pause_window"} 1.0',
        'rollfleet_sync_push_phase_seconds_sum{phase="pause_window"} 1.25',
        'rollfleet_sync_engine_step_seconds_count{step="stage"} 2.0',
        'rollfleet_sync_engine_step_seconds_count{step="load"} 2.0',
        'rollfleet_sync_engine_stages_total{source="sidecar"} 1.0',
        'rollfleet_sync_engine_stages_total{source="relay"} 1.0',
        "rollfleet_sync_relay_bytes_total 1000.0",
        "rollfleet_sync_pushed_bytes_total 1000.0",
        'rollfleet_sync_engines_left_behind_total{step="pending-sync"} 1.0',
        "rollfleet_sync_aborted_stale_requests_total 2.0",
        "rollfleet_sync_generation 3.0",
    ):
        assert line in lines, line
    # A phase the push did not have (no receive: weights from a directory) has no observation.
    assert 'rollfleet_sync_push_phase_seconds_count{phase="receive"} 0.0' in lines
    # Results it did not have are at 0, not absent: an alert's increase() sees the first failure.
    assert 'rollfleet_sync_pushes_total{result="failed"} 0.0' in lines


def test_a_rolled_back_push_leaves_the_generation_where_the_fleet_is() -> None:
    metrics = PushMetrics(CollectorRegistry())
    metrics.ended(ended_push(1))
    rolled_back = ended_push(2)
    rolled_back.state = PushState.ROLLED_BACK
    metrics.ended(rolled_back)
    lines = scrape(metrics.registry)
    assert "rollfleet_sync_generation 1.0" in lines
    assert 'rollfleet_sync_pushes_total{result="rolled-back"} 1.0' in lines


def test_the_orchestrator_counts_each_push_once_however_often_it_notifies(tmp_path: Path) -> None:
    async def run() -> set[str]:
        orch = Orchestrator(
            store=FileStore(tmp_path / "record.json"),
            discovery=StaticDiscovery([]),
            api=EngineClient("token"),
            publisher=Publisher("127.0.0.1", 0),
            spool=tmp_path / "spool",
        )
        try:
            running = ended_push()
            running.state = PushState.RUNNING
            orch.remember(running)
            await orch.notify()  # still running: nothing counted
            assert 'rollfleet_sync_pushes_total{result="done"} 1.0' not in scrape(orch.metrics.registry)
            running.state = PushState.DONE
            await orch.notify()
            await orch.notify()
            return scrape(orch.metrics.registry)
        finally:
            await orch.api.aclose()

    assert 'rollfleet_sync_pushes_total{result="done"} 1.0' in asyncio.run(run())
