"""Shard-aware weight pull: which bytes of each checkpoint tensor one tensor-parallel rank needs.

A rank of an engine whose ranks span pods pulls its weights in the pause, from the sync sidecar's
weights server. Pulling every tensor whole moves the model once per pod; a rank only ever loads its
own part of most tensors. This module decides that part (``rank_plan``, pure, by the checkpoint's
names and the model's shape) and cuts it out of a tensor's bytes (``cut_bytes``, for the server, which
slices row-parallel tensors itself so that a rank receives only its columns).

The rules are those of vLLM's tensor-parallel layers for the Llama family of checkpoints (Llama,
Qwen2/3, Mistral: the names below):

- column parallel (``q/k/v_proj``, ``gate/up_proj``, weight and bias): rows ``[r*n/tp, (r+1)*n/tp)``;
  ``k/v_proj`` only when the key-value heads divide among the ranks (otherwise vLLM replicates heads);
- row parallel (``o_proj``, ``down_proj`` weights): the same range of columns (dimension 1);
- vocabulary parallel (``embed_tokens``, ``lm_head``): the rank's range of the vocabulary padded to
  vLLM's 64, as ``VocabParallelEmbedding`` computes it;
- everything else (norms, row-parallel biases, unknown names) whole.

A rule is a proposal: the engine confirms each cut against the live model's layers before it pulls
(``http_backend``), and pulls a tensor whole wherever they disagree. Issue 34 (docs/weight-sync.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollfleet_engine.protocol import TensorCut, TensorEntry, WeightManifest

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
_COLUMN = (".q_proj.", ".gate_proj.", ".up_proj.")
_KV = (".k_proj.", ".v_proj.")
_ROW = (".o_proj.weight", ".down_proj.weight")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
# Bytes per element of each safetensors dtype.
ITEMSIZE = {
    "F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


@dataclass(frozen=True)
class RankShard:
    """One tensor-parallel rank of a model: what decides its cuts."""

    tp_size: int
    tp_rank: int
    num_kv_heads: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"rank {self.tp_rank} is not one of {self.tp_size} tensor-parallel ranks")


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The rows of the vocabulary a rank holds: vLLM pads the vocabulary to VOCAB_PADDING, splits it evenly,
    and clamps each range to the real vocabulary."""
    padded = math.ceil(vocab_size / VOCAB_PADDING) * VOCAB_PADDING
    per_rank = padded // tp_size
    return min(tp_rank * per_rank, vocab_size), min((tp_rank + 1) * per_rank, vocab_size)


def cut_for(name: str, shape: list[int], rank: RankShard) -> TensorCut:
    """The part of tensor `name` (of this `shape` in the checkpoint) that `rank` loads."""
    whole = TensorCut(name=name)
    if rank.tp_size == 1:
        return whole
    if name.endswith(_VOCAB) and len(shape) == 2 and shape[0] == rank.vocab_size:
        begin, end = vocab_range(rank.vocab_size, rank.tp_size, rank.tp_rank)
        # A rank past the end of a small vocabulary holds none of it (its loader narrows to nothing).
        return TensorCut(name=name, dim=0, begin=begin, end=end) if begin < end else whole
    column = any(part in name for part in _COLUMN) or (
        any(part in name for part in _KV) and rank.num_kv_heads % rank.tp_size == 0
    )
    row = name.endswith(_ROW) and len(shape) == 2
    dim = 0 if column else 1 if row else None
    if dim is None or not shape or shape[dim] % rank.tp_size:
        return whole
    size = shape[dim] // rank.tp_size
    return TensorCut(name=name, dim=dim, begin=rank.tp_rank * size, end=(rank.tp_rank + 1) * size)


def rank_plan(manifest: WeightManifest, rank: RankShard) -> list[TensorCut]:
    """A cut of every tensor of `manifest` for `rank` (whole where no rule splits it)."""
    return [cut_for(t.name, t.shape, rank) for shard in manifest.shards for t in shard.tensors]


def cut_shape(entry: TensorEntry, cut: TensorCut) -> list[int]:
    """The shape of `cut` of the tensor `entry`; raises ValueError for a cut the tensor does not have."""
    if cut.dim is None:
        return list(entry.shape)
    if cut.dim >= len(entry.shape) or not cut.begin < cut.end <= entry.shape[cut.dim]:
        raise ValueError(
            f"{entry.name}: no rows [{cut.begin}, {cut.end}) of dimension {cut.dim} in shape {entry.shape}"
        )
    return [*entry.shape[: cut.dim], cut.end - cut.begin, *entry.shape[cut.dim + 1 :]]


def cut_run(entry: TensorEntry, cut: TensorCut) -> tuple[int, int] | None:
    """Where `cut` lies in the tensor's bytes (row-major) when it is one run of them (the whole tensor,
    dimension 0, or every dimension before it of size 1): its first and last byte offsets; else None."""
    size = math.prod(entry.shape) * ITEMSIZE[entry.dtype]
    if cut.dim is None:
        return 0, size
    if math.prod(entry.shape[: cut.dim]) != 1:
        return None
    inner = math.prod(entry.shape[cut.dim + 1 :]) * ITEMSIZE[entry.dtype]
    return cut.begin * inner, cut.end * inner


def cut_bytes(data: memoryview, entry: TensorEntry, cut: TensorCut) -> memoryview | bytes:
    """The bytes of `cut` of a tensor whose bytes are `data` (row-major): a view where they are one run,
    else gathered, one block per outer row."""
    if (run := cut_run(entry, cut)) is not None:
        return data[run[0] : run[1]]
    assert cut.dim is not None  # a whole tensor is one run
    shape = entry.shape
    inner = math.prod(shape[cut.dim + 1 :]) * ITEMSIZE[entry.dtype]
    row, first, last = shape[cut.dim] * inner, cut.begin * inner, cut.end * inner
    return b"".join(data[o * row + first : o * row + last] for o in range(math.prod(shape[: cut.dim])))
