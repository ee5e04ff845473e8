"""On a CPU host the engine core and its worker start as the engine says (fork), not as vLLM's CPU platform
would have it (spawn): `rollfleet_engine.server.keep_start_method`, checked against vLLM's own config check."""

from __future__ import annotations

import os

import pytest

from rollfleet_engine.server import CPU_ENV_DEFAULTS, keep_start_method
from rollfleet_engine.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine

METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def check_engine_config() -> None:
    """What vLLM does before it starts the engine core: build the engine's config, which the platform checks."""
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(model=str(ensure_tiny_model()), enforce_eager=True, max_model_len=512).create_engine_config()


def test_the_engine_core_is_forked_on_cpu_where_vllm_would_spawn_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.cpu import CpuPlatform

    # Restored after the test: the engine patches vLLM's CPU platform for its whole process.
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", CpuPlatform.__dict__["check_and_update_config"])
    monkeypatch.setenv(METHOD, CPU_ENV_DEFAULTS[METHOD])
    check_engine_config()
    assert os.environ[METHOD] == "spawn"  # vLLM's own, whatever the environment said

    monkeypatch.setenv(METHOD, CPU_ENV_DEFAULTS[METHOD])
    keep_start_method()
    check_engine_config()
    assert os.environ[METHOD] == "fork"
