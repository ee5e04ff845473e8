"""Container logs on disk, and `rollfleet cluster logs`.

The agent writes each container's stdout+stderr to
`<state-dir>/pods/<namespace>_<pod>_<uid>/<container>.log`; when a container
restarts, the previous run's file becomes `<container>.<restart>.log`. This module
names those files and prints them; it talks to nothing but the files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rollfleet.errors import RollfleetError
from rollfleet_dev.localcluster.paths import state_dir


def pod_dir_name(namespace: str, name: str, uid: str) -> str:
    return f"{namespace}_{name}_{uid}"


def nodes_state_dir() -> Path:
    """Where `rollfleet cluster up` tells the agent to keep its state."""
    return state_dir() / "nodes"


class LogsError(RollfleetError, LookupError):
    pass


# kubelet's limits for terminationMessagePolicy FallbackToLogsOnError.
TAIL_LINES = 80
TAIL_BYTES = 2048


def log_tail(path: Path) -> str:
    """A failed container's termination message from its log: the last 80 lines, at most 2048 bytes."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode(errors="replace").splitlines()[-TAIL_LINES:]
    return "\n".join(lines)


def find_log(pods_dir: Path, namespace: str, pod: str, container: str | None, previous: bool) -> Path:
    """The log file of a pod's container (the newest pod of that name if it was recreated)."""
    dirs = [d for d in pods_dir.glob(f"{namespace}_{pod}_*") if d.name.rsplit("_", 1)[0] == f"{namespace}_{pod}"]
    if not dirs:
        raise LogsError(f'no logs for pod "{pod}" in namespace "{namespace}" under {pods_dir}')
    pod_dir = max(dirs, key=lambda d: d.stat().st_mtime)
    if container is None:
        meta = json.loads((pod_dir / "pod.json").read_text()) if (pod_dir / "pod.json").exists() else {}
        names = meta.get("containers") or sorted(p.name.split(".")[0] for p in pod_dir.glob("*.log"))
        container = meta.get("defaultContainer") or (names[0] if names else None)
        if container is None:
            raise LogsError(f"pod {pod} has no container logs yet")
    if not previous:
        path = pod_dir / f"{container}.log"
        if not path.exists():
            raise LogsError(
                f'container "{container}" of pod "{pod}" has no log (yet); files: '
                f"{sorted(p.name for p in pod_dir.glob('*.log'))}"
            )
        return path
    runs = sorted(
        (int(p.name.split(".")[-2]), p) for p in pod_dir.glob(f"{container}.*.log") if p.name.split(".")[-2].isdigit()
    )
    if not runs:
        raise LogsError(f'previous terminated container "{container}" in pod "{pod}" not found')
    return runs[-1][1]


def _follow(path: Path) -> None:
    with open(path, "rb") as f:
        while True:
            chunk = f.read(65536)
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            try:
                # The container restarted: its old file was renamed; continue with the new one.
                if os.stat(path).st_ino != os.fstat(f.fileno()).st_ino:
                    f.close()
                    f = open(path, "rb")  # noqa: SIM115 - replaces the file being followed
                    continue
            except FileNotFoundError:
                pass
            time.sleep(0.5)


def logs_command(args: argparse.Namespace) -> int:
    """`rollfleet cluster logs POD [-n NS] [-c CONTAINER] [--previous] [-f]`."""
    pods_dir = Path(args.state_dir) / "pods" if args.state_dir else nodes_state_dir() / "pods"
    try:
        path = find_log(pods_dir, args.namespace, args.pod, args.container, args.previous)
    except LogsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.follow:
        try:
            _follow(path)
        except KeyboardInterrupt:
            return 0
    sys.stdout.buffer.write(path.read_bytes())
    return 0


def add_logs_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("logs", help="print a container's log (pods of the local cluster's node agent)")
    p.add_argument("pod")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("-c", "--container", help="default: the pod's default container, else its first")
    p.add_argument("-p", "--previous", action="store_true", help="the log of the previous run")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--state-dir", help="the node agent's state dir (default: $ROLLFLEET_STATE/nodes)")
    p.set_defaults(func=logs_command)
    return p
