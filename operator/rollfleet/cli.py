"""`rollfleet`: the one command a person runs.

Each subcommand group lives with its component; this module only wires argparse
and imports lazily, so `rollfleet cluster status` does not import vLLM or kopf.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cluster_up(args: argparse.Namespace) -> int:
    from rollfleet.localcluster import controlplane

    layout = controlplane.up(pools=Path(args.pools))
    print(layout.kubeconfig)
    return 0


def _cluster_down(args: argparse.Namespace) -> int:
    from rollfleet.localcluster import controlplane

    controlplane.down(purge=not args.keep_state)
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    from rollfleet.localcluster import controlplane

    states = controlplane.status()
    for component, state in states.items():
        print(f"{component:<26} {state}")
    return 0 if all(s.endswith("healthy)") and "not healthy" not in s for s in states.values()) else 1


def _cluster_kubeconfig(args: argparse.Namespace) -> int:
    from rollfleet.localcluster import controlplane

    layout = controlplane.Layout()
    if not layout.kubeconfig.exists():
        print("no local cluster: run `rollfleet cluster up`", file=sys.stderr)
        return 1
    print(layout.kubeconfig)
    return 0


def _cluster_build(args: argparse.Namespace) -> int:
    from rollfleet.localcluster import build

    b = build.ensure_built()
    for name, path in vars(b).items():
        print(f"{name:<24} {path}")
    return 0


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    from rollfleet.localcluster.controlplane import DEFAULT_POOLS

    cluster = sub.add_parser("cluster", help="a real local Kubernetes cluster with GPU node pools (no Docker)")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    p = csub.add_parser("up", help="build (once, cached) and start the control plane and node agent")
    p.add_argument("--pools", default=str(DEFAULT_POOLS), help="node pools file (default: %(default)s)")
    p.set_defaults(func=_cluster_up)
    p = csub.add_parser("down", help="stop everything and free the ports")
    p.add_argument("--keep-state", action="store_true", help="keep etcd data, certificates and logs")
    p.set_defaults(func=_cluster_down)
    csub.add_parser("status", help="what runs, and whether it is healthy").set_defaults(func=_cluster_status)
    csub.add_parser("kubeconfig", help="print the admin kubeconfig's path").set_defaults(func=_cluster_kubeconfig)
    csub.add_parser("build", help="build the control-plane binaries only").set_defaults(func=_cluster_build)
    from rollfleet.localcluster.nodeagent import cli as agent_cli

    agent_cli.add_cluster_subcommands(csub)


def _add_sync(sub: argparse._SubParsersAction) -> None:
    from rollfleet.sync import server

    p = sub.add_parser("sync", help="the weight sync sidecar of a trainer pod (pushes new weights to a fleet)")
    server.add_arguments(p)
    p.set_defaults(func=server.main)


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    from rollfleet.gateway import server

    p = sub.add_parser("gateway", help="the fleet's data plane: routing, abort by id, cancellation, failover")
    server.add_arguments(p)
    p.set_defaults(func=server.run)


def _add_operator(sub: argparse._SubParsersAction) -> None:
    from rollfleet.controller import main as operator_main  # light: kopf is imported when it runs

    p = sub.add_parser("operator", help="run the operator (RolloutFleet, RolloutRequest) with kopf, in-process")
    operator_main.add_arguments(p)
    p.set_defaults(func=operator_main.run)


def _add_results(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("results", help="print a RolloutRequest's stored samples as JSONL")
    p.add_argument("target", help="rr/NAME")
    p.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")

    def run(args: argparse.Namespace) -> int:
        from rollfleet.controller.requests.results import print_results

        return print_results(args.target, args.namespace, args.kubeconfig, sys.stdout)

    p.set_defaults(func=run)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    def run(args: argparse.Namespace) -> int:
        from rollfleet import demo

        return demo.main()

    sub.add_parser("demo", help="the walkthrough (`make demo`): local cluster, operator, a fleet, every feature"
                   ).set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollfleet", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_cluster(sub)
    _add_sync(sub)
    _add_gateway(sub)
    _add_operator(sub)
    _add_results(sub)
    _add_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a person reads this: one clear line, not a traceback
        from rollfleet.localcluster.build import BuildError
        from rollfleet.localcluster.controlplane import ClusterError

        if isinstance(e, ClusterError | BuildError):
            print(f"rollfleet: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
