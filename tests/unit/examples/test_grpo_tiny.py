"""The GRPO example's staleness accounting: which weights made each token, and what the loss learns from."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from rollfleet_client import Generation, WeightSegment

TRAIN = Path(__file__).resolve().parents[3] / "examples" / "grpo_tiny" / "train.py"


@pytest.fixture(scope="module")
def grpo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_tiny_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def answer(
    tokens: int, versions: dict[str, int], segments: list[tuple[str, int, int]], finish: str = "length"
) -> Generation:
    return Generation(
        request_id="r",
        token_ids=list(range(tokens)),
        logprobs=[-1.0] * tokens,
        finish_reason=finish,
        weight_versions=list(versions),
        weight_generations=list(versions.values()),
        weight_segments=[WeightSegment(version=v, start=a, end=b) for v, a, b in segments],
    )


def test_each_token_is_credited_to_the_weights_its_segment_names(grpo: ModuleType) -> None:
    spanning = answer(5, {"v3": 3, "v4": 4}, [("v3", 0, 2), ("v4", 2, 5)])
    assert grpo.token_generations(spanning) == [3, 3, 4, 4, 4]
    # Segments unknown (an attempt before a failover nobody asked): every token counts as the oldest weights'.
    assert grpo.token_generations(answer(3, {"v3": 3, "v4": 4}, [])) == [3, 3, 3]
    with pytest.raises(RuntimeError, match="do not cover"):
        grpo.token_generations(answer(5, {"v3": 3, "v4": 4}, [("v3", 0, 2), ("v4", 2, 4)]))
    with pytest.raises(RuntimeError, match="weight generations"):
        grpo.token_generations(answer(2, {}, []))


def test_tokens_past_the_bound_are_left_out_of_the_loss_and_the_rest_still_learnt(grpo: ModuleType) -> None:
    sample = grpo.Sample(prompt=[1, 2], max_tokens=6)
    sample.extend(answer(2, {"v1": 1}, [("v1", 0, 2)], finish="abort"))  # a straggler, stopped at the deadline
    sample.extend(answer(4, {"v1": 1, "v3": 3}, [("v1", 0, 1), ("v3", 1, 4)]))  # resumed, across a push
    assert sample.made_by == [1, 1, 1, 3, 3, 3] and sample.finished and sample.lag(3) == 2
    keep = sample.within(3, 1)
    assert keep == [False, False, False, True, True, True]

    torch.manual_seed(0)
    logits = torch.randn(1, 8, 16)

    def model(ids: torch.Tensor) -> Any:
        return SimpleNamespace(logits=logits)

    loss, gap = grpo.ppo_loss(model, sample, 1.0, 0.2, keep)
    # The same as the loss over the kept tokens alone: the stale ones add nothing, the kept ones all count.
    new = torch.log_softmax(logits[0, 1:-1], -1).gather(1, torch.tensor(sample.tokens)[:, None]).squeeze(1)[3:]
    ratio = torch.exp(new + 1.0)
    expected = -torch.minimum(ratio, ratio.clamp(0.8, 1.2)).mean()
    assert torch.isclose(loss, expected) and gap == pytest.approx(float((new + 1.0).abs().mean()))
    _, all_gap = grpo.ppo_loss(model, sample, 1.0, 0.2, [True] * 6)
    assert all_gap != pytest.approx(gap)
