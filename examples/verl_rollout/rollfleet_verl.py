"""verl's rollouts on a RolloutFleet: an ``LLMServerClient`` that generates through the fleet's gateway.

verl's agent loops (``AgentLoopManager``) call ``llm_client.generate(request_id, prompt_ids=...,
sampling_params=...)`` and expect a ``TokenOutput``. ``RollfleetLLMServerClient`` answers that call
with one gateway request (``rollfleet_client``): token ids in, token ids and logprobs out, the
request id verl chose as the fleet's request id, so ``POST /v1/abort`` (or
``AsyncRolloutClient.abort``) stops exactly that sample at its engine. An aborted request comes
back with the tokens it made and ``stop_reason="aborted"``; verl's own ``FullyAsyncLLMServerClient``
loop, which this class inherits, then resubmits prompt plus those tokens, so the sample
completes from where it stopped. ``extra_fields`` carry the fleet's weight generation as
``global_steps`` (verl's name for the policy version), the weight versions behind the tokens,
the request id and how many submissions the sample took.

``RollfleetCheckpointEngine`` is verl's checkpoint-engine backend ``rollfleet``
(``checkpoint_engine.backend: rollfleet``, ``custom_backend_module: rollfleet_verl``): the actor's
rank 0 pushes the policy through the sync sidecar of its pod, versioned and all-or-nothing, and
returns when every engine of the fleet serves it. The fleet's engines are the receivers (the sidecar
drives them), so verl runs no rollout workers of its own; verl 0.9's ``CheckpointEngineManager``
needs some, and ``FleetCheckpointEngineManager`` takes its place: the actor side of the same update.

Ray ships the client to its agent-loop workers by pickling: the HTTP client is made in the
process that uses it. Needs verl and rollfleet-client, not vLLM (``hack/framework-env.sh verl``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from rollfleet_client import AsyncRolloutClient, Generation, RequestIdInUse, SyncClient

# verl's sampling parameters that vLLM's completions route takes as they are.
_PASSED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed", "stop")
# The gateway refuses an id while a request under it runs: verl resubmits an aborted sample under
# its id, and the abort's end may still be on its way there.
_ID_RETRY_S, _ID_RETRIES = 0.2, 50


def vllm_sampling(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """verl's sampling parameters as the completions route's: ``logprobs`` True is the sampled token's."""
    out = {k: sampling_params[k] for k in _PASSED if sampling_params.get(k) is not None}
    if "max_new_tokens" in sampling_params and "max_tokens" not in out:
        out["max_tokens"] = sampling_params["max_new_tokens"]
    logprobs = sampling_params.get("logprobs")
    if logprobs is not None and logprobs is not False:
        out["logprobs"] = 0 if logprobs is True else int(logprobs)
    return out


def token_output(g: Generation) -> TokenOutput:
    """A gateway answer as verl's ``TokenOutput``: aborted (with its partial tokens) or completed."""
    return TokenOutput(
        token_ids=g.token_ids,
        log_probs=g.logprobs,
        stop_reason="aborted" if g.finish_reason == "abort" else "completed",
        extra_fields={"global_steps": g.weight_generations[-1] if g.weight_generations else None},
    )


