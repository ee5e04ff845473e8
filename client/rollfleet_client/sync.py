"""``SyncClient``: push a trainer's weights to every engine of its fleet, through the sync sidecar.

::

    from rollfleet_client.sync import SyncClient

    with SyncClient() as sync:                          # the sidecar in this pod
        sync.push(model.state_dict(), version="step-12")  # streams the tensors; returns when the fleet has them
        sync.push_dir("/shared/ckpt/step-13", version="step-13")  # safetensors files the sidecar can read
        sync.fleet_version().version  # "step-13"

``push`` lays the tensors out as one safetensors file over their own memory (no copy of
the state dict; tensors are moved to CPU if they are not there). Where the trainer
container mounts the sidecar's spool volume (``$ROLLFLEET_SYNC_SPOOL``, as
manifests/sync/trainer-job.yaml does), it writes that file straight into the spool;
otherwise it streams it to the sidecar over HTTP, one hop more. It returns
the push's final ``PushStatus`` when the fleet is on the new version, and raises
``PushFailed`` when the fleet stayed on the old one. Talks to the sidecar only; its API is
``sync_protocol``. ``AsyncRolloutClient.push_weights`` runs it off the event loop.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from rollfleet_client.errors import GroupStale, InvalidArgument, PushFailed, SidecarError
from rollfleet_client.spool import open_over_spare
from rollfleet_client.sync_protocol import (
    GROUP_STALE_STATUS,
    PUSH_SPOOLED_PATH,
    PUSH_STREAM_PATH,
    PUSHES_PATH,
    SPOOL_ENV,
    SPOOL_INCOMING_DIR,
    SYNC_API_URL,
    VERSION_PATH,
    FleetVersionView,
    PushDirRequest,
    PushSpooledRequest,
    PushState,
    PushStatus,
)
from rollfleet_client.tensors import TensorFile, tensor_file

_POLL_S = 30.0
SPOOLED_FILE = "model.safetensors"


class SyncClient:
    def __init__(self, url: str | None = None, timeout_s: float = 60.0, spool: str | Path | None = None) -> None:
        """``url``: the sidecar's; by default the one in this pod (on localhost).
        ``spool``: where this container mounts the sidecar's spool (default ``$ROLLFLEET_SYNC_SPOOL``);
        without one, ``push`` streams over HTTP."""
        self.url = (url or SYNC_API_URL).rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)
        spool = spool or os.environ.get(SPOOL_ENV)
        self.spool = Path(spool) if spool else None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def push(
        self, state_dict: Mapping[str, Any], version: str, wait: bool = True, timeout_s: float = 1800.0
    ) -> PushStatus:
        """Hand ``state_dict`` to the sidecar (written into its spool, or streamed) and push it to the fleet as
        ``version`` (needs torch)."""
        check_version(version)  # refused here, before any byte is sent
        out = tensor_file(state_dict)
        if self.spool is not None:
            return self._push_spooled(self.spool, out, version, wait, timeout_s)
        resp = self.call(
            "PUT",
            PUSH_STREAM_PATH,
            params={"version": version},
            content=out.chunks(),
            headers={"Content-Length": str(out.size)},
            timeout=timeout_s,
        )
        return self._started(resp, wait, timeout_s)

    def _push_spooled(self, spool: Path, out: TensorFile, version: str, wait: bool, timeout_s: float) -> PushStatus:
        incoming = spool / SPOOL_INCOMING_DIR
        if not incoming.is_dir():
            raise SidecarError(
                f"{incoming} does not exist: {SPOOL_ENV}={spool} is not the sync sidecar's spool volume "
                "(mount the volume of its --spool-dir, or unset the variable to stream over HTTP)"
            )
        written = incoming / f"{version}.{uuid.uuid4().hex[:8]}"
        written.mkdir()
        try:
            written.chmod(0o777)  # the sidecar (a user of its own) moves it, and deletes it once superseded
            t0 = time.monotonic()
            with open_over_spare(incoming, written / SPOOLED_FILE) as f:
                out.write_to(f)
                f.truncate()
            body = PushSpooledRequest(version=version, name=written.name, write_s=time.monotonic() - t0)
            resp = self.call("POST", PUSH_SPOOLED_PATH, content=body.model_dump_json(), timeout=timeout_s)
        finally:  # taken over by the sidecar unless the write or the call failed
            shutil.rmtree(written, ignore_errors=True)
        return self._started(resp, wait, timeout_s)

    def push_dir(self, path: str | Path, version: str, wait: bool = True, timeout_s: float = 1800.0) -> PushStatus:
        """Push the .safetensors files in ``path`` (a directory the sidecar can read) as ``version``."""
        check_version(version)
        body = PushDirRequest(version=version, path=str(path))
        resp = self.call("POST", PUSHES_PATH, content=body.model_dump_json(), timeout=timeout_s)
        return self._started(resp, wait, timeout_s)

    def progress(self, generation: int) -> PushStatus:
        return PushStatus.model_validate(self.call("GET", f"{PUSHES_PATH}/{generation}").json())

    def wait(self, generation: int, timeout_s: float = 1800.0) -> PushStatus:
        """Block until the push ends; raise ``PushFailed`` unless the fleet reached its version."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SidecarError(f"push generation {generation} still running after {timeout_s:.0f} s")
            wait_s = min(_POLL_S, left)
            resp = self.call("GET", f"{PUSHES_PATH}/{generation}", params={"wait": wait_s}, timeout=wait_s + 30)
            status = PushStatus.model_validate(resp.json())
            if status.state is PushState.DONE:
                return status
            if status.state.terminal:
                raise PushFailed(status)

    def fleet_version(self) -> FleetVersionView:
        return FleetVersionView.model_validate(self.call("GET", VERSION_PATH).json())

    def _started(self, resp: httpx.Response, wait: bool, timeout_s: float) -> PushStatus:
        status = PushStatus.model_validate(resp.json())
        return self.wait(status.generation, timeout_s) if wait else status

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call of the sidecar's API; an error answer raises ``SidecarError`` (``GroupStale`` for 410)."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise SidecarError(
                f"no sync sidecar answered at {self.url} ({type(err).__name__}: {err}); run the rollfleet-sync "
                "sidecar in this pod (manifests/sync/trainer-job.yaml) or pass its URL"
            ) from err
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("error", resp.text)
            except ValueError:
                detail = resp.text
            error = GroupStale if resp.status_code == GROUP_STALE_STATUS else SidecarError
            raise error(f"{method} {path}: HTTP {resp.status_code}: {detail}", resp.status_code)
        return resp


def check_version(version: str) -> None:
    try:
        PushDirRequest(version=version, path="-")
    except ValidationError:
        raise InvalidArgument(
            f"version {version!r} is not a label: 1-128 characters of [A-Za-z0-9._-], starting with a letter or digit"
        ) from None
