"""vLLM's model-info cache filled ahead of an engine's start (`rollfleet_engine.model_info`, what the CPU image's
build runs): vLLM inspects the tiny model's architecture in a subprocess of its own once, when the cache is filled,
and never again for an engine that finds the cache."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollfleet_engine.model_info import architectures, cache_model_info
from rollfleet_engine.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine


def test_a_filled_cache_spares_vllm_its_inspection_subprocess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from vllm.model_executor.models import registry

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    inspected: list[Callable[[], Any]] = []
    subprocess_of_vllm = registry._run_in_subprocess
    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: inspected.append(fn) or subprocess_of_vllm(fn))
    [name] = architectures(ensure_tiny_model())

    assert cache_model_info([name]) == [name]
    assert len(inspected) == 1  # an empty cache: vLLM's own subprocess inspected the class
    [cached] = (tmp_path / "modelinfos").iterdir()
    assert json.loads(cached.read_text())["modelinfo"]["is_text_generation_model"] is True

    # What an engine's start asks the registry (not memoized: the class's own inspection), now from the cache.
    registry.ModelRegistry.models[name].inspect_model_cls()
    assert len(inspected) == 1


def test_bad_input_is_refused_with_what_to_do(tmp_path: Path) -> None:
    def model_info(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "rollfleet_engine", "model-info", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    none = model_info()
    assert none.returncode == 2 and "name a model directory (--model) or an architecture" in none.stderr
    no_config = model_info("--model", str(tmp_path))
    assert no_config.returncode == 1 and "pass --architecture instead" in no_config.stderr
    with pytest.raises(SystemExit, match=r"no architecture 'NoSuchForCausalLM': it knows \d+, the closest \['"):
        cache_model_info(["NoSuchForCausalLM"])
