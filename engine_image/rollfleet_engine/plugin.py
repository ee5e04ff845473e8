"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the ``http`` backend.

vLLM calls this in every process it starts (API server, engine core, workers). The
backend module is registered by path so that it is only imported where used.
"""

from __future__ import annotations

from rollfleet_engine.protocol import HTTP_WEIGHT_BACKEND


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # register_engine refuses duplicates, and plugins may be loaded more than once.
    if HTTP_WEIGHT_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            HTTP_WEIGHT_BACKEND, "rollfleet_engine.http_backend", "HTTPWeightTransferEngine"
        )
