"""Engine-side pull of a weights server's snapshot: manifest, then every shard, verified.

A tensor-parallel rank of an engine whose ranks span pods pulls only its part of each tensor
(``fetch_slices``, with a plan from ``tp_slices``): the server cuts the parts and checksums them from
bytes it first checked against the pinned manifest; the rank checks the layout against its plan and
every part against those checksums.

Uses only the standard library's HTTP client: each tensor is read straight from the
socket into its own buffer (one copy) and checked before it is handed on. A ``file://``
URL is weights this engine staged and verified beforehand (``staging``): read from its
staging area, which is memory, without checking again.
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rollfleet_engine.mappings import Mappings
from rollfleet_engine.pinning import cuda_pinning
from rollfleet_engine.protocol import (
    STAGED_URL_SCHEME,
    STAGING_DIR_ENV,
    WEIGHTS_MANIFEST_PATH,
    WEIGHTS_SLICES_PATH,
    Shard,
    SlicePlan,
    TensorCut,
    WeightManifest,
)
from rollfleet_engine.safetensors_stream import TransferError, read_shard, sha256_hex, tensors_from_buffer, torch_dtype
from rollfleet_engine.tp_slices import cut_shape

MANIFEST_FILE = "manifest.json"
_QUOTED_BYTES = 300  # of a refusal's body, in the error


@contextmanager
def http_get(
    url: str,
    path: str,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    window: tuple[int, int] | None = None,
) -> Iterator[http.client.HTTPResponse]:
    """An open GET of `path` under the weights server (or engine relay) at `url`; refused unless it answers 200, or
    with `window`, bytes ``[begin, end)`` of it (a Range: 206)."""
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"weights URL must be http://host:port, got {url!r}")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    sent = dict(headers or {})
    if window is not None:
        sent["Range"] = f"bytes={window[0]}-{window[1] - 1}"
    try:
        conn.request("GET", parts.path + path, headers=sent)
        resp = conn.getresponse()
        if resp.status != (200 if window is None else 206):
            said = resp.read(_QUOTED_BYTES).decode("utf-8", "replace")
            raise TransferError(f"GET {url}{path}: HTTP {resp.status}: {said}")
        yield resp
    finally:
        conn.close()


def check_manifest(raw: bytes, manifest_sha256: str | None) -> WeightManifest:
    if manifest_sha256 is not None and hashlib.sha256(raw).hexdigest() != manifest_sha256:
        raise TransferError("manifest sha256 differs from the one in update_info (server serves other weights)")
    return WeightManifest.model_validate_json(raw)


def fetch_manifest(
    url: str, manifest_sha256: str | None, timeout_s: float, headers: Mapping[str, str] | None = None
) -> tuple[bytes, WeightManifest]:
    with http_get(url, WEIGHTS_MANIFEST_PATH, timeout_s, headers) as resp:
        raw = resp.read()
    return raw, check_manifest(raw, manifest_sha256)


def check_length(resp: http.client.HTTPResponse, shard: Shard, window: tuple[int, int] | None = None) -> None:
    expected = shard.size if window is None else window[1] - window[0]
    if resp.length is not None and resp.length != expected:
        raise TransferError(f"{shard.path}: {resp.length} bytes offered, manifest says {expected}")


def fetch_weights(url: str, manifest_sha256: str | None, timeout_s: float) -> list[tuple[str, Any]]:
    """Every tensor of the weights at `url`, each verified; raise on any mismatch."""
    if urlsplit(url).scheme == STAGED_URL_SCHEME:
        return load_staged(Path(urlsplit(url).path), manifest_sha256)
    _, manifest = fetch_manifest(url, manifest_sha256, timeout_s)
    weights: list[tuple[str, Any]] = []
    for shard in manifest.shards:
        with http_get(url, shard.path, timeout_s) as resp:
            check_length(resp, shard)
            weights.extend(read_shard(resp.readinto, shard))
    return weights


Planner = Callable[[WeightManifest], list[TensorCut]]


def fetch_slices(url: str, manifest_sha256: str | None, timeout_s: float, plan: Planner) -> list[tuple[str, Any]]:
    """The tensors of the weights at `url` that `plan` names, each at its full shape with only its cut
    received and verified (the rest of it is never read by the loader that asked for the cut); raise on
    any mismatch."""
    raw, manifest = fetch_manifest(url, manifest_sha256, timeout_s)
    cuts = plan(manifest)
    entries = {t.name: t for shard in manifest.shards for t in shard.tensors}
    body = SlicePlan(manifest_sha256=sha256_hex(raw), cuts=cuts).model_dump_json().encode()
    parts = urlsplit(url.rstrip("/"))
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", parts.path + WEIGHTS_SLICES_PATH, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise TransferError(f"POST {url}{WEIGHTS_SLICES_PATH}: HTTP {resp.status}: {answer[:_QUOTED_BYTES]!r}")
    (shard,) = WeightManifest.model_validate_json(answer).shards
    # The server gives the checksums; the layout must be the plan's, of the manifest this rank pinned.
    planned = [(c.name, entries[c.name].dtype, cut_shape(entries[c.name], c)) for c in cuts]
    if [(t.name, t.dtype, t.shape) for t in shard.tensors] != planned:
        raise TransferError(f"{url}: the slices offered are not the ones planned")
    # Each cut is received straight into a tensor of the full shape, at the rows a tensor-parallel loader
    # narrows to (`_cut_target`); whole tensors as they come.
    import torch

    targets = {c.name: _cut_target(entries[c.name], c) for c in cuts if c.dim is not None}

    def rows_of(entry: Any) -> memoryview | None:  # a TensorEntry of the slices' shard
        target = targets.get(entry.name)
        return None if target is None else memoryview(target[1].view(torch.uint8).numpy())

    with http_get(url, shard.path, timeout_s) as resp:
        check_length(resp, shard)
        received = read_shard(resp.readinto, shard, rows_of)
    return [(name, targets[name][0] if name in targets else part) for name, part in received]


def _cut_target(entry: Any, cut: Any) -> tuple[Any, Any]:
    """A tensor of `entry`'s full shape whose `cut` is one contiguous run of memory, and that run (1-D).

    Its strides are the cut's own, contiguous, over a buffer of the cut with room before and after it, so
    ``full.narrow(cut.dim, cut.begin, width)`` is the run: what a loader narrows to is received in place,
    without a copy, and only the cut's memory is touched. Outside the cut the tensor is never written (for
    dimension 0, untouched pages of a tensor of the full size) or aliases the cut's own memory (other
    dimensions): neither is read by the loader that asked for the cut."""
    import torch

    shape, dim = list(entry.shape), cut.dim
    inner = math.prod(shape[dim + 1 :])
    part_shape = cut_shape(entry, cut)
    strides = [math.prod(part_shape[i + 1 :]) for i in range(len(part_shape))]
    before, size, after = cut.begin * inner, math.prod(part_shape), (shape[dim] - cut.end) * inner
    buffer = torch.empty(before + size + after, dtype=torch_dtype(entry.dtype))
    return buffer.as_strided(shape, strides), buffer.narrow(0, before, size)


def staging_root() -> Path:
    """Where engines stage weights (``ROLLFLEET_STAGING_DIR``; else memory at /dev/shm, else /tmp). Each
    engine stages in a directory of its own below it (``runtime.default_stager``)."""
    configured = os.environ.get(STAGING_DIR_ENV)
    if configured:
        return Path(configured)
    return Path("/dev/shm/rollfleet-staging") if Path("/dev/shm").is_dir() else Path("/tmp/rollfleet-staging")


def load_staged(directory: Path, manifest_sha256: str | None) -> list[tuple[str, Any]]:
    """The tensors of weights staged in `directory`: only inside this engine's staging area, and only the
    manifest the caller names (every tensor was checked against it when staged)."""
    root = staging_root().resolve()
    directory = directory.resolve()
    if root not in directory.parents:
        raise TransferError(f"{directory} is not in this engine's staging area {root}")
    try:
        manifest = check_manifest((directory / MANIFEST_FILE).read_bytes(), manifest_sha256)
    except FileNotFoundError:
        raise TransferError(f"nothing is staged at {directory}; stage the weights again") from None
    files = [directory / shard_file(i) for i in range(len(manifest.shards))]
    loaded = _loaded_mappings()
    loaded.keep_only(files)  # the set loaded before, unless these are its files written over
    weights: list[tuple[str, Any]] = []
    for file, shard in zip(files, manifest.shards, strict=True):
        # The staging area is memory (tmpfs): no copy until the model's own. The mapping is shared
        # and kept (``mappings``): a loader that writes into a tensor writes into a set that is
        # released after this load anyway. On a GPU the mapping is page-locked (``pinning``).
        data = loaded.view(file)
        if len(data) != shard.size:
            raise TransferError(f"{file}: {len(data)} bytes, manifest says {shard.size}")
        weights.extend(tensors_from_buffer(data, shard))
    return weights


@functools.cache
def _loaded_mappings() -> Mappings:
    """This process's mappings of the staging files it loads from. Made at the first load, in vLLM's
    worker: the process that holds the GPU, if there is one."""
    return Mappings(pinning=cuda_pinning())


def shard_file(index: int) -> str:
    return f"shard-{index}.safetensors"
