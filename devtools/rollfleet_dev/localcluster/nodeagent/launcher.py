"""Become one container: the pod's network namespace, a private mount namespace, volume binds, then exec.

Run by `processes` as `python -I -S launcher.py SPEC_FILE` in a new session (so the
container is one process group). Standard library only, so it starts in milliseconds
and does not depend on the project being importable. It deletes the spec file (it
holds the container's environment, secrets included) once read. If anything fails
before the exec, the reason goes to the error fd and the exit code is 127; a
successful exec closes that fd, which is how the agent knows the command started.
Talks to: the kernel (setns, unshare, mount, sethostname) and nobody else.
"""

import ctypes
import json
import os
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def _bind(source: str, target: str, read_only: bool) -> None:
    if not os.path.exists(source):
        os.makedirs(source, exist_ok=True)  # a subPath of an emptyDir that does not exist yet
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def become(spec: dict[str, Any]) -> None:
    if spec["netns"]:  # the pod's network namespace (none: hostNetwork)
        fd = os.open(spec["netns"], os.O_RDONLY)
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns {spec['netns']}")
        os.close(fd)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    # Nothing mounted from here on may propagate back to the host.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    hostname = spec["hostname"].encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    for root in spec["private_roots"]:
        os.makedirs(root, exist_ok=True)
        _mount("tmpfs", root, "tmpfs", 0, "mode=755")
    for m in spec["mounts"]:
        _bind(m["source"], m["target"], m["read_only"])
    os.makedirs(spec["cwd"], exist_ok=True)
    os.chdir(spec["cwd"])
    os.set_inheritable(spec["error_fd"], False)
    try:
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except FileNotFoundError:
        raise RuntimeError(f'exec: "{spec["argv"][0]}": executable file not found in $PATH') from None
    except PermissionError:
        raise RuntimeError(f'exec: "{spec["argv"][0]}": permission denied') from None


def main() -> None:
    path = sys.argv[1]
    with open(path) as f:
        spec = json.load(f)
    os.unlink(path)
    try:
        become(spec)
    except Exception as e:  # every failure before exec is reported the same way
        msg = str(e) if isinstance(e, OSError | RuntimeError) else f"{type(e).__name__}: {e}"
        os.write(spec["error_fd"], msg.encode())
        print(f"rollfleet-nodeagent: cannot start container: {msg}", file=sys.stderr)
        os._exit(127)


if __name__ == "__main__":
    main()
