"""A fast vLLM-compatible engine simulator, for router benchmarks and the gateway's unit tests only.

Serves the shapes vLLM 0.32 serves (`/v1/completions`, `/v1/chat/completions`,
`/inference/v1/generate`, streaming and not, with `token_ids`/`prompt_token_ids`),
plus the Rollfleet engine's truthful abort (`POST /rollfleet/v1/abort`), its view of one
request (`GET /rollfleet/v1/requests/{id}`, a TrackedRequest) and weight
version header. Output is deterministic: token i of a request is `(prompt_len + i) % 97 + 3`
and its text is `t<id> `. Knobs: `token_delay_ms` (before each token) and `die_after`
(route -> cut the connection after that many streamed tokens, like an engine that died).

Never a stand-in for the real engine in acceptance tests: those run real vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

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

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate"):
            app.router.add_post(path, self.generate)
        app.router.add_post("/rollfleet/v1/abort", self.abort)
        app.router.add_get("/rollfleet/v1/requests/{rid}", self.tracked)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

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
        flag = asyncio.Event()
        self.running[rid] = flag
        try:
            if body.get("stream"):
                return await self._stream(request, path, body, rid, prompt, max_tokens, delay, die_after, flag)
            return await self._whole(path, rid, prompt, max_tokens, delay, flag)
        finally:
            self.running.pop(rid, None)
            self.finished.setdefault(rid, "abort")

    def _headers(self, rid: str) -> dict[str, str]:
        return {"X-Request-Id": rid, "X-Rollfleet-Weight-Version": self.weight_version}

    async def _whole(
        self, path: str, rid: str, prompt: list[int], n: int, delay: float, flag: asyncio.Event
    ) -> web.Response:
        tokens: list[int] = []
        for i in range(n):
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
            }
        elif path == "/v1/completions":
            out = {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": [{**choice, "text": text}],
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
    ) -> Json:
        text = "".join(f"t{t} " for t in tokens)
        choice: Json = {"index": 0, "finish_reason": reason, "stop_reason": None, "token_ids": tokens}
        if path == "/v1/chat/completions":
            return {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.name,
                "choices": [{**choice, "delta": {"content": text}, "logprobs": None}],
                "prompt_token_ids": prompt,
            }
        if path == "/v1/completions":
            return {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": created,
                "model": self.name,
                "choices": [{**choice, "text": text, "logprobs": None, "prompt_token_ids": prompt}],
            }
        if reason is not None:
            choice["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": 1}]
        if output_mode == "text":
            choice["text"] = text
        return {"request_id": rid, "output_mode": output_mode, "choices": [choice]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--name", default="sim")
    args = parser.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(
        SimEngine(args.name, args.token_delay_ms).app(), host=args.host, port=args.port, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
