"""Reading the gateway's answers: what every caller of it needs the same way. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def sampled_logprobs(choice: Mapping[str, Any]) -> list[float] | None:
    """The logprob of each generated token (the sampled one's, not the top-k), in any dialect the gateway
    answers: completions (`token_logprobs`), chat and the token-in route (`content`). None when not asked."""
    logprobs = choice.get("logprobs") or {}
    per_token = logprobs.get("content")
    if per_token is not None:
        return [float(entry["logprob"]) for entry in per_token]
    values = logprobs.get("token_logprobs")
    return None if values is None else [float(v) for v in values]


def weight_versions(header: str | None) -> list[str]:
    """The `X-Rollfleet-Weight-Version` header: every version that produced the answer, oldest first."""
    return [v for v in (header or "").split(",") if v]
