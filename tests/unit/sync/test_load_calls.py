"""A push's pause window: the pause and the look at its requests in one call (PAUSE_AND_LOOK_PATH), the load in one
(LOAD_PATH) where the engine has the routes, vLLM's calls where it does not (an older engine image); no look before
loading a set the push staged, and the verified engines resumed without another look."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from tests.unit.engine_send import handler_send

from rollfleet.engine_client import EngineClient
from rollfleet.sync.engines import StaticDiscovery
from rollfleet.sync.orchestrator import Orchestrator, Publisher
from rollfleet.sync.store import FileStore
from rollfleet_client.sync_protocol import PushState
from rollfleet_engine.protocol import (
    FINISH_WEIGHT_UPDATE_PATH,
    LOAD_PATH,
    PAUSE_AND_LOOK_PATH,
    PAUSE_PATH,
    REQUESTS_PATH,
    RESUME_PATH,
    STAGE_PATH,
    START_WEIGHT_UPDATE_PATH,
    STATE_PATH,
    UPDATE_WEIGHTS_PATH,
)


class Engine:
    """An engine's weight routes as the sidecar meets them; `one_call`: an image with PAUSE_AND_LOOK_PATH and
    LOAD_PATH; `stages`: one with prefetch (it stages at once), else it pulls in the pause (404)."""

    def __init__(self, one_call: bool, stages: bool) -> None:
        self.one_call, self.stages = one_call, stages
        self.version, self.manifest, self.pending, self.paused = "v0", None, None, False
        self.staging: str | None = None
        self.calls: list[str] = []

    def state(self) -> httpx.Response:
        state = {"model": "m", "weight_version": self.version, "paused": self.paused, "running": 0, "waiting": 0}
        return httpx.Response(200, json=state | {"weights_manifest_sha256": self.manifest})

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        body = json.loads(request.content) if request.content else {}
        if path == STATE_PATH:
            return self.state()
        if path == REQUESTS_PATH:
            return httpx.Response(200, json={"in_flight": [], "recently_finished": []})
        if path == PAUSE_AND_LOOK_PATH:
            if not self.one_call:
                return httpx.Response(404, json={"detail": "Not Found"})
            self.paused = True
            return httpx.Response(200, json={"in_flight": [], "recently_finished": []})
        if path in (PAUSE_PATH, RESUME_PATH):
            self.paused = path == PAUSE_PATH
        elif path == LOAD_PATH:
            if not self.one_call:
                return httpx.Response(404, json={"detail": "Not Found"})
            self.version, self.manifest = body["weight_version"], body["update_info"]["manifest_sha256"]
            return self.state()
        elif path == UPDATE_WEIGHTS_PATH:
            self.pending = body["update_info"]["manifest_sha256"]
        elif path == FINISH_WEIGHT_UPDATE_PATH:
            self.version, self.manifest = body["weight_version"], self.pending
        elif path == STAGE_PATH:
            if not self.stages:
                return httpx.Response(404, json={"detail": "Not Found"})
            if request.method == "POST":
                self.staging = body["manifest_sha256"]
            url = f"file:///dev/shm/staged/{self.staging}"
            return httpx.Response(200, json={"state": "staged", "manifest_sha256": self.staging, "staged_url": url})
        return httpx.Response(200, json={})


def push(tmp_path: Path, engines: dict[str, Engine]) -> PushState:
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.zeros(4)}, str(weights / "model.safetensors"))

    def route(request: httpx.Request) -> httpx.Response:
        return engines[request.url.host](request)

    async def run() -> PushState:
        orch = Orchestrator(
            store=FileStore(tmp_path / "record.json"),
            discovery=StaticDiscovery([f"http://{host}:8000" for host in engines]),
            api=EngineClient("token", send=handler_send(route)),
            publisher=Publisher("127.0.0.1", 0),
            spool=tmp_path / "spool",
        )
        try:
            status = await orch.submit("v1", weights)
            ended = await orch.wait(status.generation, 30)
            assert ended is not None
            return ended.state
        finally:
            await orch.api.aclose()
            orch.publisher.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("stages", [True, False], ids=["staged", "pulled-in-the-pause"])
@pytest.mark.parametrize("one_call", [True, False], ids=["load-route", "older-image"])
def test_each_engine_loads_in_one_call_where_it_can_and_in_vllms_three_where_it_cannot(
    tmp_path: Path, one_call: bool, stages: bool
) -> None:
    engines = {"e0": Engine(one_call, stages), "e1": Engine(one_call, stages)}
    assert push(tmp_path, engines) is PushState.DONE
    for engine in engines.values():
        assert (engine.version, engine.paused) == ("v1", False)
        assert engine.manifest is not None  # the load named the pushed manifest, and the state showed it
        window = engine.calls[engine.calls.index(PAUSE_AND_LOOK_PATH) :]
        # Its state is looked at before a load only where the push did not stage it: one that serves the target
        # already is not loaded again. One staged in this push cannot serve it yet.
        look = [] if stages else [STATE_PATH]
        load = [LOAD_PATH] if one_call else [LOAD_PATH, START_WEIGHT_UPDATE_PATH, UPDATE_WEIGHTS_PATH]
        load += [] if one_call else [FINISH_WEIGHT_UPDATE_PATH, STATE_PATH]
        # Paused with its requests in the answer (staleness), the load, resumed at once: the state that verified
        # the load is the look that resuming needs.
        pause = [PAUSE_AND_LOOK_PATH] if one_call else [PAUSE_AND_LOOK_PATH, PAUSE_PATH, REQUESTS_PATH]
        assert window == [*pause, *look, *load, RESUME_PATH]
        if stages:
            assert engine.manifest == engine.staging
