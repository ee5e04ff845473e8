"""Read an engine's Prometheus counters: the demo and the e2e suite judge pause and abort by them.

What a client receives says little about an engine's state (vLLM's core runs well ahead of
SSE delivery), so both read the engine's own counters, through this one parser. Talks to an
engine's /metrics.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def engine_metric(engine_url: str, name: str, timeout: float = 10) -> float:
    """The sum of a sample (e.g. `vllm:generation_tokens_total`) over its labels."""
    text = httpx.get(engine_url + "/metrics", timeout=timeout).raise_for_status().text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)
