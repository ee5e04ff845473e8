"""The safetensors wire format, streamed: build shards and manifests, read and verify them.

A shard is a byte-exact safetensors file (8-byte little-endian header length, JSON
header, data section). The manifest lists every shard with an XXH3-128 checksum per
tensor, so the reader checks each tensor as it arrives and a corrupt or truncated
transfer fails before anything reaches the model. The manifest itself is pinned by its
sha256, which the sidecar hands each engine over the authenticated control route.

Why a checksum and not a cryptographic hash: every byte of every push is hashed once by
the sidecar and once per engine, and BLAKE3 cost 0.25 s of CPU per GiB on each (XXH3:
0.05 s). A cryptographic digest would only matter against a peer that forges bytes, and
the peers of a relay chain are engines that hold the fleet's control token: one that is
compromised can already tell every other engine to load anything. What the checksums
guard against is corruption and truncation, which XXH3-128 catches.

torch is imported lazily: the manifest side of this module is usable without it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from rollfleet_engine.protocol import Shard, TensorEntry, WeightManifest

HEADER_LEN = struct.Struct("<Q")
# torch dtype name -> safetensors dtype (the subset a model checkpoint uses).
_TORCH_TO_ST = {
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
_ST_TO_TORCH = {v: k for k, v in _TORCH_TO_ST.items()}


class TransferError(RuntimeError):
    """The weights that arrived are not the weights the manifest promised."""


def manifest_bytes(manifest: WeightManifest) -> bytes:
    """Canonical serialization; its sha256 pins a manifest (``WeightUpdateInfo.manifest_sha256``)."""
    return json.dumps(manifest.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_checksum(data: bytes | bytearray | memoryview | mmap.mmap) -> str:
    """A tensor's XXH3-128 (hex); releases the GIL, so tensors are checked on threads beside the transfer."""
    return xxhash.xxh3_128(data).hexdigest()


def safetensors_header(entries: list[TensorEntry]) -> bytes:
    """A shard's bytes before its data section: the header's length, then the header (padded to 8)."""
    header = {e.name: {"dtype": e.dtype, "shape": e.shape, "data_offsets": list(e.data_offsets)} for e in entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return HEADER_LEN.pack(len(raw)) + raw


@dataclass(frozen=True)
class MemoryShard:
    """A shard built from in-memory tensors: header bytes plus one buffer per tensor."""

    shard: Shard
    header: bytes
    buffers: list[memoryview]


def shard_from_tensors(tensors: Mapping[str, Any], path: str) -> MemoryShard:
    """Lay out CPU tensors as one safetensors shard (the tensors are not copied twice)."""
    entries, buffers, offset = [], [], 0
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        dtype = _TORCH_TO_ST.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        raw = memoryview(t.reshape(-1).view(_torch().uint8).numpy()).cast("B")
        entries.append(
            TensorEntry(
                name=name,
                dtype=dtype,
                shape=list(t.shape),
                data_offsets=(offset, offset + raw.nbytes),
                xxh3_128=tensor_checksum(raw),
            )
        )
        buffers.append(raw)
        offset += raw.nbytes
    header = safetensors_header(entries)
    return MemoryShard(Shard(path=path, size=len(header) + offset, tensors=entries), header, buffers)


Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)


