"""vLLM's model-info cache, filled when an engine image is built, so that an engine's start skips vLLM's inspection
subprocess.

Before it serves a model, vLLM inspects the model's class (is it a text generation model, does it take
multimodal inputs, ...) in a subprocess of its own, so that the API server never touches CUDA; that subprocess
imports torch and vLLM again: several CPU-seconds of every engine's start (measured on kind: docs/engine.md). vLLM
keeps the answer in `$VLLM_CACHE_ROOT/modelinfos/`, keyed by a hash of the model's source file, and inspects
again only on a miss. A container starts with the image's filesystem, so a cache written at the image's build
holds for every engine of that image, and a cache written at an engine's start is lost with its container.
Talks to vLLM's model registry only.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from pathlib import Path


def architectures(model_dir: Path) -> list[str]:
    """The architectures a Hugging Face model directory's config.json names."""
    config = model_dir / "config.json"
    try:
        names = json.loads(config.read_text())["architectures"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"{config}: no readable 'architectures' list ({err}); pass --architecture instead") from err
    return [str(n) for n in names]


def cache_model_info(names: Iterable[str]) -> list[str]:
    """Inspect each architecture as vLLM does before it serves one, which writes vLLM's cache; the names cached.
    An architecture vLLM does not know is an error that names the closest it knows."""
    from vllm.model_executor.models.registry import ModelRegistry

    done = []
    for name in names:
        model = ModelRegistry.models.get(name)
        if model is None:
            closest = difflib.get_close_matches(name, list(ModelRegistry.models), n=3, cutoff=0)
            raise SystemExit(
                f"vLLM has no architecture {name!r}: it knows {len(ModelRegistry.models)}, the closest {closest}"
            )
        model.inspect_model_cls()
        done.append(name)
    return done
