"""From what a RolloutRequest's run observed to its status subresource.

Pure. `Tally` counts stored results (the durable truth: counts are rebuilt from the
results store after a restart); `finished_verdict` says how a run that has no sample
left ends; `request_status` renders phase, counts, progress, tokens, versions, times,
results location, abort record and conditions; `runner_verdict` is what the operator says
of a runner that cannot say it itself. Talks to nobody.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rollfleet.api.common import Condition
from rollfleet.api.request import (
    TERMINAL_PHASES,
    AbortRecord,
    Counts,
    RequestPhase,
    ResultsRef,
    RolloutRequestStatus,
)
from rollfleet.controller.requests.plan import Outcome, SampleResult, Summary
from rollfleet.controller.status import _condition, not_running_reason

MAX_VERSIONS = 64  # status.weightVersions keeps the newest ones


@dataclass
class Tally:
    """Counts over the stored results of one request."""

    completed: int = 0
    aborted: int = 0
    failed: int = 0
    tokens: int = 0
    versions: list[str] = field(default_factory=list)
    first_error: str | None = None

    def add(self, result: SampleResult | Summary) -> None:
        outcome = result.outcome
        if outcome is Outcome.COMPLETED:
            self.completed += 1
        elif outcome is Outcome.ABORTED:
            self.aborted += 1
        else:
            self.failed += 1
            self.first_error = self.first_error or result.error
        self.tokens += result.tokens
        for v in result.weight_versions:
            if v not in self.versions:
                self.versions.append(v)
        del self.versions[:-MAX_VERSIONS]

    @property
    def stored(self) -> int:
        return self.completed + self.aborted + self.failed


@dataclass(frozen=True)
class Verdict:
    phase: RequestPhase
    reason: str
    message: str

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


def fleet_not_found(fleet: str, namespace: str) -> Verdict:
    return Verdict("Failed", "FleetNotFound", f"RolloutFleet {fleet!r} does not exist in namespace {namespace!r}")


def results_claim_not_found(claim: str, namespace: str) -> Verdict:
    return Verdict(
        "Failed",
        "ResultsVolumeNotFound",
        f"PersistentVolumeClaim {claim!r} (spec.results.persistentVolumeClaim) does not exist in namespace "
        f"{namespace!r}: create it, then create the request again",
    )


def _failed(job: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Job's Failed condition, when it failed for good."""
    failed = next((c for c in (job.get("status") or {}).get("conditions") or [] if c.get("type") == "Failed"), None)
    return failed if failed is not None and failed.get("status") == "True" else None


def runner_pods_matter(job: Mapping[str, Any] | None, phase: str | None) -> bool:
    """Whether `runner_verdict` reads the runner's pods: its Job failed, or the runner has not written a status yet.
    Otherwise the operator does not list them (a list reads every pod of the namespace)."""
    return job is not None and (_failed(job) is not None or phase in (None, "Pending"))


def runner_verdict(
    job: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]], phase: str | None
) -> Verdict | None:
    """What the request's status must say of its runner, which cannot say it itself: its Job failed
    for good (every pod it was allowed failed), or, before the runner wrote any status, its pod
    cannot start (image, scheduling, volume). None while the runner speaks for itself."""
    if job is None:
        return None
    name = job["metadata"]["name"]
    last = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)
    why = None
    if last is not None:
        pod_status = last.get("status") or {}
        conditions = {c.get("type"): c for c in pod_status.get("conditions") or []}
        why = not_running_reason(pod_status, conditions, what="runner")
    failed = _failed(job)
    if failed is not None:
        return Verdict(
            "Failed",
            "RunnerFailed",
            f"the runner Job {name} failed ({failed.get('reason')}: {failed.get('message')})"
            + (f"; its last pod: {why}" if why else "")
            + f"; see `kubectl logs job/{name}`; the results so far are kept",
        )
    if phase in (None, "Pending") and last is not None and (last.get("status") or {}).get("phase") == "Pending" and why:
        return Verdict("Pending", "RunnerNotStarted", f"the runner pod {last['metadata']['name']} cannot start: {why}")
    return None


def finished_verdict(tally: Tally, total: int) -> Verdict:
    """Every sample has a result: Succeeded, or Failed when some sample failed (their errors are stored)."""
    if tally.failed:
        return Verdict(
            "Failed", "SamplesFailed", f"{tally.failed} of {total} samples failed; first: {tally.first_error}"
        )
    return Verdict("Succeeded", "Completed", f"all {total} samples completed")


def request_status(
    previous: RolloutRequestStatus | None,
    *,
    verdict: Verdict,
    tally: Tally,
    total: int,
    in_flight: int,
    generation: int | None,
    now: datetime,
    results: ResultsRef,
    digest: str | None = None,
    start_time: datetime | None = None,
    abort: AbortRecord | None = None,
) -> dict[str, Any]:
    """The status subresource (wire form) for one moment of the run."""
    prev = previous or RolloutRequestStatus()
    status = RolloutRequestStatus(
        observed_generation=generation,
        phase=verdict.phase,
        reason=verdict.reason,
        message=verdict.message,
        progress=f"{tally.stored}/{total}",
        counts=Counts(
            total=total, completed=tally.completed, aborted=tally.aborted, failed=tally.failed, in_flight=in_flight
        ),
        tokens=tally.tokens,
        weight_versions=list(tally.versions),
        prompts_digest=digest or prev.prompts_digest,
        start_time=start_time or prev.start_time,
        completion_time=prev.completion_time or (now if verdict.terminal else None),
        results=results,
        abort=abort or prev.abort,
        conditions=_conditions(prev, verdict, generation, now),
    )
    return status.wire()


def status_with_verdict(
    previous: RolloutRequestStatus | None, verdict: Verdict, generation: int | None, now: datetime, total: int
) -> dict[str, Any]:
    """The status as the runner left it, with the operator's verdict on a runner that cannot speak
    for itself (`runner_verdict`): counts, results and times kept; nothing in flight once terminal.
    `total`: the samples asked for, as far as the operator knows (inline prompts; 0 otherwise)."""
    prev = previous or RolloutRequestStatus()
    counts = prev.counts.model_copy(update={"total": prev.counts.total or total})
    if verdict.terminal:
        counts.in_flight = 0
    stored = counts.completed + counts.aborted + counts.failed
    status = prev.model_copy(
        update={
            "observed_generation": generation,
            "phase": verdict.phase,
            "reason": verdict.reason,
            "message": verdict.message,
            "counts": counts,
            "progress": f"{stored}/{counts.total}",
            "completion_time": prev.completion_time or (now if verdict.terminal else None),
            "conditions": _conditions(prev, verdict, generation, now),
        }
    )
    return status.wire()


def _conditions(prev: RolloutRequestStatus, verdict: Verdict, generation: int | None, now: datetime) -> list[Condition]:
    conditions = [
        _condition(
            prev.conditions,
            "Running",
            verdict.phase == "Running",
            verdict.reason if verdict.phase == "Running" else "NotRunning",
            verdict.message if verdict.phase == "Running" else "",
            generation,
            now,
        ),
        _condition(
            prev.conditions,
            "Paused",
            verdict.phase == "Paused",
            verdict.reason if verdict.phase == "Paused" else "NotPaused",
            verdict.message if verdict.phase == "Paused" else "",
            generation,
            now,
        ),
    ]
    for phase, ctype in (("Succeeded", "Complete"), ("Failed", "Failed"), ("Aborted", "Aborted")):
        if verdict.phase == phase:
            conditions.append(
                _condition(prev.conditions, ctype, True, verdict.reason, verdict.message, generation, now)
            )
    return conditions
