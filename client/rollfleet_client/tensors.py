"""A trainer's in-memory tensors as one safetensors file, streamed without a copy.

The safetensors format (8-byte little-endian header length, JSON header, data section)
is what the sync sidecar spools and serves. The engine package reads it
(``rollfleet_engine.safetensors_stream``, which cannot import this distribution); a unit
test holds the two byte-for-byte equal. torch is imported only here, only when called.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

_HEADER_LEN = struct.Struct("<Q")
_CHUNK = 16 << 20
# torch dtype name -> safetensors dtype (the subset a model checkpoint uses).
TORCH_TO_SAFETENSORS = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


@dataclass(frozen=True)
class TensorFile:
    """A safetensors file laid out over the tensors' own memory: header bytes, then one buffer per tensor."""

    header: bytes
    buffers: list[memoryview]

    @property
    def size(self) -> int:
        return len(self.header) + sum(b.nbytes for b in self.buffers)

    def write_to(self, f: BinaryIO) -> None:
        """Write the file out from the tensors' own memory (no intermediate copy)."""
        f.write(self.header)
        for buf in self.buffers:
            f.write(buf)

    def chunks(self, chunk: int = _CHUNK) -> Iterator[bytes]:
        yield self.header
        for buf in self.buffers:
            for start in range(0, buf.nbytes, chunk):
                yield bytes(buf[start : start + chunk])


def tensor_file(tensors: Mapping[str, Any]) -> TensorFile:
    """Lay out tensors (moved to CPU if they are not there) as one safetensors file."""
    import torch

    header: dict[str, Any] = {}
    buffers: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        dtype = TORCH_TO_SAFETENSORS.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name; cast it (e.g. to bfloat16)")
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + raw.nbytes]}
        buffers.append(raw)
        offset += raw.nbytes
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    raw_header += b" " * (-len(raw_header) % 8)  # safetensors aligns the data section to 8 bytes
    return TensorFile(_HEADER_LEN.pack(len(raw_header)) + raw_header, buffers)
