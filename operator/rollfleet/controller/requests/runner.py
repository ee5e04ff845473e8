"""Runs one RolloutRequest: sends its samples through the fleet's gateway and records them.

Owns the run loop of a request (in its runner Job's pod, `worker`): observe the
fleet (exists? paused? gateway reachable?), act on a new abort annotation or a passed
deadline, send samples with bounded concurrency, store every finished sample in the
results store, and patch status at a bounded rate. Decisions come from `plan` and
`status` (pure); this module does the I/O.

Talks to kube-apiserver (the fleet and its gateway Service, prompt ConfigMaps, result
ConfigMaps, the request's status, an Event at its end; through `rollfleet.kube`)
and to the fleet's gateway (`<fleet>-gateway` Service: generation routes and
`POST /v1/abort`, which stops an id on whatever engine runs it and says so truthfully).

Restart safety: an id is re-sent only after the gateway said it no longer runs
(aborted, finished or unknown, with the engine list synced). After an operator restart
the samples an earlier run may have sent are stopped first (`plan.maybe_sent`); after
a broken call (gateway restart) that sample is stopped first. Results are written
before anything depends on them, so a sample is stored exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import httpx
import orjson

from rollfleet.api.request import KIND, TERMINAL_PHASES, AbortRecord, Prompt, ResultsRef, RolloutRequest
from rollfleet.contract import ANNOTATION_ABORT, GATEWAY_PORT, gateway_name
from rollfleet.controller.events import event_manifest
from rollfleet.controller.requests import plan
from rollfleet.controller.requests.plan import Outcome, PromptError, SampleKey, SampleResult
from rollfleet.controller.requests.results import ResultStore
from rollfleet.controller.requests.results_volume import RESULTS_MOUNT, FileStore, ResultsVolumeError, VolumeFailure
from rollfleet.controller.requests.status import Tally, Verdict, finished_verdict, fleet_not_found, request_status
from rollfleet.controller.status import parse_time
from rollfleet.controller.tasks import Stop
from rollfleet.controller.tokens import FleetTokens
from rollfleet.kube import CONFIG_MAP, FLEET, REQUEST, SERVICE, ApiError, Conflict, Kube, NotFound
from rollfleet.upstream import Response, Upstream, UpstreamError
from rollfleet_client.protocol import WEIGHT_VERSION_HEADER

# Status patches per request: at most one every 2 s (phase changes go at once). The API server validates and stores
# the whole object at each, inline prompts included: 25 ms of its CPU for a request of 512.
STATUS_INTERVAL_S = 2.0
FLUSH_INTERVAL_S = 0.5  # results wait at most this long before they are written
MAX_UNFLUSHED = 1024  # and no more samples are sent while this many results are unwritten (half: a write is due)
FLEET_INTERVAL_S = 1.0  # how often the fleet and gateway are looked at
TICK_S = 0.1  # the loop wakes at least this often (abort annotation, deadline)
ABORT_WAIT_S = 10.0  # how long an abort waits for the aborted calls to come back with their partial output
ABORT_RESEND_S = 0.25  # calls still out after an abort are aborted again this often (one may have been in transit)
ABORT_BATCH = 4096  # ids per POST /v1/abort (the gateway's limit)
STALL_S = 120.0  # samples waiting, the fleet ready, none in flight this long: a bug, reported by failing

# Each in-flight sample holds one connection to its gateway (up to spec.parallelism, <= 4096).
IDLE_CONNECTION_S = 30.0  # a sample connection left idle this long is closed: below the gateway's 75 s keep-alive
WEIGHT_VERSION = WEIGHT_VERSION_HEADER.lower().encode()  # as a response's raw headers name it

KEEPALIVE = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
]

log = logging.getLogger(__name__)


def gateway_client() -> httpx.AsyncClient:
    """The HTTP client for a gateway's control routes (`/ready`, `POST /v1/abort`); samples go through
    `sample_client`."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        transport=httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            socket_options=KEEPALIVE,
        ),
    )


