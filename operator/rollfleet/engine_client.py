"""The one client of an engine's HTTP API, used by the operator, the gateway and the sync sidecar.

Owns every call Rollfleet makes to an engine's own routes (`rollfleet_engine.protocol`:
state, the requests view, the truthful abort) and to vLLM's RL routes (pause, resume,
the weight update handshake): the bearer token header, the call policies (timeouts and
retries, all decided here), the one error type, `EngineCallError`, and parsing answers
into the protocol's pydantic models. Inference traffic (the gateway's streamed
completions) does not go through here; it only borrows `bearer_header`.

Talks to engines only, over `rollfleet.upstream` (the gateway's HTTP/1.1 client: keep-alive connections per
engine, httptools). Not httpx: its pool scans every connection and waiting request at each call's start
and end, and a call cost the caller 0.75 ms of CPU alone and 1.8 ms among 2,000 at once, where this
costs 0.2-0.35 ms; at 2,000 engines a pause fan-out was seconds of the operator's CPU (bench_scale).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlencode

import orjson
from pydantic import BaseModel, ValidationError

from rollfleet.errors import RollfleetError
from rollfleet.upstream import ConnectFailed, Upstream, UpstreamError
from rollfleet_engine.protocol import (
    ABORT_PATH,
    FINISH_WEIGHT_UPDATE_PATH,
    INIT_WEIGHT_TRANSFER_PATH,
    LOAD_PATH,
    PAUSE_AND_LOOK_PATH,
    PAUSE_PATH,
    REQUESTS_PATH,
    RESET_PREFIX_CACHE_PATH,
    RESUME_PATH,
    SHUTDOWN_WEIGHT_TRANSFER_PATH,
    STAGE_PATH,
    START_WEIGHT_UPDATE_PATH,
    STATE_PATH,
    UPDATE_WEIGHTS_PATH,
    WORLD_SIZE_PATH,
    AbortRequest,
    AbortResult,
    AbortStatus,
    EngineState,
    LoadRequest,
    PauseMode,
    RequestsView,
    StageStatus,
    TrackedRequest,
)

Model = TypeVar("Model", bound=BaseModel)

# How much of an engine's refusal an error message quotes.
_QUOTED_CHARS = 300


@dataclass(frozen=True)
class EngineRef:
    """One engine: a name for messages (pod name, or the URL in static mode) and its base URL."""

    name: str
    url: str


@dataclass(frozen=True)
class CallPolicy:
    """How long one call may take, and how often a connection that never reached the engine is retried."""

    timeout_s: float  # the whole call, retries included: connect, send, the engine's work, the answer
    connect_s: float | None = None  # one connection attempt (None: only timeout_s bounds it)
    retries: int = 0  # further attempts after a failed connection (the request was never sent)
    retry_delay_s: float = 0.5


# A state read on every operator pass: an engine that does not answer soon is read again next pass.
STATE_POLL = CallPolicy(timeout_s=5.0)
# Pause (keep), resume, the update handshake's start, the requests view, the sidecar's calls.
CONTROL = CallPolicy(timeout_s=30.0)
# pause?mode= returns once in-flight requests are held (keep), aborted, or finished (wait: long).
PAUSE: Mapping[PauseMode, CallPolicy] = {
    "keep": CONTROL,
    "abort": CallPolicy(timeout_s=60.0),
    "wait": CallPolicy(timeout_s=900.0),
}
# update_weights and finish_weight_update: the engine pulls and loads the weights before answering.
TRANSFER = CallPolicy(timeout_s=900.0)
# The gateway's abort: this much beyond the wait it asks of the engine; a dead engine fails fast.
GATEWAY_ABORT = CallPolicy(timeout_s=5.0, connect_s=2.0)
# The gateway's check of which weight versions produced a request, as the request ends.
VERSIONS_LOOKUP = CallPolicy(timeout_s=2.0)


class EngineCallError(RollfleetError):
    """An engine could not be reached, did not answer in time, refused a call, or answered nonsense."""

    def __init__(self, engine: EngineRef, method: str, path: str, problem: str, status: int | None = None) -> None:
        super().__init__(f"{engine.name}: {method} {path}: {problem}")
        self.engine = engine
        self.method = method
        self.path = path
        self.problem = problem
        self.status = status  # the engine's HTTP status when it answered, else None


def bearer_header(token: str) -> dict[str, str]:
    """The header that carries the fleet's admin token to an engine's control routes."""
    return {"Authorization": f"Bearer {token}"}


@dataclass(frozen=True)
class Reply:
    """An engine's answer: its HTTP status and body."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


# One HTTP exchange: (method, URL, body, headers, connect timeout) -> the answer. ConnectFailed when no connection
# could be opened (the engine never saw the request), UpstreamError when the answer broke off. Tests give their own.
Send = Callable[[str, str, bytes, Sequence[tuple[str, str]], float | None], Awaitable[Reply]]


