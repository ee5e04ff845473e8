"""The collective weight transfer backends: vLLM's ``nccl``, made to recover, and its CPU twin ``gloo``.

With a collective backend the trainer process is rank 0 of a group with the engines'
workers and broadcasts every tensor (``rollfleet_client.collective`` drives it).

- ``RecoveringNCCLWeightTransferEngine`` is vLLM's NCCL worker engine, able to take the
  next update after one that failed midway; the plugin registers it as ``nccl``.
- ``gloo`` runs the same protocol over torch's gloo on CPU, so that the collective path
  runs, and is tested, on hosts without GPUs. Both of its sides subclass vLLM's NCCL
  engines and keep their handshake, their update info (names, dtypes, shapes) and their
  checks; only the communicator differs: ``GlooCommunicator`` offers the two calls the
  NCCL engines make on ``PyNcclCommunicator`` (``broadcast``, ``destroy``).

Lives in vLLM's worker processes (registered by ``plugin`` for the engine) and in the
trainer process (the gloo trainer engine, registered for vLLM's trainer factory by the
same plugin, loaded with ``vllm.plugins.load_general_plugins``). Tensors are loaded as
they arrive (layerwise reload), so an update that fails midway leaves the model mixed:
the engine marks itself not intact until a full update finishes (``middleware``).
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from rollfleet_engine.protocol import GLOO_WEIGHT_BACKEND, MIXED_WEIGHTS_MARK
from rollfleet_engine.reload import abandon_layerwise_reload

logger = init_logger(__name__)

DEFAULT_TIMEOUT_S = 300.0


class GlooCommunicator:
    """A gloo group of its own with a TCPStore rendezvous: torch's default group is vLLM's, not ours."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        # Rank 0 (the trainer) hosts the store; the constructor returns once every rank has joined.
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_address_towards(master_address, rank))]
        self._group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(self._store, rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """In place, as PyNcclCommunicator.broadcast (``stream`` is accepted for its signature and unused)."""
        if self._group is None:
            raise RuntimeError("the gloo group was destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._group.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self._group = None  # gloo closes its pairs when the group is collected


def _address_towards(master_address: str, rank: int) -> str:
    """The local address peers reach this rank on: the one the route to the trainer leaves from."""
    if rank == 0:
        return master_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_address, 9))  # UDP: picks the route, sends nothing
        address: str = s.getsockname()[0]
        return address


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker side: the trainer's rendezvous, this engine's first rank, and the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side, as vLLM's NCCLTrainerInitInfo: the sender opens the rendezvous as rank 0."""

    backend: ClassVar[str] = GLOO_WEIGHT_BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


class RecoveringNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL worker engine, able to take the next update after one that failed midway.

    vLLM's layerwise reload keeps what a failed update buffered, and its next update would
    load that first; this engine drops it (``reload.abandon_layerwise_reload``). The plugin
    registers it as ``nccl`` in place of vLLM's own class.
    """

    def start_weight_update(self) -> None:
        abandon_layerwise_reload(self.model)  # what a failed update left half-loaded
        super().start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self._update(update_info)
        except Exception:
            abandon_layerwise_reload(self.model)
            raise

    def _update(self, update_info: dict[str, Any]) -> None:
        super().update_weights(update_info)


class GlooWeightTransferEngine(RecoveringNCCLWeightTransferEngine):
    """The same engine (start, finish, shutdown: layerwise reload) on a gloo group."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        # A fleet re-forms its group when its engines change; the previous one is left behind.
        self.shutdown()
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset  # as nccl_common
        self.model_update_group = GlooCommunicator(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )
        logger.info("Joined the weight transfer group as rank %d of %d", rank, init_info.world_size)

    def _update(self, update_info: dict[str, Any]) -> None:
        # vLLM's update_weights also calls torch.accelerator.synchronize(), which fails without an accelerator.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        group = self.model_update_group
        if group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        refused: tuple[str, Exception] | None = None
        with disable_mtp_completeness_check():
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            ):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                group.broadcast(weight, src=0)
                if refused is None:
                    try:
                        self.model.load_weights([(name, weight)])
                    except Exception as err:
                        refused = (name, err)
        # A rank that stopped receiving would hang every other rank until the timeout, so a
        # tensor the model refuses is reported only after the whole broadcast was received.
        if refused is not None:
            culprit, cause = refused
            raise ValueError(
                f"{MIXED_WEIGHTS_MARK} the pushed weights do not fit the model: {culprit!r}: {cause}"
            ) from cause


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine (send_weights, its checks and RPC order) on a gloo group, unpacked."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        worker_init = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        # The workers block in init until every rank has joined: rendezvous on both sides at once.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, vars(worker_init))
            engine.model_update_group = GlooCommunicator(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
            )
            joined.result()
        return engine

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
        if not self.is_sender:
            for _ in source:
                pass
            return
        group = self.model_update_group
        assert group is not None, "trainer_init() must be called before _broadcast()"
        for _name, tensor in self._checked_iter(source, meta):
            group.broadcast(tensor.detach().to("cpu").contiguous(), src=0)