def sample_client() -> Upstream:
    """The client of a run's samples: the gateway's own hot-path client (httpx's pool cost more CPU per
    sample than the gateway spent serving it). No read timeout: a sample may wait out a long weight sync
    on a paused engine; deadlines are ours. TCP keepalive instead finds a gateway gone without a word
    (its node lost): the call fails after about a minute, and the runner stops and resends the sample."""
    return Upstream(connect_timeout_s=5.0, idle_s=IDLE_CONNECTION_S, socket_options=KEEPALIVE)


async def post_sample(
    client: Upstream, gateway: str, call: plan.Call, token: str | None
) -> tuple[int, bytes, Response]:
    """Send one sample's call and read its answer whole: (status, body, response for its headers). A response
    not read to its end closes its connection, and the gateway stops the sample. UpstreamError when the gateway
    cannot be reached or broke off."""
    headers = [("Content-Type", "application/json"), *call.headers.items()]
    if token:  # the admin token (the runner's one credential) opens generation too, where the fleet asks for one
        headers.append(("Authorization", f"Bearer {token}"))
    resp = await client.request("POST", gateway + call.path, orjson.dumps(call.body), headers)
    try:
        return resp.status, await resp.read(), resp
    finally:
        resp.close()


@dataclass(frozen=True)
class FleetView:
    """The fleet as one look at the API server found it."""

    exists: bool
    model: str | None = None
    paused: str | None = None  # the pause mode, while paused
    gateway: str | None = None  # base URL of the gateway Service
    token: str | None = None
    weight_version: str | None = None


async def read_fleet(kube: Kube, tokens: FleetTokens, namespace: str, name: str) -> FleetView:
    """The fleet, its gateway Service's address and its admin token (`tokens`), as they are now."""
    # Both at once: a run's first look at them is on the way to its first sample.
    fleet, svc = await asyncio.gather(
        kube.get(FLEET, namespace, name), kube.get(SERVICE, namespace, gateway_name(name)), return_exceptions=True
    )
    if isinstance(fleet, NotFound):
        return FleetView(exists=False)
    for read in (fleet, svc):
        if isinstance(read, BaseException) and not isinstance(read, NotFound):
            raise read
    assert isinstance(fleet, Mapping)
    status = fleet.get("status") or {}
    view = FleetView(
        exists=True,
        model=fleet["spec"]["model"]["servedName"],
        paused=(status.get("pause") or {}).get("mode"),
        weight_version=status.get("weightVersion"),
    )
    if isinstance(svc, BaseException):  # NotFound: the fleet's operator has not created it yet
        return view
    ip = svc["spec"].get("clusterIP")
    gateway = f"http://{ip}:{GATEWAY_PORT}" if ip and ip != "None" else None
    token = await tokens.token(kube, namespace, name, fleet["metadata"]["uid"])
    return replace(view, gateway=gateway, token=token)


def results_store(kube: Kube, rr: RolloutRequest, namespace: str, name: str, uid: str) -> ResultStore | FileStore:
    """The request's results store: its file on the claim its spec names (mounted by its pod), else ConfigMaps."""
    volume = rr.spec.results.persistent_volume_claim
    if volume is not None:
        return FileStore(Path(RESULTS_MOUNT), volume, name, uid)
    return ResultStore(kube, namespace, name, uid)


async def load_prompts(kube: Kube, namespace: str, rr: RolloutRequest) -> list[Prompt]:
    if rr.spec.prompts is not None:
        return list(rr.spec.prompts)
    prompts: list[Prompt] = []
    for src in rr.spec.prompts_from or []:
        try:
            data = (await kube.get(CONFIG_MAP, namespace, src.name)).get("data") or {}
        except NotFound:
            raise PromptError(f"ConfigMap {src.name!r} (spec.promptsFrom) does not exist") from None
        if src.key not in data:
            raise PromptError(f"ConfigMap {src.name!r} has no key {src.key!r} (spec.promptsFrom)")
        prompts += plan.prompts_from_jsonl(data[src.key], f"ConfigMap {src.name}/{src.key}")
    if not prompts:
        raise PromptError("spec.promptsFrom holds no prompts")
    return prompts


