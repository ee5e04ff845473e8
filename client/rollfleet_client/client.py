"""``AsyncRolloutClient`` and its sync twin ``RolloutClient``: a trainer's way to a fleet's gateway.

::

    async with AsyncRolloutClient(fleet="tiny", namespace="team") as fleet:   # from a pod in the cluster
        g = await fleet.generate([1, 2, 3], max_tokens=256, temperature=1.0, logprobs=0)
        g.token_ids, g.logprobs, g.finish_reason, g.weight_version
        await fleet.abort(["my-id"])
        await fleet.pause("keep")       # as `kubectl annotate rf/tiny rollfleet.dev/pause=keep` does
        await fleet.resume()
        await fleet.push_weights(model.state_dict(), "step-12")   # through the sync sidecar in this pod

Every request carries an id (``request_id``, else a fresh one): the key of abort at the engines.
Cancelling or timing out the awaiting task aborts that id at the engine, and nothing is ever
sent twice under one id. Talks to the gateway (``protocol`` has its routes and headers) and, for
``push_weights``, to the sync sidecar in the trainer's pod (``sync``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rollfleet_client.answers import sampled_logprobs, weight_versions
from rollfleet_client.errors import (
    EngineFailed,
    GatewayUnreachable,
    GenerateTimeout,
    NotSettled,
    PushInProgress,
    RequestIdInUse,
    RequestRefused,
    RollfleetClientError,
    Unauthorized,
)
from rollfleet_client.models import AbortResult, FleetState, Generation, PauseMode, WeightSegment
from rollfleet_client.protocol import (
    ABORT_PATH,
    CALLER_HEADER,
    COMPLETIONS_PATH,
    FLEET_PATH,
    FLEET_PAUSE_PATH,
    FLEET_RESUME_PATH,
    GROUP_HEADER,
    INFERENCE_TOKEN_FILE,
    MAX_WEIGHT_LAG_HEADER,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
    TIMEOUT_HEADER,
    TOKEN_FILE,
    WEIGHT_VERSION_HEADER,
    gateway_endpoint,
    gateway_name,
)
from rollfleet_client.sync import SyncClient
from rollfleet_client.sync_protocol import PushStatus

T = TypeVar("T")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
ABORT_TIMEOUT_S = 10.0
# Beyond a request's own timeout: the gateway stops it at that deadline and answers; this is
# how long the client waits for that answer before it gives up on the connection.
ANSWER_MARGIN_S = 5.0
CONTROL_WAIT_S = 120.0


def _own_namespace() -> str | None:
    """This pod's namespace (POD_NAMESPACE, else the ServiceAccount mount); None outside a pod."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return None


def _gateway_url(fleet: str, namespace: str | None) -> str:
    """The fleet's gateway Service. In its own namespace a pod has it from the environment kubelet gives
    it for each Service (`<NAME>_SERVICE_HOST/PORT`; also where there is no cluster DNS), else by DNS."""
    own = _own_namespace()
    namespace = namespace or own
    if namespace is None:
        raise RollfleetClientError("no namespace: pass namespace=, or run in a pod (or set POD_NAMESPACE)")
    if namespace == own:
        service = gateway_name(fleet).upper().replace("-", "_")
        host, port = os.environ.get(f"{service}_SERVICE_HOST"), os.environ.get(f"{service}_SERVICE_PORT")
        if host and port:
            return f"http://{host}:{port}"
    return gateway_endpoint(fleet, namespace)


