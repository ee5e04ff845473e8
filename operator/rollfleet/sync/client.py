"""``SyncClient``: what a trainer uses to push weights through the sync sidecar.

::

    from rollfleet.sync.client import SyncClient

    sync = SyncClient("http://127.0.0.1:8471")
    sync.push(model.state_dict(), version="step-12")  # streams the tensors; returns when the fleet has them
    sync.push_dir("/shared/ckpt/step-13", version="step-13")  # safetensors files the sidecar can read
    sync.fleet_version().version  # "step-13"

``push`` lays the tensors out as one safetensors shard and streams it (no copy of the
state dict is made; tensors are moved to CPU if they are not there). It returns the
push's final ``PushStatus`` when the fleet is on the new version, and raises
``PushFailed`` when the fleet stayed on the old one. Talks to the sidecar only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from rollfleet.contract import SYNC_API_PORT
from rollfleet.errors import RollfleetError
from rollfleet.sync.models import MANIFEST_SHA_HEADER, FleetVersionView, PushDirRequest, PushState, PushStatus
from rollfleet_engine.protocol import WeightManifest
from rollfleet_engine.safetensors_stream import MemoryShard, manifest_bytes, sha256_hex, shard_from_tensors

_CHUNK = 16 << 20
_POLL_S = 30.0


class SyncError(RollfleetError, RuntimeError):
    """The sidecar refused or could not answer a call."""


class PushFailed(SyncError):
    """The push ended without moving the fleet to the new version."""

    def __init__(self, status: PushStatus) -> None:
        super().__init__(f"push {status.version} ended {status.state.value}: {status.message}")
        self.status = status


class SyncClient:
    def __init__(self, url: str = f"http://127.0.0.1:{SYNC_API_PORT}", timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def push(
        self, state_dict: Mapping[str, Any], version: str, wait: bool = True, timeout_s: float = 1800.0
    ) -> PushStatus:
        """Stream ``state_dict`` to the sidecar and push it to the fleet as ``version``."""
        mem = shard_from_tensors(state_dict, "/shards/0")
        sha = sha256_hex(manifest_bytes(WeightManifest(shards=[mem.shard])))
        resp = self._http.put(
            "/v1/pushes/stream",
            params={"version": version},
            content=_stream(mem),
            headers={"Content-Length": str(mem.shard.size), MANIFEST_SHA_HEADER: sha},
            timeout=timeout_s,
        )
        return self._started(resp, wait, timeout_s)

    def push_dir(self, path: str | Path, version: str, wait: bool = True, timeout_s: float = 1800.0) -> PushStatus:
        """Push the .safetensors files in ``path`` (a directory the sidecar can read) as ``version``."""
        body = PushDirRequest(version=version, path=str(path))
        resp = self._http.post("/v1/pushes", content=body.model_dump_json(), timeout=timeout_s)
        return self._started(resp, wait, timeout_s)

    def progress(self, generation: int) -> PushStatus:
        return PushStatus.model_validate(self._json(self._http.get(f"/v1/pushes/{generation}")))

    def wait(self, generation: int, timeout_s: float = 1800.0) -> PushStatus:
        """Block until the push ends; raise ``PushFailed`` unless the fleet reached its version."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncError(f"push generation {generation} still running after {timeout_s:.0f}s")
            wait_s = min(_POLL_S, left)
            resp = self._http.get(f"/v1/pushes/{generation}", params={"wait": wait_s}, timeout=wait_s + 30)
            status = PushStatus.model_validate(self._json(resp))
            if status.state is PushState.DONE:
                return status
            if status.state.terminal:
                raise PushFailed(status)

    def fleet_version(self) -> FleetVersionView:
        return FleetVersionView.model_validate(self._json(self._http.get("/v1/version")))

    def _started(self, resp: httpx.Response, wait: bool, timeout_s: float) -> PushStatus:
        status = PushStatus.model_validate(self._json(resp))
        return self.wait(status.generation, timeout_s) if wait else status

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("error", resp.text)
            except ValueError:
                detail = resp.text
            raise SyncError(f"{resp.request.method} {resp.request.url.path}: HTTP {resp.status_code}: {detail}")
        return resp.json()


def _stream(mem: MemoryShard) -> Iterator[bytes]:
    yield mem.header
    for buf in mem.buffers:
        for start in range(0, buf.nbytes, _CHUNK):
            yield bytes(buf[start : start + _CHUNK])
