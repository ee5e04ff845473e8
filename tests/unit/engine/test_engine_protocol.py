"""The gateway and operator import the protocol: it must not pull in vLLM or torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollfleet_engine.server import parse_serve_argv, pipeline_problem, vllm_argv


def test_protocol_imports_without_vllm_or_torch() -> None:
    code = (
        "import sys, rollfleet_engine.protocol, rollfleet_engine.access, rollfleet_engine.tracker;"
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_argv_split_and_defaults() -> None:
    opts = parse_serve_argv(
        ["--model", "/m", "--host", "127.1.2.3", "--port", "9", "--token-file", "/t", "--", "--dtype", "float32"]
    )
    assert opts.served_model_name == "/m" and opts.vllm_args == ["--dtype", "float32"]
    argv = vllm_argv(opts, on_cpu=True)
    assert argv[-2:] == ["--dtype", "float32"]  # user arguments come last, so they win
    assert "--weight-transfer-config" in argv and "--enforce-eager" in argv
    assert "--enable-scale-out" in argv  # the generate route that failover continues through
    assert "--enforce-eager" not in vllm_argv(opts, on_cpu=False)


def test_the_token_file_is_required_except_for_a_headless_rank() -> None:
    with pytest.raises(SystemExit, match="serve needs --token-file"):
        parse_serve_argv(["--model", "/m"])
    rank = parse_serve_argv(["--model", "/m", "--headless", "--", "--nnodes", "2", "--node-rank", "1"])
    assert rank.headless and rank.token_file is None
    assert vllm_argv(rank, on_cpu=True)[-4:] == ["--nnodes", "2", "--node-rank", "1"]  # the rank's own, last
    assert not parse_serve_argv(["--model", "/m", "--token-file", "/t"]).headless


def test_more_pipeline_stages_than_layers_are_refused_before_vllm_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    problem = pipeline_problem(str(tmp_path), ["--enforce-eager", "--pipeline-parallel-size", "4"])
    assert problem is not None and "4 is more stages than the model's 2 layers" in problem
    assert pipeline_problem(str(tmp_path), ["--pipeline-parallel-size=2"]) is None
    assert pipeline_problem(str(tmp_path), ["-pp", "3", "--pipeline-parallel-size", "1"]) is None  # the last wins
    assert "not 'x'" in (pipeline_problem(str(tmp_path), ["-pp", "x"]) or "")
    nested = tmp_path / "vl"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 1}}))
    assert pipeline_problem(str(nested), ["-pp", "2"]) is not None
    assert pipeline_problem("org/hub-model", ["-pp", "64"]) is None  # not a local directory: vLLM's to judge
