"""A push of a directory the sidecar cannot use is refused with a message that says what to do."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollfleet.engine_client import EngineClient
from rollfleet.sync import orchestrator
from rollfleet.sync.engines import StaticDiscovery
from rollfleet.sync.orchestrator import Orchestrator, Publisher
from rollfleet.sync.protocol import PushRefused
from rollfleet.sync.store import FileStore


def submit(tmp_path: Path, source: Path) -> None:
    async def run() -> None:
        orch = Orchestrator(
            store=FileStore(tmp_path / "record.json"),
            discovery=StaticDiscovery([]),
            api=EngineClient("token"),
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
