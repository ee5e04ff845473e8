"""What the client returns: a generation, an abort's answer, the fleet's state and a push's outcome.

``FleetState`` is also what the gateway's ``GET /v1/fleet`` answers (the gateway builds it).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

AbortAnswer = Literal["aborted", "finished", "pending", "unconfirmed", "unknown"]
PauseMode = Literal["keep", "wait", "abort"]  # the engines' (rollfleet_engine.protocol; a unit test holds them equal)


class WeightSegment(BaseModel):
    """Output tokens ``[start, end)`` (indexes into ``token_ids``) came from the weights labelled ``version``."""

    version: str
    start: int
    end: int


class Generation(BaseModel):
    """One completed (or aborted) generation, as the gateway answered it."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = Field(default=None, description="Of each token in token_ids, when asked for.")
    text: str = ""
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    weight_versions: list[str] = Field(default_factory=list, description="Every version that produced the tokens.")
    weight_generations: list[int | None] = Field(
        default_factory=list,
        description="The fleet's generation number of each of weight_versions (None: not in the fleet's record).",
    )
    engines: list[str] = Field(default_factory=list, description="The engines it ran on, in order (failover).")
    weight_segments: list[WeightSegment] = Field(
        default_factory=list,
        description="Which tokens came from which version, in order, when the gateway knows it end to end (a "
        "rollout that a push paused and resumed on new weights has two). Empty when it does not.",
    )

    @property
    def weight_version(self) -> str | None:
        """The oldest weight version that produced any of its tokens (what staleness is measured by)."""
        return self.weight_versions[0] if self.weight_versions else None

    @property
    def weight_generation(self) -> int | None:
        """The generation of ``weight_version``: what a staleness bound compares."""
        return self.weight_generations[0] if self.weight_generations else None


class AbortResult(BaseModel):
    """Per id, what the gateway confirmed: aborted, finished, pending, unconfirmed (with a reason) or unknown."""

    results: dict[str, AbortAnswer]
    reasons: dict[str, str] = Field(default_factory=dict)


class EngineState(BaseModel):
    """One engine, as the fleet's status last showed it."""

    name: str
    phase: str = Field(description="Starting, PendingSync, Ready, Paused, Syncing, Draining or Failed.")
    weight_version: str | None = None
    in_flight: int | None = None


class PauseState(BaseModel):
    mode: PauseMode
    since: datetime
    paused_engines: int = Field(description="Engines that report being paused.")
    requested_by: str | None = Field(default=None, description="kubectl-annotate, or rollfleet-client/<caller>.")


class FleetState(BaseModel):
    """A fleet as its status and its weight-sync record show it."""

    fleet: str
    namespace: str
    replicas: int = Field(description="Engines wanted (spec.replicas).")
    ready_replicas: int = Field(description="Engines that serve (Ready or Paused).")
    weight_version: str | None = None
    weight_generation: int | None = None
    generations: dict[str, int] = Field(default_factory=dict, description="Recent weight versions' generations.")
    push: str | None = Field(default=None, description="The version a weight push in progress moves the fleet to.")
    pause: PauseState | None = None
    engines: list[EngineState] = Field(default_factory=list)
