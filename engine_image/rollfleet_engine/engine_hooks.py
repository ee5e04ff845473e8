"""The one hook into vLLM's engine client: record which vLLM request serves which caller.

Every OpenAI-compatible handler (completions, chat, generate, responses, ...) ends in
``EngineClient.generate(prompt, params, request_id, ...)``. Wrapping that one method on
the engine instance gives the exact id vLLM uses for abort (``AsyncLLM.abort`` with
external ids), whatever prefix a handler adds, and lets us watch each request's
outputs until its true finish reason. The caller id arrives through a context
variable set by the HTTP middleware for the duration of the request.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from rollfleet_engine.protocol import WeightSegment
from rollfleet_engine.tracker import ABORT, RequestTracker

current_caller_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollfleet_caller_id", default=None)


def install_generate_hook(engine: Any, tracker: RequestTracker, weight_version: Callable[[], str]) -> None:
    """Replace ``engine.generate`` on this instance with a recording wrapper. ``weight_version``: the version the
    engine serves now (the launcher's cached one)."""
    original = engine.generate

    def generate(prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        caller = current_caller_id.get()
        stream: AsyncGenerator[Any, None] = original(prompt, sampling_params, request_id, *args, **kwargs)
        if caller is None:
            return stream
        tracker.attach(caller, request_id)
        return _observe(tracker, caller, request_id, _is_cumulative(sampling_params), stream, weight_version)

    engine.generate = generate


def _is_cumulative(sampling_params: Any) -> bool:
    from vllm.sampling_params import RequestOutputKind

    return getattr(sampling_params, "output_kind", None) is not RequestOutputKind.DELTA


async def _observe(
    tracker: RequestTracker,
    caller: str,
    engine_id: str,
    cumulative: bool,
    stream: AsyncGenerator[Any, None],
    weight_version: Callable[[], str],
) -> AsyncGenerator[Any, None]:
    try:
        async for out in stream:
            outputs = getattr(out, "outputs", None) or []
            reasons = [o.finish_reason for o in outputs if o.finish_reason is not None]
            finished = bool(getattr(out, "finished", False))
            # vLLM gives the spans of versions only with the final output: until then, tokens out now came from the
            # weights served now (a swap happens in a pause, and the output of a step reaches here before it). The
            # sync sidecar reads these in flight to abort requests past a staleness bound.
            versions = [span.version for o in outputs for span in (o.weight_versions or [])] or (
                [weight_version()] if any(o.token_ids for o in outputs) else []
            )
            spans = [WeightSegment(version=s.version, start=s.start, end=s.end) for s in _spans(outputs)]
            tracker.on_output(
                caller,
                engine_id,
                spans=spans,
                sequences=len(outputs),
                output_tokens=sum(len(o.token_ids) for o in outputs),
                cumulative=cumulative,
                finish_reason=(ABORT if ABORT in reasons else (reasons[0] if reasons else "stop"))
                if finished
                else None,
                versions=versions,
            )
            yield out
    finally:
        # Closed early (client went away, handler error): vLLM aborts the request then.
        tracker.on_engine_end(caller, engine_id, ABORT)
        await stream.aclose()


def _spans(outputs: list[Any]) -> list[Any]:
    """vLLM's spans of versions for a request of one sequence (its final output only); none for several."""
    return list(outputs[0].weight_versions or []) if len(outputs) == 1 else []