def _read_token(path: str) -> str | None:
    try:
        token = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    return token or None


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500] or r.reason_phrase
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])
        for key in ("error", "detail", "message"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


def raise_for_answer(r: httpx.Response, conflict: type[RequestRefused] = RequestIdInUse) -> None:
    """The typed error for a refused or failed call, carrying the server's message."""
    if r.status_code < 400:
        return
    message = _message(r)
    if r.status_code == 401:
        raise Unauthorized(
            f"the gateway refused the client's token: {message}; mount the fleet's Secret <fleet>-admin-token at "
            f"{TOKEN_FILE} (or <fleet>-inference-token at {INFERENCE_TOKEN_FILE}, to generate only), or pass token="
        )
    if r.status_code == 409:
        raise conflict(r.status_code, message)
    if r.status_code < 500:
        raise RequestRefused(r.status_code, message)
    raise EngineFailed(r.status_code, message)


def generation_from(request_id: str, r: httpx.Response, generations: Mapping[str, int]) -> Generation:
    body = r.json()
    choices = body.get("choices") or []
    if not choices:
        raise EngineFailed(r.status_code, f"an answer without choices: {str(body)[:300]}")
    choice = choices[0]
    report = body.get("rollfleet") or {}
    versions = weight_versions(r.headers.get(WEIGHT_VERSION_HEADER))  # parsed once: the generations follow it
    return Generation(
        request_id=request_id,
        token_ids=list(choice.get("token_ids") or []),
        logprobs=sampled_logprobs(choice),
        text=choice.get("text") or "",
        finish_reason=str(choice.get("finish_reason")),
        prompt_token_ids=body.get("prompt_token_ids") or choice.get("prompt_token_ids"),
        weight_versions=versions,
        weight_generations=[generations.get(v) for v in versions],
        engines=list(report.get("engines") or []),
        weight_segments=[WeightSegment.model_validate(s) for s in report.get("weight_segments") or []],
    )


class AsyncRolloutClient:
    """The fleet's gateway, by URL or (in the cluster) by fleet name and namespace."""

    def __init__(
        self,
        gateway_url: str | None = None,
        *,
        fleet: str | None = None,
        namespace: str | None = None,
        model: str | None = None,
        token: str | None = None,
        token_file: str = TOKEN_FILE,
        inference_token: str | None = None,
        inference_token_file: str = INFERENCE_TOKEN_FILE,
        sync_url: str | None = None,
        caller: str | None = None,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if gateway_url is None:
            if fleet is None:
                raise RollfleetClientError("pass gateway_url=, or fleet= (and namespace= outside a pod)")
            gateway_url = _gateway_url(fleet, namespace)
        self.gateway_url = gateway_url.rstrip("/")
        self.model = model or fleet
        self._token = token or _read_token(token_file)
        self._token_file = token_file
        # Generation asks for a credential unless the fleet is open: the inference token where the pod has it
        # (the least it needs), else the admin token, which opens generation too.
        inference = inference_token or _read_token(inference_token_file) or self._token
        self._generation_auth = {"Authorization": f"Bearer {inference}"} if inference else {}
        self.sync_url = sync_url
        # Who asks for a pause, as the fleet's status will show it: this pod's name by default.
        self.caller = caller or os.environ.get("HOSTNAME") or "trainer"
        self._generations: dict[str, int] = {}  # weight version -> the fleet's generation number
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # No read timeout of the client's own: a generation takes as long as it takes; deadlines are per call.
        self._http = httpx.AsyncClient(
            base_url=self.gateway_url, timeout=httpx.Timeout(None, connect=10.0), limits=limits, transport=transport
        )

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(
        self,
        prompt: str | list[int],
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        group_id: str | None = None,
        timeout_s: float | None = None,
        max_weight_lag: int | None = None,
        **sampling: Any,
    ) -> Generation:
        """Text or token ids in; token ids, logprobs (with ``logprobs=0`` or more), finish reason and weight
        versions out. ``sampling`` takes vLLM's sampling parameters (max_tokens, temperature, top_p, seed, stop,
        ignore_eos, logprobs, ...).

        Cancelling the awaiting task (``asyncio.wait_for`` included) aborts it at the engine. With
        ``timeout_s`` the gateway stops it at the engine at that deadline and answers with what was made
        (``finish_reason`` "abort": a partial rollout to resubmit); ``GenerateTimeout`` only when no answer came.

        ``max_weight_lag``: how many generations the tokens may lag the fleet's newest weights. The gateway routes
        it only to engines within that; a push that would leave it further behind aborts it (``finish_reason``
        "abort"); one with no tokens yet runs on the new weights. 0 is strictly on-policy.
        """
        rid = request_id or f"rf-{uuid.uuid4().hex}"
        model = sampling.pop("model", self.model)
        if model is None:
            raise RollfleetClientError("no model name: pass model= to the client (the fleet's spec.model.servedName)")
        body = {"model": model, "prompt": prompt, "return_token_ids": True, **sampling, "stream": False}
        headers = {REQUEST_ID_HEADER: rid, **self._generation_auth}
        if session_id is not None:
            headers[SESSION_HEADER] = session_id
        if group_id is not None:
            headers[GROUP_HEADER] = group_id
        if max_weight_lag is not None:
            headers[MAX_WEIGHT_LAG_HEADER] = str(max_weight_lag)
        timeout = None
        if timeout_s is not None:
            headers[TIMEOUT_HEADER] = f"{timeout_s:.3f}"  # the gateway stops it at the engine by itself too
            timeout = httpx.Timeout(timeout_s + ANSWER_MARGIN_S, connect=10.0)
        try:
            r = await self._http.post(
                COMPLETIONS_PATH, json=body, headers=headers, timeout=timeout or httpx.USE_CLIENT_DEFAULT
            )
        except asyncio.CancelledError:
            # The caller gave up (verl's _on_cancel): the engine must stop too, even while we are cancelled.
            await asyncio.shield(self._abort_quietly(rid))
            raise
        except httpx.TimeoutException as err:
            await self._abort_quietly(rid)
            raise GenerateTimeout(f"request {rid} ran past {timeout_s} s; asked the gateway to abort it") from err
        except httpx.TransportError as err:
            raise self._unreachable(err) from err
        raise_for_answer(r)
        g = generation_from(rid, r, self._generations)
        if self._token is not None and None in g.weight_generations:
            with contextlib.suppress(RollfleetClientError):
                await self.fleet_state()  # learns the generations of the fleet's recent versions
            g.weight_generations = [self._generations.get(v) for v in g.weight_versions]
        return g

    async def abort(self, request_ids: list[str], timeout_s: float = ABORT_TIMEOUT_S) -> AbortResult:
        """Abort these ids wherever they run; per id, what the engines confirmed."""
        body = {"request_ids": list(request_ids), "timeout_s": timeout_s}
        r = await self._control("POST", ABORT_PATH, body, timeout_s + ANSWER_MARGIN_S)
        return AbortResult.model_validate(r.json())

    async def fleet_state(self) -> FleetState:
        """The fleet's engines, their phases and versions, its pause and its weight generations."""
        r = await self._control("GET", FLEET_PATH, None, ABORT_TIMEOUT_S)
        return self._learn(FleetState.model_validate(r.json()))

    async def pause(self, mode: PauseMode = "keep", wait_s: float = CONTROL_WAIT_S) -> FleetState:
        """Pause the fleet (keep: hold requests where they are; wait: let them finish; abort: end them) and
        wait until every serving engine reports paused. Recorded on the RolloutFleet as who asked (this
        client's ``caller``), exactly as ``kubectl annotate rf/NAME rollfleet.dev/pause=MODE``.
        ``PushInProgress`` while a weight push runs; ``NotSettled`` if not done within ``wait_s``."""
        return await self._settle(FLEET_PAUSE_PATH, {"mode": mode, "wait_s": wait_s}, wait_s)

    async def resume(self, wait_s: float = CONTROL_WAIT_S) -> FleetState:
        """Undo the fleet's pause (whoever asked for it) and wait until no engine reports paused."""
        return await self._settle(FLEET_RESUME_PATH, {"wait_s": wait_s}, wait_s)

    async def push_weights(
        self, weights: Mapping[str, Any] | str | Path, version: str, timeout_s: float = 1800.0
    ) -> PushStatus:
        """Push a state dict (needs torch) or a directory of .safetensors files (readable by the sidecar) to
        every engine as ``version``, through the sync sidecar; return when the whole fleet has it.
        ``PushFailed`` when the fleet stayed on its previous version."""

        def push() -> PushStatus:
            with SyncClient(self.sync_url) as sync:
                if isinstance(weights, str | Path):
                    return sync.push_dir(weights, version, timeout_s=timeout_s)
                return sync.push(weights, version, timeout_s=timeout_s)

        status = await asyncio.to_thread(push)  # a long blocking stream: off the event loop
        self._generations[status.version] = status.generation
        return status

    async def _settle(self, path: str, body: dict[str, Any], wait_s: float) -> FleetState:
        r = await self._control("POST", path, body, wait_s + ANSWER_MARGIN_S + ABORT_TIMEOUT_S, PushInProgress)
        state = self._learn(FleetState.model_validate(r.json()))
        if r.status_code == 202:
            engines = ", ".join(f"{e.name} {e.phase}" for e in state.engines) or "none"
            raise NotSettled(
                f"asked, but the fleet's status did not show it done within {wait_s:.0f} s (engines: {engines}); "
                "read fleet_state() or wait longer",
                state,
            )
        return state

    def _learn(self, state: FleetState) -> FleetState:
        self._generations.update(state.generations)
        return state

    async def _control(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout_s: float,
        conflict: type[RequestRefused] = RequestIdInUse,
    ) -> httpx.Response:
        """A call to a route that needs the fleet's admin token."""
        if self._token is None:
            raise Unauthorized(
                f"no fleet token: {path} needs the fleet's admin token; mount the Secret <fleet>-admin-token at "
                f"{self._token_file} or pass token="
            )
        headers = {"Authorization": f"Bearer {self._token}", CALLER_HEADER: self.caller}
        try:
            r = await self._http.request(method, path, json=body, headers=headers, timeout=timeout_s)
        except httpx.TransportError as err:
            raise self._unreachable(err) from err
        raise_for_answer(r, conflict)
        return r

    async def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(RollfleetClientError, httpx.HTTPError):
            await self.abort([request_id])

    def _unreachable(self, err: Exception) -> GatewayUnreachable:
        return GatewayUnreachable(
            f"no gateway answered at {self.gateway_url} ({type(err).__name__}: {err}); check the fleet's name and "
            f"namespace (its Service is {gateway_name('<fleet>')}) or the URL"
        )


class RolloutClient:
    """``AsyncRolloutClient`` for synchronous code: the same calls, run on a private event loop thread."""

    def __init__(self, gateway_url: str | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollfleet-client", daemon=True)
        self._thread.start()
        self._async = self._run(self._make(gateway_url, kwargs))

    async def _make(self, gateway_url: str | None, kwargs: dict[str, Any]) -> AsyncRolloutClient:
        return AsyncRolloutClient(gateway_url, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the call is cancelled, so a generation is aborted at the engine
            raise

    def generate(self, prompt: str | list[int], **kwargs: Any) -> Generation:
        return self._run(self._async.generate(prompt, **kwargs))

    def abort(self, request_ids: list[str], timeout_s: float = ABORT_TIMEOUT_S) -> AbortResult:
        return self._run(self._async.abort(request_ids, timeout_s))

    def fleet_state(self) -> FleetState:
        return self._run(self._async.fleet_state())

    def pause(self, mode: PauseMode = "keep", wait_s: float = CONTROL_WAIT_S) -> FleetState:
        return self._run(self._async.pause(mode, wait_s))

    def resume(self, wait_s: float = CONTROL_WAIT_S) -> FleetState:
        return self._run(self._async.resume(wait_s))

    def push_weights(
        self, weights: Mapping[str, Any] | str | Path, version: str, timeout_s: float = 1800.0
    ) -> PushStatus:
        return self._run(self._async.push_weights(weights, version, timeout_s))

    def close(self) -> None:
        self._run(self._async.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