class Run:
    """One request's run, from adoption (fresh or after a restart) to a terminal phase."""

    def __init__(
        self,
        kube: Kube,
        tokens: FleetTokens,
        http: httpx.AsyncClient,
        body: Mapping[str, Any],
        stop: Stop,
        fleet: FleetView | None = None,
    ) -> None:
        """`fleet`: the fleet as read just before (a spare reads it as it learns of its request); None: the run's
        first look reads it."""
        self.kube, self.tokens, self.http = kube, tokens, http
        self.samples = sample_client()  # its connections are this run's: closed with it
        self.body = body  # a live view: annotations change under us
        self.stop = stop
        meta = body["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.rr = RolloutRequest.model_validate(dict(body))
        self.store = results_store(kube, self.rr, self.ns, self.name, self.uid)
        self.volume_failure: VolumeFailure | None = None  # the results volume took no more
        self.tally = Tally()
        self.prompts: list[Prompt] = []
        self.total = 0
        self.digest: str | None = None
        self.start: datetime | None = self.rr.status.start_time if self.rr.status else None
        self.abort_record: AbortRecord | None = self.rr.status.abort if self.rr.status else None
        self.fleet = FleetView(exists=True)
        self.history: list[str] = []  # fleet weight versions seen, oldest first (staleness)
        self.fleet_read = fleet is not None
        if fleet is not None:
            self._saw(fleet)
        # The senders and the sample each is sending. A sender goes on with the next sample while sending may go on
        # (`_may_send`): a task and a turn of this loop per sample cost the runner more CPU than the call itself.
        self.calls: dict[asyncio.Task[None], SampleKey] = {}
        self.ended: list[asyncio.Task[None]] = []  # senders that stopped since the loop last looked
        self.wake = asyncio.Event()  # the loop has something to do before its tick: a sender stopped, a write is due
        self.unsure: set[SampleKey] = set()  # may still run somewhere: stop before sending again
        self.aborting = False
        self.abort_token: str | None = None  # the abort annotation value (or "deadline") being acted on
        self.hold_until = 0.0
        self.verdict = Verdict("Pending", "Starting", "starting")
        self.status_rate = plan.RateLimit(STATUS_INTERVAL_S)
        self.flush_rate = plan.RateLimit(FLUSH_INTERVAL_S)
        self.flushing: asyncio.Task[None] | None = None  # the results write under way: sending goes on meanwhile
        self.fleet_rate = plan.RateLimit(FLEET_INTERVAL_S)
        self.last_patched: Verdict | None = None
        # A look at the fleet and a status patch go on beside the sending: the loop sends no sample while it awaits
        # the API server, and at 64 samples in flight a wait of 20 ms drains the batch.
        self.looking: asyncio.Task[None] | None = None
        self.patching: asyncio.Task[None] | None = None
        self.stuck_since: float | None = None
        self.gateway_error: str | None = None  # why the gateway did not answer the last abort; None when it did

    # --- the loop -------------------------------------------------------------------
    async def run(self) -> Verdict:
        try:
            return await self._loop()
        finally:
            # A write in a thread cannot be cancelled, nor should a status patch be cut: let them end before closing.
            await asyncio.gather(*(t for t in (self.flushing, self.patching) if t), return_exceptions=True)
            if self.looking is not None:
                self.looking.cancel()
            self.store.close()
            # After a failure, a retry adopts what this run sent: its calls must not outlive it
            # (a cancelled call closes its connection, and the gateway stops the sample).
            senders = list(self.calls)
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            self.samples.close()

    async def _loop(self) -> Verdict:
        # The first look at the fleet (unless made before the run) goes beside loading the results and prompts; the
        # loop's looks start a second on.
        if not self.fleet_read:
            self.looking = asyncio.create_task(self._observe_fleet())
        verdict = await self._prepare()
        if self.looking is not None:
            await self.looking
        self.fleet_rate.due(time.time())
        if verdict is not None:
            return await self._finish(verdict)
        schedule = plan.Schedule(len(self.prompts), self.rr.spec.samples_per_prompt, self.store.results)
        if self.start is not None:  # an earlier run sent samples: stop any that may still run
            bound = len(self.store.results) + self.rr.spec.parallelism + MAX_UNFLUSHED
            self.unsure = set(
                plan.maybe_sent(len(self.prompts), self.rr.spec.samples_per_prompt, self.store.results, bound)
            )
        while True:
            now = time.time()
            if self.stop:
                await self._on_stop()
                return self.verdict
            if self.fleet_rate.due(now):
                await self._look_at_fleet()
            final = self._final_verdict(schedule, now)
            if final is not None:
                if final.phase != "Succeeded" and final.reason != "SamplesFailed":
                    await self._abort_in_flight(schedule, final)
                return await self._finish(final)
            if self.unsure and self.fleet.gateway and now >= self.hold_until:
                await self._stop_unsure()
            self._dispatch(schedule, now)
            f = self.fleet
            self.stuck_since = plan.stuck_since(
                self.stuck_since,
                in_flight=len(self.calls),
                waiting=len(schedule),
                can_send=bool(f.gateway and f.model and not f.paused and self.gateway_error is None),
                now=now,
            )
            await self._collect()
            await self._flush(urgent=False)
            await self._patch_status(len(schedule.in_flight))

    def _final_verdict(self, schedule: plan.Schedule, now: float) -> Verdict | None:
        if self.volume_failure is not None:
            return Verdict("Failed", self.volume_failure.reason, self.volume_failure.message)
        limit = self.store.limit
        if limit is not None and self.store.bytes > limit:
            return Verdict(
                "Failed",
                "ResultsTooLarge",
                f"the results reached {self.store.bytes / 2**20:.1f} MiB, more than ConfigMaps (in etcd) should hold "
                f"({limit // 2**20} MiB): set spec.results.persistentVolumeClaim; the samples so far are kept",
            )
        if schedule.idle and not self.unsure:
            return finished_verdict(self.tally, self.total)
        if self.stuck_since is not None and now - self.stuck_since >= STALL_S:
            log.error(
                "request %s/%s stuck: %d samples waiting, %d unconfirmed, %d results unwritten",
                self.ns,
                self.name,
                len(schedule),
                len(self.unsure),
                self.store.pending,
            )
            return Verdict(
                "Failed",
                "Stalled",
                f"no sample in flight for {STALL_S:.0f}s while {len(schedule)} wait and the fleet could take them "
                f"({len(self.unsure)} waiting for the gateway to confirm they stopped): a bug in the runner, "
                "please report it with the operator's log; the results so far are kept",
            )
        if not self.fleet.exists:
            return fleet_not_found(self.rr.spec.fleet, self.ns)
        token = plan.new_abort_token(
            self.body["metadata"].get("annotations"),
            self.abort_record.token if self.abort_record else None,
            ANNOTATION_ABORT,
        )
        if token is not None:
            self.abort_token = token
            return Verdict("Aborted", "AbortRequested", f"aborted by annotation {ANNOTATION_ABORT}={token}")
        left = plan.deadline_left(
            self.start.timestamp() if self.start else None, self.rr.spec.active_deadline_seconds, now
        )
        if left is not None and left <= 0:
            self.abort_token = "deadline"
            return Verdict(
                "Failed",
                "DeadlineExceeded",
                f"the request ran longer than activeDeadlineSeconds="
                f"{self.rr.spec.active_deadline_seconds}; in-flight samples were aborted",
            )
        return None

    async def _prepare(self) -> Verdict | None:
        """Load stored results and prompts; a verdict when the request cannot run at all."""
        try:
            stored = await self.store.load()
        except ResultsVolumeError as err:
            return Verdict("Failed", err.failure.reason, err.failure.message)
        for r in stored:
            self.tally.add(r)
        try:
            self.prompts = await load_prompts(self.kube, self.ns, self.rr)
        except PromptError as err:
            return Verdict("Failed", "InvalidPrompts", str(err))
        self.total = len(self.prompts) * self.rr.spec.samples_per_prompt
        self.digest = plan.prompts_digest(self.prompts)
        recorded = self.rr.status.prompts_digest if self.rr.status else None
        if recorded is not None and recorded != self.digest:
            return Verdict(
                "Failed",
                "PromptsChanged",
                "the prompt ConfigMaps changed after the run started; "
                "results would mix prompt sets (create a new RolloutRequest)",
            )
        return None

    async def _look_at_fleet(self) -> None:
        """Look at the fleet: at once while its gateway is not known (nothing can be sent before), else beside the
        sending, one look at a time."""
        if self.fleet.gateway is None:
            await self._observe_fleet()
        elif _ended(self.looking):
            self.looking = asyncio.create_task(self._observe_fleet())

    async def _observe_fleet(self) -> None:
        try:
            view = await read_fleet(self.kube, self.tokens, self.ns, self.rr.spec.fleet)
        except ApiError as err:  # API hiccup: keep the last view
            log.warning("reading fleet %s/%s: %s", self.ns, self.rr.spec.fleet, err)
            return
        self._saw(view)

    def _saw(self, view: FleetView) -> None:
        self.fleet = view
        v = view.weight_version
        if v and (not self.history or self.history[-1] != v):
            self.history.append(v)

    # --- sending --------------------------------------------------------------------
    def _dispatch(self, schedule: plan.Schedule, now: float) -> None:
        f = self.fleet
        if not f.gateway or not f.model:
            self.verdict = Verdict(
                "Pending", "WaitingForGateway", f"waiting for the gateway of fleet {self.rr.spec.fleet!r}"
            )
            return
        if f.paused:
            self.verdict = Verdict(
                "Paused",
                "FleetPaused",
                f"fleet {self.rr.spec.fleet!r} is paused (mode {f.paused}); samples resume when it resumes",
            )
            return
        if self.start is not None:
            message = f"{len(schedule.in_flight)} samples in flight"
            if self.unsure and self.gateway_error is not None:
                # Not stuck: an outside wait, which the status says (a restarting gateway or API server).
                message = f"waiting for the gateway to confirm {len(self.unsure)} samples stopped: {self.gateway_error}"
            self.verdict = Verdict("Running", "Running", message)
        if not self._may_send(now):
            return
        keys = schedule.take(self.rr.spec.parallelism)
        if keys and self.start is None:
            self.start = datetime.now(UTC)
            self.verdict = Verdict("Running", "Running", f"{len(keys)} samples in flight")
        for key in keys:
            task = asyncio.create_task(self._send(schedule, key))
            task.add_done_callback(self._sender_ended)
            self.calls[task] = key

    def _may_send(self, now: float) -> bool:
        f = self.fleet
        return bool(
            f.gateway
            and f.model
            and not f.paused
            and not (self.unsure or self.aborting or self.stop or self.volume_failure)
            and now >= self.hold_until
            and self.store.pending < MAX_UNFLUSHED
        )

    async def _send(self, schedule: plan.Schedule, key: SampleKey) -> None:
        """A sender: sends sample `key` and records it, then the next sample while sending may go on; the loop
        starts senders again once it may. A sender that fails fails the run (`_collect`)."""
        me = asyncio.current_task()
        assert me is not None
        while True:
            f = self.fleet
            outcome, result = await self._sample(key, cast(str, f.gateway), self.rr.spec.model or f.model, f.token)
            self._record(schedule, key, outcome, result)
            if self.store.pending >= MAX_UNFLUSHED // 2 and (self.flushing is None or self.flushing.done()):
                self.wake.set()  # a write is due
            follows = schedule.next(self.rr.spec.parallelism) if self._may_send(time.time()) else None
            if follows is None:
                return
            key = self.calls[me] = follows

    def _sender_ended(self, task: asyncio.Task[None]) -> None:
        self.calls.pop(task, None)
        self.ended.append(task)
        self.wake.set()

    async def _sample(
        self, key: SampleKey, gateway: str, model: str | None, token: str | None
    ) -> tuple[Outcome, SampleResult | None]:
        assert model is not None  # _may_send
        left = None
        if self.rr.spec.active_deadline_seconds is not None:
            left = plan.deadline_left(
                self.start.timestamp() if self.start else None, self.rr.spec.active_deadline_seconds, time.time()
            )
        # The gateway stops the sample by itself a little after the deadline, should this operator be gone.
        call = plan.build_call(
            self.rr.spec, model, self.uid, key, self.prompts[key[0]], timeout_s=None if left is None else left + 5
        )
        started = time.time()
        try:
            status, raw, resp = await post_sample(self.samples, gateway, call, token)
        except UpstreamError:
            return Outcome.UNSURE, None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        version = resp.header(WEIGHT_VERSION)
        return plan.interpret(
            status,
            body if isinstance(body, dict) else None,
            {} if version is None else {WEIGHT_VERSION_HEADER.lower(): version},
            uid=self.uid,
            key=key,
            started_at=started,
            finished_at=time.time(),
            abort_wanted=self.aborting,
        )

    async def _collect(self, wait_s: float = TICK_S) -> None:
        """Wait for a wake-up or the tick (a timer handle: cheaper than a timeout per turn); a sender that failed
        raises its error here."""
        tick = asyncio.get_running_loop().call_later(wait_s, self.wake.set)
        await self.wake.wait()
        tick.cancel()
        self.wake.clear()
        ended, self.ended = self.ended, []
        for task in ended:
            if not task.cancelled():
                task.result()

    def _record(self, schedule: plan.Schedule, key: SampleKey, outcome: Outcome, result: SampleResult | None) -> None:
        if (
            result is not None
            and outcome is Outcome.COMPLETED
            and plan.is_stale(result, self.history, self.rr.spec.max_weight_staleness)
        ):
            outcome, result = Outcome.RETRY, None  # the id finished: it is free to run again
        if result is not None:
            schedule.finished(key)
            if self.store.add(result):
                self.tally.add(result)
            return
        schedule.again(key)
        if outcome is Outcome.UNSURE:
            self.unsure.add(key)
        # Back off a little: a broken or busy gateway is not helped by an immediate resend.
        self.hold_until = max(self.hold_until, time.time() + 0.5)

    # --- stopping -------------------------------------------------------------------
    async def _gateway_abort(self, ids: list[str], timeout_s: float) -> dict[str, str] | None:
        """Per id aborted|finished|pending|unconfirmed|unknown; None when the gateway cannot answer."""
        results, self.gateway_error = await gateway_abort(self.http, self.fleet, ids, timeout_s)
        return results

    async def _stop_unsure(self) -> None:
        """Stop every id that may still run; those confirmed stopped may be sent again."""
        keys = sorted(self.unsure)
        answer = await self._gateway_abort([plan.sample_id(self.uid, k) for k in keys], timeout_s=10)
        if answer is None:
            self.hold_until = time.time() + 1.0
            return
        for key in keys:
            if plan.stopped_for_sure(answer.get(plan.sample_id(self.uid, key))):
                self.unsure.discard(key)

    async def _abort_in_flight(self, schedule: plan.Schedule, verdict: Verdict) -> None:
        """Stop every in-flight sample on its engine, keep their partial outputs, record the abort."""
        self.aborting = True
        stopped: set[str] = set()
        ids = [plan.sample_id(self.uid, k) for k in self.unsure]
        # The aborted calls come back with finish_reason abort and what they generated so far. A call
        # sent just before the abort may still be on its way to an engine ("unknown" everywhere): abort
        # again, every ABORT_RESEND_S, until every call has come back.
        deadline = time.monotonic() + ABORT_WAIT_S
        while (self.calls or ids) and time.monotonic() < deadline:
            ids += [plan.sample_id(self.uid, k) for k in self.calls.values()]
            if ids:
                answer = await self._gateway_abort(ids, timeout_s=5) or {}
                stopped.update(rid for rid, v in answer.items() if v == "aborted")
                ids = []
            await self._collect(wait_s=max(0.0, min(ABORT_RESEND_S, deadline - time.monotonic())))
        for task in list(self.calls):  # closing the connection makes the gateway stop it too
            task.cancel()
        if self.abort_token is not None:
            self.abort_record = AbortRecord(token=self.abort_token, time=datetime.now(UTC), stopped=len(stopped))

    async def _on_stop(self) -> None:
        """The run stops: the request was deleted (stop its samples) or its pod is going away."""
        deleted = self.stop.deleted
        if deleted and self.calls:
            self.aborting = True
            await self._gateway_abort([plan.sample_id(self.uid, k) for k in self.calls.values()], timeout_s=5)
        for task in list(self.calls):
            task.cancel()
        if not deleted:
            await self._flush(urgent=True)

    # --- recording ------------------------------------------------------------------
    async def _flush(self, urgent: bool) -> None:
        """Write the buffered results: `urgent`, all of them now; otherwise, when enough wait or they waited
        long enough, in the background (one write at a time), so that the loop sends on during an fsync."""
        if self.flushing is not None:
            if not (urgent or self.flushing.done()):
                return
            task, self.flushing = self.flushing, None
            await self._stored(task, urgent)
        if not self.store.pending:
            return
        if urgent:
            await self._stored(self.store.flush(), urgent)
        elif self.store.pending >= MAX_UNFLUSHED // 2 or self.flush_rate.due(time.time()):
            self.flushing = asyncio.create_task(self.store.flush())
            self.flushing.add_done_callback(lambda _: self.wake.set())  # the next write may be due

    async def _stored(self, flush: Awaitable[None], urgent: bool) -> None:
        try:
            await flush
        except ResultsVolumeError as err:
            # Results the volume did not take are not stored: counts say what is.
            log.error("results of %s/%s: %s", self.ns, self.name, err)
            self.volume_failure = err.failure
            self.tally = Tally()
            for r in self.store.results.values():
                self.tally.add(r)
        except ApiError as err:
            if urgent:
                raise
            log.warning("writing results of %s/%s: %s (will retry)", self.ns, self.name, err)

    def _results_ref(self) -> ResultsRef:
        return self.store.ref(f"rollfleet results rr/{self.name} -n {self.ns}")

    async def _patch_status(self, in_flight: int, urgent: bool = False) -> None:
        changed = self.last_patched is None or self.last_patched.phase != self.verdict.phase
        if not self.status_rate.due(time.time(), urgent=urgent or changed):
            return
        status = request_status(  # as things stand now, whenever it is sent
            self.rr.status,
            verdict=self.verdict,
            tally=self.tally,
            total=self.total,
            in_flight=in_flight,
            generation=self.body["metadata"].get("generation"),
            now=datetime.now(UTC),
            results=self._results_ref(),
            digest=self.digest,
            start_time=self.start,
            abort=self.abort_record,
        )
        self.last_patched = self.verdict
        earlier = self.patching if not _ended(self.patching) else None
        if urgent:  # the end of the run: after any patch still under way, and done when this returns
            self.patching = None
            await self._send_status(status, earlier)
        else:
            self.patching = asyncio.create_task(self._send_status(status, earlier))

    async def _send_status(self, status: dict[str, Any], earlier: asyncio.Task[None] | None) -> None:
        if earlier is not None:  # patches land in the order they were made
            await earlier
        with contextlib.suppress(NotFound):  # deleted meanwhile
            await self.kube.patch(REQUEST, self.ns, self.name, {"status": status}, status=True)

    async def _finish(self, verdict: Verdict) -> Verdict:
        self.verdict = verdict
        await self._flush(urgent=True)
        await self._patch_status(0, urgent=True)
        log.info("RolloutRequest %s/%s: %s (%s)", self.ns, self.name, verdict.phase, verdict.message)
        await self._post_event(verdict)
        return verdict

    async def _post_event(self, verdict: Verdict) -> None:
        """The end of the run as an Event (`kubectl describe rr`): Warning unless it succeeded. Best effort."""
        type_ = "Normal" if verdict.phase == "Succeeded" else "Warning"
        event = event_manifest(
            KIND, self.name, self.ns, self.uid, type_, verdict.reason, verdict.message, datetime.now(UTC)
        )
        try:
            await self.kube.create(event)
        except ApiError as err:
            log.warning("event %s on %s/%s not posted: %s", verdict.reason, self.ns, self.name, err)


def _ended(task: asyncio.Task[None] | None) -> bool:
    """Whether a task beside the loop is over (or none was started); one that failed raises its error here, so
    that a failure beside the loop fails the run as one inside it does."""
    if task is None:
        return True
    if not task.done():
        return False
    task.result()
    return True


async def gateway_abort(
    http: httpx.AsyncClient, fleet: FleetView, ids: list[str], timeout_s: float
) -> tuple[dict[str, str] | None, str | None]:
    """POST /v1/abort: per id aborted|finished|pending|unconfirmed|unknown, or None and why the gateway
    cannot answer (not reachable, or its engine list not synced: "unknown" would then mean nothing)."""
    if not fleet.gateway or not fleet.token:
        return None, "no gateway address or token yet"
    results: dict[str, str] = {}
    try:
        ready = await http.get(fleet.gateway + "/ready", timeout=5)
        if ready.status_code != 200:
            return None, f"its /ready answered {ready.status_code}"
        for i in range(0, len(ids), ABORT_BATCH):
            resp = await http.post(
                fleet.gateway + "/v1/abort",
                timeout=timeout_s + 10,
                headers={"Authorization": f"Bearer {fleet.token}"},
                json={"request_ids": ids[i : i + ABORT_BATCH], "timeout_s": timeout_s},
            )
            if resp.status_code != 200:
                log.warning("gateway abort answered %s: %s", resp.status_code, resp.text[:300])
                return None, f"its abort answered {resp.status_code}"
            results.update(resp.json()["results"])
    except (httpx.HTTPError, ValueError, KeyError) as err:
        log.info("gateway abort failed: %s", err)
        return None, f"{type(err).__name__}: {err}"[:200]
    return results, None


async def expire(
    kube: Kube, body: Mapping[str, Any], wait: Callable[[float], Any], finished_at: float | None = None
) -> None:
    """Delete a finished request once its ttlSecondsAfterFinished has passed (results go with it).

    `finished_at` comes from a run that just ended: the watch's view of the body may not show
    the terminal status yet, and a task that returns is not started again.
    """
    rr = RolloutRequest.model_validate(dict(body))
    if finished_at is None:
        status = rr.status
        if status is None or status.phase not in TERMINAL_PHASES:
            return
        done_at = status.completion_time or parse_time(body["metadata"].get("creationTimestamp"))
        finished_at = done_at.timestamp() if done_at else None
    left = plan.ttl_left(finished_at, rr.spec.ttl_seconds_after_finished, time.time())
    if left is None:
        return
    if left > 0 and await wait(left):  # True: the task was asked to stop first
        return
    meta = body["metadata"]
    with contextlib.suppress(NotFound, Conflict):  # gone, or a new object of that name: not ours to delete
        await kube.delete(
            REQUEST,
            meta["namespace"],
            meta["name"],
            {"preconditions": {"uid": meta["uid"]}, "propagationPolicy": "Background"},
        )
