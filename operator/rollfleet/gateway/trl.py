"""TRL's `VLLMClient` (GRPOTrainer's `vllm_mode="server"`) served by the gateway as one vLLM server.

TRL 1.16 (pinned in pyproject.toml; its client speaks `vllm serve`'s own routes) points at
`<gateway>/trl` (`TRL_PREFIX`). Owns, under that prefix:

- `POST /v1/completions`, TRL's `generate`: fanned out into one gateway request per sample
  (`n` 1, id `<batch id>-p<prompt>-s<sample>`, the samples of a prompt grouped on one engine by
  `X-Group-Id` so that they share its prefix cache), each admitted and proxied as any request is
  (abort by id, failover, deadline, metrics); their answers are put back together as vLLM
  answers a batch (prompt-major). The batch id is in flight too: aborting it, or the client
  leaving, stops every sample at its engine;
- `GET /health` (200 while an engine is routable);
- `GET /v1/models` and `POST /v1/chat/completions`: the gateway's own (a conversation's n
  samples are one request);
- vLLM's control routes (`/get_world_size`, `/reset_prefix_cache`, the NCCL weight transfer's
  501, ...): `vllm_api`'s, as at the gateway's root;
- 501, saying what to do instead, for multimodal features.

The translation (bodies in, bodies out) is pure. The endpoints use the gateway's own admission
and proxy in-process (a sample is an ASGI request handed to its completions endpoint: no
connection back to itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute
from starlette.types import Message, Receive, Scope

from rollfleet.gateway.dialects import MAX_CHOICES, BadRequest, Json, Route
from rollfleet.gateway.inflight import ABORT, InFlight, StopReason
from rollfleet.gateway.proxy import ENGINE_HEADER, error_body
from rollfleet.gateway.refusal import Refused
from rollfleet.gateway.vllm_api import VllmControl, vllm_routes
from rollfleet_client.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    GROUP_HEADER,
    MAX_WEIGHT_LAG_HEADER,
    REQUEST_ID_HEADER,
    SESSION_END_HEADER,
    TIMEOUT_HEADER,
    TRL_HEALTH_PATH,
    TRL_MODELS_PATH,
    TRL_MULTIMODAL_PATHS,
    TRL_PREFIX,
    WEIGHT_VERSION_HEADER,
)

if TYPE_CHECKING:
    from rollfleet.gateway.app import _Gateway

MULTIMODAL_HELP = (
    "multimodal prompts (TRL's image features) are not served through the Rollfleet gateway; "
    "send text or token-id prompts"
)
_TOKEN_ID = "token_id:"  # a logprob token asked for as an id (`return_tokens_as_token_ids`): `token_id:<id>`
_PER_SAMPLE = ("prompt", "n", "stream", "stream_options", "request_id")  # set per sample, or not passed on
# A sample is admitted as its batch was.
_FORWARDED = (b"authorization", TIMEOUT_HEADER.lower().encode(), MAX_WEIGHT_LAG_HEADER.lower().encode())


# --- the translation (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One sample of a batch: a completions request of its own."""

    prompt: int  # its prompt's index in the batch
    index: int  # which of that prompt's n samples
    request_id: str
    group: str  # X-Group-Id: the samples of one prompt share an engine
    body: Json


def batch_prompts(body: Json) -> list[str | list[int]]:
    """The prompts of a completions body, in each of vLLM's forms (a string, strings, token ids, lists of them)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BadRequest(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of non-empty token-id lists"
    )


def fan_out(body: Json, batch_id: str) -> list[Sample]:
    """The samples of a completions body that the gateway's `validate` accepted, prompt-major."""
    if body.get("stream"):
        raise BadRequest(f"{TRL_PREFIX}{COMPLETIONS_PATH} answers one JSON; stream from {COMPLETIONS_PATH} instead")
    if body.get("prompt_logprobs") is not None:
        raise BadRequest(
            f"'prompt_logprobs' is not served on {TRL_PREFIX}{COMPLETIONS_PATH}: its answers do not carry it"
        )
    prompts = batch_prompts(body)
    n = int(body.get("n", 1))
    if len(prompts) * n > MAX_CHOICES:  # each sample holds a task and an in-flight record at this replica
        raise BadRequest(f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} samples per request: split the batch")
    shared = {k: v for k, v in body.items() if k not in _PER_SAMPLE}
    seed = body.get("seed")
    samples = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            sample_body = {**shared, "prompt": prompt, "n": 1}
            if isinstance(seed, int) and not isinstance(seed, bool):
                # One vLLM request with a seed draws its n samples from one generator: they differ. So do these.
                sample_body["seed"] = seed + j
            samples.append(Sample(i, j, f"{batch_id}-p{i}-s{j}", f"{batch_id}-p{i}", sample_body))
    return samples


