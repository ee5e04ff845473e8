"""Simulated node loss: `rollfleet cluster node stop|start NAME`.

A stopped node is a file `<state-dir>/control/<node>.stopped`. The agent looks at
these files every second: for a stopped node it kills the node's pods (SIGKILL, as
when a machine dies) and stops renewing its Lease and status, so the node controller
marks it NotReady and evicts its pods; removing the file brings it back. Talks to
nothing but those files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollfleet_dev.localcluster.nodeagent.logs import nodes_state_dir


def control_dir(state: Path) -> Path:
    return state / "control"


def stopped_nodes(state: Path) -> set[str]:
    d = control_dir(state)
    return {p.name.removesuffix(".stopped") for p in d.glob("*.stopped")} if d.is_dir() else set()


def set_stopped(state: Path, node: str, stopped: bool) -> None:
    path = control_dir(state) / f"{node}.stopped"
    if stopped:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    else:
        path.unlink(missing_ok=True)


def node_command(args: argparse.Namespace) -> int:
    state = Path(args.state_dir) if args.state_dir else nodes_state_dir()
    if not state.is_dir():
        print(f"error: no node agent state at {state}; is the cluster up?", file=sys.stderr)
        return 1
    set_stopped(state, args.name, args.action == "stop")
    print(f"node {args.name}: {'stopped (heartbeats off, pods killed)' if args.action == 'stop' else 'started'}")
    return 0


def add_node_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("node", help="simulate losing a node (stop) and getting it back (start)")
    p.add_argument("action", choices=["stop", "start"])
    p.add_argument("name", help="node name, e.g. gpu-1")
    p.add_argument("--state-dir", help="the node agent's state dir (default: $ROLLFLEET_STATE/nodes)")
    p.set_defaults(func=node_command)
    return p
