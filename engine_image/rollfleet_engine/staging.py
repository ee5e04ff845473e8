"""Prefetch: the next weights downloaded and verified into the engine's staging area while it serves.

Runs in the API-server process, on a thread of its own, so that the engine keeps decoding
while the bytes arrive (an update_weights call would run in the engine core, between its
steps, and stall them). The staging area is memory (a memory-backed emptyDir in a pod), so
the load in the pause that follows is a memory copy: ``/update_weights`` with the staged
``file://`` URL (``weights_client.load_staged``).

One set is staged at a time: staging another replaces it; asking again for the set being
staged or already staged changes nothing; a finished weight update releases it (the model
holds the weights now: it cannot be loaded again). Bounded by ``ROLLFLEET_STAGING_MAX_BYTES`` and by
the free space of the area; weights that do not fit fail with what to do. Every tensor is
checked against the manifest before the set is called staged.

The bytes are received straight into the staging files, mapped (once: ``mappings``), and a
released set's files are kept and written over by the next set: allocating fresh memory pages
(zeroed by the kernel) cost more than the transfer itself (1 GiB: 1.1-1.4 s fresh, 0.45-0.5 s
written over, on a 2-core dev box). The area thus holds one set's memory from the first push on,
which the pod's memory limit has to allow at every push anyway; the process's exit frees it.

Relay: while it stages, an engine serves what it has received so far to the next engine
of a chain (``relay_manifest``, ``relay_shard``: its bytes as they land, through
``STAGE_RELAY_PATH``), so that the sidecar sends each byte about once however many
engines there are. Every engine still checks every tensor it receives against the
manifest, so a relay cannot pass corrupted or truncated bytes on as the weights.

Two upstreams (``WeightUpdateInfo.second_url``): the first half of every shard comes from ``url``
and the second half (``second_half``) from the second upstream, at once; a relay serves either
half (an HTTP Range) as it lands. The sync sidecar's two relay trees use this: each engine relays
one half down one tree and is a leaf of the other, so every engine sends about as much as it
receives (a single tree's leaves send nothing, halving the rate). The halves are checked when
both have landed. A relay asked for a set (``RELAY_MANIFEST_HEADER``, which every staging sends)
before this engine began staging it waits for it to begin, up to ``RELAY_BEGIN_WAIT_S``: an
engine's two upstreams cannot both be asked before it.
"""

from __future__ import annotations

import atexit
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rollfleet_engine.mappings import Mappings
from rollfleet_engine.protocol import (
    RELAY_MANIFEST_HEADER,
    STAGED_URL_SCHEME,
    Shard,
    StageState,
    StageStatus,
    WeightManifest,
    WeightUpdateInfo,
)
from rollfleet_engine.safetensors_stream import (
    TransferError,
    check_shard,
    parse_byte_range,
    receive_range,
    receive_shard,
    second_half,
)
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


class RelayUnavailable(TransferError):
    """This engine is not staging (or no longer) the set asked for: pull it from the sidecar."""


_RELAY_CHUNK = 4 << 20
RELAY_BEGIN_WAIT_S = 10.0  # a relay asked before this engine began staging waits this long for it (the sidecar's own)
_SPARE_DIR = ".spare"  # shard files of an earlier set, kept to be written over


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir())


@dataclass
class _Job:
    status: StageStatus
    thread: threading.Thread | None = None
    # What a relay reads, as it grows: the manifest, the mapping each shard is received into, and its bytes
    # landed so far: from its start (`written`) and, from two upstreams, of its second half (`seconds`: where the
    # half begins, and the end of what landed of it).
    manifest_raw: bytes | None = None
    manifest: WeightManifest | None = None
    views: dict[int, memoryview] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.status.state is not StageState.STAGING

    def landed(self, index: int, position: int) -> int:
        """The end of the bytes of shard `index` that landed without a gap from `position` on."""
        begin, end = self.seconds.get(index, (None, 0))
        if begin is not None and position >= begin:
            return end
        return self.written.get(index, 0)


def stages_already(current: StageStatus, manifest_sha256: str) -> bool:
    """Whether a staging asked for `manifest_sha256` is the one under way or done: it is not begun again."""
    return current.manifest_sha256 == manifest_sha256 and current.state in (StageState.STAGING, StageState.STAGED)


