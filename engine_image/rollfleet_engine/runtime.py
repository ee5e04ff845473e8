"""What the launcher shares with the middleware and the routes: the engine and our state.

Owns the few facts vLLM does not keep for us: the mode of the last pause and a cached
weight version (read on every inference response, so it must not cost an RPC).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollfleet_engine.access import AccessPolicy
from rollfleet_engine.protocol import PauseMode
from rollfleet_engine.tracker import RequestTracker


@dataclass
class Runtime:
    engine: Any  # vllm.engine.protocol.EngineClient (AsyncLLM); Any keeps this module vLLM-free
    policy: AccessPolicy
    model_name: str
    weight_backend: str | None
    tracker: RequestTracker = field(default_factory=RequestTracker)
    weight_version: str = "default"
    pause_mode: PauseMode | None = None

    async def refresh_weight_version(self) -> str:
        self.weight_version = await self.engine.get_weight_version()
        return self.weight_version
