"""The sync sidecar's metrics: each push counted once, when it ends (`PushMetrics.ended`, from the
orchestrator's record of its pushes), and served on the sidecar's health port. Names and help:
`rollfleet.metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rollfleet import metrics as m
from rollfleet_client.sync_protocol import EngineStep, PushState, PushStatus

PHASES = ("receive", "staging", "prefetch", "transfer", "pause_window", "total")  # PushStatus's *_s, in order


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
        for phase in PHASES:
            self.phase_seconds.labels(phase)
        for engine_step in ("stage", "load"):
            self.engine_seconds.labels(engine_step)
        for source in ("sidecar", "relay"):
            self.stages.labels(source)

    def ended(self, push: PushStatus) -> None:
        """Count a push that ended (its state terminal); once per push."""
        self.pushes.labels(push.state.value).inc()
        phases = (push.receive_s, push.staging_s, push.prefetch_s, push.transfer_s, push.pause_window_s, push.total_s)
        for phase, seconds in zip(PHASES, phases, strict=True):
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
