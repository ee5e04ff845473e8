"""`rollfleet`: the one command a person runs.

Each subcommand group lives with its component; this module only wires argparse
and imports lazily, so `rollfleet cluster status` does not import vLLM or kopf.
"""

from __future__ import annotations

import argparse
import sys

from rollfleet.api.common import DEFAULT_ROLLFLEET_IMAGE
from rollfleet.errors import RollfleetError

# Entry-point group through which installed packages add subcommands (rollfleet_dev: cluster, demo).
COMMANDS_GROUP = "rollfleet.commands"


def _add_sync(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rollfleet.sync import server

    p = sub.add_parser("sync", help="the weight sync sidecar of a trainer pod (pushes new weights to a fleet)")
    server.add_arguments(p)
    p.set_defaults(func=server.main)


def _add_gateway(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rollfleet.gateway import server

    p = sub.add_parser("gateway", help="the fleet's data plane: routing, abort by id, cancellation, failover")
    server.add_arguments(p)
    p.set_defaults(func=server.run)


def _add_operator(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rollfleet.controller import main as operator_main  # light: kopf is imported when it runs

    p = sub.add_parser("operator", help="run the operator (RolloutFleet, RolloutRequest) with kopf, in-process")
    operator_main.add_arguments(p)
    p.set_defaults(func=operator_main.run)


def _add_request_runner(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rollfleet.contract import TOKEN_FILE

    p = sub.add_parser("request-runner", help="run one RolloutRequest's samples (the process of its runner Job)")
    p.add_argument("--namespace", required=True, help="the RolloutRequest's namespace")
    p.add_argument("--name", help="the RolloutRequest's name")
    p.add_argument("--uid", help="its uid: a new request of the same name is not this one's to run")
    p.add_argument("--spare", help="run as this spare runner: wait for a request, instead of --name and --uid")
    p.add_argument("--token-file", default=TOKEN_FILE, help="the fleet's admin token (its Secret, mounted)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig when not in a pod (default: $KUBECONFIG)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    def run(args: argparse.Namespace) -> int:
        from rollfleet.controller.requests import worker

        if (args.spare is None) == (args.name is None or args.uid is None):
            p.error("give --name and --uid (a request), or --spare (a spare runner)")
        return worker.main(
            args.namespace, args.name, args.uid, args.spare, args.token_file, args.kubeconfig, args.verbose
        )

    p.set_defaults(func=run)


def _add_results(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("results", help="print a RolloutRequest's stored samples as JSONL")
    p.add_argument("target", help="rr/NAME")
    p.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    p.add_argument(
        "--image",
        default=DEFAULT_ROLLFLEET_IMAGE,
        help="image of the reader pod, for results on a PersistentVolumeClaim (default: %(default)s)",
    )

    def run(args: argparse.Namespace) -> int:
        from rollfleet.controller.requests.results import print_results

        return print_results(args.target, args.namespace, args.kubeconfig, args.image, sys.stdout)

    p.set_defaults(func=run)

    s = sub.add_parser("results-server", help="serve one results file (the process of `results`' reader pod)")
    s.add_argument("--file", required=True, help="the JSONL file on the mounted claim")
    s.add_argument("--token-sha256", required=True, help="sha256 (hex) of the token a caller must send")
    s.add_argument("--port", type=int, required=True, help="port to listen on")
    s.add_argument("--host", default="0.0.0.0", help="address to bind (default: every address of the pod)")

    def serve(args: argparse.Namespace) -> int:
        from rollfleet.controller.requests.reader import serve

        return serve(args.file, args.token_sha256, args.host, args.port)

    s.set_defaults(func=serve)


def _add_top(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="a live view of fleets: engines, phase, weights, running requests, tokens/s, pause")
    p.add_argument("fleet", nargs="?", default=None, help="one fleet (default: every fleet of the namespace)")
    p.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one screen (tokens/s over one interval) and exit")

    def run(args: argparse.Namespace) -> int:
        from rollfleet import top

        if args.interval <= 0:
            raise top.TopError(f"--interval must be more than 0 seconds, not {args.interval}")
        return top.run(args.namespace, args.fleet, args.kubeconfig, args.interval, args.once, sys.stdout)

    p.set_defaults(func=run)


def _add_installed(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Subcommands of other installed packages (`rollfleet.commands` entry points): the
    development tooling's `cluster` and `demo` (rollfleet_dev), absent from the operator image."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        entry.load()(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollfleet", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sync(sub)
    _add_gateway(sub)
    _add_operator(sub)
    _add_request_runner(sub)
    _add_results(sub)
    _add_top(sub)
    _add_installed(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except RollfleetError as e:  # a person reads this: one clear line, not a traceback (bugs keep theirs)
        print(f"rollfleet: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
