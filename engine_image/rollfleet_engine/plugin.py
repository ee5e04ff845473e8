"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the ``http`` and ``gloo`` backends,
and swaps vLLM's ``nccl`` worker engine for one that recovers from a failed update.

vLLM calls this in every process it starts (API server, engine core, workers); a trainer
process calls it through ``vllm.plugins.load_general_plugins``. Backend modules are
registered by path so that they are only imported where used.
"""

from __future__ import annotations

from rollfleet_engine.protocol import GLOO_WEIGHT_BACKEND, HTTP_WEIGHT_BACKEND

_WORKER_ENGINES = {
    HTTP_WEIGHT_BACKEND: ("rollfleet_engine.http_backend", "HTTPWeightTransferEngine"),
    GLOO_WEIGHT_BACKEND: ("rollfleet_engine.collective_backend", "GlooWeightTransferEngine"),
}
# vLLM's own nccl worker engine, with recovery from a failed update (collective_backend says why).
_REPLACED_WORKER_ENGINES = {"nccl": ("rollfleet_engine.collective_backend", "RecoveringNCCLWeightTransferEngine")}
_TRAINER_ENGINES = {
    GLOO_WEIGHT_BACKEND: ("rollfleet_engine.collective_backend", "GlooTrainerWeightTransferEngine"),
}


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    # register_engine refuses duplicates, and plugins may be loaded more than once.
    for factory, engines in (
        (WeightTransferEngineFactory, _WORKER_ENGINES),
        (WeightTransferTrainerFactory, _TRAINER_ENGINES),
    ):
        for name, (module, cls) in engines.items():
            if name not in factory._registry:
                factory.register_engine(name, module, cls)
    for name, (module, cls) in _REPLACED_WORKER_ENGINES.items():
        # register_engine refuses a name taken, so the entry is replaced (lazily loaded, as vLLM's).
        WeightTransferEngineFactory._registry.pop(name, None)
        WeightTransferEngineFactory.register_engine(name, module, cls)


def check() -> None:
    """The engine images' build check: vLLM loads this plugin through its entry point, and every backend
    it registers imports against this vLLM build (``hack/images.sh``)."""
    import importlib

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    for factory, engines in (
        (WeightTransferEngineFactory, _WORKER_ENGINES | _REPLACED_WORKER_ENGINES),
        (WeightTransferTrainerFactory, _TRAINER_ENGINES),
    ):
        for name, (module, cls) in engines.items():
            ours = getattr(importlib.import_module(module), cls)
            loader = factory._registry.get(name)
            if loader is None or loader() is not ours:
                raise SystemExit(f"vLLM's {factory.__name__} does not create {module}.{cls} for {name!r}")
            print(f"{factory.__name__} {name}: {module}.{cls}")
