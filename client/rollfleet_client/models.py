"""What the client returns: a generation and an abort's answer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

AbortAnswer = Literal["aborted", "finished", "pending", "unconfirmed", "unknown"]


class Generation(BaseModel):
    """One completed (or aborted) generation, as the gateway answered it."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = Field(default=None, description="Of each token in token_ids, when asked for.")
    text: str = ""
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    weight_versions: list[str] = Field(default_factory=list, description="Every version that produced the tokens.")
    engines: list[str] = Field(default_factory=list, description="The engines it ran on, in order (failover).")

    @property
    def weight_version(self) -> str | None:
        """The oldest weight version that produced any of its tokens (what staleness is measured by)."""
        return self.weight_versions[0] if self.weight_versions else None


class AbortResult(BaseModel):
    """Per id, what the gateway confirmed: aborted, finished, pending, unconfirmed (with a reason) or unknown."""

    results: dict[str, AbortAnswer]
    reasons: dict[str, str] = Field(default_factory=dict)
