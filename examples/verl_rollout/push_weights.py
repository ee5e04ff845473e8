"""verl's own weight sync to a RolloutFleet: its checkpoint-engine update with the ``rollfleet`` backend.

verl's trainer calls its checkpoint manager's ``update_weights(global_steps)`` after each step: it forms
the checkpoint engine's topology (``prepare``, ``build_topology``, ``init_process_group``), calls
``update_weights`` on every actor worker (whose checkpoint engine ``send_weights`` the policy) and
finalizes. Here ``FleetCheckpointEngineManager`` (verl's manager, actor side only) runs it over a Ray
worker group of ``PolicyWorker`` (2 ranks on CPU): the two methods of verl's actor worker
(``verl.workers.engine_workers``) that the manager calls, with the checkpoint engine built from verl's
``CheckpointEngineConfig`` as the actor builds it. The fleet's engines are the rollout side. Each round
changes the policy (the same seeded step on every rank, as data-parallel ranks hold one policy), pushes
it as verl step N, and saves it to ``--save-dir/step-N`` (rank 0), so that a test can compare the
engines' output with the weights pushed. One JSON line per round on stdout: the step, the fleet's
weight generation, verl's sync metrics.

Needs verl and rollfleet-client, not vLLM (``hack/framework-env.sh verl``), and the fleet's sync sidecar.
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

import ray
import torch
from omegaconf import OmegaConf
from rollfleet_verl import FleetCheckpointEngineManager
from transformers import AutoModelForCausalLM
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig

HERE = Path(__file__).resolve().parent
RANKS = 2
STEP_SCALE = 0.05  # of each round's change, relative to a weight's spread: enough to change greedy tokens


class PolicyWorker(Worker):
    """A data-parallel rank of the policy, with verl's actor-worker methods that weight sync calls."""

    def __init__(self, model_dir: str, checkpoint_engine: dict[str, Any]) -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # As verl's actor builds it (verl.workers.engine_workers): the backend's module imported, rank 0 its master.
        config: CheckpointEngineConfig = omega_conf_to_dataclass(
            OmegaConf.create(checkpoint_engine), dataclass_type=CheckpointEngineConfig
        )
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            is_master=self.rank == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> None:
        """A stand-in optimizer step: the same seeded change on every rank."""
        generator = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * STEP_SCALE * (p.std() if p.numel() > 1 else 1))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> None:
        if self.rank == 0:
            self.model.save_pretrained(path)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        weights = ((name, tensor) for name, tensor in self.model.state_dict().items())
        return await self.checkpoint_engine.send_weights(weights, global_steps=global_steps) or {}


def main(args: argparse.Namespace) -> int:
    checkpoint_engine = {
        "backend": "rollfleet",
        "custom_backend_module": "rollfleet_verl",
        "engine_kwargs": {"rollfleet": {"sync_url": args.sync_url, "version_prefix": args.version_prefix}},
    }
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    scratch = tempfile.mkdtemp(prefix="ray-")  # Ray's session files (logs, sockets): removed at the end
    ray.init(num_cpus=RANKS, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}}, _temp_dir=scratch)
    try:
        actors = RayWorkerGroup(
            resource_pool=RayResourcePool([RANKS], use_gpu=False, max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(PolicyWorker), model_dir=args.model_dir, checkpoint_engine=checkpoint_engine
            ),
            device_name="cpu",
        )
        manager = FleetCheckpointEngineManager(
            omega_conf_to_dataclass(OmegaConf.create(checkpoint_engine), dataclass_type=CheckpointEngineConfig), actors
        )
        for step in range(1, args.steps + 1):
            actors.train_step(step)
            actors.save(str(Path(args.save_dir) / f"step-{step}"))
            metrics = manager.update_weights(global_steps=step)
            print(json.dumps({"step": step, **metrics}), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync-url", help="the fleet's sync sidecar (default: the one in this pod)")
    p.add_argument("--model-dir", required=True, help="the policy to start from")
    p.add_argument("--save-dir", required=True, help="each pushed policy is saved here as step-N")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--version-prefix", default="verl-step")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse()))