class _GatewayRequest(LLMServerClient):
    """One generation, one gateway request: what verl's base client does with a Ray server handle."""

    def __init__(
        self,
        config: Any,
        *,
        gateway_url: str,
        model: str,
        token: str | None = None,
        sampling: dict[str, Any] | None = None,
        **kwargs: Any,  # verl's own (load_balancer_handle: None here, the gateway routes)
    ) -> None:
        super().__init__(config=config, **kwargs)
        self.gateway_url, self.model, self.token = gateway_url, model, token
        self.sampling = dict(sampling or {})  # added to every request's (vLLM's names: ignore_eos, ...)
        self._client: AsyncRolloutClient | None = None
        self._submissions: dict[str, list[Generation]] = {}  # per request id: its answers so far

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}  # an HTTP client does not cross processes

    def client(self) -> AsyncRolloutClient:
        if self._client is None:
            self._client = AsyncRolloutClient(self.gateway_url, model=self.model, token=self.token)
        return self._client

    async def generate(  # type: ignore[override]
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        **_: Any,  # mm_processor_kwargs, priority: nothing the gateway takes
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("multimodal rollouts: the gateway's token route takes text token ids only")
        params = self.sampling | vllm_sampling(sampling_params)
        for _ in range(_ID_RETRIES):
            try:
                g = await self.client().generate(list(prompt_ids), request_id=request_id, **params)
                self._submissions.setdefault(request_id, []).append(g)
                return token_output(g)
            except RequestIdInUse:
                await asyncio.sleep(_ID_RETRY_S)  # the id's previous request is still ending
        raise RequestIdInUse(f"request id {request_id} stayed in use for {_ID_RETRY_S * _ID_RETRIES:.0f} s")


class RollfleetLLMServerClient(FullyAsyncLLMServerClient, _GatewayRequest):
    """verl's resubmitting client (an aborted sample continues from its tokens) over the fleet's gateway.

    ``RollfleetLLMServerClient(config, gateway_url=..., model="tiny", token=...)``; pass it to
    ``AgentLoopManager.create(config, llm_client=...)``. ``sampling``: vLLM sampling parameters that verl's
    config has no setting for, added to every request (``{"ignore_eos": True}``). verl's own constructor
    runs first and hands the rest of the arguments on to ``_GatewayRequest``'s.
    """

    async def generate(self, request_id: str, **kwargs: Any) -> TokenOutput:  # type: ignore[override]
        """verl's loop over submissions (resubmitting an aborted sample with its tokens); the sample's answer
        says how many submissions it took and every weight version behind its tokens."""
        self._submissions[request_id] = []
        try:
            out: TokenOutput = await super().generate(request_id, **kwargs)
        finally:
            answers = self._submissions.pop(request_id, [])
        out.extra_fields["rollfleet_request_id"] = request_id
        out.extra_fields["rollfleet_submissions"] = len(answers)
        out.extra_fields["weight_versions"] = list(dict.fromkeys(v for g in answers for v in g.weight_versions))
        return out


@CheckpointEngineRegistry.register("rollfleet")
class RollfleetCheckpointEngine(CheckpointEngine):
    """verl's weight transfer to a RolloutFleet: the actor's rank 0 pushes the whole policy through the sync
    sidecar as ``<version_prefix>-<global_steps>``; ``send_weights`` returns once the fleet serves it (or raises
    ``PushFailed``: the fleet stayed on its previous version). Every rank iterates the weights, as FSDP's and
    Megatron's gathers need; rank 0 keeps a CPU copy to push (the sidecar hashes and serves it, the engines
    prefetch and swap). Config (``checkpoint_engine.engine_kwargs.rollfleet``): ``sync_url`` (default: the
    sidecar in this pod), ``version_prefix``, ``timeout_s``.
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        sync_url: str | None = None,
        version_prefix: str = "verl-step",
        timeout_s: float = 1800.0,
    ) -> None:
        # bucket_size: verl's bucketing is for its own collectives; the sidecar takes the whole policy.
        self.sync_url, self.version_prefix, self.timeout_s = sync_url, version_prefix, timeout_s
        self.rank = 0 if is_master else -1
        self.pushes = 0

    def prepare(self) -> dict[str, Any]:
        return {}  # no group to form: the sidecar reaches the engines

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        if rollout_world_size:
            raise ValueError(
                "the rollfleet checkpoint engine feeds a RolloutFleet, whose engines take the weights from the "
                f"sync sidecar: use FleetCheckpointEngineManager, with no rollout replicas ({rollout_world_size} "
                "workers given)"
            )
        return {"rank": [0] + [-1] * (actor_wg_world_size - 1)}, {}

    def init_process_group(self, rank: int) -> None:
        self.rank = rank

    def finalize(self) -> None:
        pass

    def version(self, global_steps: int | None) -> str:
        """The version label of a push: verl's step when it gives one, else this engine's own count."""
        return f"{self.version_prefix}-{global_steps if global_steps is not None else f'push{self.pushes}'}"

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Push the weights to the fleet (rank 0; the others only iterate); verl's sync metrics come back."""
        self.pushes += 1
        state: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)  # the generator may reuse its buffers
        if self.rank != 0:
            return {}
        t0 = time.monotonic()

        def push() -> Any:
            with SyncClient(self.sync_url) as sync:
                return sync.push(state, self.version(global_steps), timeout_s=self.timeout_s)

        status = await asyncio.to_thread(push)
        return {
            "rollfleet/weight_generation": status.generation,
            "rollfleet/push_s": time.monotonic() - t0,
            "rollfleet/pause_window_s": status.pause_window_s,
            "rollfleet/bytes": status.bytes,
        }

    def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        raise NotImplementedError(
            "a RolloutFleet's engines receive the weights from the sync sidecar: there is no verl rollout "
            "worker to receive them (FleetCheckpointEngineManager runs none)"
        )


class FleetCheckpointEngineManager(CheckpointEngineManager):
    """verl's ``CheckpointEngineManager`` for a fleet: ``update_weights`` does the actor side of verl's update
    (topology, every actor worker's ``update_weights``, finalize) and returns the sender's sync metrics. The
    sidecar pauses and resumes the engines itself, so there is nothing to abort or resume here. Construct it
    where verl's trainer constructs its manager: ``FleetCheckpointEngineManager(config, actor_wg)``."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any] | None = None) -> None:
        if replicas:
            raise ValueError("a fleet's engines are not verl rollout replicas: pass none")
        super().__init__(config, actor_wg, [])

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        actors, size = self.actor_wg, self.actor_wg.world_size
        metadata = ray.get(actors.execute_checkpoint_engine(["prepare"] * size))
        kwargs, _ = self.backend_cls.build_topology(size, 0, metadata)
        ray.get(actors.execute_checkpoint_engine(method=["init_process_group"] * size, **kwargs))
        results = ray.get(actors.update_weights(global_steps=global_steps, mode=self.backend))
        ray.get(actors.execute_checkpoint_engine(["finalize"] * size))
        return {k: v for result in results if isinstance(result, dict) for k, v in result.items()}
