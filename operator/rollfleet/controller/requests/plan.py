"""Pure planning of a RolloutRequest: sample ids, the gateway call of each sample, what
its answer means, which samples to send next, and when deadline, TTL and staleness act.

No I/O and no clock of its own (callers pass `now`), so every decision is unit-tested.
The runner (`runner.py`) does the talking: gateway calls, results store, status.

Request ids are `<rr-uid>-<prompt>-<sample>`: stable across operator and gateway
restarts, unique across requests, and the key of the sample everywhere (gateway,
engine, results). An id is only ever re-sent after the gateway said it no longer runs.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from rollfleet import jsonl
from rollfleet.api.request import Prompt, RolloutRequestSpec
from rollfleet.errors import RollfleetError
from rollfleet_client.answers import sampled_logprobs, weight_versions
from rollfleet_client.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    GENERATE_PATH,
    GROUP_HEADER,
    MAX_WEIGHT_LAG_HEADER,
    TIMEOUT_HEADER,
    WEIGHT_VERSION_HEADER,
)
from rollfleet_engine.protocol import REQUEST_ID_HEADER, AbortStatus

SampleKey = tuple[int, int]  # (prompt index, sample index)

ABORT = "abort"


def sample_id(uid: str, key: SampleKey) -> str:
    return f"{uid}-{key[0]}-{key[1]}"


def parse_sample_id(uid: str, request_id: str) -> SampleKey | None:
    """The sample a request id names, or None when the id is not one of this request's."""
    prefix = f"{uid}-"
    if not request_id.startswith(prefix):
        return None
    parts = request_id[len(prefix) :].split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


class PromptError(RollfleetError, ValueError):
    """The prompts cannot be used; the message says where and why (the request then Fails)."""


def prompts_from_jsonl(text: str, source: str) -> list[Prompt]:
    """Prompts from a ConfigMap's JSONL: one Prompt object or bare string per non-empty line."""
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            prompts.append(Prompt(text=raw) if isinstance(raw, str) else Prompt.model_validate(raw))
        except (json.JSONDecodeError, ValidationError) as err:
            raise PromptError(f"{source} line {lineno}: not a prompt ({_short(err)})") from err
        p = prompts[-1]
        if (p.text is not None) + (p.messages is not None) + (p.token_ids is not None) != 1:
            raise PromptError(f"{source} line {lineno}: a prompt sets exactly one of text, messages or tokenIds")
    return prompts


