"""Prefetch: the next weights downloaded and verified into the engine's staging area while it serves.

Runs in the API-server process, on a thread of its own, so that the engine keeps decoding
while the bytes arrive (an update_weights call would run in the engine core, between its
steps, and stall them). The staging area is memory (a memory-backed emptyDir in a pod), so
the load in the pause that follows is a memory copy: ``/update_weights`` with the staged
``file://`` URL (``weights_client.load_staged``).

One set is staged at a time: staging another replaces it; asking again for the set being
staged or already staged changes nothing; a finished weight update releases it (the model
holds the weights now), and so does the process's exit. Bounded by ``ROLLFLEET_STAGING_MAX_BYTES`` and by
the free space of the area; weights that do not fit fail with what to do. Every tensor is
hashed against the manifest before the set is called staged.
"""

from __future__ import annotations

import atexit
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rollfleet_engine.protocol import STAGED_URL_SCHEME, StageState, StageStatus, WeightUpdateInfo
from rollfleet_engine.safetensors_stream import TransferError, read_shard
from rollfleet_engine.weights_client import MANIFEST_FILE, check_length, fetch_manifest, http_get, shard_file


class StagingFull(TransferError):
    """The weights do not fit the staging area."""


def fits(needed: int, max_bytes: int | None, free: int) -> str | None:
    """Why `needed` bytes cannot be staged, or None. Pure."""
    if max_bytes is not None and needed > max_bytes:
        return (
            f"the weights need {needed} bytes and the staging limit is {max_bytes}: raise ROLLFLEET_STAGING_MAX_BYTES "
            "(and the engine pod's memory), or push with the sidecar's --no-prefetch"
        )
    if needed > free:
        return (
            f"the weights need {needed} bytes and the staging area has {free} free: give the engine pod more memory, "
            "or push with the sidecar's --no-prefetch"
        )
    return None


@dataclass
class _Job:
    status: StageStatus
    thread: threading.Thread | None = None


class Stager:
    def __init__(self, root: Path, max_bytes: int | None) -> None:
        self.root, self.max_bytes = root, max_bytes
        self._lock = threading.Lock()
        self._job = _Job(StageStatus())
        # The area may be the host's /dev/shm (the local cluster): leave nothing there at exit.
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)

    def release(self) -> None:
        """The staged set was loaded (or given up): free its memory. A staging under way goes on."""
        with self._lock:
            if self._job.status.state is StageState.STAGING:
                return
            self._job = _Job(StageStatus())
            self._clear()

    def status(self) -> StageStatus:
        with self._lock:
            return self._job.status.model_copy()

    def start(self, info: WeightUpdateInfo) -> StageStatus:
        """Stage the weights at `info.url` (pinned by its manifest sha256) in the background."""
        if info.manifest_sha256 is None:
            raise ValueError("staging needs manifest_sha256: it names the staged set")
        with self._lock:
            current = self._job.status
            if current.manifest_sha256 == info.manifest_sha256 and current.state in (
                StageState.STAGING,
                StageState.STAGED,
            ):
                return current.model_copy()
            job = _Job(StageStatus(state=StageState.STAGING, manifest_sha256=info.manifest_sha256))
            job.thread = threading.Thread(target=self._run, args=(job, info), name="rollfleet-stage", daemon=True)
            self._job = job
        job.thread.start()
        return job.status.model_copy()

    def _run(self, job: _Job, info: WeightUpdateInfo) -> None:
        t0 = time.monotonic()
        try:
            url = self._stage(job, info)
            outcome = {"state": StageState.STAGED, "staged_url": url}
        except (OSError, ValueError, TransferError) as err:
            outcome = {"state": StageState.FAILED, "error": f"{type(err).__name__}: {err}"}
        with self._lock:
            if self._job is job:  # not replaced meanwhile
                job.status = job.status.model_copy(update={**outcome, "seconds": time.monotonic() - t0})

    def _stage(self, job: _Job, info: WeightUpdateInfo) -> str:
        assert info.manifest_sha256 is not None
        raw, manifest = fetch_manifest(info.url, info.manifest_sha256, info.timeout_s)
        job.status.bytes = manifest.total_bytes
        final = self.root / info.manifest_sha256
        partial = self.root / f"{info.manifest_sha256}.partial"
        self._clear()  # one set at a time: what was staged before goes first, to make room
        self.root.mkdir(parents=True, exist_ok=True)
        why = fits(manifest.total_bytes, self.max_bytes, shutil.disk_usage(self.root).free)
        if why is not None:
            raise StagingFull(why)
        partial.mkdir()
        for i, shard in enumerate(manifest.shards):
            # Every tensor is hashed against the manifest as it arrives (staged means verified), and its
            # bytes land in the shard's file as they are.
            with http_get(info.url, shard.path, info.timeout_s) as resp, (partial / shard_file(i)).open("wb") as out:
                check_length(resp, shard)
                read_shard(resp.readinto, shard, sink=out.write)
        (partial / MANIFEST_FILE).write_bytes(raw)
        partial.rename(final)
        return f"{STAGED_URL_SCHEME}://{final}"

    def _clear(self) -> None:
        if self.root.is_dir():
            for entry in self.root.iterdir():
                shutil.rmtree(entry, ignore_errors=True)
