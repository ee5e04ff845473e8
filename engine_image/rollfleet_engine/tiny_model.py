"""The tiny model: a deterministic random-weight Llama for tests and the demo.

Owns building (no download, a few seconds) and locating the model. The layout under
``$ROLLFLEET_CACHE/models/tiny-v2/`` is:

- ``./`` weight set A, a complete Hugging Face model directory that vLLM serves;
- ``./weights-b/`` weight set B (another seed), also a complete model directory, so
  that a reference implementation can load it directly and the weights server can
  serve its safetensors for an update test.

The sizes are the smallest that vLLM's CPU attention backend accepts (head_dim 64). The
context is long (``TINY_MODEL_CONTEXT``) so that a test can start a generation the engine
core cannot finish before the test acts on it (abort, pause); it costs nothing until used.
Weights are float32 so that vLLM and transformers agree on greedy decoding token for
token; the init scale is raised so that the top logit is well separated from the next.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is heavy: imported only when a model is built
    from transformers import PreTrainedTokenizerFast

TINY_MODEL_NAME = "tiny-v2"
# Where the model is on a node: the CPU engine image bakes it there (engine_image/Dockerfile.cpu)
# and the samples' hostPath volumes read it (manifests/samples/); the local cluster keeps that
# node directory in the cache (see rollfleet_dev/localcluster/pools.yaml).
NODE_MODEL_DIR = f"/var/lib/rollfleet/models/{TINY_MODEL_NAME}"
WEIGHTS_B_DIR = "weights-b"
TINY_MODEL_CONTEXT = 32_768  # tokens (max_position_embeddings); engines serve it all (--max-model-len)
# A generation that tests act on (abort, pause) while it runs. The engine core runs well ahead
# of the stream (on a loaded 2-core host it decodes 2,000 tokens in ~4 s, which a client sees
# over ~14 s), so a token a client has seen does not prove its request still runs; 30,000 tokens
# of growing context keep the core busy for over a minute, and an abort lands within a second.
LONG_GENERATION = 30_000
SEED_A = 1234
SEED_B = 5678
_MARKER = ".complete"

# Text the byte-level BPE is trained on; fixed so that the vocabulary is deterministic.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from human feedback trains a policy with rollouts.",
    "A rollout engine samples completions; the trainer updates the weights.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "user: what is two plus two?\nassistant: two plus two is four.",
    "Kubernetes runs pods on nodes; an operator reconciles custom resources.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?",
]
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
_VOCAB_SIZE = 300
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cache_root() -> Path:
    """Where Rollfleet caches what it builds (``$ROLLFLEET_CACHE``, default ~/.cache/rollfleet)."""
    return Path(os.environ.get("ROLLFLEET_CACHE", Path.home() / ".cache" / "rollfleet"))


def default_model_dir() -> Path:
    return cache_root() / "models" / TINY_MODEL_NAME


def ensure_tiny_model(out: Path | None = None) -> Path:
    """Build the tiny model into ``out`` unless a complete build is already there; return it.

    Builds into a temporary sibling and renames it into place, so concurrent builders
    (several test sessions on one machine) never see a half-written model.
    """
    target = out or default_model_dir()
    if (target / _MARKER).exists():
        _make_readable(target)  # a build made before this rule
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build(tmp)
        (tmp / _MARKER).write_text("1\n")
        _make_readable(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another builder won the race (or a stale incomplete dir exists).
            if not (target / _MARKER).exists():
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(root: Path) -> None:
    """Readable by every user: pods that mount it from a node directory may run as non-root (the sync
    sidecar, uid 65532, reads the second weight set), and the model holds no secret."""
    for path in [root, *root.rglob("*")]:
        mode = 0o755 if path.is_dir() else 0o644
        if path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def _build(root: Path) -> None:
    tokenizer = _train_tokenizer()
    _write_model(root, tokenizer, SEED_A)
    _write_model(root / WEIGHTS_B_DIR, tokenizer, SEED_B)


def _train_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def _write_model(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=TINY_MODEL_CONTEXT,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # No sampling defaults: vLLM would otherwise apply them to every request.
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    (out / "rollfleet-tiny.json").write_text(json.dumps({"name": TINY_MODEL_NAME, "seed": seed}) + "\n")
