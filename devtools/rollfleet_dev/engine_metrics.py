"""Read an engine's Prometheus counters: the demo and the e2e suite judge pause and abort by them.

What a client receives says little about an engine's state (vLLM's core runs well ahead of
SSE delivery), so both read the engine's own counters, through this one parser. Talks to an
engine's /metrics.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from rollfleet_dev import oneshot


def _samples(engine_url: str, name: str, timeout: float) -> list[tuple[dict[str, str], float]]:
    text = oneshot.get(engine_url + "/metrics", timeout=timeout).raise_for_status().text
    return [
        (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
    ]


def engine_metric(engine_url: str, name: str, /, timeout: float = 10, **labels: str) -> float:
    """The sum of a sample (e.g. `vllm:generation_tokens_total`) over its labels, or over the samples with these
    labels (`engine="1"`: a data parallel engine's rank 1, whose counters its leader's API server reports). Raises
    LookupError when labels are given and no sample has them: a rank that reports nothing is not an idle one."""
    values = [value for have, value in _samples(engine_url, name, timeout) if labels.items() <= have.items()]
    if labels and not values:
        raise LookupError(f"{engine_url}/metrics has no {name} with labels {labels}")
    return sum(values)


def engine_metric_by(engine_url: str, name: str, label: str, /, timeout: float = 10) -> dict[str, float]:
    """A sample summed per value of one label, from one scrape (`engine`: each data parallel rank's, read at one
    moment; a scrape of a leader's /metrics costs its API server tens of milliseconds)."""
    per: dict[str, float] = {}
    for have, value in _samples(engine_url, name, timeout):
        if label in have:
            per[have[label]] = per.get(have[label], 0.0) + value
    return per
