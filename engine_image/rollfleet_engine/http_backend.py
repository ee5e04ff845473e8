"""The portable weight transfer backend ``http``: workers pull safetensors over HTTP.

Lives in vLLM's worker processes (registered by ``plugin``). The handshake is vLLM's
own: ``/init_weight_transfer_engine`` (optional here), ``/start_weight_update``,
``/update_weights`` with ``{"update_info": {"url": ..., "manifest_sha256": ...}}`` (one
or more times), ``/finish_weight_update`` with ``weight_version``.

All-or-nothing: ``update_weights`` only downloads and verifies into host memory; the
model is touched in ``finish_weight_update``, after every tensor has passed its sha256
check. A failed transfer raises, vLLM ends the update session, the following finish is
refused, and the old weights (and version) keep serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from rollfleet_engine.weights_client import fetch_weights

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
        self._staged: list[tuple[str, torch.Tensor]] = []

    def init_transfer_engine(self, init_info: HTTPInitInfo) -> None:
        """Nothing to set up; accepted so that the standard handshake works unchanged."""

    def start_weight_update(self) -> None:
        self._staged = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also calls torch.accelerator.synchronize(), which fails on a
        # host without an accelerator; nothing here runs on a device anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: HTTPUpdateInfo) -> None:
        weights = fetch_weights(update_info.url, update_info.manifest_sha256, update_info.timeout_s)
        logger.info("Received %d verified tensors from %s", len(weights), update_info.url)
        self._staged.extend(weights)

    def finish_weight_update(self) -> None:
        staged, self._staged = self._staged, []
        if not staged:
            raise RuntimeError("no verified weights were received in this update; the version is not recorded")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        # Layerwise reload re-runs each layer's post-load processing (the CPU backend
        # repacks linear weights), so the new values reach the kernels actually used.
        initialize_layerwise_reload(self.model)
        with disable_mtp_completeness_check():
            self.model.load_weights(staged)
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._staged = []
