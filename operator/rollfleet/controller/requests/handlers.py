"""kopf registration for RolloutRequest: each request's runner, supervised.

The operator does not send samples: each running request gets a runner (`desired`: a Job
whose pod runs `rollfleet request-runner`, `worker`, with a ServiceAccount and Role of its
own), so a busy request costs the operator nothing and an operator restart stops no sample.
A long-lived task per request (`tasks.ObjectTasks`, the fleets' idiom) keeps the runner in
place while the request runs and speaks for a runner that cannot speak itself: a pod that
cannot start, a Job that failed for good (`status.runner_verdict`). A finished request keeps
its task only until its TTL, then is deleted. A deleted request's task stops its samples at
the gateway, should its runner have gone before it could.

The clients the tasks share (the API server's, through `rollfleet.kube`, and the HTTP client
to gateways) live in kopf's memo from startup to cleanup. Talks to kube-apiserver (the
runner's objects, its pods, the request's status) and to gateways (`runner.gateway_abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Mapping
from datetime import UTC, datetime
from typing import Any

import httpx
import kopf
import prometheus_client

from rollfleet.api.request import KIND, PLURAL, TERMINAL_PHASES, RolloutRequest, RolloutRequestSpec
from rollfleet.contract import GROUP, LABEL_REQUEST_UID, VERSION, runner_name
from rollfleet.controller.events import event_manifest
from rollfleet.controller.metrics import RequestMetrics
from rollfleet.controller.owner import RequestRef
from rollfleet.controller.requests import plan, runner
from rollfleet.controller.requests.desired import runner_objects
from rollfleet.controller.requests.spare_pool import SparePool
from rollfleet.controller.requests.status import (
    Verdict,
    fleet_not_found,
    results_claim_not_found,
    runner_pods_matter,
    runner_verdict,
    status_with_verdict,
)
from rollfleet.controller.tasks import LiveBody, ObjectTasks, Stop
from rollfleet.controller.tokens import OperatorKey
from rollfleet.kube import (
    FLEET,
    JOB,
    JOB_NAME_LABEL,
    PERSISTENT_VOLUME_CLAIM,
    POD,
    REQUEST,
    ApiError,
    Kube,
    NotFound,
    Obj,
    load_client,
)

SUPERVISE_INTERVAL_S = 2.0  # how often a running request's runner Job and pods are looked at
ABORT_WAIT_S = 5.0

log = logging.getLogger(__name__)


@kopf.on.startup()
async def open_clients(memo: kopf.Memo, **_: Any) -> None:
    # Clients of their own, apart from the fleets': request supervision does not queue fleet calls.
    memo.request_kube = Kube(load_client())
    memo.request_http = runner.gateway_client()
    memo.request_tasks = ObjectTasks("request", wanted=_needs_task)
    memo.request_spares = SparePool(memo.request_kube, memo.runner_image)
    memo.request_metrics = RequestMetrics(prometheus_client.REGISTRY)  # served on --metrics-port


@kopf.on.cleanup()
async def close_clients(memo: kopf.Memo, **_: Any) -> None:
    await memo.request_tasks.stop_all()
    memo.request_metrics.close()
    await memo.request_http.aclose()
    memo.request_kube.close()


def _needs_task(body: Mapping[str, Any]) -> bool:
    """Running requests, and finished ones still waiting for their TTL: others cost no task."""
    return _phase(body) not in TERMINAL_PHASES or body["spec"].get("ttlSecondsAfterFinished") is not None


def _phase(body: Mapping[str, Any]) -> str | None:
    phase = (body.get("status") or {}).get("phase")
    return str(phase) if phase is not None else None


@kopf.on.event(GROUP, VERSION, PLURAL)
async def request_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    tasks: ObjectTasks = memo.request_tasks
    memo.request_metrics.seen(event.get("type"), event["object"])
    tasks.on_event(
        event.get("type"),
        event["object"],
        lambda body: RequestRun(
            memo.request_kube, memo.operator_key, memo.request_http, memo.runner_image, memo.request_spares, body
        ),
    )


async def _exists(read: Awaitable[Any]) -> bool:
    try:
        await read
    except NotFound:
        return False
    return True


class RequestRun:
    """A request's task: its runner until the request ends, then its deletion once its TTL passed."""

    def __init__(
        self, kube: Kube, key: OperatorKey, http: httpx.AsyncClient, image: str, spares: SparePool, body: LiveBody
    ) -> None:
        self.kube, self.key, self.http, self.image, self.spares, self.body = kube, key, http, image, spares, body
        self.ref = RequestRef.of(dict(body))

    async def run(self, stop: Stop) -> None:
        finished_at = None
        if _phase(self.body) not in TERMINAL_PHASES:
            await self._supervise(stop)
            if stop:
                if stop.deleted:
                    await self._stop_samples()
                return
            finished_at = time.time()
            await self._keep_a_spare()
        await runner.expire(self.kube, self.body, stop.wait, finished_at)

    async def close(self) -> None:
        return

    async def exists(self) -> bool:
        return await self.kube.exists(REQUEST, self.ref.namespace, self.ref.name, self.ref.uid)

    async def _supervise(self, stop: Stop) -> None:
        """Keep the runner in place until the request is terminal; say what its runner cannot."""
        spec = RolloutRequest.model_validate(dict(self.body)).spec
        ns = self.ref.namespace
        said: Verdict | None = None
        # At first, what making a runner needs is read beside its Job: a request that takes a spare runs as soon as
        # the spare learns of it.
        job, needs = await asyncio.gather(self._runner_job(spec), self._runner_needs(spec))
        while not stop:
            if job is None:
                failed = await self._make_runner(spec, needs if needs is not None else await self._runner_needs(spec))
                if failed is not None:
                    await self._say(failed)
                    return
            else:
                phase, pods = _phase(self.body), []
                if runner_pods_matter(job, phase):
                    pods = await self.kube.list(POD, ns, f"{JOB_NAME_LABEL}={job['metadata']['name']}")
                verdict = runner_verdict(job, pods, phase)
                if verdict is not None and verdict != said:
                    await self._say(verdict)
                    said = verdict
                    if verdict.terminal:
                        return
            await stop.wait(SUPERVISE_INTERVAL_S)
            if stop or _phase(self.body) in TERMINAL_PHASES:
                return
            job, needs = await self._runner_job(spec, job["metadata"]["name"] if job else None), None

    async def _runner_job(self, spec: RolloutRequestSpec, known: str | None = None) -> Mapping[str, Any] | None:
        """The Job that runs the request: its own, or the spare it took (labelled for it once taken). `known`: its
        name at the last look, read first (the lists below read every Job and ConfigMap of the namespace)."""
        if known is not None:
            with contextlib.suppress(NotFound):
                job = await self.kube.get(JOB, self.ref.namespace, known)
                if job["metadata"].get("labels", {}).get(LABEL_REQUEST_UID) == self.ref.uid:
                    return job
        jobs, spare = await asyncio.gather(
            self.kube.list(JOB, self.ref.namespace, f"{LABEL_REQUEST_UID}={self.ref.uid}"),
            self.spares.taken_by(self.ref),
        )
        if jobs:
            return jobs[0]
        if spare is None:
            return None
        # Taken by an operator that stopped before it made the Job the request's: finish that.
        await self.spares.finish_taking(self.ref, spec, spare)
        return await self.kube.get(JOB, self.ref.namespace, spare)

    async def _runner_needs(self, spec: RolloutRequestSpec) -> Verdict | list[Obj]:
        """What making a runner needs: the spare runners that wait for the request's fleet and claim; or, when the
        fleet or the claim does not exist, the verdict (no pod is spent on a request that one would wait on for
        ever). All read at once."""
        ns = self.ref.namespace
        claim = spec.results.persistent_volume_claim
        if claim is None:
            return [] if await _exists(self.kube.get(FLEET, ns, spec.fleet)) else fleet_not_found(spec.fleet, ns)
        fleet, found, spares = await asyncio.gather(
            _exists(self.kube.get(FLEET, ns, spec.fleet)),
            _exists(self.kube.get(PERSISTENT_VOLUME_CLAIM, ns, claim.claim_name)),
            self.spares.untaken(ns, spec.fleet, claim.claim_name),
        )
        if not fleet:
            return fleet_not_found(spec.fleet, ns)
        if not found:
            return results_claim_not_found(claim.claim_name, ns)
        return spares

    async def _make_runner(self, spec: RolloutRequestSpec, needs: Verdict | list[Obj]) -> Verdict | None:
        """Take one of the spare runners (`needs`), or make the request's own (ServiceAccount, Role, RoleBinding,
        Job); the verdict when it cannot have one (`_runner_needs`)."""
        if isinstance(needs, Verdict):
            return needs
        ns = self.ref.namespace
        claim = spec.results.persistent_volume_claim
        if claim is not None and await self.spares.take(self.ref, spec, claim.claim_name, needs):
            return None
        for manifest in runner_objects(self.ref, spec, self.image, "IfNotPresent"):
            await self.kube.create_kept(manifest)  # made by an earlier try, or by the operator before a restart
        log.info("RolloutRequest %s/%s: runner Job %s created", ns, self.ref.name, runner_name(self.ref.name))
        return None

    async def _keep_a_spare(self) -> None:
        """The request ended: a spare runner waits for the next one of its fleet and claim (`spares`)."""
        spec = RolloutRequest.model_validate(dict(self.body)).spec
        claim = spec.results.persistent_volume_claim
        if claim is None:
            return
        try:
            await self.spares.keep(self.ref.namespace, spec.fleet, claim.claim_name)
        except ApiError as err:  # the next request starts a runner of its own
            log.warning("RolloutRequest %s/%s: no spare runner made: %s", self.ref.namespace, self.ref.name, err)

    async def _say(self, verdict: Verdict) -> None:
        ns, name = self.ref.namespace, self.ref.name
        rr = RolloutRequest.model_validate(dict(self.body))
        total = len(rr.spec.prompts or []) * rr.spec.samples_per_prompt
        status = status_with_verdict(
            rr.status, verdict, self.body["metadata"].get("generation"), datetime.now(UTC), total
        )
        with contextlib.suppress(NotFound):
            await self.kube.patch(REQUEST, ns, name, {"status": status}, status=True)
        log.warning("RolloutRequest %s/%s: %s (%s)", ns, name, verdict.reason, verdict.message)
        event = event_manifest(
            KIND, name, ns, self.ref.uid, "Warning", verdict.reason, verdict.message, datetime.now(UTC)
        )
        try:
            await self.kube.create(event)
        except ApiError as err:
            log.warning("event %s on %s/%s not posted: %s", verdict.reason, ns, name, err)

    async def _stop_samples(self) -> None:
        """The request was deleted: abort every sample id it has at the gateway (its runner, deleted with
        it, does the same; this covers a runner that was already gone). Ids that do not run are ignored."""
        rr = RolloutRequest.model_validate(dict(self.body))
        total = rr.status.counts.total if rr.status else 0
        if not total:
            return
        per_prompt = rr.spec.samples_per_prompt
        ids = [plan.sample_id(self.ref.uid, (p, s)) for p in range(total // per_prompt) for s in range(per_prompt)]
        try:
            fleet = await runner.read_fleet(self.kube, self.key, self.ref.namespace, rr.spec.fleet)
        except ApiError as err:
            log.warning(
                "RolloutRequest %s/%s deleted; its fleet cannot be read: %s", self.ref.namespace, self.ref.name, err
            )
            return
        _, error = await runner.gateway_abort(self.http, fleet, ids, ABORT_WAIT_S)
        if error is not None:
            log.warning(
                "RolloutRequest %s/%s deleted; its samples not aborted: %s", self.ref.namespace, self.ref.name, error
            )
