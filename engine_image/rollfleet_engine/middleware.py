"""The ASGI middleware in front of vLLM's app: access control and request bookkeeping.

Runs before any vLLM route, so a refused control call changes nothing. For generation
requests it fixes the caller id (header, else body ``request_id``, else a new one,
written back into the header so vLLM uses the same), tracks the request for abort,
and stamps the weight version and the id on the response. It keeps the proof of the bytes: the
manifest each load was verified against (``EngineState.weights_manifest_sha256``). A weight update that finishes
drops the caches of the old weights before its answer leaves (``Runtime.drop_old_weights_caches``),
so nothing resumed after it can read them.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import ValidationError

from rollfleet_engine.engine_hooks import current_caller_id
from rollfleet_engine.protocol import (
    ATTEMPT_HEADER,
    FINISH_WEIGHT_UPDATE_PATH,
    LOAD_PATH,
    MAX_WEIGHT_LAG_HEADER,
    MIXED_WEIGHTS_MARK,
    PAUSE_AND_LOOK_PATH,
    PAUSE_PATH,
    REQUEST_ID_HEADER,
    REQUESTS_PATH,
    RESUME_PATH,
    START_WEIGHT_UPDATE_PATH,
    STATE_PATH,
    UPDATE_WEIGHTS_PATH,
    WEIGHT_VERSION_HEADER,
    LoadRequest,
    parse_max_weight_lag,
    parse_pause_mode,
)
from rollfleet_engine.rank_staging import RANK_STAGED_SCHEME
from rollfleet_engine.runtime import Runtime

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Step = tuple[str, str, bytes, bytes]  # method, path, body, query string

log = logging.getLogger(__name__)

# Routes that generate; each request to them is tracked by caller id.
TRACKED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/v1/responses", "/v1/messages"}
)
_VERSION_ROUTES = frozenset({FINISH_WEIGHT_UPDATE_PATH, "/update_weight_version"})
_LOADING_ROUTES = frozenset({UPDATE_WEIGHTS_PATH, FINISH_WEIGHT_UPDATE_PATH})
_NOT_INTACT = (
    "the weights are partly updated (an in-place weight update started and did not finish), or the caches "
    "of the old weights could not be dropped (the engine's log says why); "
    "push the full weights again (start, update, finish) before resuming"
)


class RollfleetMiddleware:
    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.runtime.policy.decide(method, path, headers.get("authorization"))
        if refusal is not None:
            await _json(send, refusal[0], {"error": refusal[1]})
            return
        if method == "POST" and path in TRACKED_PATHS:
            await self._tracked(scope, receive, send, headers)
            return
        if method == "POST" and path == LOAD_PATH:
            await self._load(scope, receive, send)
            return
        if method == "POST" and path == PAUSE_AND_LOOK_PATH:
            query = scope.get("query_string", b"")
            await self._in_order(
                scope, receive, send, [("POST", PAUSE_PATH, b"", query), ("GET", REQUESTS_PATH, b"", b"")]
            )
            return
        if path == RESUME_PATH and not self.runtime.weights_intact:
            await _json(send, 409, {"error": _NOT_INTACT})
            return
        body = None
        if path == UPDATE_WEIGHTS_PATH:  # what it names is what the load verifies its tensors against
            body = await _read_body(receive)
            receive = _replay(body, receive)
        # The answer to a finished update waits until the old weights' caches are gone: the caller resumes on it.
        answer = _Answer(self._drop_caches if path == FINISH_WEIGHT_UPDATE_PATH else None)
        try:
            await answer.run(self.app, scope, receive, send, keep_error_body=path in _LOADING_ROUTES)
        finally:  # vLLM's error middleware answers 500, then re-raises
            if MIXED_WEIGHTS_MARK.encode() in answer.error_body:
                self.runtime.weights_intact = False  # a load failed after some layers took new values
                self.runtime.weights_manifest_sha256 = None
        if answer.status == 200:
            await self._after_control(path, scope, answer.prepared, body)

    async def _after_control(self, path: str, scope: Scope, prepared: bool, body: bytes | None) -> None:
        rt = self.runtime
        if path == PAUSE_PATH:
            mode = parse_qs(scope.get("query_string", b"").decode()).get("mode", ["abort"])[0]
            rt.pause_mode = parse_pause_mode(mode)
        elif path == RESUME_PATH:
            rt.pause_mode = None
        elif path == START_WEIGHT_UPDATE_PATH:
            rt.loading_manifests = []
            if rt.loads_in_place:  # each tensor is loaded as it arrives, from now on
                rt.weights_intact, rt.weights_manifest_sha256 = False, None
        elif path == UPDATE_WEIGHTS_PATH:
            rt.loading_manifests.append(verified_manifest(body or b""))
        elif path in _VERSION_ROUTES:
            await rt.refresh_weight_version()
            if path == FINISH_WEIGHT_UPDATE_PATH:
                rt.weights_intact = prepared  # one version, and no cache of the old one
                rt.weights_manifest_sha256 = one_manifest(rt.loading_manifests)
                rt.loading_manifests = []
                if rt.stager is not None:
                    rt.stager.release()  # loaded: the staged copy is not needed any more

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        """LOAD_PATH: vLLM's three calls of a load, each through this middleware as if sent on its own (the same
        access rule and bookkeeping), then the state; the first failure (a refused start aside) answers."""
        try:
            load = LoadRequest.model_validate_json(await _read_body(receive))
        except ValidationError as err:
            await _json(send, 400, {"error": f"a load needs update_info and weight_version: {err}"})
            return
        update = {"update_info": load.update_info.for_load()}
        version = json.dumps({"weight_version": load.weight_version}).encode()
        steps = [
            ("POST", START_WEIGHT_UPDATE_PATH, b"", b""),
            ("POST", UPDATE_WEIGHTS_PATH, json.dumps(update).encode(), b""),
            ("POST", FINISH_WEIGHT_UPDATE_PATH, version, b""),
            ("GET", STATE_PATH, b"", b""),
        ]
        await self._in_order(scope, receive, send, steps, passed_over=START_WEIGHT_UPDATE_PATH)

    async def _in_order(
        self, scope: Scope, receive: Receive, send: Send, steps: list[Step], passed_over: str | None = None
    ) -> None:
        """The calls of `steps` in order, each through this middleware as if sent on its own; the last one's answer,
        or the first failure's (one of `passed_over` aside)."""
        for method, path, body, query in steps:
            status, answer = await self._inner(scope, receive, method, path, body, query)
            if status != 200 and path != passed_over:
                break
        await _raw_json(send, status, answer)

    async def _inner(
        self, scope: Scope, receive: Receive, method: str, path: str, body: bytes, query: bytes = b""
    ) -> tuple[int, bytes]:
        """One call of `path` made by this engine to itself, with the caller's credential; its status and body."""
        authorization = [(k, v) for k, v in scope["headers"] if k.lower() == b"authorization"]
        inner = dict(scope, method=method, path=path, raw_path=path.encode(), query_string=query)
        inner["headers"] = [
            *authorization,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        answer: dict[str, Any] = {"status": None, "body": b""}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body":
                answer["body"] += message.get("body", b"")

        try:
            await self(inner, _replay(body, receive), capture)
        except Exception as err:  # vLLM's error middleware answers 500, then re-raises: its answer stands
            log.exception("%s %s, called by the engine itself", method, path)
            if answer["status"] is None:
                error = f"{method} {path}: {type(err).__name__}: {err}"
                answer = {"status": 500, "body": json.dumps({"error": error}).encode()}
        return answer["status"], answer["body"]

    async def _drop_caches(self) -> bool:
        try:
            await self.runtime.drop_old_weights_caches()
        except Exception:
            log.exception("could not drop the caches of the old weights; refusing to resume until a full update")
            return False
        return True

    async def _tracked(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        body = await _read_body(receive)
        caller = headers.get(REQUEST_ID_HEADER.lower()) or _body_request_id(body) or f"rf-{uuid.uuid4().hex}"
        tracker = self.runtime.tracker
        try:
            max_lag = parse_max_weight_lag(headers.get(MAX_WEIGHT_LAG_HEADER.lower()))
        except ValueError as err:
            await _json(send, 400, {"error": str(err)})
            return
        if not tracker.open(caller, headers.get(ATTEMPT_HEADER.lower()), max_lag):
            await _json(send, 409, {"error": f"request id {caller!r} is still in flight; ids must not be reused"})
            return
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-request-id"] + [
            (b"x-request-id", caller.encode("latin-1"))
        ]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                tracked = tracker.get(caller)
                versions = tracked.weight_versions if tracked and tracked.weight_versions else []
                version = ",".join(versions) or self.runtime.weight_version
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", []),
                    (REQUEST_ID_HEADER.lower().encode(), caller.encode("latin-1")),
                    (WEIGHT_VERSION_HEADER.lower().encode(), version.encode("latin-1")),
                ]
            await send(message)

        token = current_caller_id.set(caller)
        try:
            await self.app(scope, _replay(body, receive), send_with_headers)
        finally:
            current_caller_id.reset(token)
            tracker.close(caller)


