"""GRPO on a RolloutFleet: sample groups from the fleet, score, update with torch, push the new weights.

Runs in a trainer pod next to the sync sidecar (``trainer-pod.yaml``) and talks to Rollfleet
only through ``rollfleet_client``: ``generate`` through the fleet's gateway, ``push_weights``
through the sidecar. Each step:

1. samples ``--prompts`` x ``--group-size`` completions (a GRPO group shares one engine and
   its prefix cache), with the engines' per-token logprobs, and resubmits the stragglers of
   the last step from where they stopped (partial rollout: prompt + tokens so far);
2. stops every request still running at ``--deadline-s`` (the gateway aborts it at the
   engine and answers with what was made): a straggler, resumed on the next version (so is
   one whose answer does not come even then, on a busy host: it keeps the tokens it had);
3. learns only from tokens at most ``--max-staleness`` generations behind the policy: each
   token's generation comes from the answer's weight segments (a rollout that a push paused
   and resumed on new weights has two), tokens past the bound are left out of the loss, and a
   group with a sample that has none within it is dropped; scores the complete groups with a
   verifiable toy reward (the share of completion tokens in a target set), and takes a
   PPO-clipped policy-gradient step, the engines' logprobs being the behaviour policy's;
4. pushes the new weights to every engine (``push_weights``: all or nothing, versioned).

One JSON line per step on stdout: mean reward, samples per second, push and pause-window
seconds, the generations the learnt tokens came from, stragglers, resubmissions, drops, tokens
left out as too stale and samples that span a swap, and how
far the trainer's logprobs are from the engines' for the same tokens. On a GPU
cluster the same script runs with another fleet spec and model (``--model-dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollfleet_client import AsyncRolloutClient, GenerateTimeout, Generation, SidecarError, SyncClient

TARGET_TOKENS = frozenset(range(100, 150))  # the toy task: write tokens from this set


@dataclass
class Sample:
    """One completion of a group, possibly assembled from several partial generations."""

    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    made_by: list[int] = field(default_factory=list)  # the weight generation behind each token
    finished: bool = False
    resubmits: int = 0

    def lag(self, generation: int) -> int:
        """How many generations the oldest weights behind its tokens trail `generation` (0: no tokens yet)."""
        return generation - min(self.made_by, default=generation)

    def within(self, generation: int, bound: int) -> list[bool]:
        """Per token: made by weights at most `bound` generations behind `generation`."""
        return [generation - n <= bound for n in self.made_by]

    def extend(self, g: Generation) -> None:
        """Add what a generation made (nothing, if the deadline came while it still queued)."""
        if g.token_ids:
            if g.logprobs is None or len(g.logprobs) != len(g.token_ids):
                raise RuntimeError(f"{g.request_id}: an answer without logprobs: {g!r}")
            self.tokens += g.token_ids
            self.logprobs += g.logprobs
            self.made_by += token_generations(g)
        self.finished = g.finish_reason != "abort" or len(self.tokens) >= self.max_tokens


def token_generations(g: Generation) -> list[int]:
    """The fleet's weight generation behind each token of `g`, from its weight segments. Where the gateway does
    not know them end to end, every token counts as made by the oldest weights the answer ran on."""
    by_version = dict(zip(g.weight_versions, g.weight_generations, strict=True))
    if not by_version or None in by_version.values():
        raise RuntimeError(f"{g.request_id}: an answer without the fleet's weight generations: {g!r}")
    if not g.weight_segments:
        return [min(n for n in by_version.values() if n is not None)] * len(g.token_ids)
    made_by = [by_version.get(s.version) for s in g.weight_segments for _ in range(s.start, s.end)]
    if len(made_by) != len(g.token_ids) or None in made_by:
        raise RuntimeError(f"{g.request_id}: weight segments that do not cover its tokens: {g!r}")
    return [n for n in made_by if n is not None]


@dataclass
class Group:
    key: str
    samples: list[Sample]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


def reward(tokens: list[int]) -> float:
    return sum(t in TARGET_TOKENS for t in tokens) / max(1, len(tokens))


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: each reward against its group's mean, in units of the group's spread."""
    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)