def _short(err: Exception) -> str:
    if isinstance(err, ValidationError):
        first = err.errors(include_url=False)[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(err).splitlines()[0]


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """Identifies the prompt set: a run that resumes must see the same prompts (ConfigMaps can change)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p.wire(), sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class Call:
    """One gateway call: the path, JSON body and headers of a sample."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


def build_call(
    spec: RolloutRequestSpec, model: str, uid: str, key: SampleKey, prompt: Prompt, timeout_s: float | None = None
) -> Call:
    """The gateway call that produces sample `key` (one sample per call: each has its own id)."""
    sampling = spec.sampling.body(key[1])
    headers = {REQUEST_ID_HEADER: sample_id(uid, key)}
    if spec.stickiness == "Prompt":
        headers[GROUP_HEADER] = f"{uid}-{key[0]}"
    elif spec.stickiness == "Request":
        headers[GROUP_HEADER] = uid
    if timeout_s is not None:
        headers[TIMEOUT_HEADER] = f"{max(timeout_s, 0.001):.3f}"
    if spec.max_weight_staleness is not None:
        # Routed within the bound, and aborted at a push past it (then run again): no compute spent on a sample
        # that the staleness check at its end would throw away.
        headers[MAX_WEIGHT_LAG_HEADER] = str(spec.max_weight_staleness)
    if prompt.token_ids is not None:
        # vLLM's token-in route takes SamplingParams as an object; ask for text too.
        body = {"model": model, "token_ids": prompt.token_ids, "sampling_params": sampling, "output_mode": "text"}
        return Call(GENERATE_PATH, body, headers)
    extra = {"return_token_ids": True}
    if prompt.messages is not None:
        messages = [m.model_dump(mode="json") for m in prompt.messages]
        logprobs = sampling.pop("logprobs", None)
        if logprobs is not None:  # chat spells it differently
            extra |= {"logprobs": True, "top_logprobs": logprobs}
        return Call(CHAT_PATH, {"model": model, "messages": messages, **sampling, **extra}, headers)
    return Call(COMPLETIONS_PATH, {"model": model, "prompt": prompt.text, **sampling, **extra}, headers)


class Outcome(StrEnum):
    COMPLETED = "completed"  # stop or length: stored
    ABORTED = "aborted"  # finish_reason abort while this request asked for it: stored with its partial output
    FAILED = "failed"  # refused or errored at the gateway/engine: stored with the error
    RETRY = "retry"  # did not finish here (fleet paused with abort, engine lost): the id is free, send again
    UNSURE = "unsure"  # the call broke: the id may still run somewhere; stop it, then send again


# A runner makes a SampleResult and a Summary per sample: they are not frozen, whose __init__ costs three times as
# much, and nothing changes them once made.
@dataclass(slots=True)
class Summary:
    """What a run keeps in memory of a stored sample: enough to count it. Its tokens, logprobs and
    text stay in the results store (a GRPO batch of them is hundreds of MB)."""

    key: SampleKey
    outcome: Outcome
    tokens: int
    weight_versions: tuple[str, ...]
    error: str | None


@dataclass(slots=True)
class SampleResult:
    """One finished sample, as stored (one JSON line) and printed by `rollfleet results`."""

    prompt: int
    sample: int
    request_id: str
    finish_reason: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # of each token in token_ids, when the sampling asked for logprobs
    prompt_token_ids: list[int] | None = None
    weight_version: str | None = None  # the oldest version that produced it
    weight_versions: list[str] = field(default_factory=list)
    started_at: float = 0.0  # unix seconds
    finished_at: float = 0.0
    error: str | None = None

    @property
    def key(self) -> SampleKey:
        return self.prompt, self.sample

    @property
    def outcome(self) -> Outcome:
        if self.error is not None:
            return Outcome.FAILED
        return Outcome.ABORTED if self.finish_reason == ABORT else Outcome.COMPLETED

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def summary(self) -> Summary:
        return Summary(self.key, self.outcome, self.tokens, tuple(self.weight_versions), self.error)

    def line(self) -> str:
        out = {
            "prompt": self.prompt,
            "sample": self.sample,
            "request_id": self.request_id,
            "finish_reason": self.finish_reason,
            "text": self.text,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "prompt_token_ids": self.prompt_token_ids,
            "weight_version": self.weight_version,
            "weight_versions": self.weight_versions,
            "started_at": _ms(self.started_at),
            "finished_at": _ms(self.finished_at),
            "latency_s": _ms(self.finished_at - self.started_at),
            "error": self.error,
        }
        return jsonl.dumps(out)

    @classmethod
    def from_line(cls, line: str) -> SampleResult:
        raw = json.loads(line)
        raw.pop("latency_s", None)
        return cls(**raw)


def _ms(seconds: float) -> float:
    """Seconds to the millisecond: round(seconds, 3) costs ten times as much (a runner does it thrice a sample)."""
    return round(seconds * 1000) / 1000


def interpret(
    status: int,
    body: Mapping[str, Any] | None,
    headers: Mapping[str, str],
    *,
    uid: str,
    key: SampleKey,
    started_at: float,
    finished_at: float,
    abort_wanted: bool,
) -> tuple[Outcome, SampleResult | None]:
    """What a gateway answer means for the sample; a result when it is to be stored."""
    rid = sample_id(uid, key)
    if status == 409 or status >= 500 or body is None:
        # 409: the id is still in flight at the gateway; 5xx: an engine or the gateway broke mid-way.
        return Outcome.UNSURE, None
    if status == 429:
        return Outcome.RETRY, None
    error = None
    choices = body.get("choices") or []
    if status >= 400:
        error = f"HTTP {status}: " + str((body.get("error") or {}).get("message") or body.get("detail") or body)
    elif not choices:
        # An answer, so the id ended; without choices it is nothing to store or to resend blindly.
        error = f"HTTP {status} without choices: {body}"
    if error is not None:
        failed = SampleResult(
            key[0], key[1], rid, "error", started_at=started_at, finished_at=finished_at, error=error[:2000]
        )
        return Outcome.FAILED, failed
    choice = choices[0]
    reason = choice.get("finish_reason")
    if reason is None or (reason == ABORT and not abort_wanted):
        # Aborted by someone else (a pause with mode abort, a drained engine): the id is free; run it again.
        return Outcome.RETRY, None
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content") or ""
    versions = weight_versions(headers.get(WEIGHT_VERSION_HEADER.lower()))
    prompt_ids = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
    result = SampleResult(
        prompt=key[0],
        sample=key[1],
        request_id=rid,
        finish_reason=str(reason),
        text=text,
        token_ids=list(choice.get("token_ids") or []),
        logprobs=sampled_logprobs(choice),
        prompt_token_ids=prompt_ids,
        weight_version=versions[0] if versions else None,
        weight_versions=versions,
        started_at=started_at,
        finished_at=finished_at,
    )
    return result.outcome, result


def staleness(sample_version: str | None, history: Sequence[str]) -> int:
    """Fleet weight updates between the sample's version and the newest one seen (0 when unknown)."""
    if sample_version is None or sample_version not in history:
        return 0
    return len(history) - 1 - history.index(sample_version)


def is_stale(result: SampleResult, history: Sequence[str], max_staleness: int | None) -> bool:
    return max_staleness is not None and staleness(result.weight_version, history) > max_staleness


class Schedule:
    """Which samples to send next: every sample without a result, in order, each at most once in flight.

    A sample comes back to the front when it must run again (fleet pause, stale weights,
    after a stopped call), so retries do not wait behind the whole remaining set.
    """

    def __init__(self, prompts: int, n: int, done: Iterable[SampleKey] = ()) -> None:
        finished = set(done)
        self.total = prompts * n
        self._pending: deque[SampleKey] = deque(
            (p, s) for p in range(prompts) for s in range(n) if (p, s) not in finished
        )
        self.in_flight: set[SampleKey] = set()

    def __len__(self) -> int:
        return len(self._pending)

    def take(self, limit: int) -> list[SampleKey]:
        """Up to `limit` samples to send now, keeping at most `limit` in flight in all."""
        out = []
        while (key := self.next(limit)) is not None:
            out.append(key)
        return out

    def next(self, limit: int) -> SampleKey | None:
        """The one sample to send next (after one ended), keeping at most `limit` in flight; None when none is."""
        if not self._pending or len(self.in_flight) >= limit:
            return None
        key = self._pending.popleft()
        self.in_flight.add(key)
        return key

    def finished(self, key: SampleKey) -> None:
        self.in_flight.discard(key)

    def again(self, key: SampleKey) -> None:
        self.in_flight.discard(key)
        self._pending.appendleft(key)

    @property
    def idle(self) -> bool:
        return not self._pending and not self.in_flight


# The gateway's abort answers after which an id runs nowhere: it ended (aborted or finished), or
# every engine was asked and none knew it. `pending` and `unconfirmed` (an engine could not be
# asked, or did not confirm the end) mean it may still run: resending it could decode it twice.
STOPPED_ANSWERS = frozenset({AbortStatus.ABORTED, AbortStatus.FINISHED, AbortStatus.UNKNOWN})


def stopped_for_sure(answer: str | None) -> bool:
    return answer in STOPPED_ANSWERS


def stuck_since(previous: float | None, *, in_flight: int, waiting: int, can_send: bool, now: float) -> float | None:
    """Since when the run has had samples waiting, a fleet ready to take them, and none in flight.

    None while it has not. Outside a bug this lasts a moment (a backoff, a confirmation from the
    gateway); the runner fails a request stuck for long instead of showing Running forever.
    """
    if in_flight or not waiting or not can_send:
        return None
    return now if previous is None else previous


def new_abort_token(annotations: Mapping[str, str] | None, acted_on: str | None, annotation: str) -> str | None:
    """The abort annotation's value when it asks for an abort not yet acted on."""
    token = (annotations or {}).get(annotation)
    if not token or token == acted_on:
        return None
    return token


def deadline_left(start: float | None, deadline_s: int | None, now: float) -> float | None:
    """Seconds until activeDeadlineSeconds passes (negative once past); None without a deadline or start."""
    if start is None or deadline_s is None:
        return None
    return start + deadline_s - now


def ttl_left(completed_at: float | None, ttl_s: int | None, now: float) -> float | None:
    """Seconds until a finished request is deleted (<= 0: now); None when it is kept."""
    if completed_at is None or ttl_s is None:
        return None
    return completed_at + ttl_s - now


@dataclass
class RateLimit:
    """At most one action per `interval` seconds; urgent ones (phase changes) go at once."""

    interval: float
    last: float = float("-inf")

    def due(self, now: float, urgent: bool = False) -> bool:
        if urgent or now - self.last >= self.interval:
            self.last = now
            return True
        return False


def maybe_sent(prompts: int, n: int, stored: Iterable[SampleKey], bound: int) -> list[SampleKey]:
    """Samples without a result that an earlier run may have sent (and that may still run).

    Samples are first sent in order, and the runner keeps at most `parallelism` in flight
    and at most `MAX_UNFLUSHED` results unwritten, so every sample ever sent lies among
    the first `stored + parallelism + MAX_UNFLUSHED` (= `bound`) in order. Only those need
    stopping before a restarted run sends anything.
    """
    done = set(stored)
    limit = min(prompts * n, bound)
    return [(i // n, i % n) for i in range(limit) if (i // n, i % n) not in done]
