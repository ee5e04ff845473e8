"""TRL's own VLLMClient (vllm_mode="server" generation) against the live fleet's gateway and REAL vLLM engines.

n samples per token-id prompt with logprobs, each sample a gateway request of its own that
leaves nothing running on the engines; prefix-cache reset and world size answered for the
fleet; NCCL weight sync refused with what to do instead. Light on purpose: the engines are
tiny and shared by the whole suite.
"""

from __future__ import annotations

import re

import pytest

from e2e.fleet_helpers import trl_client
from e2e.live_fleet import LiveFleet
from e2e.provider import wait_for

pytest.importorskip("trl")

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

SAMPLE_ID = re.compile(r"-p\d+-s\d+$")  # the gateway's id of one sample of a TRL batch


@pytest.fixture
def fleet(live: LiveFleet) -> LiveFleet:
    live.ready()
    return live


def test_trl_generates_n_samples_per_prompt_with_logprobs_through_the_gateway(fleet: LiveFleet) -> None:
    client = trl_client(fleet.gateways[0].url, fleet.inference_token)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    out = client.generate(prompts, n=4, max_tokens=8, temperature=1.0, generation_kwargs={"ignore_eos": True})
    assert out["prompt_ids"] == prompts
    completions = out["completion_ids"]
    assert len(completions) == 8 and all(len(c) == 8 for c in completions), completions
    # logprobs=0 (TRL's default, what GRPO asks): one logprob per token, of the token sampled.
    assert out["logprob_token_ids"] == [[[t] for t in c] for c in completions]
    assert all(lp is None or lp <= 0 for seq in out["logprobs"] for (lp,) in seq)
    assert client.get_world_size() == len(fleet.engines)  # tensor-parallel size 1 each
    # Every engine's cache goes: a control call, as at the engines, which the trainer's admin token opens.
    with pytest.raises(Exception, match="401"):
        client.reset_prefix_cache()
    trl_client(fleet.gateways[0].url, fleet.token).reset_prefix_cache()
    with pytest.raises(Exception, match=r"501.*sync sidecar"):
        client.init_communicator(device="cpu")

    def nothing_left() -> bool:
        return not [rid for ids in fleet.in_flight().values() for rid in ids if SAMPLE_ID.search(rid)]

    wait_for(nothing_left, 30, what="no TRL sample left running on an engine")