def ppo_loss(model: Any, sample: Sample, advantage: float, clip: float, keep: list[bool]) -> tuple[torch.Tensor, float]:
    """PPO-clipped policy gradient over the sample's tokens that `keep` says (the others still condition them),
    the engines' logprobs being the old policy's; and how far the trainer's logprobs are from the engines' on
    those tokens (mean absolute difference per token)."""
    ids = torch.tensor([sample.prompt + sample.tokens])
    logits = model(ids).logits[0, len(sample.prompt) - 1 : -1]
    new = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(sample.tokens)[:, None]).squeeze(1)
    old, mask = torch.tensor(sample.logprobs), torch.tensor(keep, dtype=torch.float32)
    ratio = torch.exp(new - old)
    clipped = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    kept = mask.sum().clamp(min=1)
    return -(clipped * mask).sum() / kept, float(((new.detach() - old).abs() * mask).sum() / kept)


async def run_sample(
    client: AsyncRolloutClient, group: str, sample: Sample, deadline_s: float, max_staleness: int
) -> bool:
    """Generate what the sample lacks; at the deadline the gateway stops it and answers what was made.
    False if no answer came even then (a busy host; the client asked the gateway to stop it): the sample
    keeps what it had, and is resumed on the next step like any straggler. The call carries the staleness
    bound: the gateway routes it to engines within it, and a push past it ends it (answered with what was made,
    like the deadline); what the sample made on earlier steps the trainer weighs itself (``Sample.lag``)."""
    try:
        g = await client.generate(
            sample.prompt + sample.tokens,
            group_id=group,
            request_id=f"{group}-{uuid.uuid4().hex[:8]}",
            timeout_s=deadline_s,
            max_weight_lag=max_staleness,
            max_tokens=sample.max_tokens - len(sample.tokens),
            temperature=1.0,
            logprobs=0,
            ignore_eos=True,
        )
    except GenerateTimeout:
        return False
    sample.extend(g)
    return True


def new_groups(args: argparse.Namespace, step: int) -> list[Group]:
    groups = []
    for i in range(args.prompts):
        prompt = [1, 5 + (step * args.prompts + i) % 90, 17, 42]
        # The last prompt of a step asks for long completions: a straggler the deadline stops.
        tokens = args.long_tokens if i == args.prompts - 1 and args.long_tokens else args.max_tokens
        key = f"s{step}-p{i}"
        groups.append(Group(key, [Sample(prompt, tokens) for _ in range(args.group_size)]))
    return groups


def wait_for_sidecar(timeout_s: float) -> None:
    """The sync sidecar starts beside the trainer: wait until it answers and knows the fleet's version."""
    deadline = time.monotonic() + timeout_s
    with SyncClient() as sync:
        while True:
            try:
                if sync.fleet_version().version is not None:
                    return
            except SidecarError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)  # polling a condition: the sidecar's first reconcile


def learn(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[Group],
    keep: dict[int, list[bool]],
    clip: float,
) -> list[float]:
    """One PPO step on `groups`, each sample's tokens masked by `keep` (by the sample's id); each sample's gap
    between its sampling and training logprobs."""
    optimizer.zero_grad()
    n = sum(len(g.samples) for g in groups)
    loss, gaps = torch.zeros(()), list[float]()
    for g in groups:
        adv = advantages(torch.tensor([reward(s.tokens) for s in g.samples]))
        for s, a in zip(g.samples, adv.tolist(), strict=True):
            sample_loss, gap = ppo_loss(model, s, a, clip, keep[id(s)])
            loss = loss + sample_loss / n
            gaps.append(gap)
    if n:
        loss.backward()
        optimizer.step()
    return gaps


