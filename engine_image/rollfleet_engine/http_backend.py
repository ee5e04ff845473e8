"""The portable weight transfer backend ``http``: workers pull safetensors over HTTP.

Lives in vLLM's worker processes (registered by ``plugin``). The handshake is vLLM's
own: ``/init_weight_transfer_engine`` (optional here), ``/start_weight_update``,
``/update_weights`` with ``{"update_info": {"url": ..., "manifest_sha256": ...}}`` (one
or more times), ``/finish_weight_update`` with ``weight_version``.

All-or-nothing: ``update_weights`` downloads and verifies every tensor into host memory
before it touches the model, then loads them; ``finish_weight_update`` finalizes and
labels. A failed transfer raises, vLLM ends the update session, the following finish is
refused, and the old weights (and version) keep serving. A tensor-parallel rank pulling over HTTP
takes only its part of each tensor (``tp_slices``), each cut confirmed against this model's own
layers first (a tensor whose layer does not confirm it is pulled whole); a rank of an engine whose
ranks span pods stages that part while it serves (``stage``, ``rank_staging``) and loads it in the
pause (``rank-staged://`` URL). Weights that do not fit the
model fail in the load, after some layers took them: the error carries
``MIXED_WEIGHTS_MARK``, the engine then says it is not intact (``middleware``), and the
sidecar brings it back to one version.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from rollfleet_engine.protocol import MIXED_WEIGHTS_MARK, StageStatus, TensorCut, WeightManifest, WeightUpdateInfo
from rollfleet_engine.rank_staging import RANK_STAGED_SCHEME, RankStage
from rollfleet_engine.reload import abandon_layerwise_reload
from rollfleet_engine.tp_slices import RankShard, rank_plan
from rollfleet_engine.weights_client import fetch_slices, fetch_weights

logger = init_logger(__name__)


@dataclass
class HTTPInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the URL travels with each update."""


@dataclass
class HTTPUpdateInfo(WeightTransferUpdateInfo):
    url: str
    manifest_sha256: str | None = None
    timeout_s: float = 300.0


class HTTPWeightTransferEngine(WeightTransferEngine[HTTPInitInfo, HTTPUpdateInfo]):
    init_info_cls = HTTPInitInfo
    update_info_cls = HTTPUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded = False  # this session loaded verified weights: finish may label them
        self._stage = RankStage()  # this rank's part of the next weights, for an engine whose ranks span pods

    def init_transfer_engine(self, init_info: HTTPInitInfo) -> None:
        """Nothing to set up; accepted so that the standard handshake works unchanged."""

    def start_weight_update(self) -> None:
        self._loaded = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also calls torch.accelerator.synchronize(), which fails on a
        # host without an accelerator; nothing here runs on a device anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def stage(self, info: WeightUpdateInfo) -> StageStatus:
        """Pull this rank's part of the weights at `info.url` into memory while the engine serves
        (``rank_staging``); the load then takes it (``rank-staged://`` URL)."""
        return self._stage.start(info, lambda i: self._pull(i.url, i.manifest_sha256, i.timeout_s))

    def stage_status(self) -> StageStatus:
        return self._stage.status()

    def _pull(self, url: str, manifest_sha256: str | None, timeout_s: float) -> list[tuple[str, Any]]:
        """Every tensor at `url`, verified; a tensor-parallel rank pulling over HTTP takes only its cuts."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_size = get_tensor_model_parallel_world_size()
        if tp_size > 1 and urlsplit(url).scheme == "http":
            text = self.model_config.hf_text_config
            rank = RankShard(tp_size, get_tensor_model_parallel_rank(), text.num_key_value_heads, text.vocab_size)
            return fetch_slices(url, manifest_sha256, timeout_s, functools.partial(confirmed_plan, self.model, rank))
        return fetch_weights(url, manifest_sha256, timeout_s)

    def receive_weights(self, update_info: HTTPUpdateInfo) -> None:
        """Download and verify every tensor (or take the ones this rank staged), then load them. A failure here,
        unlike one in finish, ends vLLM's update session, so the engine can take the next update."""
        info, parallel = update_info, self.vllm_config.parallel_config
        try:
            if urlsplit(info.url).scheme == RANK_STAGED_SCHEME:
                weights = self._stage.take(info.url)
            else:
                weights = self._pull(info.url, info.manifest_sha256, info.timeout_s)
        except Exception as err:
            if parallel.world_size * parallel.data_parallel_size > 1:
                # The engine's other ranks may have got their parts and loaded them: it is one version no more.
                raise RuntimeError(
                    f"{MIXED_WEIGHTS_MARK} this rank did not get its part of the weights: {err}"
                ) from err
            raise
        logger.info("Received %d verified tensors from %s", len(weights), info.url)
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # Layerwise reload re-runs each layer's post-load processing (the CPU backend
        # repacks linear weights), so the new values reach the kernels actually used.
        initialize_layerwise_reload(self.model)
        try:
            with disable_mtp_completeness_check():
                self.model.load_weights(weights)
        except Exception as err:
            abandon_layerwise_reload(self.model)
            raise RuntimeError(f"{MIXED_WEIGHTS_MARK} the weights do not fit the model: {err}") from err
        self._loaded = True

    def finish_weight_update(self) -> None:
        if not self._loaded:
            raise RuntimeError("no verified weights were received in this update; the version is not recorded")
        self._loaded = False
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._loaded = False


