"""Shard-aware pull without vLLM's engine: each tensor-parallel rank's cuts (``tp_slices``), the weights
server cutting and checksumming them, and the rank's pull putting them at their rows (issue 34, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollfleet_dev import oneshot
from rollfleet_engine import weights_server
from rollfleet_engine.protocol import WEIGHTS_SLICES_PATH, SlicePlan, TensorCut, WeightManifest
from rollfleet_engine.safetensors_stream import TransferError
from rollfleet_engine.tp_slices import RankShard, cut_for, rank_plan, vocab_range
from rollfleet_engine.weights_client import fetch_slices, fetch_weights
from rollfleet_engine.weights_server import WeightsServer

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 200, 16, 40, 4, 2, 4


def llama(layers: int = 2) -> dict[str, torch.Tensor]:
    """A Llama-shaped checkpoint: every kind of tensor the rules name, and a norm they do not."""
    g = torch.Generator().manual_seed(1)
    out = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.self_attn.q_proj.weight": torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g),
            f"{p}.self_attn.k_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g),
            f"{p}.self_attn.v_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g),
            f"{p}.self_attn.o_proj.weight": torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g),
            f"{p}.mlp.gate_proj.weight": torch.randn(FFN, HIDDEN, generator=g).to(torch.bfloat16),
            f"{p}.mlp.up_proj.weight": torch.randn(FFN, HIDDEN, generator=g).to(torch.bfloat16),
            f"{p}.mlp.down_proj.weight": torch.randn(HIDDEN, FFN, generator=g).to(torch.bfloat16),
            f"{p}.input_layernorm.weight": torch.randn(HIDDEN, generator=g),
        }
    return out


def rank(r: int, tp: int = 2, kv_heads: int = KV_HEADS) -> RankShard:
    return RankShard(tp_size=tp, tp_rank=r, num_kv_heads=kv_heads, vocab_size=VOCAB)


def test_the_vocabulary_is_split_as_vllm_pads_and_clamps_it() -> None:
    # vLLM's VocabParallelEmbedding: the vocabulary padded to 64, split evenly, each range clamped to the
    # real vocabulary (so a last rank may hold fewer rows, or none). The engine confirms each range against
    # the live layer's shard_indices before it pulls (http_backend), and the multipod tier loads them.
    assert [vocab_range(200, 2, r) for r in (0, 1)] == [(0, 128), (128, 200)]
    assert [vocab_range(32000, 4, r) for r in range(4)] == [(0, 8000), (8000, 16000), (16000, 24000), (24000, 32000)]
    assert [vocab_range(65, 2, r) for r in (0, 1)] == [(0, 64), (64, 65)]
    assert [vocab_range(10, 4, r) for r in range(4)] == [(0, 10), (10, 10), (10, 10), (10, 10)]


def test_each_rule_cuts_its_dimension_and_the_rest_is_whole() -> None:
    shapes = {name: list(t.shape) for name, t in llama(1).items()}
    cuts = {name: cut_for(name, shape, rank(1)) for name, shape in shapes.items()}
    assert cuts["model.layers.0.self_attn.q_proj.weight"] == TensorCut(
        name="model.layers.0.self_attn.q_proj.weight", dim=0, begin=8, end=16
    )
    assert (cuts["model.layers.0.mlp.down_proj.weight"].dim, cuts["model.layers.0.mlp.down_proj.weight"].begin) == (
        1,
        20,
    )
    assert (cuts["model.embed_tokens.weight"].begin, cuts["model.embed_tokens.weight"].end) == (128, 200)
    assert cuts["model.layers.0.input_layernorm.weight"].dim is None
    # One key-value head for two ranks: vLLM replicates it, so both ranks need all of it.
    assert cut_for("model.layers.0.self_attn.k_proj.weight", [4, HIDDEN], rank(0, kv_heads=1)).dim is None
    assert all(c.dim is None for c in (cut_for(n, s, rank(0, tp=1)) for n, s in shapes.items()))
    with pytest.raises(ValueError, match="not one of 2"):
        rank(2)


@pytest.fixture
def served(tmp_path: Path) -> tuple[WeightsServer, dict[str, torch.Tensor]]:
    tensors = llama()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    server = WeightsServer(tmp_path)
    server.start()
    yield server, tensors
    server.stop()


def test_two_ranks_pull_the_model_once_and_each_loader_finds_its_rows(
    served: tuple[WeightsServer, dict[str, torch.Tensor]],
) -> None:
    server, tensors = served
    info = server.update_info()
    pulled = {}
    for r in (0, 1):
        pulled[r] = dict(fetch_slices(info["url"], info["manifest_sha256"], 30, lambda m, r=r: rank_plan(m, rank(r))))
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    norms = sum(t.numel() * t.element_size() for n, t in tensors.items() if "norm" in n)
    # Both ranks together: the model once, the norms twice, and two headers (a few KiB each).
    assert 0 < server.bytes_sent - (model_bytes + norms) <= 2 * 4096, (server.bytes_sent, model_bytes)
    for name, full in tensors.items():
        for r in (0, 1):
            got, cut = pulled[r][name], cut_for(name, list(full.shape), rank(r))
            assert got.shape == full.shape and got.dtype == full.dtype
            if cut.dim is None:
                assert torch.equal(got, full), name
            else:  # what the rank's loader narrows to: its rows, exactly
                n = cut.end - cut.begin
                assert torch.equal(got.narrow(cut.dim, cut.begin, n), full.narrow(cut.dim, cut.begin, n)), name
    # The whole pull still works beside it, and sends every byte.
    before = server.bytes_sent
    assert dict(fetch_weights(info["url"], info["manifest_sha256"], 30)).keys() == tensors.keys()
    assert server.bytes_sent - before > model_bytes


def test_a_plan_that_is_wrong_is_refused_with_the_reason(served: tuple[WeightsServer, dict[str, torch.Tensor]]) -> None:
    server, _ = served
    sha = server.update_info()["manifest_sha256"]
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        (SlicePlan(manifest_sha256="0" * 64, cuts=[]).model_dump_json(), 409, "other weights"),
        (SlicePlan(manifest_sha256=sha, cuts=[TensorCut(name="nope")]).model_dump_json(), 400, "no tensor 'nope'"),
        (
            SlicePlan(manifest_sha256=sha, cuts=[TensorCut(name=q, dim=2, begin=0, end=1)]).model_dump_json(),
            400,
            "no rows",
        ),
        (
            SlicePlan(manifest_sha256=sha, cuts=[TensorCut(name=q, dim=0, begin=4, end=99)]).model_dump_json(),
            400,
            "no rows",
        ),
        (
            SlicePlan(manifest_sha256=sha, cuts=[TensorCut(name=q), TensorCut(name=q)]).model_dump_json(),
            400,
            "more than once",
        ),
        (json.dumps({"manifest_sha256": sha, "cuts": [{"name": q, "dim": -1}]}), 400, "not a slice plan"),
        ("{", 400, "not a slice plan"),
    ]
    for body, status, said in cases:
        r = oneshot.post(server.url + WEIGHTS_SLICES_PATH, content=body)
        assert r.status_code == status and said in r.json()["error"], (body, r.text)
    assert oneshot.get(server.url + WEIGHTS_SLICES_PATH + "/0123").status_code == 404  # no plan made it


def test_weights_written_over_after_hashing_are_refused_not_sliced(
    served: tuple[WeightsServer, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    server, tensors = served
    info = server.update_info()
    save_file({n: t * 2 for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TransferError, match="changed since it was hashed"):
        fetch_slices(info["url"], info["manifest_sha256"], 30, lambda m: rank_plan(m, rank(0)))


@pytest.mark.parametrize("settled", [True, False])
def test_a_plan_hashes_whole_tensors_again_unless_the_files_stamp_vouches_for_them(
    settled: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Files untouched for _SETTLED_NS before the stamp taken for the manifest: their stamp vouches for the
    # bytes, and a plan hashes only its cuts (each rank's plan would otherwise hash the whole model again).
    monkeypatch.setattr(weights_server, "_SETTLED_NS", 0 if settled else 10**18)
    tensors = llama(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    server = WeightsServer(tmp_path)
    server.start()
    hashed: list[int] = []
    real = weights_server.tensor_checksum
    monkeypatch.setattr(weights_server, "tensor_checksum", lambda data: hashed.append(len(data)) or real(data))
    try:
        info = server.update_info()
        got = dict(fetch_slices(info["url"], info["manifest_sha256"], 30, lambda m: rank_plan(m, rank(1))))
    finally:
        server.stop()
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    # Vouched for: the rank's cuts alone (about half the model); otherwise every whole tensor too.
    assert (sum(hashed) < model_bytes) is settled, (sum(hashed), model_bytes)
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], tensors["model.layers.0.input_layernorm.weight"])


def test_a_server_that_offers_other_slices_than_planned_is_refused(
    served: tuple[WeightsServer, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = served
    info = server.update_info()
    original = WeightManifest.model_validate_json

    def another_layout(raw: bytes | str) -> WeightManifest:
        manifest = original(raw)
        if manifest.shards[0].path.startswith(WEIGHTS_SLICES_PATH):  # the answer to the plan, tampered
            manifest.shards[0].tensors[0].shape = [1, 1]
        return manifest

    monkeypatch.setattr(WeightManifest, "model_validate_json", another_layout)
    with pytest.raises(TransferError, match="not the ones planned"):
        fetch_slices(info["url"], info["manifest_sha256"], 30, lambda m: rank_plan(m, rank(0)))