async def train(args: argparse.Namespace) -> int:
    wait_for_sidecar(timeout_s=120)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    client = AsyncRolloutClient(args.gateway_url, fleet=args.fleet, namespace=args.namespace, model=args.served_name)
    async with client:
        state = await client.fleet_state()
        generation = state.weight_generation or 0
        waiting: list[Group] = []  # groups with a straggler: finished on a later step
        for step in range(args.steps):
            t0 = time.monotonic()
            groups = [*waiting, *new_groups(args, step)]
            todo = [(g.key, s) for g in groups for s in g.samples if not s.finished]
            resubmitted = sum(1 for _, s in todo if s.tokens)
            for _, s in todo:
                s.resubmits += bool(s.tokens)
            calls = (run_sample(client, key, s, args.deadline_s, args.max_staleness) for key, s in todo)
            answered = await asyncio.gather(*calls)
            sampling_s = time.monotonic() - t0
            stragglers = [s for _, s in todo if not s.finished]

            ready = [g for g in groups if g.finished]
            waiting = [g for g in groups if not g.finished]
            # Tokens past the bound are left out of the loss; a group with a sample that has no token within
            # it is too stale to learn from, and dropped (a real trainer would resample it).
            keep = {id(s): s.within(generation, args.max_staleness) for g in ready for s in g.samples}  # per token
            fresh = [g for g in ready if all(any(keep[id(s)]) for s in g.samples)]
            dropped = sum(len(g.samples) for g in ready) - sum(len(g.samples) for g in fresh)
            too_old = [g for g in waiting if any(s.lag(generation) >= args.max_staleness for s in g.samples)]
            waiting = [g for g in waiting if g not in too_old]
            dropped += sum(len(g.samples) for g in too_old)
            used = [s for g in fresh for s in g.samples]

            rewards = [reward(s.tokens) for g in fresh for s in g.samples if s.max_tokens == args.max_tokens]
            gaps = learn(model, optimizer, fresh, keep, args.clip)

            version = f"{args.version_prefix}-{step + 1}"
            pushed = await client.push_weights({k: v.detach() for k, v in model.state_dict().items()}, version)
            learnt = [  # the generation behind each token the step learnt from
                n for s in used for n, ok in zip(s.made_by, keep[id(s)], strict=True) if ok
            ]
            masked = sum(len(s.tokens) - sum(keep[id(s)]) for s in used)
            staleness = [generation - n for n in learnt]
            generation = pushed.generation
            print(
                json.dumps(
                    {
                        "step": step + 1,
                        "reward": round(sum(rewards) / max(1, len(rewards)), 4),
                        "samples": len(used),
                        "samples_per_s": round(len(used) / sampling_s, 2),
                        "sampling_s": round(sampling_s, 2),
                        "push_s": pushed.total_s,
                        "pause_window_s": pushed.pause_window_s,
                        "version": pushed.version,
                        "generation": pushed.generation,
                        "sample_generations": sorted(set(learnt)),
                        "max_staleness_seen": max(staleness, default=0),
                        "stragglers": len(stragglers),
                        "straggler_tokens": sum(len(s.tokens) for s in stragglers),  # made so far: resumed next step
                        "unanswered": answered.count(False),
                        "resumed_used": sum(1 for s in used if s.resubmits),
                        "resubmitted": resubmitted,
                        "dropped": dropped,
                        "stale_tokens_left_out": masked,
                        "samples_across_a_swap": sum(1 for s in used if len(set(s.made_by)) > 1),
                        # Trainer vs engine logprobs of the same tokens: ~0 for samples of the current
                        # policy; larger for resumed stragglers (older weights behind their tokens).
                        "logprob_gap": round(sum(gaps) / max(1, len(gaps)), 5),
                    }
                ),
                flush=True,
            )
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", help="the RolloutFleet (in a pod of its namespace: found by name)")
    p.add_argument("--namespace", help="the fleet's namespace (default: this pod's)")
    p.add_argument("--gateway-url", help="the gateway's URL instead of the fleet's Service")
    p.add_argument("--served-name", default="tiny", help="the fleet's spec.model.servedName")
    p.add_argument("--model-dir", default="/models/tiny", help="the same weights the engines start from")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=6, help="GRPO groups per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=1500, help="the last group's length (0: none)")
    p.add_argument("--deadline-s", type=float, default=8.0, help="stragglers past this are stopped and resumed")
    p.add_argument("--max-staleness", type=int, default=2, help="generations a sample may lag the policy")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version-prefix", default="grpo")
    args = p.parse_args(argv)
    if not args.fleet and not args.gateway_url:
        p.error("pass --fleet (in the cluster) or --gateway-url")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(train(parse())))
