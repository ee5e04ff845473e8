"""A push of a directory the sidecar cannot use is refused with a message that says what to do."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from tests.unit.engine_send import handler_send

from rollfleet.engine_client import CONTROL, STATE_POLL, EngineClient
from rollfleet.sync import orchestrator
from rollfleet.sync.engines import StaticDiscovery
from rollfleet.sync.orchestrator import Orchestrator, Publisher
from rollfleet.sync.protocol import PushRefused
from rollfleet.sync.store import FileStore
from rollfleet_client.sync_protocol import SPOOL_SPARE_FILE
from rollfleet_engine.protocol import STATE_PATH


def submit(tmp_path: Path, source: Path, engines: tuple[str, ...] = (), api: EngineClient | None = None) -> None:
    async def run() -> None:
        orch = Orchestrator(
            store=FileStore(tmp_path / "record.json"),
            discovery=StaticDiscovery(list(engines)),
            api=api or EngineClient("token"),
            publisher=Publisher("127.0.0.1", 0),
            spool=tmp_path / "spool",
        )
        try:
            await orch.submit("v1", source)
        finally:
            await orch.api.aclose()

    asyncio.run(run())


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(PushRefused, match=r"no \.safetensors files in .*empty"):
        submit(tmp_path, tmp_path / "empty")


def test_an_unreadable_directory_is_refused_with_the_uid_to_grant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests run as root, which reads everything: the filesystem's refusal is faked at its boundary.
    def denied(source: str) -> bool:
        raise PermissionError(13, "Permission denied", source)

    monkeypatch.setattr(orchestrator, "_has_weights", denied)
    with pytest.raises(
        PushRefused, match=r"cannot read .*Permission denied.*runs as uid \d+; make the directory readable"
    ):
        submit(tmp_path, tmp_path / "weights")


def test_a_push_to_engines_of_a_collective_backend_is_refused_before_anything_changes(tmp_path: Path) -> None:
    state = {"model": "tiny", "weight_version": "v1", "paused": False, "running": 0, "waiting": 0}

    async def engine(request: httpx.Request) -> httpx.Response:
        assert request.url.path == STATE_PATH, request.url  # nothing but a read reaches the engine
        return httpx.Response(200, json={**state, "weight_backend": "gloo"})

    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    api = EngineClient("token", send=handler_send(engine))
    with pytest.raises(PushRefused, match=r"collective backend: http://e0:8000 \(gloo\).*CollectivePusher"):
        submit(tmp_path, weights, ("http://e0:8000",), api)
    assert not (tmp_path / "record.json").exists()


def test_only_writes_idle_for_long_in_the_spool_are_abandoned(tmp_path: Path) -> None:
    now = 1_000_000.0
    for name, age in (("old", 3600), ("fresh", 5), ("old-dir-fresh-file", 3600)):
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
        os.utime(d, (now - age, now - age))
        os.utime(d / "model.safetensors", (now - age, now - age))
    os.utime(tmp_path / "old-dir-fresh-file" / "model.safetensors", (now - 1, now - 1))  # still being written
    (tmp_path / "stray-file").write_bytes(b"x")  # not a trainer's directory: judged by its own time
    os.utime(tmp_path / "stray-file", (now - 3600, now - 3600))
    (tmp_path / SPOOL_SPARE_FILE).write_bytes(b"x")  # kept on purpose, for the next push
    os.utime(tmp_path / SPOOL_SPARE_FILE, (now - 3600, now - 3600))
    assert sorted(p.name for p in orchestrator.abandoned_writes(tmp_path, now)) == ["old", "stray-file"]


def test_an_engine_that_does_not_answer_holds_a_push_back_no_longer_than_a_state_read(tmp_path: Path) -> None:
    """The collective-backend check before a push reads each engine's state: one engine hung (SIGSTOPped, its node
    lost) delays the trainer's push by a state read's timeout, not a control call's."""
    hung = asyncio.Event()  # never set: the stopped engine never answers
    state = {"model": "tiny", "weight_version": "v1", "paused": False, "running": 0, "waiting": 0}

    async def engine(request: httpx.Request) -> httpx.Response:
        if request.url.host == "hung":
            await hung.wait()
        return httpx.Response(200, json={**state, "weight_backend": "http"})

    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.zeros(4)}, str(weights / "model.safetensors"))
    api = EngineClient("token", send=handler_send(engine))
    t0 = time.monotonic()
    submit(tmp_path, weights, ("http://hung:8000", "http://e1:8000"), api)  # accepted: nothing refused it
    took = time.monotonic() - t0
    assert STATE_POLL.timeout_s <= took < CONTROL.timeout_s / 2, took
