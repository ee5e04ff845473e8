"""The simulator's weight routes, with the engine's own code: prefetch and relay (`rollfleet_engine.staging.Stager`:
every tensor checked against the manifest as it lands, its bytes served on to the next engine as they arrive) and
vLLM's update session (`/start_weight_update`, `/update_weights`, `/finish_weight_update`, and the engine's one call
for all three, `LOAD_PATH`) with the engine's bookkeeping of the proof of the bytes (`middleware.verified_manifest`,
`one_manifest`).

What the simulator leaves out is the model: a load checks that what it names is staged and verified (or pulls and
verifies it, for an engine asked to pull in the pause) and copies it nowhere. The control-plane tier and the scale
harness push weights through the real sync sidecar to these routes; the engine tier tests the loads themselves on
real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from pydantic import ValidationError

from rollfleet_engine.middleware import one_manifest, verified_manifest
from rollfleet_engine.protocol import (
    FINISH_WEIGHT_UPDATE_PATH,
    LOAD_PATH,
    RELAY_MANIFEST_HEADER,
    STAGE_PATH,
    STAGE_RELAY_PATH,
    STAGE_WAIT_MAX_S,
    STAGED_URL_SCHEME,
    START_WEIGHT_UPDATE_PATH,
    UPDATE_WEIGHTS_PATH,
    WEIGHTS_MANIFEST_PATH,
    LoadRequest,
    WeightUpdateInfo,
)
from rollfleet_engine.safetensors_stream import TransferError, receive_shard
from rollfleet_engine.staging import RelayUnavailable, Stager
from rollfleet_engine.weights_client import MANIFEST_FILE, check_length, check_manifest, fetch_manifest, http_get
from rollfleet_engine.weights_server import content_range

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.Response]]
# What blocks (a wait for the end of a staging, a relay's wait for the next bytes, a pull) runs here, not in the
# event loop's default pool: a host of many engines (the engine host) has hundreds of such waits at once, where
# each real engine has its own process and pool; 6 threads (the default on 2 cores) held them all back.
_BLOCKING = ThreadPoolExecutor(max_workers=2048, thread_name_prefix="sim-weights")


async def _blocking(call: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_BLOCKING, call, *args)


class SimWeights:
    """One simulated engine's staging area and update session. `version` is what it serves, `manifest_sha256` the
    manifest its last finished update was verified against (None: its first weights)."""

    def __init__(self, root: Path, version: str) -> None:
        self.stager = Stager(root, None)
        self.version = version
        self.manifest_sha256: str | None = None
        self._loading: list[str | None] = []

    def add_routes(self, app: web.Application, state: Handler) -> None:
        """The weight routes on `app`; `state` answers the engine's state (the answer of a load in one call)."""

        async def load(request: web.Request) -> web.Response:
            return await self.load(request, state)

        app.router.add_post(LOAD_PATH, load)
        app.router.add_post(STAGE_PATH, self.stage)
        app.router.add_get(STAGE_PATH, self.stage_status)
        app.router.add_get(STAGE_RELAY_PATH + WEIGHTS_MANIFEST_PATH, self.relay_manifest)
        app.router.add_get(STAGE_RELAY_PATH + "/{path:.*}", self.relay_shard)
        app.router.add_post(START_WEIGHT_UPDATE_PATH, self.start)
        app.router.add_post(UPDATE_WEIGHTS_PATH, self.update)
        app.router.add_post(FINISH_WEIGHT_UPDATE_PATH, self.finish)

    def close(self) -> None:
        """Free the staging area (the engine is gone)."""
        shutil.rmtree(self.stager.root, ignore_errors=True)

    async def stage(self, request: web.Request) -> web.Response:
        try:
            info = WeightUpdateInfo.model_validate_json(await request.read())
            started = self.stager.start(info, request.headers.get("Authorization"))
        except (ValidationError, ValueError) as err:
            return _error(400, str(err))
        return web.json_response(started.model_dump(mode="json"), status=202)

    async def stage_status(self, request: web.Request) -> web.Response:
        try:
            wait = min(max(float(request.query.get("wait", 0)), 0.0), STAGE_WAIT_MAX_S)
        except ValueError:
            return _error(400, f"wait must be a number of seconds, got {request.query.get('wait')!r}")
        status = await _blocking(self.stager.status, wait)
        return web.json_response(status.model_dump(mode="json"))

    async def relay_manifest(self, request: web.Request) -> web.Response:
        try:
            # Waits until the manifest of the set asked for has arrived.
            raw = await _blocking(self.stager.relay_manifest, request.headers.get(RELAY_MANIFEST_HEADER))
        except RelayUnavailable as err:
            return _error(409, str(err))
        return web.Response(body=raw, content_type="application/json")

    async def relay_shard(self, request: web.Request) -> web.StreamResponse:
        asked = request.headers.get("Range")
        try:
            path = "/" + request.match_info["path"]
            pinned = request.headers.get(RELAY_MANIFEST_HEADER)
            shard, (begin, end), chunks = await _blocking(self.stager.relay_shard, path, asked, pinned)
        except RelayUnavailable as err:
            return _error(409, str(err))
        except ValueError as err:  # a Range past the shard
            return _error(416, str(err))
        headers = {"Content-Length": str(end - begin)}
        if asked is not None:
            headers["Content-Range"] = content_range(begin, end, shard.size)
        resp = web.StreamResponse(status=200 if asked is None else 206, headers=headers)
        await resp.prepare(request)
        with contextlib.suppress(RelayUnavailable):  # the stream breaks off short, as the engine's does
            while (chunk := await _blocking(next, chunks, None)) is not None:
                await resp.write(chunk)
        return resp

    async def start(self, _: web.Request) -> web.Response:
        self._loading = []
        return web.json_response({})

    async def update(self, request: web.Request) -> web.Response:
        return await self._update(await request.read())

    async def _update(self, raw: bytes) -> web.Response:
        try:
            info = WeightUpdateInfo.model_validate(orjson.loads(raw)["update_info"])
            await _blocking(self._load, info)
        except (ValidationError, ValueError, KeyError, TypeError, OSError, TransferError) as err:
            return _error(400, f"{type(err).__name__}: {err}")
        self._loading.append(verified_manifest(raw))
        return web.json_response({})

    async def finish(self, request: web.Request) -> web.Response:
        try:
            version = str(orjson.loads(await request.read())["weight_version"])
        except (ValueError, KeyError, TypeError) as err:
            return _error(400, f"finish_weight_update needs a weight_version: {err}")
        self._finish(version)
        return web.json_response({})

    def _finish(self, version: str) -> None:
        self.version, self.manifest_sha256 = version, one_manifest(self._loading)
        self._loading = []
        self.stager.release()

    async def load(self, request: web.Request, state: Handler) -> web.Response:
        """LOAD_PATH: start, update and finish as the engine runs them, then the state."""
        try:
            load = LoadRequest.model_validate_json(await request.read())
        except ValidationError as err:
            return _error(400, f"a load needs update_info and weight_version: {err}")
        self._loading = []
        updated = await self._update(orjson.dumps({"update_info": load.update_info.for_load()}))
        if updated.status != 200:
            return updated
        self._finish(load.weight_version)
        return await state(request)

    def _load(self, info: WeightUpdateInfo) -> None:
        """Check what a load names: a set staged here (verified as it landed), or one pulled and verified now."""
        if urlsplit(info.url).scheme == STAGED_URL_SCHEME:
            directory = Path(urlsplit(info.url).path).resolve()
            if self.stager.root.resolve() not in directory.parents:
                raise TransferError(f"{directory} is not in this engine's staging area {self.stager.root}")
            check_manifest((directory / MANIFEST_FILE).read_bytes(), info.manifest_sha256)
            return
        _, manifest = fetch_manifest(info.url, info.manifest_sha256, info.timeout_s)
        for shard in manifest.shards:
            with http_get(info.url, shard.path, info.timeout_s) as resp:
                check_length(resp, shard)
                receive_shard(resp.readinto, shard, memoryview(bytearray(shard.size)), lambda _: None)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
