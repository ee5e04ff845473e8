"""Command line: ``python -m rollfleet_engine serve|tiny-model|model-info|wait-idle``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

USAGE = """usage: python -m rollfleet_engine <command> [args]

commands:
  serve       run the engine: vLLM's OpenAI server with Rollfleet's control API
              serve --model DIR --token-file PATH [--host H] [--port P] [...] [-- vLLM args]
              serve --model DIR --headless [...] -- vLLM args: a rank of a multi-pod engine
  tiny-model  build (once) the deterministic tiny test model and print its directory
              tiny-model [--out DIR]
  model-info  fill vLLM's model-info cache for a model's architectures (an image's build: engines then
              start without vLLM's inspection subprocess)
              model-info (--model DIR | --architecture NAME ...)
  wait-idle   wait until the engine on this host holds no request (an engine pod's preStop hook)
              wait-idle [--port P] [--timeout-s S]
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from rollfleet_engine.server import parse_serve_argv, serve

        serve(parse_serve_argv(rest))
        return 0
    if command == "tiny-model":
        from rollfleet_engine.tiny_model import ensure_tiny_model

        parser = argparse.ArgumentParser(prog="python -m rollfleet_engine tiny-model")
        parser.add_argument("--out", type=Path, default=None, help="default: $ROLLFLEET_CACHE/models/tiny-v2")
        print(ensure_tiny_model(parser.parse_args(rest).out))
        return 0
    if command == "model-info":
        from rollfleet_engine.model_info import architectures, cache_model_info

        parser = argparse.ArgumentParser(prog="python -m rollfleet_engine model-info")
        parser.add_argument("--model", type=Path, help="a model directory: the architectures its config.json names")
        parser.add_argument("--architecture", action="append", default=[], help="an architecture by name (repeatable)")
        opts = parser.parse_args(rest)
        if opts.model is None and not opts.architecture:
            parser.error("name a model directory (--model) or an architecture (--architecture)")
        names = [*(architectures(opts.model) if opts.model else []), *opts.architecture]
        print("\n".join(cache_model_info(names)))
        return 0
    if command == "wait-idle":
        from rollfleet_engine.drain import wait_idle
        from rollfleet_engine.protocol import ENGINE_PORT

        parser = argparse.ArgumentParser(prog="python -m rollfleet_engine wait-idle")
        parser.add_argument("--port", type=int, default=ENGINE_PORT)
        parser.add_argument(
            "--timeout-s", type=float, default=25.0, help="give up after this (within the grace period)"
        )
        opts = parser.parse_args(rest)
        print(wait_idle(f"http://127.0.0.1:{opts.port}", opts.timeout_s))
        return 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
