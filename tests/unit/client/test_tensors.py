"""The client's safetensors writer against the engine's reader and the safetensors library."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from rollfleet_client.tensors import TORCH_TO_SAFETENSORS, tensor_file
from rollfleet_engine import safetensors_stream


def test_the_streamed_file_is_the_engines_shard_byte_for_byte_and_loads_with_safetensors() -> None:
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1, 2, 3], dtype=torch.int64),
        "h": torch.ones(5, dtype=torch.bfloat16)[::2],  # not contiguous
    }
    out = tensor_file(tensors)
    raw = b"".join(out.chunks(chunk=7))
    engine = safetensors_stream.shard_from_tensors(tensors, "/shards/0")
    assert raw == engine.header + b"".join(bytes(b) for b in engine.buffers)
    assert out.size == len(raw) == engine.shard.size
    loaded = load(raw)
    assert all(torch.equal(loaded[name], t.contiguous()) for name, t in tensors.items())


def test_the_dtype_names_are_the_engines() -> None:
    assert TORCH_TO_SAFETENSORS == safetensors_stream._TORCH_TO_ST


def test_a_dtype_without_a_safetensors_name_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="cast it"):
        tensor_file({"c": torch.zeros(2, dtype=torch.complex64)})
