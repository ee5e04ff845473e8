"""The node agent's `rollfleet cluster` subcommands: `logs` and `node stop|start`.

`rollfleet.cli` calls `add_cluster_subcommands` with its `cluster` subparser group.
"""

from __future__ import annotations

import argparse

from rollfleet_dev.localcluster.nodeagent.control import add_node_parser
from rollfleet_dev.localcluster.nodeagent.logs import add_logs_parser


def add_cluster_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_logs_parser(subparsers)
    add_node_parser(subparsers)