class Stager:
    def __init__(self, root: Path, max_bytes: int | None, relay_begin_wait_s: float = RELAY_BEGIN_WAIT_S) -> None:
        self.root, self.max_bytes, self.relay_begin_wait_s = root, max_bytes, relay_begin_wait_s
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # relays wait on it for more bytes
        # Waits for the end of a staging, apart: they need not wake at each of its pieces.
        self._ended = threading.Condition(self._lock)
        self._job = _Job(StageStatus())
        self._mappings = Mappings()  # the files received into, mapped once (``mappings``)
        # The area may be a host's /dev/shm (an engine outside a pod): leave nothing there at exit.
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)

    def release(self) -> None:
        """The staged set was loaded (or given up): it cannot be loaded again, and its memory is kept for the
        next set to be written over (see the module's docstring). A staging under way goes on."""
        with self._lock:
            if self._job.status.state is StageState.STAGING:
                return
            self._job = _Job(StageStatus())
            if self.root.is_dir():
                self._recycle()

    def status(self, wait_s: float = 0.0) -> StageStatus:
        """The staging's status; once it is no longer staging, if that happens within `wait_s` seconds."""
        with self._ended:
            job = self._job
            self._ended.wait_for(lambda: job.ended or self._job is not job, timeout=wait_s)
            return self._job.status.model_copy()

    def start(self, info: WeightUpdateInfo, authorization: str | None = None) -> StageStatus:
        """Stage the weights at `info.url` (pinned by its manifest sha256) in the background. `authorization`
        goes with the requests to `info.url`: another engine's relay is a control route."""
        if info.manifest_sha256 is None:
            raise ValueError("staging needs manifest_sha256: it names the staged set")
        with self._lock:
            current = self._job.status
            if stages_already(current, info.manifest_sha256):
                return current.model_copy()
            job = _Job(StageStatus(state=StageState.STAGING, manifest_sha256=info.manifest_sha256))
            job.thread = threading.Thread(
                target=self._run, args=(job, info, authorization), name="rollfleet-stage", daemon=True
            )
            self._job = job
            self._progress.notify_all()  # relays of the set replaced, and waits on its status, end
            self._ended.notify_all()
            started = job.status.model_copy()  # before the thread runs: a small set may be staged at once
        job.thread.start()
        return started

    def relay_manifest(self, manifest_sha256: str | None = None) -> bytes:
        """The manifest being staged, once it is known (blocks until then, and until a staging of `manifest_sha256`
        begins, up to `relay_begin_wait_s`)."""
        job = self._begun(manifest_sha256)
        with self._progress:
            self._progress.wait_for(lambda: job.manifest_raw is not None or job.ended or self._job is not job)
            if job.manifest_raw is None or self._job is not job or job.status.state is StageState.FAILED:
                raise RelayUnavailable("this engine is not staging any weights now")
            if manifest_sha256 is not None and job.status.manifest_sha256 != manifest_sha256:
                raise RelayUnavailable(f"this engine stages {job.status.manifest_sha256}, not {manifest_sha256}")
            return job.manifest_raw

    def relay_shard(
        self, path: str, byte_range: str | None = None, manifest_sha256: str | None = None
    ) -> tuple[Shard, tuple[int, int], Iterator[memoryview]]:
        """The shard of the set being staged at `path` (as the manifest names it), the bytes ``[begin, end)``
        served (those an HTTP Range header's `byte_range` asks for, else the whole shard), and those bytes as they
        arrive. Blocks until a staging of `manifest_sha256`, if given, has begun, up to `relay_begin_wait_s`. The
        iterator raises if the staging fails or is replaced before they are all served. ValueError for a range
        past the shard."""
        job = self._begun(manifest_sha256)
        with self._progress:
            self._progress.wait_for(lambda: job.manifest is not None or job.ended or self._job is not job)
            manifest = job.manifest
            if manifest is None or self._job is not job or job.status.state is StageState.FAILED:
                raise RelayUnavailable("this engine is not staging any weights now")
            if manifest_sha256 is not None and job.status.manifest_sha256 != manifest_sha256:
                raise RelayUnavailable(f"this engine stages {job.status.manifest_sha256}, not {manifest_sha256}")
        index = next((i for i, sh in enumerate(manifest.shards) if sh.path == path), None)
        if index is None:
            raise RelayUnavailable(f"no shard {path!r} in the weights being staged")
        shard = manifest.shards[index]
        begin, end = parse_byte_range(byte_range, shard.size) or (0, shard.size)
        return shard, (begin, end), self._relay(job, index, begin, end)

    def _begun(self, manifest_sha256: str | None) -> _Job:
        """The staging of `manifest_sha256` under way or staged; one not begun yet is waited for, up to
        `relay_begin_wait_s` (the sidecar may ask this engine's downstream of its second relay tree first). Without
        a set named, the staging there is now, if any."""

        def begun() -> bool:
            status = self._job.status
            return status.state is not StageState.IDLE and status.manifest_sha256 == manifest_sha256

        with self._progress:
            if manifest_sha256 is not None:
                self._progress.wait_for(begun, self.relay_begin_wait_s)
            return self._job

    def _relay(self, job: _Job, index: int, begin: int, end: int) -> Iterator[memoryview]:
        sent = begin

        def more() -> bool:  # called under the lock
            return job.landed(index, sent) > sent or job.ended or self._job is not job

        while sent < end:
            with self._progress:
                self._progress.wait_for(more)
                available = min(job.landed(index, sent), end)
                if available <= sent or self._job is not job:  # ended or replaced before it was whole
                    raise RelayUnavailable(
                        f"staging ended {job.status.state.value} after {sent - begin} of {end - begin} bytes"
                    )
                data = job.views[index]
            # Slices of the mapping the bytes were received into, handed to the socket without a copy (a
            # pread copied every relayed byte once more, on the CPU the engine shares).
            while sent < available:
                chunk = data[sent : min(sent + _RELAY_CHUNK, available)]
                sent += len(chunk)
                yield chunk

    def _run(self, job: _Job, info: WeightUpdateInfo, authorization: str | None) -> None:
        t0 = time.monotonic()
        try:
            url = self._stage(job, info, authorization)
            outcome = {"state": StageState.STAGED, "staged_url": url}
        except (OSError, ValueError, TransferError) as err:
            outcome = {"state": StageState.FAILED, "error": f"{type(err).__name__}: {err}"}
        with self._progress:
            if self._job is job:  # not replaced meanwhile
                job.status = job.status.model_copy(update={**outcome, "seconds": time.monotonic() - t0})
            self._progress.notify_all()
            self._ended.notify_all()

    def _stage(self, job: _Job, info: WeightUpdateInfo, authorization: str | None) -> str:
        assert info.manifest_sha256 is not None
        headers = {RELAY_MANIFEST_HEADER: info.manifest_sha256} | (
            {"Authorization": authorization} if authorization else {}
        )
        raw, manifest = fetch_manifest(info.url, info.manifest_sha256, info.timeout_s, headers)
        job.status.bytes = manifest.total_bytes
        final = self.root / info.manifest_sha256
        partial = self.root / f"{info.manifest_sha256}.partial"
        spare = self._recycle()  # one set at a time: what was staged before is written over
        why = fits(manifest.total_bytes, self.max_bytes, shutil.disk_usage(self.root).free + _size(spare))
        if why is not None:
            raise StagingFull(why)
        partial.mkdir()
        with self._progress:
            job.manifest_raw, job.manifest = raw, manifest
            self._progress.notify_all()
        for i, shard in enumerate(manifest.shards):
            target = partial / shard_file(i)
            if (spare / shard_file(i)).exists():
                (spare / shard_file(i)).rename(target)
            view = self._mappings.view(target, shard.size)
            with self._progress:
                job.views[i], job.written[i] = view, 0
            if info.second_url is not None:
                self._receive_halves(job, info, headers, i, shard, view)
                continue
            with http_get(info.url, shard.path, info.timeout_s, headers) as resp:
                check_length(resp, shard)
                # Every tensor is checked against the manifest as it arrives (staged means verified), and its
                # bytes land in the shard's file, where a relay reads them on.
                receive_shard(resp.readinto, shard, view, self._landing(job, i))
        shutil.rmtree(spare, ignore_errors=True)  # a set of more shards than this one
        self._mappings.keep_only(partial.iterdir())  # and its files' memory goes with their mappings
        (partial / MANIFEST_FILE).write_bytes(raw)
        partial.rename(final)
        return f"{STAGED_URL_SCHEME}://{final}"

    def _landing(self, job: _Job, index: int, second: int | None = None) -> Callable[[int], None]:
        """What records the bytes of shard `index` landed so far, from its start or from `second` (its second half's
        start), and wakes the relays waiting for them."""

        def landed(n: int) -> None:
            with self._progress:
                if second is None:
                    job.written[index] = n
                else:
                    job.seconds[index] = (second, n)
                self._progress.notify_all()

        return landed

    def _receive_halves(
        self, job: _Job, info: WeightUpdateInfo, headers: dict[str, str], index: int, shard: Shard, view: memoryview
    ) -> None:
        """Shard `index` from two upstreams at once: its first half from `info.url`, its second from
        `info.second_url`; every tensor checked once both have landed."""
        assert info.second_url is not None
        middle = second_half(shard.size)
        with self._progress:
            job.seconds[index] = (middle, middle)
        halves = [(info.url, (0, middle), None), (info.second_url, (middle, shard.size), middle)]
        failures: list[BaseException] = []

        def receive(url: str, window: tuple[int, int], second: int | None) -> None:
            try:
                with http_get(url, shard.path, info.timeout_s, headers, window) as resp:
                    check_length(resp, shard, window)
                    receive_range(resp.readinto, view, *window, self._landing(job, index, second))
            except (OSError, ValueError, TransferError) as err:
                failures.append(err)

        second = threading.Thread(target=receive, args=halves[1], name="rollfleet-stage-half", daemon=True)
        if middle < shard.size:  # else the shard is all first half
            second.start()
        receive(*halves[0])
        if middle < shard.size:
            second.join()
        if failures:
            raise failures[0]
        check_shard(view, shard)

    def _recycle(self) -> Path:
        """Every shard file left in the area (a set staged or loaded before, a staging cut off) moved into the
        spare directory, one per shard index, and the rest deleted; the spare directory."""
        spare = self.root / _SPARE_DIR
        spare.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if entry == spare:
                continue
            if not entry.is_dir():
                entry.unlink(missing_ok=True)
                continue
            for file in entry.glob("shard-*.safetensors"):
                if not (spare / file.name).exists():
                    file.rename(spare / file.name)
            shutil.rmtree(entry, ignore_errors=True)
        self._mappings.keep_only(spare.iterdir())
        return spare
