"""Forwarding one client request to engines: streaming, cancellation, deadline and failover.

Owns the life of a request after it was accepted: pick an engine (routing), stream
from it (always streamed upstream, so the gateway knows every generated token),
answer the client in its dialect (SSE passthrough, or one JSON assembled from the
chunks), and end it for real when asked:

- stop (admin abort, client disconnect, deadline): the gateway calls the engine's
  truthful abort for the caller id, scoped to this request's attempt value (ids are the
  clients'; a client reusing another's id, at this replica or another, can never get that
  request stopped), and lets the engine's own stream deliver the end
  (`finish_reason: "abort"`), so the client gets its partial output; only if the
  engine does not end it within a grace period is the connection closed (vLLM then
  aborts on disconnect);
- failover: when the engine fails mid-request (connection refused, reset, stream
  cut, 5xx), the request continues on another engine through vLLM's token-in/token-out
  route from prompt + tokens generated so far, at most `max_attempts` attempts, never
  on an engine instance that already had this id;
- every answer says the weight versions and engines that produced it: each engine's
  response header, plus, for an attempt that may have spanned a weight update, what the
  engine's request tracker recorded for the caller id.

Talks to engines (inference through `upstream`; their own API through `rollfleet.engine_client`)
and to the client (raw ASGI send/receive).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from rollfleet.engine_client import GATEWAY_ABORT, EngineCallError, EngineClient, EngineRef, bearer_header
from rollfleet.gateway.dialects import (
    Assembler,
    ContinuationState,
    Json,
    Route,
    Template,
    choices_requested,
    closing_chunk,
    continuation_body,
    continuation_chunk,
    first_attempt_body,
    prompt_token_ids,
    streams_upstream,
)
from rollfleet.gateway.inflight import ABORT, InFlight, InFlightTable, StopReason, segments_report
from rollfleet.gateway.metrics import Metrics
from rollfleet.gateway.registry import Engine, Registry, lag_floor, lag_label, lag_summary, within_lag
from rollfleet.gateway.routing import Decision, NoEngine, Router
from rollfleet.upstream import LocalResourceError, Response, Upstream, UpstreamError
from rollfleet_client.protocol import TRACEPARENT_HEADER, TRACESTATE_HEADER
from rollfleet_engine.protocol import (
    ATTEMPT_HEADER,
    MAX_WEIGHT_LAG_HEADER,
    REQUEST_ID_HEADER,
    WEIGHT_VERSION_HEADER,
    AbortStatus,
)

log = logging.getLogger(__name__)

ENGINE_HEADER = "X-Rollfleet-Engine"
# Header names as bytes, lowercase: as the upstream client keeps them and as ASGI sends them.
_WEIGHT_VERSION = WEIGHT_VERSION_HEADER.lower().encode()
_REQUEST_ID_NAME, _ENGINE_NAME = REQUEST_ID_HEADER.lower().encode(), ENGINE_HEADER.lower().encode()
Send = Any  # ASGI send/receive callables
Receive = Any


@dataclass(frozen=True)
class ProxyConfig:
    max_attempts: int = 3
    queue_timeout_s: float = 60.0  # how long a request waits for a routable engine before 503
    stop_grace_s: float = 5.0  # after an abort on the engine, how long its stream may take to end
    abort_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    # An attempt this long (or one during which its engine was seen changing weights) asks
    # the engine which versions produced its tokens: a weight sync pauses the engine, so a
    # request spanning one takes at least that long.
    version_check_after_s: float = 2.0
    # A non-streaming request that may generate fewer tokens is sent whole to the engine: a
    # failover restarts it instead of continuing from its tokens (dialects.streams_upstream).
    continue_min_tokens: int = 256


@dataclass
class ClientRequest:
    route: Route
    body: Json
    request_id: str
    session: str | None
    end_session: bool
    deadline: float  # event-loop time
    max_weight_lag: int | None = None  # its X-Rollfleet-Max-Weight-Lag: routed within it, sent on to the engine
    trace: tuple[tuple[str, str], ...] = ()  # its W3C trace context, when well formed (`trace_context`)


_TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{0,512}")  # printable ASCII, W3C's 512-character bound


def trace_context(traceparent: str | None, tracestate: str | None) -> tuple[tuple[str, str], ...]:
    """The headers of a caller's W3C trace context to send on to the engine: a well-formed `traceparent` (version
    not ff, ids not all zeros) and its `tracestate`; nothing for a malformed one, which W3C says to ignore (the
    request is served, its trace starts at the engine), so a hostile value never reaches the engine."""
    if traceparent is None or not _TRACEPARENT.fullmatch(traceparent):
        return ()
    if tracestate is None or not _TRACESTATE.fullmatch(tracestate):
        return ((TRACEPARENT_HEADER, traceparent),)
    return ((TRACEPARENT_HEADER, traceparent), (TRACESTATE_HEADER, tracestate))


class Outcome(StrEnum):
    FINISHED = "finished"  # every choice has a finish reason
    FAILED = "failed"  # the engine failed; another may continue
    REJECTED = "rejected"  # the engine refused the request (4xx): the client's answer
    UNSERVED = "unserved"  # the engine's answer ended whole but left a choice unfinished: the client's input may
    # be the cause (an `n` the engine answers fewer choices to), so no other engine is tried and none ejected
    OVERLOADED = "overloaded"  # this gateway could not open a connection (out of descriptors): no engine's fault
    STOPPED = "stopped"  # stop requested and the stream was cut


@dataclass
class AttemptResult:
    outcome: Outcome
    detail: str = ""
    status: int = 0
    body: bytes = b""


class StreamWriter:
    """SSE to the client: upstream chunks pass through as bytes unless the gateway changed them."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.sent_any = False
        self.responded = False
        self._held = b""  # the chunks that end the request, sent with [DONE] in one write

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers],
            }
        )

    async def chunks(self, batch: list[tuple[Json, bytes | None]], last: bool = False) -> None:
        """Send a batch of chunks; `last`: they end the request, and wait for [DONE] to go with them."""
        self.sent_any = True
        body = b"".join(b"data: " + (raw if raw is not None else orjson.dumps(obj)) + b"\n\n" for obj, raw in batch)
        body, self._held = self._held + body, b""
        if last:
            self._held = body
            return
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def done(self, extra: Json, headers: list[tuple[bytes, bytes]]) -> None:
        self.responded = True
        body, self._held = self._held + b"data: [DONE]\n\n", b""
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def error(self, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
        if not self.started:
            await send_json(self.send, status, error_body(message, status), headers)
            self.responded = True
            return
        await self.chunks([(error_body(message, status), None)])
        await self.done({}, headers)


class JsonWriter:
    """One JSON answer for a non-streaming client, assembled from the upstream chunks."""

    def __init__(self, send: Send, assembler: Assembler) -> None:
        self.send = send
        self.assembler = assembler
        self.started = False  # nothing reaches the client before the end
        self.sent_any = False
        self.responded = False
        self.tpl: Template | None = None
        self.prompt_tokens: int | None = None
        self.whole: Json | None = None  # the engine's own answer, when it was not streamed

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        return

    async def chunks(self, batch: list[tuple[Json, bytes | None]], last: bool = False) -> None:
        for obj, _ in batch:
            self.assembler.add(obj)

    async def done(self, extra: Json, headers: list[tuple[bytes, bytes]]) -> None:
        assert self.tpl is not None
        self.responded = True
        if self.whole is not None:
            await send_json(self.send, 200, self.whole | extra, headers)
            return
        await send_json(self.send, 200, self.assembler.response(self.tpl, self.prompt_tokens, extra), headers)

    async def error(self, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.responded = True
        await send_json(self.send, status, error_body(message, status), headers)


Writer = StreamWriter | JsonWriter


def error_body(message: str, status: int) -> Json:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


async def send_json(send: Send, status: int, body: Json, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


class Proxy:
    def __init__(
        self,
        registry: Registry,
        router: Router,
        inflight: InFlightTable,
        token: str,
        config: ProxyConfig,
        metrics: Metrics,
        inference_token: str | None = None,
    ) -> None:
        self.registry = registry
        self.router = router
        self.inflight = inflight
        self.config = config
        self.metrics = metrics
        self.upstream: Upstream | None = None
        # The admin token opens the engines' control routes (abort, the tracked-request view) and nothing
        # goes to them but control calls; generation carries the inference token (none when the fleet is open).
        self.engines = EngineClient(token)
        inference = bearer_header(inference_token).items() if inference_token else ()
        self.upstream_headers = [("Content-Type", "application/json"), *inference]
        self._background: set[asyncio.Task[Any]] = set()
        self._attempts: dict[str, set[_StopWatch]] = {}  # engine key -> the attempts running there

    def move_off(self, engine_key: str) -> None:
        """The engine is leaving (its pod is being deleted): end every attempt running there as a failure, so that
        each request continues on another engine from the tokens its client has, while this one still serves."""
        watches = self._attempts.get(engine_key, ())
        if watches:
            log.info("engine %s is leaving: moving %d request(s) to other engines", engine_key, len(watches))
        for watch in list(watches):
            if watch.move():
                self.metrics.moves.inc()

    def background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    async def abort_quietly(self, engine: Engine, entry: InFlight) -> None:
        if engine.url is not None:
            await self.abort_on_engine(engine, [entry.request_id], self.config.abort_timeout_s, entry.attempt)

    async def abort_on_engine(
        self, engine: Engine, request_ids: list[str], wait_s: float, attempt: str | None = None
    ) -> dict[str, AbortStatus]:
        """Ask one engine to abort caller ids and say how each ended there; unconfirmed when it could not be asked.
        With `attempt`: only this replica's request under the id (the stop of a request of its own); without, any
        (the admin's abort by id, from whichever replica)."""
        try:
            results = await self.engines.abort(engine_ref(engine), request_ids, wait_s, GATEWAY_ABORT, attempt)
        except EngineCallError as err:
            # Not an error: another engine may know the id (abort.combine), and if none does the
            # answer says that this one could not be asked.
            level = logging.WARNING if err.status is not None else logging.INFO  # refused, or not reached
            log.log(level, "abort on %s failed: %s", engine.key, err)
            return dict.fromkeys(request_ids, AbortStatus.UNCONFIRMED)
        return {rid: results.get(rid, AbortStatus.UNKNOWN) for rid in request_ids}

    async def open(self) -> None:
        # No read timeout: a paused engine holds requests for as long as a weight sync takes;
        # the request's own deadline bounds it instead.
        self.upstream = Upstream(connect_timeout_s=self.config.connect_timeout_s)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self.upstream is not None:
            self.upstream.close()
        await self.engines.aclose()

    def stop(self, entry: InFlight, reason: StopReason) -> None:
        """End a request early: its current attempt is aborted on the engine, no further attempt starts."""
        if entry.ended.done() or entry.stopping.done():
            return
        entry.request_stop(reason)
        entry.stopping.set_result(None)
        self.metrics.of(self.metrics.stops, reason).inc()

    async def serve(self, req: ClientRequest, entry: InFlight, send: Send, receive: Receive | None = None) -> None:
        """Answer one admitted request through ASGI's `send`. A client leaving is seen through `receive`, or,
        without it, told by the caller (`stop(entry, StopReason.DISCONNECT)`)."""
        loop = asyncio.get_running_loop()  # looked up once per request: each lookup is a getpid() system call
        exchange = _Exchange(self, req, entry, send, loop)
        watcher = None if receive is None else asyncio.create_task(self._watch_disconnect(receive, exchange))
        timer = loop.call_at(req.deadline, self.stop, entry, StopReason.DEADLINE)
        finish: str | None = None
        started = loop.time()
        try:
            finish = await exchange.run()
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
            self.inflight.close(entry, finish)
            self.metrics.request_done(req.route, finish or "none", loop.time() - started)

    async def _watch_disconnect(self, receive: Receive, exchange: _Exchange) -> None:
        # The body was read already; the next message is a disconnect (client gone, or our
        # own response completed, which `responded` tells apart).
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not exchange.writer.responded:
                    self.stop(exchange.entry, StopReason.DISCONNECT)
                return


class _Exchange:
    """One client request across its attempts."""

    def __init__(
        self, proxy: Proxy, req: ClientRequest, entry: InFlight, send: Send, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.proxy = proxy
        self.req = req
        self.entry = entry
        self.loop = loop
        self.n = choices_requested(req.route, req.body)
        self.tpl: Template | None = None
        self.writer: Writer
        if req.body.get("stream"):
            self.writer = StreamWriter(send)
        else:
            per_prompt = int(req.body.get("n") or 1) if req.route is Route.COMPLETIONS else 1
            self.writer = JsonWriter(send, Assembler(req.route, req.body.get("output_mode", "tokens"), per_prompt))
        self.attempts = 0
        self._closing: int | None = None  # index in the current batch of the chunk that ends the request
        self.continuation_refused = False
        self.lag_bound_left_none = False  # engines were routable, but none within the request's weight-lag bound
        self._tokens_key = ("", "unknown")  # (engine, lag) of the current attempt, for the tokens counter

    # --- the attempt loop -----------------------------------------------------------
    async def run(self) -> str | None:
        entry, cfg = self.entry, self.proxy.config
        last_failure = ""
        while True:
            if entry.stop is not None:
                return await self._close_stopped()
            if self.attempts >= cfg.max_attempts:
                return await self._fail(502, f"gave up after {self.attempts} attempts: {last_failure}")
            picked = await self._pick()
            if picked is None:
                if entry.stop is not None:
                    continue
                return await self._fail(503, self._no_engine())
            engine, decision = picked
            plan = self._plan()
            if plan is None:
                self.proxy.router.finish(decision, self.loop.time())
                return await self._fail(502, f"engine failed after output was streamed: {last_failure}")
            self.attempts += 1
            if self.attempts > 1:
                self.proxy.metrics.failovers.inc()
            result = await self._attempt(engine, decision, *plan)
            self.proxy.metrics.attempt_done(engine.key, result.outcome)
            if result.outcome is Outcome.FINISHED:
                return await self._close_finished()
            if result.outcome is Outcome.UNSERVED and entry.stop is not None:
                # The engine ended the answer it was told to stop without saying how: stopped all the same.
                log.warning("request %s: %s after its stop (%s)", self.req.request_id, result.detail, entry.stop)
                result = AttemptResult(Outcome.STOPPED, result.detail)
            if result.outcome is Outcome.STOPPED:
                return await self._close_stopped()
            if result.outcome is Outcome.UNSERVED:
                return await self._fail(502, result.detail)
            if result.outcome is Outcome.OVERLOADED:
                return await self._fail(503, result.detail)
            if result.outcome is Outcome.REJECTED:
                continuing = plan[2] is not None
                if not continuing and not self.writer.started:
                    await send_json(
                        self.writer.send, result.status, _error_json(result.body, result.status), self._headers()
                    )
                    self.writer.responded = True
                    return "rejected"
                if not continuing:  # output reached the client already: the error ends its stream
                    return await self._fail(result.status, result.detail)
                if continuing and result.status == 404 and not self.continuation_refused:
                    # The engine does not serve the token-in/token-out route (vLLM without
                    # --enable-scale-out): start over, where nothing reached the client yet.
                    # The id ended there with that 404, so that engine may have it again.
                    self.continuation_refused = True
                    entry.tried.discard(engine.instance)
                    last_failure = f"{engine.key}: {result.detail}"
                    continue
                return await self._fail(502, f"engine refused the continuation: {result.detail}")
            last_failure = f"{engine.key}: {result.detail}"
            log.warning(
                "request %s failed on %s (%s); %d/%d attempts used",
                self.req.request_id,
                engine.key,
                result.detail,
                self.attempts,
                cfg.max_attempts,
            )
            # An engine that only looked dead (a cut connection) aborts the request when it
            # notices the disconnect; tell it now, without holding up the continuation.
            self.proxy.background(self.proxy.abort_quietly(engine, entry))

    def _no_engine(self) -> str:
        """Why no engine took the request within the queue timeout."""
        entry, wait_s = self.entry, self.proxy.config.queue_timeout_s
        tried = f" other than {', '.join(entry.engines)} (failed)" if entry.engines else ""
        if self.lag_bound_left_none:
            return (
                f"no engine within {MAX_WEIGHT_LAG_HEADER} {self.req.max_weight_lag} of the newest weights{tried} "
                f"within {wait_s:.0f}s (engines: {lag_summary(self.proxy.registry.routable())}); ask again once the "
                "engines have the fleet's version, or with a larger bound"
            )
        return f"no routable engine{tried} within {wait_s:.0f}s (engines starting, syncing or draining)"

    def _plan(self) -> tuple[str, Json, ContinuationState | None] | None:
        """(path, body, continuation state) of the next attempt; None when it cannot be continued."""
        entry, req = self.entry, self.req
        if not self.writer.sent_any and entry.generated == 0:
            # Nothing reached the client: (re)start from the client's own request.
            return self._start_over()
        if self.n == 1 and entry.prompt_token_ids is not None and not self.continuation_refused:
            choice = entry.choice(0)
            body = continuation_body(req.route, req.body, entry.prompt_token_ids, choice.token_ids)
            state = ContinuationState(len(choice.token_ids), choice.text_chars, len(entry.prompt_token_ids))
            return Route.GENERATE.value, body, state
        if isinstance(self.writer, JsonWriter):
            # Nothing was sent yet: start over (several sequences are not stitched, and an
            # engine without the generate route cannot continue one).
            return self._start_over()
        return None

    def _start_over(self) -> tuple[str, Json, None]:
        if isinstance(self.writer, JsonWriter):
            self.writer.assembler.reset()
            self.writer.whole = None
        self.entry.choices.clear()
        route, body = self.req.route, self.req.body
        stream = streams_upstream(route, body, self.proxy.config.continue_min_tokens)
        return route.value, first_attempt_body(route, body, stream), None

    async def _pick(self) -> tuple[Engine, Decision] | None:
        """An engine this id has not run on; waits (bounded) while none is routable: no 503 storms."""
        loop, p, entry = self.loop, self.proxy, self.entry
        deadline = min(self.req.deadline, loop.time() + p.config.queue_timeout_s)
        while entry.stop is None:
            try:
                # The registry's list, the same object until its engines change: the router keeps its index.
                decision = p.router.choose(p.registry.routable_keys(), self.req.session, loop.time(), self._admits())
            except NoEngine:
                self.lag_bound_left_none = self.req.max_weight_lag is not None and any(
                    e.instance not in entry.tried for e in p.registry.routable()
                )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                await p.registry.wait_changed(min(remaining, 1.0))
                continue
            if decision.moved_from is not None:
                p.metrics.session_moves.inc()
            engine = p.registry.get(decision.engine)
            assert engine is not None
            return engine, decision
        return None

    def _admits(self) -> Callable[[str], bool] | None:
        """Which engines this try may take (None: any): none that this id has run on, and within the request's
        weight-lag bound of the newest routable weights."""
        tried, max_lag, registry = self.entry.tried, self.req.max_weight_lag, self.proxy.registry
        if not tried and max_lag is None:
            return None
        floor = None if max_lag is None else lag_floor(registry.newest_generation(), max_lag)

        def admits(key: str) -> bool:
            engine = registry.get(key)
            return engine is not None and engine.instance not in tried and within_lag(engine, floor)

        return admits

    async def _attempt(
        self, engine: Engine, decision: Decision, path: str, body: Json, cont: ContinuationState | None
    ) -> AttemptResult:
        p, entry = self.proxy, self.entry
        entry.engine = engine.key
        entry.engines.append(engine.key)
        entry.tried.add(engine.instance)
        # Tokens are counted as they pass (a live view sees a long stream's), under the engine's lag at its start.
        self._tokens_key = (engine.key, lag_label(engine, p.registry.newest_generation()))
        # The exchange runs in this task (no task per attempt: the hot path); a stop reaches it through
        # the watch, which aborts the id on the engine and, past the grace period, cancels this task.
        watch = _StopWatch(self, engine)
        entry.stopping.add_done_callback(watch.stop)
        running = p._attempts.setdefault(engine.key, set())
        running.add(watch)
        result = None
        try:
            result = await self._exchange(engine, path, body, cont)
        except asyncio.CancelledError:
            if (watch.cut or watch.moved) and watch.task.uncancel() == 0:  # cut by the watch alone, not by anyone else
                if watch.cut:
                    return AttemptResult(Outcome.STOPPED, "stopped")
                return AttemptResult(Outcome.FAILED, f"engine {engine.key} is leaving (its pod is being deleted)")
            raise
        finally:
            watch.attempt_ended()
            entry.stopping.remove_done_callback(watch.stop)
            running.discard(watch)
            if not running:
                p._attempts.pop(engine.key, None)
            failed = result is not None and result.outcome is Outcome.FAILED
            p.router.finish(decision, self.loop.time(), end_session=self.req.end_session, served=not failed)
        return result

    async def _exchange(self, engine: Engine, path: str, body: Json, cont: ContinuationState | None) -> AttemptResult:
        p, req = self.proxy, self.req
        assert p.upstream is not None and engine.url is not None
        headers = [*p.upstream_headers, (REQUEST_ID_HEADER, req.request_id), (ATTEMPT_HEADER, self.entry.attempt)]
        if req.max_weight_lag is not None:
            headers.append((MAX_WEIGHT_LAG_HEADER, str(req.max_weight_lag)))
        headers.extend(req.trace)
        try:
            resp = await p.upstream.request("POST", engine.url + path, orjson.dumps(body), headers)
            try:
                return await self._read(engine, resp, cont)
            finally:
                resp.close()
        except LocalResourceError as err:
            return AttemptResult(Outcome.OVERLOADED, f"this gateway {err}: retry later")
        except UpstreamError as err:
            p.registry.eject(engine.key)
            return AttemptResult(Outcome.FAILED, str(err))

    async def _read(self, engine: Engine, resp: Response, cont: ContinuationState | None) -> AttemptResult:
        p, entry = self.proxy, self.entry
        if resp.status != 200:
            data = await resp.read()
            detail = f"engine answered {resp.status}: {data[:300].decode(errors='replace')}"
            if resp.status >= 500:
                return AttemptResult(Outcome.FAILED, detail)
            return AttemptResult(Outcome.REJECTED, detail, resp.status, data)
        version = resp.header(_WEIGHT_VERSION)
        if version:
            entry.add_versions(version.split(","))
            p.registry.observe_version(engine.key, version.split(",")[-1])
        since = (self.loop.time(), p.registry.version_epoch(engine.key))
        if not resp.headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            return await self._read_whole(engine, await resp.read(), since, cont)
        # Whatever bytes arrived together are forwarded together: one write to the client per
        # read, not one per token. [DONE] is read past, to the end of the body: a response left
        # unread closes its connection instead of returning it to the keep-alive pool.
        pending, done = b"", False
        while data := await resp.read_any():
            *events, pending = (pending + data).split(b"\n\n")
            datas = [e[6:].strip() for e in events if e.startswith(b"data: ")]
            done = done or b"[DONE]" in datas
            batch: list[tuple[Json, bytes | None]] = []
            failure = None
            payloads = [d for d in datas if d and d != b"[DONE]"]
            for payload, obj in zip(payloads, _parse_all(payloads), strict=True):
                failure = self._forward(payload, obj, cont, batch)
                if failure is not None:
                    break
            last = self._closing is not None
            if self._closing is not None:
                if not self._versions_certain(engine, *since):
                    await self._ask_versions(engine, cont)
                obj, _ = batch[self._closing]
                obj["rollfleet"] = self._report()
                batch[self._closing] = (obj, None)
                self._closing = None
            if batch:
                # The client's 200 waits for the first chunk: an engine that rejects the request
                # in its stream (its first event an error) is answered with its own status.
                if not self.writer.started:
                    await self.writer.start(self._headers())
                await self.writer.chunks(batch, last)
            if failure is not None:
                return failure
        if self._all_finished():
            return AttemptResult(Outcome.FINISHED)
        if done:  # the engine ended its answer: it works, the request is what it did not serve
            return AttemptResult(Outcome.UNSERVED, f"engine {engine.key} ended its stream with {self._unfinished()}")
        p.registry.eject(engine.key)
        return AttemptResult(Outcome.FAILED, "the engine's stream ended before the request finished")

    async def _read_whole(
        self, engine: Engine, data: bytes, since: tuple[float, int], cont: ContinuationState | None
    ) -> AttemptResult:
        """The engine's one JSON answer (a request sent whole): tracked as one chunk, then passed on."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as err:
            return AttemptResult(Outcome.FAILED, f"the engine's answer is not JSON: {err}")
        if not isinstance(self.writer, JsonWriter) or not isinstance(obj, dict):
            return AttemptResult(Outcome.FAILED, f"the engine answered a stream with one JSON: {data[:300]!r}")
        self._template(obj)
        self._track(obj)
        if not self._all_finished():
            return AttemptResult(Outcome.UNSERVED, f"engine {engine.key} answered with {self._unfinished()}")
        if not self._versions_certain(engine, *since):
            await self._ask_versions(engine, cont)
        self.writer.whole = obj
        return AttemptResult(Outcome.FINISHED)

    def _forward(
        self, payload: bytes, obj: Json, cont: ContinuationState | None, batch: list[tuple[Json, bytes | None]]
    ) -> AttemptResult | None:
        """Track one upstream chunk and queue it in the client's dialect; a result if it was an error."""
        error = obj.get("error")
        if error is not None:
            # vLLM answers 200 and then reports some errors in the stream (a token id outside the
            # vocabulary): a 4xx there is the caller's, as if the engine had answered it.
            code = _error_code(error)
            detail = f"engine error in stream: {str(error)[:300]}"
            if code >= 500:
                return AttemptResult(Outcome.FAILED, detail)
            return AttemptResult(Outcome.REJECTED, detail, code, payload)
        raw: bytes | None = payload
        if cont is not None:
            obj = continuation_chunk(self.req.route, obj, self._template(obj), cont)
            raw = None
        elif self.tpl is None:
            self._template(obj)
        if self._track(obj):
            self._closing = len(batch)  # gets the report once the batch is complete
        batch.append((obj, raw))
        return None

    def _versions_certain(self, engine: Engine, started: float, epoch: int) -> bool:
        """A short request on an engine whose weight version did not change meanwhile: made by one version."""
        p = self.proxy
        recent = self.loop.time() - started < p.config.version_check_after_s
        return recent and p.registry.version_epoch(engine.key) == epoch

    async def _ask_versions(self, engine: Engine, cont: ContinuationState | None) -> None:
        """Ask the engine which weight versions produced the tokens (they may be more than one), and which
        tokens each (its output begins `cont.tokens_before` into the client's on a continuation)."""
        p = self.proxy
        try:
            tracked = await p.engines.request(engine_ref(engine), self.req.request_id)
        except EngineCallError as err:
            if err.status is None:  # an engine that answered (404: it forgot the id) has nothing to add
                log.info("weight versions of %s not confirmed by %s: %s", self.req.request_id, engine.key, err)
            return
        self.entry.add_versions(tracked.weight_versions)
        segments = [s.model_dump() for s in tracked.weight_segments]
        self.entry.add_segments(segments, cont.tokens_before if cont is not None else 0)

    def _template(self, first: Json) -> Template:
        if self.tpl is None:
            key = "request_id" if self.req.route is Route.GENERATE else "id"
            rid, created, model = first.get(key), first.get("created"), first.get("model")
            if rid and created and model:  # what vLLM says: no fallback needed
                self.tpl = Template(rid, created, model)
            else:
                self.tpl = Template.of(self.req.route, first, self.fallback)
        return self.tpl

    def _track(self, obj: Json) -> bool:
        """Record tokens and finish reasons; True when this chunk finished the last open choice."""
        entry, route = self.entry, self.req.route
        if entry.prompt_token_ids is None:
            entry.prompt_token_ids = prompt_token_ids(route, self.req.body, obj)
        closed = False
        choices = entry.choices
        for c in obj.get("choices") or ():
            index = c.get("index", 0)
            choice = choices.get(index) or entry.choice(int(index))
            ids = c.get("token_ids")
            if ids:
                choice.token_ids += ids
                self.proxy.metrics.tokens_served(*self._tokens_key, len(ids))
            if route is Route.COMPLETIONS:
                choice.text_chars += len(c.get("text") or "")
            spans = c.get("weight_versions")
            if spans:
                entry.add_versions([span["version"] for span in spans])
                entry.add_segments(spans)  # offset already, on a continuation (dialects.continuation_chunk)
            if c.get("finish_reason") is not None and choice.finish_reason is None:
                choice.finish_reason = c["finish_reason"]
                closed = True
        return closed and self._all_finished()

    def _finished_choices(self) -> int:
        return sum(1 for c in self.entry.choices.values() if c.finish_reason is not None)

    def _all_finished(self) -> bool:
        return self._finished_choices() >= self.n

    def _unfinished(self) -> str:
        return f"{self._finished_choices()} of the {self.n} choices asked for finished"

    @functools.cached_property
    def fallback(self) -> Template:
        """What the client's chunks share when the engine said nothing (made only then)."""
        return Template.fallback(self.req.route, self.req.request_id, self.req.body)

    def _report(self) -> Json:
        entry = self.entry
        report: Json = {
            "weight_versions": list(entry.versions),
            "engines": list(entry.engines),
            "attempts": self.attempts,
        }
        if self.n == 1:
            segments = segments_report(entry.segments, entry.versions, len(entry.choice(0).token_ids))
            if segments is not None:
                report["weight_segments"] = segments
        return report

    def _headers(self) -> list[tuple[bytes, bytes]]:
        entry = self.entry
        headers = [(_REQUEST_ID_NAME, self.req.request_id.encode("latin-1"))]
        if entry.engines:
            headers.append((_ENGINE_NAME, ",".join(entry.engines).encode("latin-1")))
        if entry.versions:
            headers.append((_WEIGHT_VERSION, ",".join(entry.versions).encode("latin-1")))
        return headers

    def _finish_reason(self) -> str | None:
        reasons = [c.finish_reason for c in self.entry.choices.values()]
        if ABORT in reasons:
            return ABORT
        return next((r for r in reasons if r is not None), None)

    async def _close_finished(self) -> str | None:
        self._prepare_json()
        await self.writer.done({"rollfleet": self._report()}, self._headers())
        return self._finish_reason()

    async def _close_stopped(self) -> str | None:
        """End what is still open with finish_reason abort (the engine was told; it did not say it in time)."""
        open_indexes = [i for i in range(self.n) if self.entry.choice(i).finish_reason is None]
        tpl = self.tpl or self.fallback
        if open_indexes:
            if not self.writer.started:
                await self.writer.start(self._headers())
            chunk = closing_chunk(self.req.route, tpl, open_indexes, ABORT)
            self._track(chunk)
            chunk["rollfleet"] = self._report()
            await self.writer.chunks([(chunk, None)])
        return await self._close_finished()

    def _prepare_json(self) -> None:
        if isinstance(self.writer, JsonWriter):
            self.writer.tpl = self.tpl or self.fallback
            prompt = self.entry.prompt_token_ids
            self.writer.prompt_tokens = len(prompt) if prompt is not None else None

    async def _fail(self, status: int, message: str) -> str:
        await self.writer.error(status, message, self._headers())
        return "error"


class _StopWatch:
    """Ends one attempt when its request must stop (admin abort, client gone, deadline): aborts the caller id
    on the engine, gives the engine's stream `stop_grace_s` to deliver the end (`finish_reason: "abort"`,
    with the partial output), and only then cuts the stream by cancelling the attempt's task, which closes
    the connection (vLLM aborts a request whose client left)."""

    def __init__(self, exchange: _Exchange, engine: Engine) -> None:
        self.exchange, self.engine = exchange, engine
        task = asyncio.current_task(exchange.loop)
        assert task is not None, "made by an attempt, in its task"
        self.task = task
        self.over = False
        self.ended: asyncio.Future[None] | None = None  # made by a stop: most attempts are never stopped
        self.cut = False
        self.moved = False

    def move(self) -> bool:
        """End the attempt now, as a failure of its engine (the request continues elsewhere): the bytes given to
        the client so far are what the gateway tracked, so the continuation starts where the client is."""
        if self.over or self.cut or self.moved:
            return False
        self.moved = True
        self.task.cancel()
        return True

    def stop(self, _: asyncio.Future[None]) -> None:
        if not self.over:
            self.ended = self.exchange.loop.create_future()
            self.exchange.proxy.background(self._stop(self.ended))

    def attempt_ended(self) -> None:
        self.over = True
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(None)

    async def _stop(self, ended: asyncio.Future[None]) -> None:
        p, entry, rid = self.exchange.proxy, self.exchange.entry, self.exchange.req.request_id
        status = await p.abort_on_engine(self.engine, [rid], p.config.abort_timeout_s, entry.attempt)
        log.info("request %s stopped (%s): engine %s says %s", rid, entry.stop, self.engine.key, status[rid].value)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(ended), p.config.stop_grace_s)
        if self.over:
            return
        if status[rid] is not AbortStatus.ABORTED:
            entry.unconfirmed = (
                f"engine {self.engine.key} answered {status[rid].value!r} to the abort and its stream did not end "
                f"within {p.config.stop_grace_s:.0f}s; the gateway closed the connection (vLLM aborts a request "
                "whose client left)"
            )
        self.cut = True
        self.task.cancel()


def _parse_all(payloads: list[bytes]) -> list[Json]:
    """The JSON of several SSE payloads, parsed as one array (one call instead of one per token)."""
    if len(payloads) > 1:
        try:
            parsed = orjson.loads(b"[" + b",".join(payloads) + b"]")
        except orjson.JSONDecodeError:
            pass  # one of them is not JSON: parse them one by one, to say which
        else:
            if all(isinstance(obj, dict) for obj in parsed):
                return parsed  # type: ignore[no-any-return]
    out = []
    for payload in payloads:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError as err:
            obj = {"error": {"message": f"the engine streamed an event that is not JSON ({err}): {payload[:200]!r}"}}
        out.append(obj if isinstance(obj, dict) else {"error": {"message": f"not a JSON object: {payload[:200]!r}"}})
    return out


def engine_ref(engine: Engine) -> EngineRef:
    assert engine.url is not None  # only engines with an address are routed to or asked to abort
    return EngineRef(engine.key, engine.url)


def _error_json(data: bytes, status: int) -> Json:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return error_body(data.decode(errors="replace")[:1000], status)
    return parsed if isinstance(parsed, dict) else error_body(str(parsed), status)


def _error_code(error: Any) -> int:
    """The HTTP status an engine's in-stream error stands for (vLLM puts it in `code`); 500 when it says none."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code <= 599 else 500
