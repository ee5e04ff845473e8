"""Container processes: start through `launcher`, wait, signal, and make sure none survive.

Each container runs in its own session (one process group) and its own mount
namespace. The namespace doubles as the container's identity: every process whose
`/proc/PID/ns/mnt` is the container's belongs to it, even one that called setsid, so
stopping a container leaves nothing behind. A namespace's number is only its own while
the namespace lives: the kernel hands a freed number to the next namespace made on the
host (a kind node's container, say). So the agent holds the namespace open (`_Pin`)
whenever it signals by namespace, and a restarted agent signals what an earlier run
left (its pid files: pid, start time, namespace) only while that container's first
process still runs.
Talks to: the processes it starts, /proc, and `nsenter` for exec probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("launcher.py")
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"


@dataclass(frozen=True)
class Identity:
    """What identifies a running container process across agent restarts."""

    pid: int
    start_ticks: int
    mntns: str

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.start_ticks


@dataclass(frozen=True)
class Exit:
    code: int
    signal: int | None
    start_error: str


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with its pid, what names one process for good. None
    once it has exited (a zombie included)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])  # field 22 of stat: start time, in clock ticks since boot


def _mntns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, with those of its reaped children) a process has used; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # exited meanwhile
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # fields 14-17: utime, stime, cu-, cstime


def cpu_seconds(pid_file: Path) -> float:
    """CPU seconds every live process of the container that `pid_file` names has used (`process_cpu_seconds`):
    what a benchmark charges to a pod."""
    ident = json.loads(pid_file.read_text())
    return sum(process_cpu_seconds(pid) for pid in members(ident["mntns"]))


def members(mntns: str) -> list[int]:
    """Every live (not zombie) process in that mount namespace."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _mntns(int(entry.name)) == mntns and start_ticks(int(entry.name)) is not None:
            found.append(int(entry.name))
    return found


class _Pin:
    """An open handle on a process's mount namespace: while it is open the namespace, and its
    number, stay the container's, even once every process in it has exited."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self.mntns = f"mnt:[{os.fstat(self.fd).st_ino}]"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _pin(ident: Identity) -> _Pin | None:
    """Pin the namespace of the container's first process, if that process still runs and its namespace
    is the recorded one; None otherwise (the number may be another namespace's by now)."""
    if not ident.mntns or not ident.alive():
        return None
    try:
        pin = _Pin(ident.pid)
    except OSError:
        return None
    if pin.mntns != ident.mntns or not ident.alive():  # the pid was reused between the two reads
        pin.close()
        return None
    return pin


def kill_all(ident: Identity, sig: int) -> None:
    """Signal the container's process group and every other process of its namespace. The caller holds
    the namespace pinned (`_Pin`): an unpinned number may name a stranger's namespace."""
    if ident.alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(ident.pid, sig)
    if not ident.mntns or ident.mntns == _mntns(os.getpid()):
        return  # never our own namespace: the launcher failed before unshare
    for pid in members(ident.mntns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _open_files(spec_file: Path, spec: dict[str, object], log_file: Path) -> int:
    """Write the launcher's spec (owner-only: it holds secrets); open the log for appending."""
    fd = os.open(spec_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    return os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


class ContainerProcess:
    """One run of one container."""

    def __init__(self, proc: asyncio.subprocess.Process, pid_file: Path, error_r: int) -> None:
        self._proc = proc
        self._pid_file = pid_file
        self._error_r = error_r
        self.exited = asyncio.Event()
        self.identity = Identity(proc.pid, start_ticks(proc.pid) or 0, "")
        self._pin: _Pin | None = None  # held from the exec until every process of the container is signalled

    @classmethod
    async def start(cls, spec: dict[str, object], spec_file: Path, log_file: Path, pid_file: Path) -> ContainerProcess:
        error_r, error_w = os.pipe()
        out = _open_files(spec_file, {**spec, "error_fd": error_w}, log_file)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                str(LAUNCHER),
                str(spec_file),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=(error_w,),
                start_new_session=True,
                env={},
            )
        finally:
            os.close(out)
            os.close(error_w)
        return cls(proc, pid_file, error_r)

    async def started(self) -> str:
        """Wait until the launcher exec'd the command ("") or failed (the reason)."""
        loop = asyncio.get_running_loop()
        try:
            data = await loop.run_in_executor(None, os.read, self._error_r, 4096)
        finally:
            os.close(self._error_r)
        if not data:
            # The exec happened: the namespace is now the container's; pin it and remember it for cleanup.
            ident = Identity(self._proc.pid, self.identity.start_ticks, _mntns(self._proc.pid) or "")
            self._pin = _pin(ident)
            self.identity = ident if self._pin else Identity(ident.pid, ident.start_ticks, "")
            self._pid_file.write_text(json.dumps(self.identity.__dict__))
        return data.decode(errors="replace")

    async def wait(self) -> Exit:
        code = await self._proc.wait()
        self.exited.set()
        # Like a container's PID 1 exiting: whatever it left running in the namespace goes too.
        if self._pin is not None:
            kill_all(self.identity, signal.SIGKILL)
            self._pin.close()
            self._pin = None
        self._pid_file.unlink(missing_ok=True)
        if code < 0:
            return Exit(128 - code, -code, "")
        return Exit(code, None, "")

    def signal(self, sig: int) -> None:
        if self._pin is not None:
            kill_all(self.identity, sig)
        elif self._proc.returncode is None:  # exec'd without a namespace of its own (it exited at once)
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)


async def exec_in(ident: Identity, argv: list[str], env: dict[str, str], cwd: str, limit_s: float) -> int:
    """Run a command inside a running container (exec probes); its exit code, -1 on timeout."""
    proc = await asyncio.create_subprocess_exec(
        NSENTER,
        "-t",
        str(ident.pid),
        "-m",
        "-u",
        "-n",
        f"--wd={cwd}",
        "--",
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        return await asyncio.wait_for(proc.wait(), limit_s)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return -1


def _signal_recorded(pods_dir: Path, sig: int) -> list[tuple[Identity, _Pin]]:
    """Signal every container that a pid file names and whose first process still runs (its namespace
    pinned); forget the pid files. A container whose first process has exited is left alone: its
    namespace's number may be a stranger's by now."""
    found = []
    for pid_file in pods_dir.glob("*/*.pid"):
        try:
            ident = Identity(**json.loads(pid_file.read_text()))
        except (OSError, ValueError, TypeError):
            ident = None
        pid_file.unlink(missing_ok=True)
        pin = _pin(ident) if ident else None
        if ident and pin:
            kill_all(ident, sig)
            found.append((ident, pin))
    return found


async def kill_leftovers(pods_dir: Path, grace_s: float = 3.0) -> int:
    """Stop the processes that pid files under `pods_dir` name (an earlier agent's containers):
    SIGTERM, then SIGKILL after `grace_s`. Returns how many containers were still running."""
    found = _signal_recorded(pods_dir, signal.SIGTERM)
    try:
        deadline = asyncio.get_running_loop().time() + grace_s
        while found and asyncio.get_running_loop().time() < deadline:
            if not any(members(i.mntns) for i, _ in found):
                break
            await asyncio.sleep(0.1)
        for ident, _ in found:
            kill_all(ident, signal.SIGKILL)
    finally:
        for _, pin in found:
            pin.close()
    return len(found)
