"""The results store of a RolloutRequest on a PersistentVolumeClaim: one JSONL file it appends to.

For batches that do not belong in etcd (thousands of samples with logprobs: hundreds of MB).
The runner's pod mounts the claim at `RESULTS_MOUNT`; the file is
`<subPath>/<request>-<uid[:8]>/samples.jsonl` (the uid part keeps a re-created request from
meeting its predecessor's file). A flush appends the finished lines and fsyncs, so a line
on the volume is a stored sample. A runner killed mid-write may leave half a line: the
next one cuts it off when it loads the file. One writer at a time: the file is locked
(`flock`), and the Job makes a new pod only once the old one has ended.

A volume that cannot take the results fails the request with why (`volume_failure`, pure):
read-only, full, or not writable by the runner. The data stays on the volume after the
request is deleted: it is the user's claim. `reader` serves the file to `rollfleet results`.
Talks to nobody but the filesystem.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rollfleet.api.request import PersistentVolumeClaimResults, ResultsRef
from rollfleet.controller.requests.plan import SampleKey, SampleResult, Summary
from rollfleet.errors import RollfleetError

RESULTS_MOUNT = "/var/lib/rollfleet/results"  # where runner and reader pods mount the claim
RESULTS_FILE = "samples.jsonl"


def relative_path(volume: PersistentVolumeClaimResults, request: str, uid: str) -> str:
    """The results file of a request, relative to the root of its claim."""
    return str(PurePosixPath(volume.sub_path or ".") / f"{request}-{uid[:8]}" / RESULTS_FILE).removeprefix("./")


@dataclass(frozen=True)
class VolumeFailure:
    reason: str
    message: str


def volume_failure(err: OSError, claim: str) -> VolumeFailure | None:
    """Why a write to the results volume failed, for the request's status; None: not the volume's fault."""
    where = f"PersistentVolumeClaim {claim!r} (spec.results.persistentVolumeClaim)"
    if err.errno == errno.EROFS:
        return VolumeFailure("ResultsVolumeReadOnly", f"{where} is mounted read-only: give the runner a writable one")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return VolumeFailure(
            "ResultsVolumeFull", f"{where} is full: the results so far are kept there; use a larger claim"
        )
    if err.errno in (errno.EACCES, errno.EPERM):
        return VolumeFailure(
            "ResultsVolumeNotWritable",
            f"{where} is not writable by the runner (uid {os.getuid()}): {err.strerror}; fix the volume's permissions",
        )
    return None


class ResultsVolumeError(RollfleetError):
    """The results volume cannot take the results; `failure` says why, for the status."""

    def __init__(self, failure: VolumeFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def complete_lines(data: bytes) -> tuple[list[str], int]:
    """The whole lines of a results file and the length they take; what follows (half a line, written by a
    runner killed mid-write) is not a stored sample."""
    end = data.rfind(b"\n") + 1
    return [line for line in data[:end].decode().split("\n") if line], end


class FileStore:
    """The results of one RolloutRequest, in its file on the claim mounted at `root`."""

    limit: int | None = None  # a volume takes what it has room for

    def __init__(self, root: Path, volume: PersistentVolumeClaimResults, name: str, uid: str) -> None:
        self.volume, self.name = volume, name
        self.relative = relative_path(volume, name, uid)
        self.path = root / self.relative
        self.results: dict[SampleKey, Summary] = {}  # the samples stored or buffered; their data is in the file
        self._unwritten: list[tuple[SampleKey, str]] = []
        self._writing: list[tuple[SampleKey, str]] = []  # the lines a flush is appending
        self._fd: int | None = None
        self.bytes = 0

    async def load(self) -> list[Summary]:
        """Open (and lock) the file, cut off a torn last line, read what the stored results are."""
        data = await asyncio.to_thread(self._open)
        lines, _ = complete_lines(data)
        self.results = {}
        for line in lines:
            r = SampleResult.from_line(line)
            self.results.setdefault(r.key, r.summary())
        self.bytes = len(data)
        return list(self.results.values())

    def add(self, result: SampleResult) -> bool:
        """Buffer a result; False (and nothing stored) when the sample already has one."""
        if result.key in self.results:
            return False
        self.results[result.key] = result.summary()
        line = result.line() + "\n"
        self._unwritten.append((result.key, line))
        self.bytes += len(line.encode())
        return True

    @property
    def pending(self) -> int:
        return len(self._unwritten) + len(self._writing)

    async def flush(self) -> None:
        """Append every unwritten line, then fsync: once this returns they are stored. Results added
        meanwhile wait for the next flush. When the volume fails, the lines it did not take are forgotten
        (the status counts only what is stored)."""
        if not self._unwritten:
            return
        self._writing, self._unwritten = self._unwritten, []
        data = "".join(line for _, line in self._writing).encode()
        try:
            await asyncio.to_thread(self._append, data)
        except ResultsVolumeError:
            self._drop(self._writing + self._unwritten)
            self._unwritten = []
            raise
        finally:
            self._writing = []

    def _drop(self, lines: list[tuple[SampleKey, str]]) -> None:
        for key, line in lines:
            self.results.pop(key, None)
            self.bytes -= len(line.encode())

    def ref(self, command: str) -> ResultsRef:
        return ResultsRef(
            persistent_volume_claim=self.volume.claim_name,
            path=self.relative,
            samples=len(self.results) - self.pending,
            bytes=self.bytes - sum(len(line.encode()) for _, line in self._unwritten + self._writing),
            command=command,
        )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def _fail(self, err: OSError) -> Exception:
        failure = volume_failure(err, self.volume.claim_name)
        return err if failure is None else ResultsVolumeError(failure)

    def _open(self) -> bytes:
        self.close()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as err:
            raise self._fail(err) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RollfleetError(
                f"{self.relative} on claim {self.volume.claim_name!r} is locked by another runner of this request"
            ) from None
        self._fd = fd
        data = b""
        while chunk := os.read(fd, 1 << 20):
            data += chunk
        _, end = complete_lines(data)
        if end < len(data):  # a torn last line: not a sample; the next append starts on a fresh line
            try:
                os.ftruncate(fd, end)
            except OSError as err:
                raise self._fail(err) from err
            data = data[:end]
        os.lseek(fd, end, os.SEEK_SET)
        return data

    def _append(self, data: bytes) -> None:
        assert self._fd is not None, "load() first"
        start = os.lseek(self._fd, 0, os.SEEK_CUR)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as err:
            # What made it to disk may be half a line: cut back, so the file holds whole samples only.
            try:
                os.ftruncate(self._fd, start)
                os.lseek(self._fd, start, os.SEEK_SET)
            except OSError:
                pass  # the next runner's load cuts a torn line off
            raise self._fail(err) from err
