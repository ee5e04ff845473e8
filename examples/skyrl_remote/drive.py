"""SkyRL's own remote inference client driving a RolloutFleet's gateway as its one vLLM server.

SkyRL's remote-server mode (``run_engines_locally=False``, ``external_server_urls``) talks to vLLM
servers through ``RemoteInferenceClient``: generation on ``/inference/v1/generate`` (token ids in
and out, logprobs), and pause (``/pause?mode=keep|abort|wait``), resume, prefix-cache reset and
world size on each server. Pointed at the gateway (proxy and server URL alike), every one of
those calls acts on the whole fleet: a pause is the fleet's (its status says so), an abort ends
requests at the engines with the tokens they made.

The gateway asks for a credential; SkyRL's client has no setting for one, so it goes in the URL
(``http://skyrl:<token>@host:port``: aiohttp sends it as HTTP Basic auth, and the gateway takes a
Basic password as a bearer token). The admin token: pause and resume are control calls.

One JSON line per step on stdout. SkyRL 0.3.0 does not import on Python 3.11 as released (its
``skyrl.backends`` package imports a pydantic model built on ``typing.TypedDict``, which pydantic
refuses below Python 3.12); the client module itself does not need that package's ``__init__``,
so ``load_client`` imports the module past it (docs/frameworks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import types
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import skyrl
from transformers import AutoTokenizer

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
RESUBMITTED = 8  # tokens asked of the aborted request's continuation
IN_FLIGHT_METRIC = "rollfleet_gateway_in_flight"  # requests this gateway replica runs (docs/gateway.md)


def load_client() -> Any:
    """SkyRL's ``RemoteInferenceClient`` module, imported without running ``skyrl/backends/__init__.py``."""
    backends = types.ModuleType("skyrl.backends")
    backends.__path__ = [str(Path(skyrl.__file__).parent / "backends")]
    sys.modules.setdefault("skyrl.backends", backends)
    from skyrl.backends.skyrl_train.inference_servers import remote_inference_client

    return remote_inference_client


def with_token(url: str, token: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"skyrl:{token}@{parts.netloc}"))


async def requests_running(gateway_url: str, at_least: int = 1, timeout_s: float = 120.0) -> None:
    """Wait until the gateway runs `at_least` requests (its open /metrics): a pause must meet them running."""
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:
        async with asyncio.timeout(timeout_s):
            while True:
                metrics = (await http.get("/metrics")).text
                line = next(m for m in metrics.splitlines() if m.startswith(IN_FLIGHT_METRIC + " "))
                if float(line.split()[1]) >= at_least:
                    return
                await asyncio.sleep(0.05)  # polling a condition


def emit(step: str, **facts: Any) -> None:
    print(json.dumps({"step": step, **facts}, default=str), flush=True)


async def drive(args: argparse.Namespace) -> int:
    ric = load_client()
    url = with_token(args.gateway_url, args.token)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    client = ric.RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=args.served_name, tokenizer=tokenizer
    )
    sampling = {"temperature": 1.0, "logprobs": 0}
    long = {"prompt_token_ids": [[1, 2, 3]], "sampling_params": {"max_tokens": args.long, "ignore_eos": True}}
    async with client:
        total, per_server = await client.get_world_size()
        emit("world_size", total=total, per_server=per_server)

        out = await client.generate({"prompt_token_ids": PROMPTS, "sampling_params": {**sampling, "max_tokens": 16}})
        emit(
            "generate",
            lengths=[len(ids) for ids in out["response_ids"]],
            logprobs=[len(lp or []) for lp in out["response_logprobs"] or []],
            stop_reasons=out["stop_reasons"],
        )

        # keep: a running request is frozen where it is, and goes on after resume with nothing lost.
        task = asyncio.create_task(client.generate(long))
        await requests_running(args.gateway_url)
        paused = await client.pause(mode=ric.PauseMode.KEEP)
        frozen = not task.done()
        resumed = await client.resume()
        out = await task
        emit(
            "pause_keep",
            pause_status=[r["status"] for r in paused.values()],
            frozen_while_paused=frozen,
            resume_status=[r["status"] for r in resumed.values()],
            tokens=len(out["response_ids"][0]),
            stop_reason=out["stop_reasons"][0],
        )

        # abort: a running request ends with the tokens it made; SkyRL resubmits prompt + tokens after resume
        # (a few more tokens here: the continuation is the point, not its length).
        task = asyncio.create_task(client.generate(long))
        await requests_running(args.gateway_url)
        await client.pause(mode=ric.PauseMode.ABORT)
        aborted = await task
        await client.resume()
        partial = aborted["response_ids"][0]
        rest = await client.generate(
            {
                "prompt_token_ids": [long["prompt_token_ids"][0] + partial],
                "sampling_params": {"max_tokens": RESUBMITTED, "ignore_eos": True},
            }
        )
        emit(
            "pause_abort",
            stop_reason=aborted["stop_reasons"][0],
            partial_tokens=len(partial),
            resubmitted_tokens=len(rest["response_ids"][0]),
            final_stop_reason=rest["stop_reasons"][0],
        )

        reset = await client.reset_prefix_cache()
        emit("reset_prefix_cache", status=[r["status"] for r in reset.values()])
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateway-url", required=True, help="the fleet's gateway")
    p.add_argument("--token-file", required=True, help="the fleet's admin token (pause and resume are control)")
    p.add_argument("--served-name", default="tiny", help="the fleet's spec.model.servedName")
    p.add_argument("--model-dir", required=True, help="the tokenizer SkyRL detokenizes with")
    p.add_argument("--long", type=int, default=6000, help="tokens of the request that a pause meets mid-way")
    args = p.parse_args(argv)
    args.token = Path(args.token_file).read_text().strip()
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(drive(parse())))
