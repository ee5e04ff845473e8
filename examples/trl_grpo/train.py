"""GRPO with TRL's own GRPOTrainer, its rollouts generated on a RolloutFleet, its weights pushed to the fleet.

TRL (`pip install trl`) trains; Rollfleet generates. Two hooks join them, both TRL's public API:

- ``rollout_func`` (GRPOTrainer's, with ``use_vllm=False``): each batch of prompts goes to the
  fleet's gateway through ``rollfleet_client``, as token ids, one request per sample, the samples
  of one prompt routed together (``group_id``: one engine, one prefix cache). It returns what TRL
  asks of a rollout (prompt and completion token ids, the engines' logprobs) and, per sample, the
  weight version and the fleet's generation that made it (``weight_version``, ``weight_generation``:
  TRL hands them to the reward functions).
- a ``TrainerCallback`` that pushes the policy through the sync sidecar: before the first step
  (the engines then sample from exactly the trainer's weights) and after every optimizer step, all
  or nothing and versioned (``<prefix>-<step>``), so step N's samples come from step N-1's weights.

The toy task: write tokens from a target set (reward: their share of the completion). One JSON
line per step on stdout: mean reward, the generations the step's samples came from, the version
pushed after it. Runs on CPU, in an environment with TRL and rollfleet-client and no vLLM
(``hack/framework-env.sh trl``); docs/frameworks.md says what to change on a GPU cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rollfleet_client import AsyncRolloutClient, SyncClient

TARGET_TOKENS = frozenset(range(100, 150))


def target_share(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The reward: the share of each completion's tokens in the target set."""
    return [sum(t in TARGET_TOKENS for t in ids) / max(1, len(ids)) for ids in completion_ids]


class FleetRollouts:
    """GRPOTrainer's ``rollout_func``: the batch's samples generated on the fleet, with logprobs and generations."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.made_by: list[
            tuple[str | None, int | None]
        ] = []  # the last batch's (weight version, generation) per sample

    def __call__(self, prompts: list[str], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        # TRL hands the batch with each prompt repeated num_generations times: one sample per entry.
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        samples = asyncio.run(self._generate(prompts, prompt_ids, trainer.state.global_step))
        # A sample made across a weight push has several; the latest is the one the trainer is ahead of.
        self.made_by = [
            (g.weight_versions[-1], g.weight_generations[-1]) if g.weight_versions else (None, None) for g in samples
        ]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [g.token_ids for g in samples],
            "logprobs": [g.logprobs for g in samples],
            "weight_version": [v for v, _ in self.made_by],
            "weight_generation": [n for _, n in self.made_by],
        }

    async def _generate(self, prompts: list[str], prompt_ids: list[list[int]], step: int) -> list[Any]:
        a = self.args
        client = AsyncRolloutClient(a.gateway_url, model=a.served_name, token=a.token, inference_token=a.token)
        async with client:
            return await asyncio.gather(
                *(
                    client.generate(
                        ids,
                        request_id=f"trl-s{step}-{i}-{uuid.uuid4().hex[:6]}",
                        group_id=f"trl-s{step}-{zlib.crc32(text.encode()):08x}",
                        max_tokens=a.max_tokens,
                        temperature=1.0,
                        # Each sample's own seed (vLLM's per-request generator): a run is repeatable, whatever
                        # engine or batch a sample lands in.
                        seed=zlib.crc32(f"{a.seed}/{step}/{i}".encode()),
                        logprobs=0,
                        ignore_eos=True,
                    )
                    for i, (text, ids) in enumerate(zip(prompts, prompt_ids, strict=True))
                )
            )


class PushWeights(TrainerCallback):
    """The policy to every engine through the sidecar: before training, then after each optimizer step."""

    def __init__(self, args: argparse.Namespace, rollouts: FleetRollouts) -> None:
        self.args = args
        self.rollouts = rollouts
        self.pushed: Any = None

    def push(self, model: Any, step: int) -> Any:
        state = {k: v.detach() for k, v in model.state_dict().items()}
        with SyncClient(self.args.sync_url) as sync:
            return sync.push(state, f"{self.args.version_prefix}-{step}")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        pushed = self.push(model, 0)
        print(json.dumps({"step": 0, "version": pushed.version, "generation": pushed.generation}), flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.pushed = self.push(model, state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
        if not logs or "reward" not in logs:  # the summary at the end of training
            return
        made_by = self.rollouts.made_by
        line = {
            "step": state.global_step,
            "reward": round(logs["reward"], 4),
            "samples": len(made_by),
            # The weights behind the step's samples: the version pushed after the step before.
            "sample_versions": sorted({str(v) for v, _ in made_by}),
            "sample_generations": sorted({g for _, g in made_by if g is not None}),
            "version": self.pushed.version,
            "generation": self.pushed.generation,
            "push_s": self.pushed.total_s,
        }
        print(json.dumps(line), flush=True)


def prompts(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"count {i} {i + 1} {i + 2}" for i in range(n)]})


def train(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's experimental API: known
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    rollouts = FleetRollouts(args, tokenizer)
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_vllm=False,
        use_cpu=True,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.prompts * args.num_generations,
        max_completion_length=args.max_tokens,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[target_share],
        args=config,
        train_dataset=prompts(args.steps * args.prompts),
        processing_class=tokenizer,
        rollout_func=rollouts,
    )
    trainer.add_callback(PushWeights(args, rollouts))
    trainer.train()
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateway-url", required=True, help="the fleet's gateway")
    p.add_argument("--sync-url", help="the sync sidecar's API (default: the one in this pod, on localhost)")
    p.add_argument("--token-file", help="the fleet's token (default: the mounted one, if any)")
    p.add_argument("--served-name", default="tiny", help="the fleet's spec.model.servedName")
    p.add_argument("--model-dir", required=True, help="the weights the policy starts from")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--num-generations", type=int, default=4, help="samples per prompt (GRPO's group)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version-prefix", default="trl")
    p.add_argument("--output-dir", default="/tmp/trl-grpo")
    args = p.parse_args(argv)
    args.token = Path(args.token_file).read_text().strip() if args.token_file else None
    return args


if __name__ == "__main__":
    sys.exit(train(parse()))