def confirmed_plan(model: Any, rank: RankShard, manifest: WeightManifest) -> list[TensorCut]:
    """`rank`'s cuts of `manifest` (``tp_slices.rank_plan``), each kept only if the layer that loads the tensor
    narrows it to exactly those rows: else the tensor is pulled whole and its loader cuts it, as ever."""
    params, modules = _loader_params(model), dict(model.named_modules())
    fused = {part: whole for whole, parts in getattr(model, "packed_modules_mapping", {}).items() for part in parts}
    cuts = rank_plan(manifest, rank)
    kept = [
        cut if cut.dim is None or _layer_cuts(params, modules, fused, rank, cut) else TensorCut(name=cut.name)
        for cut in cuts
    ]
    logger.info("Shard-aware pull: %d of %d tensors cut for tensor-parallel rank %d of %d",
                sum(c.dim is not None for c in kept), len(kept), rank.tp_rank, rank.tp_size)  # fmt: skip
    return kept


def _loader_params(model: Any) -> dict[str, Any]:
    """The model's parameters as its loaders see them: vLLM's record of each layer's tensors in checkpoint
    format, taken before the backend processed them (on CPU, a linear layer's weight is repacked and its
    parameter removed), else the live parameter."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    params = dict(model.named_parameters())
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            params |= {f"{name}.{p}" if name else p: meta for p, meta in info.restore_metadata[0].items()}
    return params


def _layer_cuts(
    params: dict[str, Any], modules: dict[str, Any], fused: dict[str, str], rank: RankShard, cut: TensorCut
) -> bool:
    """Whether the layer that loads checkpoint tensor `cut.name` (through vLLM's fused names: q_proj into
    qkv_proj) takes exactly `cut` of it on this rank."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    prefix, _, leaf = cut.name.rpartition(".")
    parent, _, layer = prefix.rpartition(".")
    name = f"{parent}.{fused.get(layer, layer)}" if parent else fused.get(layer, layer)
    module, param = modules.get(name), params.get(f"{name}.{leaf}")
    if (
        module is None
        or param is None
        or any(getattr(param, a, None) is not None for a in ("packed_dim", "packed_factor"))
    ):
        return False
    if isinstance(module, VocabParallelEmbedding):
        indices = module.shard_indices
        return cut.dim == 0 and (cut.begin, cut.end) == (indices.org_vocab_start_index, indices.org_vocab_end_index)
    if (getattr(module, "tp_size", None), getattr(module, "tp_rank", None)) != (rank.tp_size, rank.tp_rank):
        return False
    if getattr(module, "num_kv_head_replicas", 1) != 1:
        return False
    if isinstance(module, RowParallelLinear):
        return getattr(param, "input_dim", None) == cut.dim and param.shape[cut.dim] == cut.end - cut.begin
    if not isinstance(module, ColumnParallelLinear) or getattr(param, "output_dim", None) != cut.dim:
        return False
    return layer in fused or param.shape[cut.dim] == cut.end - cut.begin  # a fused one holds several cuts
