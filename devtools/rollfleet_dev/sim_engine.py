"""A fast vLLM-compatible engine simulator, for router benchmarks and the gateway's unit tests only.

Serves the shapes vLLM 0.32 serves (`/v1/completions`, `/v1/chat/completions`,
`/inference/v1/generate`, streaming and not, with `token_ids`/`prompt_token_ids`),
plus the Rollfleet engine's truthful abort (`POST /rollfleet/v1/abort`), its view of one
request (`GET /rollfleet/v1/requests/{id}`, a TrackedRequest) and weight
version header. Output is deterministic: token i of a request is `(prompt_len + i) % 97 + 3`,
its text is `t<id> ` and its logprob (when asked) `-(id % 7) / 4`. Knobs: `token_delay_ms`
(before each token) and `die_after` (route -> cut the connection after that many tokens,
streamed or not, like an engine that died); `streamed` holds the ids it was asked to
stream. As a fleet's engine (`python -m rollfleet_dev.sim_engine serve ... --port N`, the
operator's engine arguments; bench/bench_requests.py) it also answers the engine's state,
readiness, pause and resume routes, with no token checked.

Never a stand-in for the real engine in acceptance tests: those run real vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import time
from typing import Any

import orjson
from aiohttp import web

from rollfleet_engine.protocol import (
    PAUSE_PATH,
    READY_PATH,
    RESUME_PATH,
    STATE_PATH,
    EngineState,
    PauseMode,
    parse_pause_mode,
)

Json = dict[str, Any]


class SimEngine:
    def __init__(
        self,
        name: str = "sim",
        token_delay_ms: float = 0.0,
        weight_version: str = "v1",
        die_after: dict[str, int] | None = None,
    ) -> None:
        self.name = name
        self.token_delay_ms = token_delay_ms
        self.die_after = die_after or {}
        # Routes answered 404: like vLLM without --enable-scale-out, or an engine whose abort cannot be had.
        self.refuse: set[str] = set()
        self.weight_version = weight_version
        self.running: dict[str, asyncio.Event] = {}  # caller id -> abort flag
        self.finished: dict[str, str] = {}  # caller id -> finish reason
        self.versions: dict[str, list[str]] = {}  # caller id -> weight versions that produced its tokens
        self.served = 0
        self.streamed: set[str] = set()
        self.pause_mode: PauseMode | None = None
        self.instance = secrets.token_hex(4)

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate"):
            app.router.add_post(path, self.generate)
        app.router.add_post("/rollfleet/v1/abort", self.abort)
        app.router.add_get("/rollfleet/v1/requests/{rid}", self.tracked)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get(STATE_PATH, self.state)
        app.router.add_get(READY_PATH, self.health)
        app.router.add_post(PAUSE_PATH, self.pause)
        app.router.add_post(RESUME_PATH, self.resume)
        return app

    async def state(self, request: web.Request) -> web.Response:
        state = EngineState(
            model=self.name,
            weight_version=self.weight_version,
            paused=self.pause_mode is not None,
            pause_mode=self.pause_mode,
            running=len(self.running),
            waiting=0,
            instance=self.instance,
        )
        return web.json_response(state.model_dump(mode="json"))

    async def pause(self, request: web.Request) -> web.Response:
        self.pause_mode = parse_pause_mode(request.query.get("mode")) or "abort"
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        self.pause_mode = None
        return web.json_response({})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def tracked(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        if rid not in self.versions:
            return web.json_response({"detail": "unknown"}, status=404)
        phase = "running" if rid in self.running else "finished"
        return web.json_response(
            {
                "request_id": rid,
                "phase": phase,
                "finish_reason": self.finished.get(rid),
                "weight_versions": self.versions[rid],
            }
        )

    def _produced(self, rid: str) -> None:
        seen = self.versions.setdefault(rid, [])
        if self.weight_version not in seen:
            seen.append(self.weight_version)

    async def abort(self, request: web.Request) -> web.Response:
        if request.path in self.refuse:
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        results = {}
        for rid in body["request_ids"]:
            if rid in self.running:
                self.running[rid].set()
                for _ in range(200):
                    if rid in self.finished:
                        break
                    await asyncio.sleep(0.005)
            reason = self.finished.get(rid)
            results[rid] = "unknown" if reason is None else ("aborted" if reason == "abort" else "finished")
        return web.json_response({"results": results})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        path = request.path
        if path in self.refuse:
            return web.json_response({"detail": "Not Found"}, status=404)
        rid = request.headers.get("X-Request-Id") or f"sim-{self.served}"
        if rid in self.running:
            return web.json_response({"error": f"request id {rid!r} is still in flight"}, status=409)
        self.served += 1
        delay = self.token_delay_ms / 1000
        die_after = self.die_after.get(path, -1)
        if path == "/inference/v1/generate":
            prompt = list(body["token_ids"])
            max_tokens = int(body.get("sampling_params", {}).get("max_tokens") or 16)
        elif path == "/v1/chat/completions":
            prompt = [1] + [ord(c) % 97 + 3 for m in body["messages"] for c in str(m.get("content", ""))]
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        else:
            p = body["prompt"]
            prompt = list(p) if isinstance(p, list) else [ord(c) % 97 + 3 for c in p]
            max_tokens = int(body.get("max_tokens") or 16)
        if path == "/inference/v1/generate":
            want = body.get("sampling_params", {}).get("logprobs") is not None
        else:
            want = body.get("logprobs") is not None and body.get("logprobs") is not False  # 0 asks for them
        flag = asyncio.Event()
        self.running[rid] = flag
        try:
            if body.get("stream"):
                self.streamed.add(rid)
                return await self._stream(request, path, body, rid, prompt, max_tokens, delay, die_after, flag, want)
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            return await self._whole(request, path, rid, prompt, max_tokens, delay, die_after, flag, want, as_ids)
        finally:
            self.running.pop(rid, None)
            self.finished.setdefault(rid, "abort")

    @staticmethod
    def logprob(token: int) -> float:
        return -(token % 7) / 4

    def logprobs_of(self, path: str, tokens: list[int], as_ids: bool) -> Json:
        """vLLM's logprobs of the sampled tokens: completions' shape, or chat's (also the token-in route's);
        tokens named `token_id:N` when the request asked `return_tokens_as_token_ids`."""
        names = [f"token_id:{t}" if as_ids else f"t{t} " for t in tokens]
        values = [self.logprob(t) for t in tokens]
        if path == "/v1/completions":
            top = [{name: v} for name, v in zip(names, values, strict=True)]
            return {"tokens": names, "token_logprobs": values, "top_logprobs": top, "text_offset": []}
        return {
            "content": [
                {"token": name, "logprob": v, "bytes": None, "top_logprobs": []}
                for name, v in zip(names, values, strict=True)
            ]
        }

    def _headers(self, rid: str) -> dict[str, str]:
        return {"X-Request-Id": rid, "X-Rollfleet-Weight-Version": self.weight_version}

    async def _whole(
        self,
        request: web.Request,
        path: str,
        rid: str,
        prompt: list[int],
        n: int,
        delay: float,
        die_after: int,
        flag: asyncio.Event,
        want: bool,
        as_ids: bool,
    ) -> web.Response:
        tokens: list[int] = []
        for i in range(n):
            if i == die_after:
                assert request.transport is not None
                request.transport.close()  # an engine that died before it answered
                raise asyncio.CancelledError
            if flag.is_set():
                break
            if delay:
                await asyncio.sleep(delay)
            tokens.append((len(prompt) + i) % 97 + 3)
            self._produced(rid)
        reason = "abort" if flag.is_set() else "length"
        self.finished[rid] = reason
        text = "".join(f"t{t} " for t in tokens)
        choice: Json = {"index": 0, "finish_reason": reason, "token_ids": tokens}
        choice["logprobs"] = self.logprobs_of(path, tokens, as_ids) if want else None
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens),
        }
        if path == "/v1/chat/completions":
            out: Json = {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": [{**choice, "message": {"role": "assistant", "content": text}}],
                "usage": usage,
                "prompt_token_ids": prompt,
            }
        elif path == "/v1/completions":
            out = {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": [{**choice, "text": text, "prompt_token_ids": prompt}],
                "usage": usage,
            }
        else:
            out = {"request_id": rid, "choices": [choice], "usage": usage}
        return web.Response(body=orjson.dumps(out), content_type="application/json", headers=self._headers(rid))

    async def _stream(
        self,
        request: web.Request,
        path: str,
        body: Json,
        rid: str,
        prompt: list[int],
        n: int,
        delay: float,
        die_after: int,
        flag: asyncio.Event,
        want: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**self._headers(rid), "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = int(time.time())
        reason = None
        for i in range(n):
            if i == die_after:
                assert request.transport is not None
                request.transport.close()  # an engine that died mid-stream
                return resp
            if delay:
                await asyncio.sleep(delay)
            last = i == n - 1
            if flag.is_set():
                reason = "abort"
            elif last:
                reason = "length"
            token = (len(prompt) + i) % 97 + 3
            self._produced(rid)
            chunk = self._chunk(
                path,
                body,
                rid,
                created,
                [] if reason == "abort" else [token],
                prompt if i == 0 else None,
                reason,
                output_mode=body.get("output_mode", "tokens"),
                want=want,
            )
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if reason is not None:
                break
        self.finished[rid] = reason or "length"
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _chunk(
        self,
        path: str,
        body: Json,
        rid: str,
        created: int,
        tokens: list[int],
        prompt: list[int] | None,
        reason: str | None,
        output_mode: str,
        want: bool,
    ) -> Json:
        text = "".join(f"t{t} " for t in tokens)
        choice: Json = {"index": 0, "finish_reason": reason, "stop_reason": None, "token_ids": tokens}
        logprobs = self.logprobs_of(path, tokens, bool(body.get("return_tokens_as_token_ids"))) if want else None
        if path == "/v1/chat/completions":
            return {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.name,
                "choices": [{**choice, "delta": {"content": text}, "logprobs": logprobs}],
                "prompt_token_ids": prompt,
            }
        if path == "/v1/completions":
            return {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": created,
                "model": self.name,
                "choices": [{**choice, "text": text, "logprobs": logprobs, "prompt_token_ids": prompt}],
            }
        if reason is not None:
            choice["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": 1}]
        if output_mode == "text":
            choice["text"] = text
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return {"request_id": rid, "output_mode": output_mode, "choices": [choice]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    # A fleet's engine listens on its pod's address ($POD_IP), as the real one does.
    parser.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-ms", type=float, default=float(os.environ.get("SIM_TOKEN_DELAY_MS", "0")))
    parser.add_argument("--name", "--served-model-name", default="sim")
    parser.add_argument("--weight-version", default="v1")
    # The rest of the operator's engine arguments (serve, --model, --token-file, ...) mean nothing here.
    args, _ = parser.parse_known_args()
    import uvloop

    uvloop.install()
    engine = SimEngine(args.name, args.token_delay_ms, weight_version=args.weight_version)
    web.run_app(engine.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
