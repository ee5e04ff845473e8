"""The real engine's own acceptance, on vLLM (CPU) with the tiny model: weights (load, staging,
corrupt transfers, in-place updates). Its protocol (generation, access, abort, pause) is the contract
suite's, test_contract.py, which holds the simulator to the same answers.

Order matters only at the end: the weight update test runs last (it changes weights).
"""

from __future__ import annotations

import time

import pytest

from rollfleet_engine.protocol import STAGE_PATH, WEIGHT_VERSION_HEADER
from rollfleet_engine.tiny_model import WEIGHTS_B_DIR
from rollfleet_engine.weights_server import WeightsServer

from .calls import CACHED_PROMPT, GREEDY_PROMPTS, PROMPT, ask_cached, complete, control, load_staged, state
from .conftest import Engine

pytestmark = pytest.mark.engine


@pytest.fixture
def engine(real_engine: Engine) -> Engine:
    return real_engine


def _reference_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_weight_update_a_to_b_matches_transformers(engine: Engine) -> None:
    """vLLM lets an update run without a pause, and then nothing clears the caches of the old weights but the
    engine itself: a prompt cached before the update hits no block after it (vLLM's prefix-cache counters)."""
    prompts = GREEDY_PROMPTS
    max_tokens = 16

    def served() -> list[list[int]]:
        return [complete(engine, p, max_tokens, ignore_eos=True).json()["choices"][0]["token_ids"] for p in prompts]

    b_dir = engine.model_dir / WEIGHTS_B_DIR
    ref_a = _reference_greedy(str(engine.model_dir), prompts, max_tokens)
    ref_b = _reference_greedy(str(b_dir), prompts, max_tokens)
    assert ref_a != ref_b
    assert served() == ref_a
    cached, _ = ask_cached(engine, max_tokens)
    assert ask_cached(engine, max_tokens)[1] >= len(CACHED_PROMPT) // 2  # cached: the counters do show hits

    server = WeightsServer(b_dir, host=engine.url.split("//")[1].split(":")[0])
    server.start()
    try:
        assert control(engine, "/init_weight_transfer_engine", json={"init_info": {}}).status_code == 200
        assert control(engine, "/start_weight_update").status_code == 200
        info = server.update_info()
        assert control(engine, "/update_weights", json={"update_info": info}).status_code == 200
        assert control(engine, "/finish_weight_update", json={"weight_version": "b-1"}).status_code == 200
    finally:
        server.stop()
    # The proof of the bytes: the manifest every loaded tensor was verified against.
    assert state(engine)["weights_manifest_sha256"] == info["manifest_sha256"]
    assert served() == ref_b
    after, hit = ask_cached(engine, max_tokens)
    assert hit == 0, f"{hit} tokens of the prompt were served from blocks the old weights computed"
    assert after != cached
    assert state(engine)["weight_version"] == "b-1"
    assert complete(engine, PROMPT, 2).headers[WEIGHT_VERSION_HEADER] == "b-1"


def test_corrupt_transfer_fails_and_old_weights_keep_serving(engine: Engine) -> None:
    import torch
    from safetensors.torch import load_file

    before_version, before_manifest = (state(engine)[k] for k in ("weight_version", "weights_manifest_sha256"))
    before = complete(engine, PROMPT, 8, ignore_eos=True).json()["choices"][0]["token_ids"]
    tensors = load_file(str(engine.model_dir / "model.safetensors"))
    server = WeightsServer(tensors, host=engine.url.split("//")[1].split(":")[0])
    server.start()
    try:
        # The server references the tensors: changing one after the manifest was made
        # is exactly a corruption in transit as far as the engine can tell.
        next(iter(tensors.values())).add_(torch.ones(()))
        assert control(engine, "/start_weight_update").status_code == 200
        assert control(engine, "/update_weights", json={"update_info": server.update_info()}).status_code >= 400
        assert control(engine, "/finish_weight_update", json={"weight_version": "corrupt"}).status_code >= 400
    finally:
        server.stop()
    after = state(engine)
    assert (after["weight_version"], after["weights_manifest_sha256"]) == (before_version, before_manifest)
    assert complete(engine, PROMPT, 8, ignore_eos=True).json()["choices"][0]["token_ids"] == before


def test_prefetched_weights_load_from_the_staging_area(engine: Engine) -> None:
    """Stage while serving (POST, then GET until staged), then the handshake loads the staged copy."""
    prompts, max_tokens = [[5, 6, 7, 8], [40, 41, 42]], 12
    ref_a = _reference_greedy(str(engine.model_dir), prompts, max_tokens)
    server = WeightsServer(engine.model_dir, host=engine.url.split("//")[1].split(":")[0])
    server.start()
    try:
        info = server.update_info()
        assert control(engine, STAGE_PATH, json=info).status_code == 202
        deadline = time.monotonic() + 60
        while (staged := control(engine, STAGE_PATH, method="GET").json())["state"] == "staging":
            assert time.monotonic() < deadline, staged
            time.sleep(0.05)  # polling a condition: the engine's staging thread
        assert staged["state"] == "staged" and staged["staged_url"].startswith("file://"), staged
        # Serving goes on while staged: the engine still answers on its old weights.
        assert complete(engine, PROMPT, 2).headers[WEIGHT_VERSION_HEADER] == state(engine)["weight_version"]
    finally:
        server.stop()  # the load below reads the staging area: the weights server is not needed any more
    load_staged(engine, staged["staged_url"], info["manifest_sha256"], "a-staged")
    assert state(engine)["weight_version"] == "a-staged"
    assert [
        complete(engine, p, max_tokens, ignore_eos=True).json()["choices"][0]["token_ids"] for p in prompts
    ] == ref_a


def test_weights_that_do_not_fit_fail_the_load_and_the_engine_refuses_to_resume_until_a_full_update(
    engine: Engine,
) -> None:
    import torch
    from safetensors.torch import load_file

    prompts, max_tokens = [[5, 6, 7, 8], [40, 41, 42]], 12
    ref_a = _reference_greedy(str(engine.model_dir), prompts, max_tokens)
    host = engine.url.split("//")[1].split(":")[0]
    bad = load_file(str(engine.model_dir / "model.safetensors"))
    last = sorted(bad)[-1]  # loaded after the others: some layers take the new values first
    bad[last] = torch.zeros(bad[last].shape[0] + 1, *bad[last].shape[1:], dtype=bad[last].dtype)
    assert control(engine, "/pause", params={"mode": "keep"}).status_code == 200
    try:
        for weights, ok in ((bad, False), (engine.model_dir, True)):
            server = WeightsServer(weights, host=host)
            server.start()
            try:
                assert control(engine, "/start_weight_update").status_code == 200
                update = control(engine, "/update_weights", json={"update_info": server.update_info()})
                finish = control(engine, "/finish_weight_update", json={"weight_version": f"fit-{ok}"})
            finally:
                server.stop()
            # Every tensor verified, then the load: it fails at the tensor that does not fit.
            assert (update.status_code == 200) is ok and (finish.status_code == 200) is ok, (update.text, finish.text)
            assert state(engine)["weights_intact"] is ok
            if not ok:
                assert "do not fit the model" in update.text and "Attempted to load weight" in update.text
                refused = control(engine, "/resume")
                assert refused.status_code == 409 and "partly updated" in refused.text  # checked at the engine
    finally:
        assert control(engine, "/resume").status_code == 200
    assert state(engine)["weight_version"] == "fit-True"
    assert [
        complete(engine, p, max_tokens, ignore_eos=True).json()["choices"][0]["token_ids"] for p in prompts
    ] == ref_a
