"""GPU load benchmark: staged weights (host memory) into GPU memory, next to torch's own copies.

The pause of a prefetched push covers the load from the staging area into the model
(docs/weight-sync.md). On a GPU engine that load is a host-to-device copy, tensor by tensor,
from a memory file mapped shared. This measures it in one run, in GiB/s, over ``--gib`` of
bf16 tensors shaped like the decoder layers of a 7-8B model:

1. ``pinned``: one page-locked torch buffer to the device (the 51 GiB/s of the issue);
2. ``pageable``: one ordinary torch buffer to the device;
3. ``staged_pageable``: the staging file mapped by the engine's ``Mappings``, each tensor
   copied into its own device tensor, as a model loader does (``param.copy_``);
4. ``staged_pinned``: the same through ``Mappings`` with the engine's ``CudaPinning``: the
   mapping registered with CUDA once (``pin_s``, paid at an engine's first load), then every
   load after it.

Needs CUDA and torch only (the engine package's ``mappings`` and ``pinning`` are imported
from ``engine_image``). Without a GPU it says so, and ``--json`` records why.

Usage: PYTHONPATH=engine_image python -m bench.bench_gpu_load [--gib 4] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollfleet_engine.mappings import Mappings
from rollfleet_engine.pinning import cuda_pinning

GIB = 1 << 30
_ALIGN = 64
_HIDDEN, _KV, _FFN = 4096, 1024, 14336  # Llama-3-8B's decoder layer (grouped-query attention)
_LAYER = [
    ("q_proj", (_HIDDEN, _HIDDEN)),
    ("k_proj", (_KV, _HIDDEN)),
    ("v_proj", (_KV, _HIDDEN)),
    ("o_proj", (_HIDDEN, _HIDDEN)),
    ("gate_proj", (_FFN, _HIDDEN)),
    ("up_proj", (_FFN, _HIDDEN)),
    ("down_proj", (_HIDDEN, _FFN)),
    ("input_layernorm", (_HIDDEN,)),
    ("post_attention_layernorm", (_HIDDEN,)),
]
_BF16_BYTES = 2


def layout(gib: float) -> list[tuple[int, tuple[int, ...]]]:
    """``(offset, shape)`` of whole decoder layers' bf16 tensors, until `gib` is reached. Pure."""
    tensors: list[tuple[int, tuple[int, ...]]] = []
    offset = 0
    while offset < gib * GIB:
        for _, shape in _LAYER:
            tensors.append((offset, shape))
            nbytes = _BF16_BYTES * math.prod(shape)
            offset += -(-nbytes // _ALIGN) * _ALIGN
    return tensors


def staging_dir(needed: int) -> Path:
    """A memory file system with room for `needed` bytes, as an engine's staging area is."""
    for candidate in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        if candidate.is_dir() and shutil.disk_usage(candidate).free > needed + GIB:
            return Path(tempfile.mkdtemp(prefix="rf-bench-gpu-", dir=candidate))
    raise SystemExit(f"no file system here has {needed / GIB:.1f} GiB free for the staging file; pass a smaller --gib")


def timed(torch: Any, copy: Callable[[], None], repeats: int) -> float:
    """Median seconds of `copy`, the device synchronized before and after each."""
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def one_buffer_s(torch: Any, size: int, *, pinned: bool, repeats: int) -> float:
    """Seconds to copy one host buffer of `size` bytes to the device in one call."""
    host = torch.ones(size, dtype=torch.uint8)
    if pinned:
        host = host.pin_memory()
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    return timed(torch, lambda: device.copy_(host), repeats)


def measure(gib: float, repeats: int) -> dict[str, Any]:
    import torch

    pinning = cuda_pinning()
    if pinning is None:
        return {"skipped": "no CUDA device: run it on a GPU machine"}
    tensors = layout(gib)
    size = tensors[-1][0] + _BF16_BYTES * math.prod(tensors[-1][1])
    total_gib = size / GIB
    params = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _, shape in tensors]
    figures: dict[str, Any] = {"gib": round(total_gib, 3), "tensors": len(tensors)}
    figures["device"] = torch.cuda.get_device_name()
    figures["pinned_gib_s"] = total_gib / one_buffer_s(torch, size, pinned=True, repeats=repeats)
    figures["pageable_gib_s"] = total_gib / one_buffer_s(torch, size, pinned=False, repeats=repeats)

    directory = staging_dir(size)
    file = directory / "shard-0.safetensors"
    try:
        writer = Mappings()  # the stager's: the bytes land in the file's pages
        torch.frombuffer(writer.view(file, size), dtype=torch.uint8).fill_(1)

        def loads(mappings: Mappings) -> Callable[[], None]:
            def load() -> None:
                data = mappings.view(file)
                for param, (offset, shape) in zip(params, tensors, strict=True):
                    nbytes = _BF16_BYTES * math.prod(shape)
                    host = torch.frombuffer(data[offset : offset + nbytes], dtype=torch.bfloat16)
                    param.copy_(host.view(shape))

            return load

        figures["staged_pageable_gib_s"] = total_gib / timed(torch, loads(Mappings()), repeats)
        pinned = Mappings(pinning)
        start = time.perf_counter()
        pinned.view(file)
        figures["pin_s"] = time.perf_counter() - start
        figures["staged_pinned_gib_s"] = total_gib / timed(torch, loads(pinned), repeats)
        pinned.keep_only([])
    finally:
        shutil.rmtree(directory)
    figures["staged_pinned_over_pinned"] = figures["staged_pinned_gib_s"] / figures["pinned_gib_s"]
    figures["staged_pinned_over_staged_pageable"] = figures["staged_pinned_gib_s"] / figures["staged_pageable_gib_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="weights to load (whole decoder layers)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    figures = measure(args.gib, args.repeats)
    for name, value in figures.items():
        print(f"{name:38} {value:,.3f}" if isinstance(value, float) else f"{name:38} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