def read_layout(directory: Path) -> Layout:
    """Every tensor's dtype and shape in the .safetensors files of `directory`, from their headers only."""
    layout: Layout = {}
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            (n,) = HEADER_LEN.unpack(f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        layout.update({name: (meta["dtype"], tuple(meta["shape"])) for name, meta in header.items()})
    return layout


def shard_from_file(file: Path, path: str) -> Shard:
    """Describe an existing .safetensors file (reads it once to checksum every tensor, on every core)."""
    with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        (n,) = HEADER_LEN.unpack_from(data, 0)
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        base = 8 + n
        ordered = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        for name, meta in ordered:
            if base + meta["data_offsets"][1] > len(data):
                raise TransferError(f"{file}: truncated in tensor {name}")
        view = memoryview(data)

        def checksum(meta: dict[str, Any]) -> str:
            begin, end = meta["data_offsets"]
            return tensor_checksum(view[base + begin : base + end])

        try:
            with ThreadPoolExecutor(max_workers=os.cpu_count(), thread_name_prefix="xxh3") as pool:
                sums = list(pool.map(checksum, (meta for _, meta in ordered)))
        finally:
            view.release()
    entries = [
        TensorEntry(
            name=name, dtype=meta["dtype"], shape=meta["shape"], data_offsets=tuple(meta["data_offsets"]), xxh3_128=sum_
        )
        for (name, meta), sum_ in zip(ordered, sums, strict=True)
    ]
    return Shard(path=path, size=file.stat().st_size, tensors=entries)


ReadInto = Callable[[memoryview], int]


def _read_exact(read_into: ReadInto, view: memoryview, what: str) -> None:
    """Fill `view` from the stream."""
    got, n = 0, len(view)
    while got < n:
        k = read_into(view[got:])
        if not k:
            raise TransferError(f"stream ended after {got} of {n} bytes of {what} (truncated transfer)")
        got += k


def _tensor_entries(header: dict[str, Any], shard: Shard) -> list[TensorEntry]:
    """The manifest's tensors in the order of their bytes, once the shard's own header agrees with them."""
    header.pop("__metadata__", None)
    expected = {e.name: e for e in shard.tensors}
    if set(header) != set(expected):
        raise TransferError(f"{shard.path}: tensors differ from the manifest")
    entries, position = sorted(shard.tensors, key=lambda e: e.data_offsets[0]), 0
    for entry in entries:
        meta = header[entry.name]
        if (meta["dtype"], list(meta["shape"]), tuple(meta["data_offsets"])) != (
            entry.dtype,
            entry.shape,
            tuple(entry.data_offsets),
        ):
            raise TransferError(f"{shard.path}: header of {entry.name} differs from the manifest")
        if entry.data_offsets[0] < position:
            raise TransferError(f"{shard.path}: overlapping tensor {entry.name}")
        position = entry.data_offsets[1]
    return entries


def _header_length(raw: bytes | bytearray | memoryview, shard: Shard) -> int:
    (n,) = HEADER_LEN.unpack(raw)
    if 8 + n > shard.size:
        raise TransferError(f"{shard.path}: header length {n} exceeds the shard size {shard.size}")
    return int(n)


def _check_sums(received: list[tuple[TensorEntry, Future[str]]]) -> None:
    for entry, checksum in received:
        _check_sum(entry, checksum.result())


def _check_sum(entry: TensorEntry, checksum: str) -> None:
    if checksum != entry.xxh3_128:
        raise TransferError(f"{entry.name}: checksum mismatch (corrupt transfer)")


def read_shard(
    read_into: ReadInto, shard: Shard, into: Callable[[TensorEntry], memoryview | None] | None = None
) -> list[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor of a shard stream, each in a buffer of its own (or the one `into`
    gives for it: its bytes land there, and the tensor is a view of it) and checked against the manifest
    (pulled in the pause: the load copies each tensor into the model and frees it).

    Checksums run on a second thread while the next tensor is received (xxhash releases
    the GIL), so verification costs little wall time. Nothing is returned unless every
    tensor verified.
    """
    torch = _torch()

    def take(n: int, what: str) -> bytearray:
        buf = bytearray(n)
        _read_exact(read_into, memoryview(buf), what)
        return buf

    n = _header_length(take(8, "header length"), shard)
    entries = _tensor_entries(json.loads(bytes(take(n, "header"))), shard)
    received: list[tuple[TensorEntry, Future[str]]] = []
    tensors, position = [], 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="xxh3") as hasher:
        for entry in entries:
            begin, end = entry.data_offsets
            if begin > position:
                take(begin - position, "padding")
            target = into(entry) if into is not None else None
            if target is None:
                data: bytearray | memoryview = take(end - begin, entry.name)
            else:
                data = target
                _read_exact(read_into, data, entry.name)
            received.append((entry, hasher.submit(tensor_checksum, data)))
            tensors.append((entry.name, _tensor(torch, data, entry)))
            position = end
    _check_sums(received)
    return tensors


# Bytes are received into a staging file in pieces of at most this much, each reported as it lands:
# a relay forwards them on as they arrive, not a whole tensor (hundreds of MiB in a large model) at once.
PIECE_BYTES = 1 << 20


def second_half(size: int) -> int:
    """Where the second half of a shard of `size` bytes begins, for a staging from two upstreams (the sync sidecar's
    two relay trees, each carrying one half of every shard): the piece boundary nearest below the middle. A shard
    of under two pieces is all first half (`size`)."""
    return size // 2 // PIECE_BYTES * PIECE_BYTES if size >= 2 * PIECE_BYTES else size


def parse_byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The bytes ``[begin, end)`` of a resource of `size` bytes that an HTTP ``Range`` header asks for (one range,
    ``bytes=B-E`` or ``bytes=B-``), or None for no header. ValueError for any other form, or a range past `size`:
    a relay answers 416 then."""
    if header is None:
        return None
    unit, _, spec = header.strip().partition("=")
    first, dash, last = spec.partition("-")
    if unit.strip().lower() != "bytes" or not dash or not first.strip().isdigit() or "," in spec:
        raise ValueError(f"only one range of bytes, bytes=B-E, is served: got Range {header[:80]!r}")
    begin = int(first)
    end = int(last) + 1 if last.strip().isdigit() else size if not last.strip() else -1
    if not 0 <= begin < end <= size:
        raise ValueError(f"Range {header[:80]!r} is not within the {size} bytes served")
    return begin, end


def receive_shard(read_into: ReadInto, shard: Shard, into: memoryview, progress: Callable[[int], object]) -> None:
    """Read a whole shard stream into `into` (``shard.size`` bytes: a mapped staging file), checking its header
    and every tensor's checksum against the manifest; `progress(bytes so far)` after every piece.

    The bytes land once, where they stay (no buffer per tensor, no second copy); each tensor is
    checked on a second thread while the next one arrives.
    """
    if len(into) != shard.size:
        raise ValueError(f"{shard.path}: {len(into)} bytes to receive into, manifest says {shard.size}")
    position = 0

    def take_until(end: int, what: str) -> None:
        nonlocal position
        while position < end:
            piece = min(PIECE_BYTES, end - position)
            _read_exact(read_into, into[position : position + piece], what)
            position += piece
            progress(position)

    take_until(8, "header length")
    n = _header_length(into[:8], shard)
    take_until(8 + n, "header")
    entries = _tensor_entries(json.loads(bytes(into[8 : 8 + n])), shard)
    received: list[tuple[TensorEntry, Future[str]]] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="xxh3") as hasher:
        for entry in entries:
            begin, end = (8 + n + offset for offset in entry.data_offsets)
            take_until(end, entry.name)
            received.append((entry, hasher.submit(tensor_checksum, into[begin:end])))
        take_until(shard.size, "trailing bytes")
    _check_sums(received)


def receive_range(
    read_into: ReadInto, into: memoryview, begin: int, end: int, progress: Callable[[int], object]
) -> None:
    """Read bytes ``[begin, end)`` of a shard into `into` (the whole shard's mapped staging file), piece by piece;
    `progress(end of the bytes so far)` after every piece. Checked afterwards, whole (`check_shard`)."""
    position = begin
    while position < end:
        piece = min(PIECE_BYTES, end - position)
        _read_exact(read_into, into[position : position + piece], f"bytes {begin}-{end}")
        position += piece
        progress(position)


def check_shard(data: memoryview, shard: Shard) -> None:
    """Check a whole shard in memory (received in parts: `receive_range`) against the manifest: its header, and
    every tensor's checksum. TransferError on any mismatch."""
    if len(data) != shard.size:
        raise TransferError(f"{shard.path}: {len(data)} bytes received, manifest says {shard.size}")
    n = _header_length(data[:8], shard)
    for entry in _tensor_entries(json.loads(bytes(data[8 : 8 + n])), shard):
        begin, end = (8 + n + offset for offset in entry.data_offsets)
        _check_sum(entry, tensor_checksum(data[begin:end]))


def tensors_from_buffer(data: bytearray | memoryview, shard: Shard) -> list[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor of a whole shard already in memory (verified when it was
    written: ``staging``), each a view of `data`."""
    torch = _torch()
    (n,) = HEADER_LEN.unpack_from(data, 0)
    base = 8 + n
    view = memoryview(data)
    return [
        (e.name, _tensor(torch, view[base + e.data_offsets[0] : base + e.data_offsets[1]], e)) for e in shard.tensors
    ]


def torch_dtype(safetensors_dtype: str) -> Any:
    """The torch dtype of a safetensors dtype name."""
    return getattr(_torch(), _ST_TO_TORCH[safetensors_dtype])


def _tensor(torch: Any, data: bytearray | memoryview, entry: TensorEntry) -> Any:
    dtype = torch_dtype(entry.dtype)
    tensor = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
    return tensor.reshape(entry.shape)


def _torch() -> Any:
    import torch

    return torch
