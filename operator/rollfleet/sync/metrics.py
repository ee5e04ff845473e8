"""The sync sidecar's metrics: each push counted once, when it ends (`PushMetrics.ended`, from the
orchestrator's record of its pushes), and served on the sidecar's health port. Names and help:
`rollfleet.metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rollfleet import metrics as m
from rollfleet_client.sync_protocol import EngineStep, PushState, PushStatus


class PushMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.pushes = m.counter(m.SYNC_PUSHES, registry)
        self.phase_seconds = m.histogram(m.SYNC_PUSH_PHASE_SECONDS, registry)
        self.bytes = m.counter(m.SYNC_PUSHED_BYTES, registry)
        self.engine_seconds = m.histogram(m.SYNC_ENGINE_STEP_SECONDS, registry)
        self.stages = m.counter(m.SYNC_ENGINE_STAGES, registry)
        self.relay_bytes = m.counter(m.SYNC_RELAY_BYTES, registry)
        self.left_behind = m.counter(m.SYNC_ENGINES_LEFT_BEHIND, registry)
        self.aborted_stale = m.counter(m.SYNC_ABORTED_STALE, registry)
        self.generation = m.gauge(m.SYNC_GENERATION, registry)
        # Children at 0 from the start: `increase()` over a series that appears at 1 misses the first failure.
        for state in (s for s in PushState if s.terminal):
            self.pushes.labels(state.value)
        for step in (EngineStep.PENDING_SYNC, EngineStep.FAILED):
            self.left_behind.labels(step.value)

    def ended(self, push: PushStatus) -> None:
        """Count a push that ended (its state terminal); once per push."""
        self.pushes.labels(push.state.value).inc()
        phases = {
            "receive": push.receive_s,
            "staging": push.staging_s,
            "prefetch": push.prefetch_s,
            "transfer": push.transfer_s,
            "pause_window": push.pause_window_s,
            "total": push.total_s,
        }
        for phase, seconds in phases.items():
            if seconds is not None:
                self.phase_seconds.labels(phase).observe(seconds)
        self.bytes.inc(push.bytes)
        for e in push.engines:
            if e.stage_s is not None:
                self.engine_seconds.labels("stage").observe(e.stage_s)
                self.stages.labels("relay" if e.source else "sidecar").inc()
                if e.source:
                    self.relay_bytes.inc(push.bytes)
            if e.transfer_s is not None:
                self.engine_seconds.labels("load").observe(e.transfer_s)
            if e.step in (EngineStep.PENDING_SYNC, EngineStep.FAILED):
                self.left_behind.labels(e.step.value).inc()
        self.aborted_stale.inc(push.aborted_stale)
        if push.state is PushState.DONE:
            self.generation.set(push.generation)
