"""Ending a vLLM layerwise reload that will not finish, so that the engine can take the next update.

vLLM's layerwise reload (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``)
buffers each layer's tensors until the layer is complete. An update that fails midway
leaves those buffers (and layers still on the meta device) behind, and the next update
would load them first. Both weight backends of this package call this when an update
fails, and the collective ones at every start.
"""

from __future__ import annotations

import torch


def abandon_layerwise_reload(model: torch.nn.Module) -> None:
    """End a layerwise reload that will not finish: layers still waiting for tensors get their current
    weights back, and drop what they buffered (else the next update would load it). Layers already
    complete keep the new values, so the model is mixed: the engine stays not intact until a full update.
    vLLM has no public call for this (finalize would load the partial buffers), hence its helpers."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        _get_original_loader,
        _place_kernel_tensors,
        get_layerwise_info,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        for tensor in get_layer_tensors(layer).values():
            tensor.weight_loader = _get_original_loader(tensor)
        info.reset()