def batch_answer(batch_id: str, body: Json, samples: Sequence[Sample], answers: Sequence[Json]) -> Json:
    """vLLM's answer to the whole batch from each sample's answer: choice k is sample k (prompt-major).

    Each choice carries its sample's `rollfleet` report and request id; the top level, the union
    of their weight versions and engines.
    """
    choices = []
    for k, (sample, answer) in enumerate(zip(samples, answers, strict=True)):
        choice = {**answer["choices"][0], "index": k, "rollfleet": {"request_id": sample.request_id}}
        choice["rollfleet"].update(answer.get("rollfleet") or {})
        if body.get("return_tokens_as_token_ids"):
            choice["logprobs"] = _token_id_logprobs(choice.get("logprobs"), choice.get("token_ids") or [])
        choices.append(choice)
    groups: dict[int, tuple[Json, list[Json]]] = {}  # prompt index -> (a sample's body, the prompt's choices)
    for sample, choice in zip(samples, choices, strict=True):
        groups.setdefault(sample.prompt, (sample.body, []))[1].append(choice)
    prompt_tokens = 0
    for sample_body, group in groups.values():
        ids = next((c["prompt_token_ids"] for c in group if c.get("prompt_token_ids")), None)
        if ids is None and isinstance(sample_body["prompt"], list):  # no sample got as far as the engine saying it
            ids = sample_body["prompt"]
        for c in group:
            c["prompt_token_ids"] = ids
        prompt_tokens += len(ids or [])
    completion_tokens = sum(len(c.get("token_ids") or []) for c in choices)
    reports = [c["rollfleet"] for c in choices]
    first = answers[0]  # a batch has a sample at least
    return {
        "id": f"cmpl-{batch_id}",
        "object": "text_completion",
        "created": first.get("created"),
        "model": first.get("model"),
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "rollfleet": {
            "weight_versions": _union(r.get("weight_versions") or [] for r in reports),
            "engines": _union(r.get("engines") or [] for r in reports),
        },
    }


def batch_failure(samples: Sequence[Sample], answers: Sequence[tuple[int, Json]]) -> tuple[int, str] | None:
    """The batch's error when a sample failed (the first one's status, and which sample): TRL takes all or nothing."""
    failed = [(s, status, body) for s, (status, body) in zip(samples, answers, strict=True) if status != 200]
    if not failed:
        return None
    sample, status, body = failed[0]
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    more = f" ({len(failed) - 1} more samples failed)" if len(failed) > 1 else ""
    detail = message or orjson.dumps(body).decode()[:300]
    return status, f"sample {sample.request_id} (prompt {sample.prompt}, sample {sample.index}) failed: {detail}{more}"


def batch_finish_reason(answer: Json) -> str | None:
    """The batch's finish reason at this replica (what an abort of its id answers): abort if any sample was."""
    reasons = [c.get("finish_reason") for c in answer["choices"]]
    return ABORT if ABORT in reasons else next((r for r in reasons if r is not None), None)


def _token_id_logprobs(logprobs: Json | None, token_ids: list[int]) -> Json | None:
    """Completions logprobs with every token as `token_id:<id>`, which TRL parses.

    The tokens of a sample continued on another engine after a failure come back decoded (the
    continuation route answers text); its `token_ids` are exact, so they name the sampled tokens.
    Alternatives that came back as text have no id to give: they are left out.
    """
    if not logprobs:
        return logprobs
    tokens = logprobs.get("tokens") or []
    if len(tokens) != len(token_ids) or all(t.startswith(_TOKEN_ID) for t in tokens):
        return logprobs  # as vLLM gave it: no continuation in this sample
    tops = [
        {k: v for k, v in (top or {}).items() if k.startswith(_TOKEN_ID)} for top in logprobs.get("top_logprobs") or []
    ]
    return {**logprobs, "tokens": [f"{_TOKEN_ID}{t}" for t in token_ids], "top_logprobs": tops}


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _union(lists: Iterable[list[str]]) -> list[str]:
    return list(dict.fromkeys(v for values in lists for v in values))


# --- the endpoints ---------------------------------------------------------------------------


class _Answer:
    """What the gateway's completions endpoint sent for one sample (ASGI `send`)."""

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    def json(self) -> Json:
        parsed: Json = orjson.loads(self.body)  # the gateway answers JSON objects only
        return parsed


