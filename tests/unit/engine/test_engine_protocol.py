"""The gateway and operator import the protocol: it must not pull in vLLM or torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollfleet_engine.server import parse_serve_argv, vllm_argv


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
