"""A batch of verl rollouts on a RolloutFleet: verl's own AgentLoopManager, Rollfleet's LLMServerClient.

verl composes its trainer config (``verl/trainer/config/ppo_trainer.yaml``, the overrides below),
starts Ray (2 CPUs, one agent-loop worker) and runs its single-turn agent loop over the prompts;
every generation goes to the fleet's gateway through ``RollfleetLLMServerClient``
(``rollfleet_verl.py``). One JSON line per sample on stdout: its request id, response length,
logprobs, the fleet's weight generation (``global_steps``) and versions behind it, and how
many submissions it took (more than one after an abort: verl resubmitted it with its tokens).

With ``--deterministic-ids`` verl names each sample ``det-<i>`` (its ``full_determinism``
setting), so that another process can abort one by id while the batch runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray
import verl
from hydra import compose, initialize_config_dir
from rollfleet_verl import RollfleetLLMServerClient
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopManager

HERE = Path(__file__).resolve().parent


def verl_config(args: argparse.Namespace) -> Any:
    """verl's own trainer config, with the rollout's settings for this run."""
    rollout = "actor_rollout_ref.rollout"
    overrides = [
        f"actor_rollout_ref.model.path={args.model_dir}",
        f"{rollout}.name=vllm",  # the engines' kind, as verl names it: the fleet runs vLLM
        f"{rollout}.agent.num_workers=1",
        f"{rollout}.prompt_length={args.prompt_length}",
        f"{rollout}.response_length={args.response_length}",
        f"{rollout}.calculate_log_probs=True",
        f"{rollout}.temperature=1.0",
        f"{rollout}.full_determinism={args.deterministic_ids}",
    ]
    with initialize_config_dir(str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def prompts(n: int, samples: int) -> DataProto:
    """`n` chat prompts, each `samples` times (a GRPO group), as verl's dataloader hands them over."""
    messages = np.empty(n, dtype=object)
    messages[:] = [[{"role": "user", "content": f"count from {i}"}] for i in range(n)]
    batch = DataProto.from_dict(non_tensors={"raw_prompt": messages, "index": np.arange(n)})
    return batch.repeat(samples, interleave=True)


def main(args: argparse.Namespace) -> int:
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    config = verl_config(args)
    # The agent-loop worker imports this directory's client module: Ray starts it with the path.
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    scratch = tempfile.mkdtemp(prefix="ray-")  # Ray's session files (logs, sockets): removed at the end
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}}, _temp_dir=scratch)
    try:
        sampling = {"ignore_eos": True} if args.ignore_eos else None
        client = RollfleetLLMServerClient(
            config, gateway_url=args.gateway_url, model=args.served_name, token=token, sampling=sampling
        )
        manager = AgentLoopManager.create(config, llm_client=client)
        out = manager.generate_sequences(prompts(args.prompts, args.samples))
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    mask, logprobs = out.batch["response_mask"], out.batch.get("rollout_log_probs")
    extra = out.non_tensor_batch
    for i in range(len(out)):
        length = int(mask[i].sum())
        line = {
            "request_id": str(extra["rollfleet_request_id"][i]),
            "response_tokens": length,
            "logprobs": None if logprobs is None else int((logprobs[i][:length] != 0).sum()),
            "global_steps": extra["global_steps"][i],
            "weight_versions": list(extra["weight_versions"][i]),
            "submissions": int(extra["rollfleet_submissions"][i]),
        }
        print(json.dumps(line, default=int), flush=True)
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateway-url", required=True, help="the fleet's gateway")
    p.add_argument("--token-file", help="the fleet's token (generation, and the weight generations of the answers)")
    p.add_argument("--served-name", default="tiny", help="the fleet's spec.model.servedName")
    p.add_argument("--model-dir", required=True, help="the model's tokenizer and config (verl reads them)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=2, help="samples per prompt")
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("--ignore-eos", action="store_true", help="every sample runs to --response-length")
    p.add_argument("--deterministic-ids", action="store_true", help="request ids det-0, det-1, ... (abortable by id)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse()))
