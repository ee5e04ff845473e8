"""A fast engine simulator that speaks the Rollfleet engine's protocol: the control-plane tier's engine.

Serves the shapes vLLM 0.32 serves (`/v1/completions`, `/v1/chat/completions`,
`/inference/v1/generate`, streaming and not, with `token_ids`/`prompt_token_ids`) and the
Rollfleet engine's own API with the engine's own rules, imported from `rollfleet_engine`:
who may call what (`access.AccessPolicy`, with `--token-file` and `--inference-token-file`
as the engine takes them), caller ids and their bookkeeping (`tracker.RequestTracker`: the
409 for an id in flight, the state route's counts, `GET /rollfleet/v1/requests[/{id}]`),
truthful abort (`abort.abort_requests`), and pause modes as vLLM's: `keep` freezes every
request, `wait` lets those in flight finish and holds new ones, `abort` ends those in flight
with `finish_reason: abort`. `tests/engine/test_contract.py` runs the same checks against
this and against real vLLM, so the two cannot drift apart unnoticed.

Output is deterministic: token i of a greedy request (temperature 0) is `(prompt_len + i) % 97 + 3`
(a sampled one adds its seed, or a random one), its text is
`t<id> ` and its logprob (when asked) `-(id % 7) / 4`. Knobs: `token_delay_ms` (before each
token, read at each: lowered, it speeds up the requests in flight too) and `die_after` (route -> cut
the connection after that many tokens, streamed or not, like an engine that died); `streamed` holds
the ids it was asked to stream; `refuse` holds routes answered 404. Without a token file (benchmarks,
in-process unit tests) nothing is checked. Weight routes (prefetch, relay, the update session) are the
engine's own code with no model behind them (`sim_weights`): the sync sidecar pushes to simulated fleets;
the loads themselves are tested on real vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from rollfleet_client.protocol import TRACEPARENT_HEADER
from rollfleet_dev.sim_weights import SimWeights
from rollfleet_engine.abort import abort_requests
from rollfleet_engine.access import AccessPolicy, read_token
from rollfleet_engine.protocol import (
    ABORT_PATH,
    ATTEMPT_HEADER,
    MAX_WEIGHT_LAG_HEADER,
    PAUSE_AND_LOOK_PATH,
    PAUSE_PATH,
    READY_PATH,
    REQUEST_ID_HEADER,
    REQUESTS_PATH,
    RESUME_PATH,
    STATE_PATH,
    WEIGHT_VERSION_HEADER,
    AbortRequest,
    EngineState,
    PauseMode,
    parse_max_weight_lag,
    parse_pause_mode,
)
from rollfleet_engine.tracker import RequestTracker
from rollfleet_engine.weights_client import staging_root

Json = dict[str, Any]
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
# The vLLM metrics the tests read (name, Prometheus type): requests that produced their first token,
# requests decoding and waiting for a place in the batch, requests finished whole.
FIRST_TOKENS_METRIC = "vllm:time_to_first_token_seconds_count"
RUNNING_METRIC = "vllm:num_requests_running"
WAITING_METRIC = "vllm:num_requests_waiting"
SUCCESS_METRIC = "vllm:request_success_total"
TOKENS_METRIC = "vllm:generation_tokens_total"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class SimEngine:
    def __init__(
        self,
        name: str = "sim",
        token_delay_ms: float = 0.0,
        weight_version: str = "v1",
        die_after: dict[str, int] | None = None,
        policy: AccessPolicy | None = None,
    ) -> None:
        self.name = name
        self.token_delay_ms = token_delay_ms
        self.die_after = die_after or {}
        self.policy = policy
        # Routes answered 404: like vLLM without --enable-scale-out, or an engine whose abort cannot be had.
        self.refuse: set[str] = set()
        # A fault to inject: answer at most this many choices, whatever `n` asked (None: as many as asked).
        self.max_choices: int | None = None
        # A busy engine: seconds a generation request waits before the engine takes it (and sees its id).
        self.accept_delay_s = 0.0
        # A fault to inject: an aborted request's stream ends ([DONE]) without the chunk that says so (a CI run
        # saw vLLM do this under load; a gateway that asked for the abort must still end its client's answer).
        self.silent_abort = False
        self.instance = secrets.token_hex(4)
        self.weights = SimWeights(staging_root() / f"sim-{os.getpid()}-{self.instance}", weight_version)
        self.tracker = RequestTracker()
        self.flags: dict[str, asyncio.Event] = {}  # caller id (= its engine id here) -> abort flag
        self.served = 0
        self.first_tokens = 0
        self.successes = 0
        self.generated = 0  # output tokens, every request
        self.decoding = 0  # requests with a place in the batch
        self.queued = 0  # ... and those waiting for one
        self.streamed: set[str] = set()
        self.traces: dict[str, str | None] = {}  # caller id -> the traceparent it came with (tests of the gateway)
        self.pause_mode: PauseMode | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._admitted_before_pause: set[str] = set()  # pause=wait: these may go on, the rest wait
        # What vLLM checks a request against (None: not checked): the model's vocabulary (with it, the
        # model's name too: a simulator of a model) and context.
        self.vocab_size: int | None = None
        self.max_model_len: int | None = None
        self._slots: asyncio.Semaphore | None = None  # vLLM's --max-num-seqs, when given
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it serves on, once it serves
        # Sampling as vLLM's: a temperature over 0 (1.0 unless given) varies the tokens, reproducibly with a
        # seed. Off, every request decodes greedily: in-process tests want one answer per prompt.
        self.samples = False

    @property
    def weight_version(self) -> str:
        return self.weights.version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.weights.version = version

    def limit_batch(self, max_num_seqs: int) -> None:
        """Decode at most this many requests at once, as vLLM's `--max-num-seqs`; the others wait."""
        self._slots = asyncio.Semaphore(max_num_seqs)

    # --- views the unit tests read -----------------------------------------------------
    def _on_own_loop(self, read: Callable[[], Any]) -> Any:
        """`read()` where the tracker changes, on the engine's event loop: read from another thread while the
        engine serves, a view could see a dict change size under it."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or loop is here or not loop.is_running():
            return read()

        async def on_loop() -> Any:
            return read()

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(10)

    @property
    def running(self) -> set[str]:
        """Caller ids in flight."""
        view = self._on_own_loop(lambda: self.tracker.view(recent=0))
        return {t.request_id for t in view.in_flight}

    @property
    def finished(self) -> dict[str, str]:
        """Caller id -> finish reason, for the requests that ended (the tracker's bounded memory of them)."""
        view = self._on_own_loop(lambda: self.tracker.view(recent=1 << 30))
        return {t.request_id: t.finish_reason or "" for t in view.recently_finished}

    async def _serving(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._access] if self.policy else [])
        for path in GENERATE_PATHS:
            app.router.add_post(path, self.generate)
        app.router.add_post(ABORT_PATH, self.abort)
        app.router.add_get(REQUESTS_PATH, self.requests_view)
        app.router.add_get(REQUESTS_PATH + "/{rid}", self.tracked)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get(STATE_PATH, self.state)
        app.router.add_get(READY_PATH, self.ready)
        app.router.add_post(PAUSE_PATH, self.pause)
        app.router.add_post(PAUSE_AND_LOOK_PATH, self.pause_and_look)
        app.router.add_post(RESUME_PATH, self.resume)
        self.weights.add_routes(app, self.state)
        app.on_startup.append(self._serving)
        return app

    @web.middleware
    async def _access(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The engine's access rule, before any route (as its ASGI middleware): a refused call changes nothing."""
        assert self.policy is not None
        path = request.path.rstrip("/") or "/"
        refusal = self.policy.decide(request.method, path, request.headers.get("Authorization"))
        if refusal is not None:
            return web.json_response({"error": refusal[1]}, status=refusal[0])
        return await handler(request)

    async def state(self, request: web.Request) -> web.Response:
        running, waiting = self.tracker.counts()
        state = EngineState(
            model=self.name,
            weight_version=self.weight_version,
            paused=self.pause_mode is not None,
            pause_mode=self.pause_mode,
            running=running,
            waiting=waiting,
            instance=self.instance,
            inference_open=self.policy is None or self.policy.inference_token is None,
            weights_manifest_sha256=self.weights.manifest_sha256,
        )
        return web.json_response(state.model_dump(mode="json"))

    async def pause(self, request: web.Request) -> web.Response:
        mode = parse_pause_mode(request.query.get("mode", "abort"))
        if mode is None:
            return web.json_response({"error": f"unknown pause mode {request.query.get('mode')!r}"}, status=400)
        self.pause_mode = mode
        self._resumed.clear()
        in_flight = self.running
        if mode == "abort":
            for rid in in_flight:
                self.flags[rid].set()
        elif mode == "wait":
            # vLLM answers a wait-mode pause once the requests it runs have finished.
            self._admitted_before_pause = in_flight
            while self._admitted_before_pause & self.running:
                await self.tracker.wait_changed(1.0)
        return web.json_response({})

    async def pause_and_look(self, request: web.Request) -> web.Response:
        """PAUSE_AND_LOOK_PATH: the pause, then the requests view, as the engine's middleware runs them."""
        paused = await self.pause(request)
        return paused if paused.status != 200 else await self.requests_view(request)

    async def resume(self, request: web.Request) -> web.Response:
        self.pause_mode = None
        self._admitted_before_pause = set()
        self._resumed.set()
        return web.json_response({})

    async def _gate(self, rid: str, flag: asyncio.Event) -> None:
        """Before each token: wait out a pause that holds this request (an abort ends the wait)."""
        if self._resumed.is_set() or (self.pause_mode == "wait" and rid in self._admitted_before_pause):
            return
        resumed, aborted = asyncio.ensure_future(self._resumed.wait()), asyncio.ensure_future(flag.wait())
        try:
            await asyncio.wait([resumed, aborted], return_when=asyncio.FIRST_COMPLETED)
        finally:
            resumed.cancel()
            aborted.cancel()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def ready(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    async def metrics(self, request: web.Request) -> web.Response:
        label = f'{{model_name="{self.name}"}}'
        lines = [
            f"# TYPE {FIRST_TOKENS_METRIC.removesuffix('_count')} histogram",
            f"{FIRST_TOKENS_METRIC}{label} {self.first_tokens}",
            f"# TYPE {RUNNING_METRIC} gauge",
            f"{RUNNING_METRIC}{label} {self.decoding}",
            f"# TYPE {WAITING_METRIC} gauge",
            f"{WAITING_METRIC}{label} {self.queued}",
            f"# TYPE {SUCCESS_METRIC.removesuffix('_total')} counter",
            f"{SUCCESS_METRIC}{label} {self.successes}",
            f"# TYPE {TOKENS_METRIC.removesuffix('_total')} counter",
            f"{TOKENS_METRIC}{label} {self.generated}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def requests_view(self, request: web.Request) -> web.Response:
        return web.json_response(self.tracker.view().model_dump(mode="json"))

    async def tracked(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        tracked = self.tracker.get(rid)
        if tracked is None:
            return web.json_response({"detail": f"unknown request id {rid!r}"}, status=404)
        return web.json_response(tracked.model_dump(mode="json"))

    def _produced(self, rid: str, tokens: int, first: bool) -> None:
        self.generated += tokens
        if first:
            self.first_tokens += 1
        self.tracker.on_output(
            rid, rid, output_tokens=tokens, cumulative=False, finish_reason=None, versions=[self.weight_version]
        )

    async def _engine_abort(self, engine_ids: list[str]) -> None:
        for eid in engine_ids:
            if eid in self.flags:
                self.flags[eid].set()

    async def abort(self, request: web.Request) -> web.Response:
        if request.path in self.refuse:
            return web.json_response({"detail": "Not Found"}, status=404)
        body = AbortRequest.model_validate_json(await request.read())
        results = await abort_requests(self.tracker, self._engine_abort, body.request_ids, body.timeout_s, body.attempt)
        return web.json_response({"results": {rid: str(status) for rid, status in results.items()}})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        path = request.path
        if path in self.refuse:
            return web.json_response({"detail": "Not Found"}, status=404)
        rid = request.headers.get(REQUEST_ID_HEADER) or body.get("request_id") or f"sim-{self.served}"
        self.traces[rid] = request.headers.get(TRACEPARENT_HEADER)
        if self.accept_delay_s:
            await asyncio.sleep(self.accept_delay_s)
        try:
            max_lag = parse_max_weight_lag(request.headers.get(MAX_WEIGHT_LAG_HEADER))
        except ValueError as err:
            return web.json_response({"error": str(err)}, status=400)
        if not self.tracker.open(rid, request.headers.get(ATTEMPT_HEADER), max_lag):
            return web.json_response(
                {"error": f"request id {rid!r} is still in flight; ids must not be reused"}, status=409
            )
        try:
            return await self._generate(request, path, body, rid)
        finally:
            self.tracker.on_engine_end(rid, rid, "abort")  # no-op unless it ran and ended without a reason
            self.tracker.close(rid)
            self.flags.pop(rid, None)

    def _refusal(self, path: str, body: Json, prompt: list[int], max_tokens: int) -> tuple[int, Json, bool] | None:
        """vLLM's refusal of a request, checked in vLLM's order: (status, body, whether a streaming request gets
        it inside the stream, after a 200), or None."""
        model = body.get("model")
        if self.vocab_size is not None and path != "/inference/v1/generate" and model not in (None, self.name):
            message = f"The model `{model}` does not exist. Valid aliases: {self.name}."
            return 404, _error("NotFoundError", message, 404, "model"), False
        if self.max_model_len is not None and max_tokens > self.max_model_len:
            message = (
                f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}. Please request "
                f"fewer output tokens. (parameter=max_tokens, value={max_tokens})"
            )
            return 400, _error("BadRequestError", message, 400, "max_tokens"), False
        sampling = _sampling(path, body)
        asked = sampling.get("top_logprobs" if path == "/v1/chat/completions" else "logprobs")
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > MAX_LOGPROBS:
            message = (
                f"Requested sample logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS} "
                f"(parameter=logprobs, value={asked})"
            )
            return 400, _error("BadRequestError", message, 400, "logprobs"), True
        outside = next((t for t in prompt if self.vocab_size is not None and not 0 <= t < self.vocab_size), None)
        if outside is not None:
            return 400, _error("BadRequestError", f"Token id {outside} is out of vocabulary", 400), True
        return None

    async def _generate(self, request: web.Request, path: str, body: Json, rid: str) -> web.StreamResponse:
        self.served += 1
        die_after = self.die_after.get(path, -1)
        if path == "/inference/v1/generate":
            prompt = list(body["token_ids"])
            max_tokens = int(body.get("sampling_params", {}).get("max_tokens") or 16)
        elif path == "/v1/chat/completions":
            prompt = [1] + [ord(c) % 97 + 3 for m in body["messages"] for c in str(m.get("content", ""))]
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        else:
            p = body["prompt"]
            prompt = list(p) if isinstance(p, list) else [ord(c) % 97 + 3 for c in p]
            max_tokens = int(body.get("max_tokens") or 16)
        refusal = self._refusal(path, body, prompt, max_tokens)
        if refusal is not None:
            status, error, in_stream = refusal
            if not (body.get("stream") and in_stream):
                return web.Response(body=orjson.dumps(error), status=status, content_type="application/json")
            # A prompt vLLM refuses once the stream began: 200, then the error as an event.
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await stream.prepare(request)
            await stream.write(b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")
            await stream.write_eof()
            return stream
        sampling = _sampling(path, body)
        want = sampling.get("logprobs") is not None and sampling.get("logprobs") is not False  # 0 asks for them
        # Greedy decoding gives one answer per prompt; sampling differs per request unless seeded (as vLLM).
        temperature, seed = (sampling.get("temperature", 1.0), sampling.get("seed")) if self.samples else (0, None)
        seed = 0 if temperature == 0 else int(seed) + 1 if seed is not None else secrets.randbelow(1 << 30) + 1
        flag = asyncio.Event()
        self.flags[rid] = flag
        self.tracker.attach(rid, rid)
        async with self._batch_slot(flag):
            if body.get("stream"):
                self.streamed.add(rid)
                return await self._stream(request, path, body, rid, prompt, max_tokens, die_after, flag, want, seed)
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            return await self._whole(request, path, body, rid, prompt, max_tokens, die_after, flag, want, as_ids, seed)

    @contextlib.asynccontextmanager
    async def _batch_slot(self, flag: asyncio.Event) -> AsyncIterator[None]:
        """A place in vLLM's batch (`--max-num-seqs`): the request waits for one (an abort ends the wait,
        and the request then ends at once)."""
        acquired = False
        if self._slots is not None:
            self.queued += 1
            slot, aborted = asyncio.ensure_future(self._slots.acquire()), asyncio.ensure_future(flag.wait())
            try:
                await asyncio.wait([slot, aborted], return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.queued -= 1
                aborted.cancel()
                if not slot.done():
                    slot.cancel()
            acquired = slot.done() and not slot.cancelled()
        self.decoding += 1
        try:
            yield
        finally:
            self.decoding -= 1
            if acquired and self._slots is not None:
                self._slots.release()

    def _finish(self, rid: str, reason: str) -> None:
        if reason in ("length", "stop"):
            self.successes += 1
        self.tracker.on_output(rid, rid, output_tokens=0, cumulative=False, finish_reason=reason)

    @staticmethod
    def token(prompt: list[int], i: int, seed: int) -> int:
        """Token i of a request: from the prompt's length alone when greedy (seed 0)."""
        return (len(prompt) + i + seed * 31) % 97 + 3

    @staticmethod
    def logprob(token: int) -> float:
        return -(token % 7) / 4

    def logprobs_of(self, path: str, tokens: list[int], as_ids: bool) -> Json:
        """vLLM's logprobs of the sampled tokens: completions' shape, or chat's (also the token-in route's);
        tokens named `token_id:N` when the request asked `return_tokens_as_token_ids`."""
        names = [f"token_id:{t}" if as_ids else f"t{t} " for t in tokens]
        values = [self.logprob(t) for t in tokens]
        if path == "/v1/completions":
            top = [{name: v} for name, v in zip(names, values, strict=True)]
            return {"tokens": names, "token_logprobs": values, "top_logprobs": top, "text_offset": []}
        return {
            "content": [
                {"token": name, "logprob": v, "bytes": None, "top_logprobs": []}
                for name, v in zip(names, values, strict=True)
            ]
        }

    def _headers(self, rid: str) -> dict[str, str]:
        return {REQUEST_ID_HEADER: rid, WEIGHT_VERSION_HEADER: self.weight_version}

    async def _whole(
        self,
        request: web.Request,
        path: str,
        body: Json,
        rid: str,
        prompt: list[int],
        n: int,
        die_after: int,
        flag: asyncio.Event,
        want: bool,
        as_ids: bool,
        seed: int,
    ) -> web.Response:
        seeds = self.choice_seeds(body, path, seed)
        outputs: list[list[int]] = [[] for _ in seeds]
        for i in range(n):
            if i == die_after:
                assert request.transport is not None
                request.transport.close()  # an engine that died before it answered
                raise asyncio.CancelledError
            await self._gate(rid, flag)
            if flag.is_set():
                break
            if self.token_delay_ms:
                await asyncio.sleep(self.token_delay_ms / 1000)
            for tokens, s in zip(outputs, seeds, strict=True):
                tokens.append(self.token(prompt, i, s))
            self._produced(rid, len(seeds), first=i == 0)
        reason = "abort" if flag.is_set() else "length"
        self._finish(rid, reason)
        usage = self.usage(prompt, sum(map(len, outputs)))
        choices = []
        for index, tokens in enumerate(outputs):
            text = "".join(f"t{t} " for t in tokens)
            choice: Json = {"index": index, "finish_reason": reason, "token_ids": tokens}
            choice["logprobs"] = self.logprobs_of(path, tokens, as_ids) if want else None
            if path == "/v1/chat/completions":
                choice["message"] = {"role": "assistant", "content": text}
            elif path == "/v1/completions":
                choice |= {"text": text, "prompt_token_ids": prompt}
            choices.append(choice)
        if path == "/v1/chat/completions":
            out: Json = {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": choices,
                "usage": usage,
                "prompt_token_ids": prompt,
            }
        elif path == "/v1/completions":
            out = {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": choices,
                "usage": usage,
            }
        else:
            out = {"request_id": rid, "choices": choices, "usage": usage}
        _unasked_ids(path, body, out)
        return web.Response(body=orjson.dumps(out), content_type="application/json", headers=self._headers(rid))

    async def _stream(
        self,
        request: web.Request,
        path: str,
        body: Json,
        rid: str,
        prompt: list[int],
        n: int,
        die_after: int,
        flag: asyncio.Event,
        want: bool,
        seed: int,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**self._headers(rid), "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = int(time.time())
        reason = None
        seeds = self.choice_seeds(body, path, seed)
        produced = 0
        for i in range(n):
            if i == die_after:
                assert request.transport is not None
                request.transport.close()  # an engine that died mid-stream
                return resp
            await self._gate(rid, flag)
            if self.token_delay_ms and not flag.is_set():
                await asyncio.sleep(self.token_delay_ms / 1000)
            if flag.is_set():
                reason = "abort"
                if self.silent_abort:
                    break
            elif i == n - 1:
                reason = "length"
            if reason != "abort":
                self._produced(rid, len(seeds), first=i == 0)
                produced += len(seeds)
            for index, s in enumerate(seeds):
                tokens = [] if reason == "abort" else [self.token(prompt, i, s)]
                chunk = self._chunk(path, body, rid, created, tokens, prompt if i == 0 else None, reason, index, want)
                _unasked_ids(path, body, chunk)
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if reason is not None:
                break
        self._finish(rid, reason or "length")
        if (body.get("stream_options") or {}).get("include_usage"):
            # The usage chunk vLLM ends a stream with when asked (`stream_options.include_usage`).
            usage = self.usage(prompt, produced)
            chat = path == "/v1/chat/completions"
            last: Json = (
                {"request_id": rid, "choices": [], "usage": usage}
                if path == "/inference/v1/generate"
                else {
                    "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": self.name,
                    "choices": [],
                    "usage": usage,
                }
            )
            await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def choice_seeds(self, body: Json, path: str, seed: int) -> list[int]:
        """One seed per choice (`n`): greedy choices are one answer, sampled ones differ."""
        n = max(1, int(_sampling(path, body).get("n") or 1))
        return [seed if seed == 0 else seed + 7919 * j for j in range(min(n, self.max_choices or n))]

    @staticmethod
    def usage(prompt: list[int], completion_tokens: int) -> Json:
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens,
        }

    def _chunk(
        self,
        path: str,
        body: Json,
        rid: str,
        created: int,
        tokens: list[int],
        prompt: list[int] | None,
        reason: str | None,
        index: int,
        want: bool,
    ) -> Json:
        output_mode = body.get("output_mode", "tokens")
        text = "".join(f"t{t} " for t in tokens)
        choice: Json = {"index": index, "finish_reason": reason, "stop_reason": None, "token_ids": tokens}
        logprobs = self.logprobs_of(path, tokens, bool(body.get("return_tokens_as_token_ids"))) if want else None
        if path == "/v1/chat/completions":
            return {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.name,
                "choices": [{**choice, "delta": {"content": text}, "logprobs": logprobs}],
                "prompt_token_ids": prompt,
            }
        if path == "/v1/completions":
            return {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": created,
                "model": self.name,
                "choices": [{**choice, "text": text, "logprobs": logprobs, "prompt_token_ids": prompt}],
            }
        if reason is not None:
            choice["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": 1}]
        if output_mode == "text":
            choice["text"] = text
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return {"request_id": rid, "output_mode": output_mode, "choices": [choice]}


def _sampling(path: str, body: Json) -> Json:
    """A request's sampling parameters: the body's own fields, or the token-in route's `sampling_params`."""
    return dict(body.get("sampling_params", {})) if path == "/inference/v1/generate" else body


def _unasked_ids(path: str, body: Json, out: Json) -> None:
    """vLLM's OpenAI routes give token ids (the prompt's, the output's) only to `return_token_ids`."""
    if path == "/inference/v1/generate" or body.get("return_token_ids"):
        return
    if "prompt_token_ids" in out:
        out["prompt_token_ids"] = None
    for choice in out["choices"]:
        choice["token_ids"] = None
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None


def _error(kind: str, message: str, code: int, param: str | None = None) -> Json:
    """vLLM's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _model_config(model: str | None) -> Json:
    """A model directory's config.json, as the engine reads it; empty without one."""
    config = Path(model) / "config.json" if model else None
    return dict(orjson.loads(config.read_bytes())) if config is not None and config.is_file() else {}


def context_refusal(config: Json, max_model_len: int | None) -> str | None:
    """vLLM's refusal to start with a context longer than the model's, or None."""
    derived = config.get("max_position_embeddings")
    if max_model_len is None or derived is None or max_model_len <= derived:
        return None
    return (
        f"Value error, User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"(max_position_embeddings={float(derived)} or model_max_length=None in model's config.json)."
    )


def parser() -> argparse.ArgumentParser:
    """The simulator's command line: the engine's own flags it reads, the rest of vLLM's ignored."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    # A fleet's engine listens on every address of its pod, as the real one does.
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=None, help="required but for a --headless rank")
    parser.add_argument("--token-delay-ms", type=float, default=float(os.environ.get("SIM_TOKEN_DELAY_MS", "0")))
    parser.add_argument("--name", "--served-model-name", default="sim")
    parser.add_argument("--weight-version", default="v1")
    # As the real engine: the model directory (its config gives the vocabulary) and vLLM's context limit.
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded at once (vLLM's batch)")
    # The engine's access flags: without --token-file nothing is checked (benchmarks only).
    parser.add_argument("--token-file", default=None)
    parser.add_argument("--inference-token-file", default=None)
    # A multi-pod engine's other ranks (the operator's group manifest): the leader serves, they only run.
    parser.add_argument("--headless", action="store_true")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The operator's engine arguments (serve, --model, ...) mean nothing here but the flags above. The fleet's
    `engine.args` (the knobs above, for a simulated fleet) come after the `--` that precedes vLLM's."""
    args, _ = parser().parse_known_args([a for a in argv if a != "--"])
    return args


def engine_from_args(args: argparse.Namespace, read_file: Callable[[str], str] = read_token) -> SimEngine:
    """The engine `args` describe; `read_file` reads a token file (a host of many engines reads their Secrets).
    Exits as vLLM does when the model's context is shorter than asked."""
    policy = None
    if args.token_file:
        inference = read_file(args.inference_token_file) if args.inference_token_file else None
        policy = AccessPolicy(control_token=read_file(args.token_file), inference_token=inference)
    engine = SimEngine(args.name, args.token_delay_ms, weight_version=args.weight_version, policy=policy)
    config = _model_config(args.model)
    refusal = context_refusal(config, args.max_model_len)
    if refusal is not None:
        sys.exit(refusal)  # as vLLM: the engine does not start
    engine.vocab_size, engine.max_model_len = config.get("vocab_size"), args.max_model_len
    engine.samples = True
    if args.max_num_seqs:
        engine.limit_batch(args.max_num_seqs)
    return engine


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.headless:
        stop = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        signal.sigwait(stop)  # as vLLM's headless rank: until stopped
        return
    if args.port is None:
        parser().error("--port is required (only a --headless rank serves no port)")
    import uvloop

    uvloop.install()
    engine = engine_from_args(args)
    # A client that goes away cancels its handler: vLLM aborts such a request too.
    web.run_app(engine.app(), host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