class _Answer:
    """What the app answered: its status and, for an error of a route that loads weights, its body.
    `before_ok` runs before a 200 leaves; `prepared` says whether it succeeded."""

    _KEPT = 64 << 10

    def __init__(self, before_ok: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.status: int | None = None
        self.error_body = b""
        self.before_ok = before_ok
        self.prepared = True

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, keep_error_body: bool) -> None:
        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                if self.status == 200 and self.before_ok is not None:
                    self.prepared = await self.before_ok()
            elif keep_error_body and self.status != 200 and len(self.error_body) < self._KEPT:
                self.error_body += message.get("body", b"")[: self._KEPT]
            await send(message)

        await app(scope, receive, capture)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the already-read body once, then defers to the real one (disconnects)."""
    done = False

    async def replay() -> Message:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def verified_manifest(body: bytes) -> str | None:
    """The manifest that a load of `body` (vLLM's ``/update_weights``) verified every tensor against: a
    rank-staged URL's (each rank staged its part against it), else the pinned ``manifest_sha256``; None when it
    pinned none (a collective update, an unpinned URL, an update_info per rank)."""
    try:
        info = json.loads(body).get("update_info")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    if not isinstance(info, dict):
        return None
    url = info.get("url")
    if isinstance(url, str) and urlsplit(url).scheme == RANK_STAGED_SCHEME:
        return urlsplit(url).netloc or None
    sha = info.get("manifest_sha256")
    return sha if isinstance(sha, str) and sha else None


def one_manifest(loads: list[str | None]) -> str | None:
    """The manifest of an update whose every load was verified against the same one; else None."""
    return loads[0] if loads and loads[0] is not None and set(loads) == {loads[0]} else None


def _body_request_id(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    rid = parsed.get("request_id") if isinstance(parsed, dict) else None
    return rid if isinstance(rid, str) and rid else None


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    await _raw_json(send, status, json.dumps(payload).encode())


async def _raw_json(send: Send, status: int, data: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})