def upstream_send(upstream: Upstream) -> Send:
    """Exchanges over `upstream`'s keep-alive connections."""

    async def send(
        method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]], connect_s: float | None
    ) -> Reply:
        response = await upstream.request(method, url, body, headers, connect_timeout_s=connect_s)
        try:
            return Reply(response.status, await response.read())
        finally:
            response.close()  # read to its end: the connection goes back to the engine's idle list

    return send


class EngineClient:
    """Calls to engines over keep-alive connections to each (`send`: tests give their own); `token` (the fleet's
    admin token) goes on every call."""

    def __init__(self, token: str | None = None, *, send: Send | None = None) -> None:
        self._upstream = Upstream()
        self._send_http = send or upstream_send(self._upstream)
        self._headers: tuple[tuple[str, str], ...] = tuple(bearer_header(token).items()) if token is not None else ()

    def with_token(self, token: str) -> EngineClient:
        """This client's connections, calling with `token` (the operator serves many fleets)."""
        twin = copy.copy(self)
        twin._headers = tuple(bearer_header(token).items())
        return twin

    async def aclose(self) -> None:
        """Close the connections (of every client made from this one by `with_token`)."""
        self._upstream.close()

    # --- the engine's own routes -----------------------------------------------------

    async def state(self, engine: EngineRef, policy: CallPolicy = STATE_POLL) -> EngineState:
        """Weight version, pause state and in-flight counts (an open route)."""
        return await self._answer(EngineState, "GET", engine, STATE_PATH, policy)

    async def requests(self, engine: EngineRef, policy: CallPolicy = CONTROL) -> RequestsView:
        """The requests in flight and recently finished, with the weight versions of each."""
        return await self._answer(RequestsView, "GET", engine, REQUESTS_PATH, policy)

    async def request(self, engine: EngineRef, request_id: str, policy: CallPolicy = VERSIONS_LOOKUP) -> TrackedRequest:
        """The engine's view of one caller id (HTTP 404 once it forgot the id)."""
        return await self._answer(TrackedRequest, "GET", engine, f"{REQUESTS_PATH}/{request_id}", policy)

    async def abort(
        self,
        engine: EngineRef,
        request_ids: list[str],
        wait_s: float | None = None,
        policy: CallPolicy = CONTROL,
        attempt: str | None = None,
    ) -> dict[str, AbortStatus]:
        """Abort caller ids; how each ended there. The engine waits up to `wait_s` (its own default
        when None) for each to end; a wait asked for is added to the policy's timeout. With `attempt`,
        only the requests sent with that `X-Rollfleet-Attempt` (the sender's own)."""
        wait = {} if wait_s is None else {"timeout_s": wait_s}
        body = AbortRequest(request_ids=request_ids, attempt=attempt, **wait).model_dump(exclude_none=True)
        result = await self._answer(AbortResult, "POST", engine, ABORT_PATH, policy, wait_s or 0.0, json=body)
        return result.results

    async def stage(
        self, engine: EngineRef, update_info: Mapping[str, Any], policy: CallPolicy = CONTROL
    ) -> StageStatus:
        """Start staging (prefetching) the weights of `update_info` while the engine serves."""
        return await self._answer(StageStatus, "POST", engine, STAGE_PATH, policy, json=dict(update_info))

    async def stage_status(self, engine: EngineRef, wait_s: float = 0.0) -> StageStatus:
        """The engine's staging status; with `wait_s`, once it is no longer staging (or after `wait_s`)."""
        return await self._answer(StageStatus, "GET", engine, STAGE_PATH, CONTROL, wait_s, params={"wait": wait_s})

    async def load(
        self, engine: EngineRef, update_info: Mapping[str, Any], version: str, policy: CallPolicy = TRANSFER
    ) -> EngineState:
        """The load in a pause in one call (start, update with `update_info`, finish as `version`); the engine's
        state after it. HTTP 404 from an engine image older than the route (`EngineCallError.status`)."""
        body = LoadRequest.model_validate({"update_info": dict(update_info), "weight_version": version})
        sent = {"update_info": body.update_info.for_load(), "weight_version": body.weight_version}
        return await self._answer(EngineState, "POST", engine, LOAD_PATH, policy, json=sent)

    # --- vLLM's RL routes ------------------------------------------------------------

    async def pause(self, engine: EngineRef, mode: PauseMode, policy: CallPolicy | None = None) -> None:
        """Pause generation; `mode` says what happens to in-flight requests (policy: `PAUSE[mode]`)."""
        await self._call("POST", engine, PAUSE_PATH, policy or PAUSE[mode], params={"mode": mode})

    async def pause_and_look(
        self, engine: EngineRef, mode: PauseMode, policy: CallPolicy | None = None
    ) -> RequestsView:
        """Pause generation, then the requests view as it stands paused, in one call. HTTP 404 from an engine image
        older than the route (`EngineCallError.status`)."""
        policy = policy or PAUSE[mode]
        return await self._answer(RequestsView, "POST", engine, PAUSE_AND_LOOK_PATH, policy, params={"mode": mode})

    async def resume(self, engine: EngineRef, policy: CallPolicy = CONTROL) -> None:
        await self._call("POST", engine, RESUME_PATH, policy)

    async def init_weight_transfer(
        self, engine: EngineRef, init_info: Mapping[str, Any], policy: CallPolicy = TRANSFER
    ) -> None:
        """Join a collective backend's group; answers once every rank has joined."""
        await self._call("POST", engine, INIT_WEIGHT_TRANSFER_PATH, policy, json={"init_info": dict(init_info)})

    async def shutdown_weight_transfer(self, engine: EngineRef, policy: CallPolicy = CONTROL) -> None:
        """Leave the group joined by init_weight_transfer."""
        await self._call("POST", engine, SHUTDOWN_WEIGHT_TRANSFER_PATH, policy)

    async def start_weight_update(self, engine: EngineRef, policy: CallPolicy = CONTROL) -> None:
        await self._call("POST", engine, START_WEIGHT_UPDATE_PATH, policy)

    async def update_weights(
        self, engine: EngineRef, update_info: Mapping[str, Any], policy: CallPolicy = TRANSFER
    ) -> None:
        """Have the engine pull (and verify) weights described by the backend's `update_info`."""
        await self._call("POST", engine, UPDATE_WEIGHTS_PATH, policy, json={"update_info": dict(update_info)})

    async def finish_weight_update(self, engine: EngineRef, version: str, policy: CallPolicy = TRANSFER) -> None:
        """Load the pulled weights and label them `version`."""
        await self._call("POST", engine, FINISH_WEIGHT_UPDATE_PATH, policy, json={"weight_version": version})

    async def world_size(self, engine: EngineRef, policy: CallPolicy = CONTROL) -> int:
        """How many ranks the engine runs on (tensor x data parallel)."""
        size = (await self._json("GET", engine, WORLD_SIZE_PATH, policy)).get("world_size")
        if not isinstance(size, int):
            raise EngineCallError(engine, "GET", WORLD_SIZE_PATH, f"answered no world size: {size!r}")
        return size

    async def reset_prefix_cache(self, engine: EngineRef, policy: CallPolicy = CONTROL) -> bool:
        """Drop the engine's prefix cache; whether it did."""
        return bool((await self._json("POST", engine, RESET_PREFIX_CACHE_PATH, policy)).get("success"))

    # --- one call --------------------------------------------------------------------

    async def _json(self, method: str, engine: EngineRef, path: str, policy: CallPolicy) -> dict[str, Any]:
        """An answer of vLLM's own routes, which have no model of ours: a JSON object."""
        reply = await self._call(method, engine, path, policy)
        try:
            body = orjson.loads(reply.body) if reply.body else {}
        except orjson.JSONDecodeError as err:
            raise EngineCallError(engine, method, path, f"unexpected answer: {err}", status=reply.status) from err
        return body if isinstance(body, dict) else {}

    async def _answer(
        self,
        model: type[Model],
        method: str,
        engine: EngineRef,
        path: str,
        policy: CallPolicy,
        wait_s: float = 0.0,
        **kwargs: Any,
    ) -> Model:
        """The engine's answer, parsed into `model`."""
        reply = await self._call(method, engine, path, policy, wait_s, **kwargs)
        try:
            return model.model_validate_json(reply.body)
        except ValidationError as err:
            raise EngineCallError(engine, method, path, f"unexpected answer: {err}", status=reply.status) from err

    async def _call(
        self,
        method: str,
        engine: EngineRef,
        path: str,
        policy: CallPolicy,
        wait_s: float = 0.0,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
    ) -> Reply:
        """The engine's HTTP 2xx answer; anything else raises EngineCallError."""
        deadline_s = policy.timeout_s + wait_s
        url = engine.url.rstrip("/") + path + (f"?{urlencode(params)}" if params else "")
        headers, body = self._headers, b""
        if json is not None:
            headers, body = (*headers, ("Content-Type", "application/json")), orjson.dumps(json)
        try:
            async with asyncio.timeout(deadline_s):
                reply = await self._send(method, url, body, headers, policy)
        except TimeoutError as err:
            raise EngineCallError(engine, method, path, f"no answer within {deadline_s:g}s") from err
        except UpstreamError as err:
            raise EngineCallError(engine, method, path, f"{type(err).__name__}: {err}") from err
        if not 200 <= reply.status < 300:
            problem = f"HTTP {reply.status}: {reply.text[:_QUOTED_CHARS]}"
            raise EngineCallError(engine, method, path, problem, status=reply.status)
        return reply

    async def _send(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]], policy: CallPolicy
    ) -> Reply:
        attempt = 0
        while True:
            try:
                return await self._send_http(method, url, body, headers, policy.connect_s)
            except ConnectFailed:
                # Only a failed connection is retried: the engine never saw the request, so
                # even a POST cannot act twice.
                if attempt >= policy.retries:
                    raise
            attempt += 1
            await asyncio.sleep(policy.retry_delay_s)
