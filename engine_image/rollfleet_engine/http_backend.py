"""The portable weight transfer backend ``http``: workers pull safetensors over HTTP.

Lives in vLLM's worker processes (registered by ``plugin``). The handshake is vLLM's
own: ``/init_weight_transfer_engine`` (optional here), ``/start_weight_update``,
``/update_weights`` with ``{"update_info": {"url": ..., "manifest_sha256": ...}}`` (one
or more times), ``/finish_weight_update`` with ``weight_version``.

All-or-nothing: ``update_weights`` downloads and verifies every tensor into host memory
before it touches the model, then loads them; ``finish_weight_update`` finalizes and
labels. A failed transfer raises, vLLM ends the update session, the following finish is
refused, and the old weights (and version) keep serving. Weights that do not fit the
model fail in the load, after some layers took them: the error carries
``MIXED_WEIGHTS_MARK``, the engine then says it is not intact (``middleware``), and the
sidecar brings it back to one version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from rollfleet_engine.protocol import MIXED_WEIGHTS_MARK
from rollfleet_engine.reload import abandon_layerwise_reload
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
        self._loaded = False  # this session loaded verified weights: finish may label them

    def init_transfer_engine(self, init_info: HTTPInitInfo) -> None:
        """Nothing to set up; accepted so that the standard handshake works unchanged."""

    def start_weight_update(self) -> None:
        self._loaded = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also calls torch.accelerator.synchronize(), which fails on a
        # host without an accelerator; nothing here runs on a device anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: HTTPUpdateInfo) -> None:
        """Download and verify every tensor, then load them. A failure here, unlike one in finish, ends vLLM's
        update session, so the engine can take the next update."""
        weights = fetch_weights(update_info.url, update_info.manifest_sha256, update_info.timeout_s)
        logger.info("Received %d verified tensors from %s", len(weights), update_info.url)
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