def _sample_receive(body: bytes, stop: asyncio.Event) -> Receive:
    """A sample's ASGI input: its body, then a disconnect once the batch stops (the proxy stops it at its engine)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await stop.wait()
        return {"type": "http.disconnect"}

    return receive


def _json(status: int, body: Json, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


class _Trl:
    """The TRL routes of one gateway replica."""

    def __init__(self, gateway: _Gateway) -> None:
        self.gateway = gateway
        self.complete = gateway.generation(Route.COMPLETIONS)

    async def health(self, request: Request) -> Response:
        engines = len(self.gateway.registry.routable())
        if engines == 0:  # TRL's check_server waits (connection_timeout) for a 200
            return _json(503, error_body("no routable engine yet (engines starting, syncing or draining)", 503))
        return JSONResponse({"status": "ok", "routable_engines": engines})

    async def completions(self, request: Request) -> Response:
        gw = self.gateway
        try:
            batch, entry = gw.admit(Route.COMPLETIONS, request.headers, await gw.read_body(request))
        except Refused as refused:
            return gw.refuse(refused)
        finish: str | None = "error"
        try:
            samples = fan_out(batch.body, batch.request_id)
            answers = await self._run(request, entry, samples)
            failure = batch_failure(samples, answers)
            if failure is not None:  # the samples' own failures are counted already: no `rejected` here
                status, message = failure
                return _json(status, error_body(message, status), {REQUEST_ID_HEADER: batch.request_id})
            out = batch_answer(batch.request_id, batch.body, samples, [a for _, a in answers])
            finish = batch_finish_reason(out)
            return _json(200, out, _headers(batch.request_id, out["rollfleet"]))
        except BadRequest as err:
            return gw.refuse(Refused(400, str(err)))
        finally:
            gw.inflight.close(entry, finish)

    async def _run(self, request: Request, batch: InFlight, samples: list[Sample]) -> list[tuple[int, Json]]:
        """Every sample's status and answer. All are stopped at their engines once the batch is
        (its id aborted, its client gone) or one of them failed (TRL would get nothing of it)."""
        stop = asyncio.Event()
        batch.stopping.add_done_callback(lambda _: stop.set())
        watcher = asyncio.create_task(self._watch_client(request, batch))
        try:
            return list(await asyncio.gather(*(self._sample(request, s, stop) for s in samples)))
        finally:
            watcher.cancel()

    async def _watch_client(self, request: Request, batch: InFlight) -> None:
        # The body was read: the next message is the client leaving (cancelled before the answer is sent).
        while (await request.receive())["type"] != "http.disconnect":
            continue
        self.gateway.proxy.stop(batch, StopReason.DISCONNECT)

    async def _sample(self, request: Request, sample: Sample, stop: asyncio.Event) -> tuple[int, Json]:
        """One sample through the gateway's own completions endpoint, in-process."""
        raw = orjson.dumps(sample.body)
        headers = [(k, v) for k, v in request.headers.raw if k in _FORWARDED]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            (REQUEST_ID_HEADER.lower().encode(), sample.request_id.encode()),
            (GROUP_HEADER.lower().encode(), sample.group.encode()),
            # The group is this batch's alone: its session goes when its last sample ends.
            (SESSION_END_HEADER.lower().encode(), b"1"),
        ]
        path = {"path": COMPLETIONS_PATH, "raw_path": COMPLETIONS_PATH.encode(), "query_string": b""}
        scope: Scope = {**request.scope, **path, "headers": headers}
        receive = _sample_receive(raw, stop)
        answer = _Answer()
        response = await self.complete(Request(scope, receive))
        await response(scope, receive, answer.send)
        if answer.status != 200:
            stop.set()
        return answer.status, answer.json()

    async def multimodal(self, request: Request) -> Response:
        return self.gateway.refuse(Refused(501, f"{request.url.path}: {MULTIMODAL_HELP}"))


def _headers(request_id: str, report: Json) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: request_id}
    if report["engines"]:
        headers[ENGINE_HEADER] = ",".join(report["engines"])
    if report["weight_versions"]:
        headers[WEIGHT_VERSION_HEADER] = ",".join(report["weight_versions"])
    return headers


def trl_routes(gateway: _Gateway) -> list[HttpRoute]:
    """The routes TRL's VLLMClient calls, under TRL_PREFIX."""
    trl = _Trl(gateway)
    return [
        HttpRoute(TRL_PREFIX + TRL_HEALTH_PATH, trl.health, methods=["GET"]),
        HttpRoute(TRL_PREFIX + TRL_MODELS_PATH, gateway.models, methods=["GET"]),
        HttpRoute(TRL_PREFIX + COMPLETIONS_PATH, trl.completions, methods=["POST"]),
        HttpRoute(TRL_PREFIX + CHAT_PATH, gateway.generation(Route.CHAT), methods=["POST"]),
        # vLLM's control routes (world size, prefix-cache reset, the weight transfer's 501, ...), as at the root.
        *vllm_routes(VllmControl(gateway), TRL_PREFIX),
        *(HttpRoute(TRL_PREFIX + p, trl.multimodal, methods=["POST"]) for p in TRL_MULTIMODAL_PATHS),
    ]
