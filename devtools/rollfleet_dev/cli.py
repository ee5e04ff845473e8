"""`rollfleet cluster ...`, `rollfleet kind ...` and `rollfleet demo`: the subcommands this package
adds to `rollfleet`.

`rollfleet.cli` finds `add_cluster`, `add_kind` and `add_demo` through the `rollfleet.commands`
entry points (devtools/pyproject.toml) and calls each with its top-level subparser group.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path


def _cluster_up(args: argparse.Namespace) -> int:
    from rollfleet_dev.localcluster import controlplane

    layout = controlplane.up(pools=Path(args.pools))
    print(layout.kubeconfig)
    return 0


def _cluster_down(args: argparse.Namespace) -> int:
    from rollfleet_dev.localcluster import controlplane

    controlplane.down(purge=not args.keep_state)
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    from rollfleet_dev.localcluster import controlplane

    states = controlplane.status()
    for component, state in states.items():
        print(f"{component:<26} {state}")
    return 0 if all(s.endswith("healthy)") and "not healthy" not in s for s in states.values()) else 1


def _cluster_kubeconfig(args: argparse.Namespace) -> int:
    from rollfleet_dev.localcluster import controlplane

    layout = controlplane.Layout()
    if not layout.kubeconfig.exists():
        print("no local cluster: run `rollfleet cluster up`", file=sys.stderr)
        return 1
    print(layout.kubeconfig)
    return 0


def _cluster_kwok(args: argparse.Namespace) -> int:
    from rollfleet_dev import kwok

    kwok.up(args.nodes) if args.action == "up" else kwok.down()
    return 0


def _cluster_build(args: argparse.Namespace) -> int:
    from rollfleet_dev import kwok, lws
    from rollfleet_dev.gobuild import ensure_tool
    from rollfleet_dev.helm import helm_binary
    from rollfleet_dev.localcluster import build

    b = build.ensure_built()
    for name, path in vars(b).items():
        print(f"{name:<24} {path}")
    # Built with the control plane, installed only when asked (`rollfleet cluster lws install`).
    print(f"{'lws_manager':<24} {ensure_tool(lws.LWS) / 'cmd'}")
    # The scale harness's fake GPU nodes (`rollfleet cluster kwok up`).
    print(f"{'kwok':<24} {ensure_tool(kwok.KWOK) / 'kwok'}")
    # The chart's tests and the README's Helm install (`rollfleet helm`).
    print(f"{'helm':<24} {helm_binary()}")
    return 0


def add_cluster(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rollfleet_dev.localcluster.controlplane import DEFAULT_POOLS
    from rollfleet_dev.localcluster.nodeagent import cli as agent_cli

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
    csub.add_parser("build", help="build the control-plane binaries (and LWS's manager, KWOK) only").set_defaults(
        func=_cluster_build
    )
    p = csub.add_parser(
        "lws", help="install (or uninstall) LeaderWorkerSet, which engines of several pods need, from its module"
    )
    p.add_argument("action", choices=["install", "uninstall"])
    p.set_defaults(func=_cluster_lws)
    p = csub.add_parser(
        "kwok", help="simulated GPU nodes (KWOK) and one process serving every engine on them: the scale harness"
    )
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--nodes", type=int, default=4, help="fake GPU nodes, 510 pods each (default: %(default)s)")
    p.set_defaults(func=_cluster_kwok)
    agent_cli.add_cluster_subcommands(csub)

    def kubeconfig() -> Path:
        from rollfleet_dev.localcluster import controlplane

        return controlplane.Layout().kubeconfig

    _add_helm(csub, kubeconfig, "rollfleet cluster up")


def _cluster_lws(args: argparse.Namespace) -> int:
    from rollfleet_dev import lws

    lws.install_local() if args.action == "install" else lws.uninstall_local()
    return 0


def _kind_up(args: argparse.Namespace) -> int:
    from rollfleet_dev.kind import cluster

    print(cluster.up(clean=args.clean))
    return 0


def _kind_down(args: argparse.Namespace) -> int:
    from rollfleet_dev.kind import cluster

    cluster.down()
    return 0


def _kind_stop(args: argparse.Namespace) -> int:
    from rollfleet_dev.kind import cluster

    cluster.stop()
    return 0


def _kind_build(args: argparse.Namespace) -> int:
    from rollfleet_dev.kind import nodeimage

    print(nodeimage.ensure_node_image())
    return 0


def _kind_lws(args: argparse.Namespace) -> int:
    from rollfleet_dev import lws

    lws.install_kind() if args.action == "install" else lws.uninstall_kind()
    return 0


def _kind_kubeconfig(args: argparse.Namespace) -> int:
    from rollfleet_dev.kind import cluster

    if not cluster.kubeconfig_path().exists():
        print("no kind cluster: run `make kind-up`", file=sys.stderr)
        return 1
    print(cluster.kubeconfig_path())
    return 0


def _helm_on(kubeconfig_of: Callable[[], Path], missing: str) -> Callable[[argparse.Namespace], int]:
    """`... helm ARGS`: the pinned Helm (rollfleet_dev.helm) against one of the project's clusters."""

    def run(args: argparse.Namespace) -> int:
        from rollfleet_dev.helm import helm_binary

        kubeconfig = kubeconfig_of()
        if not kubeconfig.exists():
            print(f"no cluster: run `{missing}`", file=sys.stderr)
            return 1
        binary = helm_binary()
        os.execve(binary, [str(binary), *args.helm_args], {**os.environ, "KUBECONFIG": str(kubeconfig)})

    return run


def _add_helm(
    parent: argparse._SubParsersAction[argparse.ArgumentParser], kubeconfig_of: Callable[[], Path], missing: str
) -> None:
    p = parent.add_parser(
        "helm", help="run Helm (built from its module) against this cluster: `helm install rollfleet charts/rollfleet`"
    )
    p.add_argument("helm_args", nargs=argparse.REMAINDER, help="helm's own arguments")
    p.set_defaults(func=_helm_on(kubeconfig_of, missing))


def add_kind(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kind = sub.add_parser("kind", help="the e2e kind cluster (GPU node pools) on this machine, built offline")
    ksub = kind.add_subparsers(dest="kind_command", required=True)
    up = ksub.add_parser(
        "up", help="build the node image (once, cached), create the cluster, load the images; idempotent"
    )
    up.add_argument(
        "--clean", action="store_true", help="delete every namespace but Kubernetes' own from a cluster that is kept"
    )
    up.set_defaults(func=_kind_up)
    ksub.add_parser("down", help="delete the cluster, its containers and network").set_defaults(func=_kind_down)
    ksub.add_parser(
        "stop", help="stop the node containers, keeping the cluster and its images (`up` starts it again)"
    ).set_defaults(func=_kind_stop)
    ksub.add_parser("build", help="build the node image only").set_defaults(func=_kind_build)
    p = ksub.add_parser("lws", help="install (or uninstall) LeaderWorkerSet, as its release does, from its module")
    p.add_argument("action", choices=["install", "uninstall"])
    p.set_defaults(func=_kind_lws)
    ksub.add_parser("kubeconfig", help="print the kubeconfig's path").set_defaults(func=_kind_kubeconfig)

    def kubeconfig() -> Path:
        from rollfleet_dev.kind import cluster

        return cluster.kubeconfig_path()

    _add_helm(ksub, kubeconfig, "make kind-up")


def add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def run(args: argparse.Namespace) -> int:
        from rollfleet_dev import demo

        return demo.main()

    sub.add_parser(
        "demo", help="the walkthrough (`make demo`): local cluster, operator, a fleet, every feature"
    ).set_defaults(func=run)
