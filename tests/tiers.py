"""The test tiers (docs/testing.md): what each runs and its time budget, in one place.

A test's markers place it: `cluster` (it needs a Kubernetes cluster) and `engine` (it needs real
vLLM), and a tier's own marker where it has one (`multipod`: engines across processes, run last in
the local lane, beside the acceptance tier). Each tier runs its paths with its marker expression, so
every test is in exactly one tier as long as it lives under its tier's paths; `check` makes sure of
that.

    python -m tests.tiers run TIER [pytest args]    run one tier (make test-unit, test-engine, ...)
    python -m tests.tiers budget TIER               its budget in seconds (hack/test.sh prints against it)
    python -m tests.tiers check [--table] [--was F]  every test is in one tier; with --table, also that
                                                    docs/testing.md's table places each one there; with
                                                    --was, that it names each test id listed in F (ids of
                                                    an earlier commit: `pytest --collect-only -q` there)
    python -m tests.tiers ids [--functions]         every test id and its tier, one per line
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE_DOC = ROOT / "docs" / "testing.md"


@dataclass(frozen=True)
class Tier:
    name: str
    purpose: str
    paths: tuple[str, ...]
    cluster: bool  # its tests carry the `cluster` marker
    engine: bool  # ... and the `engine` marker
    budget_s: int  # on CI's 2-core machine, warm caches, as `make test` runs it (docs/testing.md)
    on_kind: bool = False  # its cluster is kind's (real kubelets and containers), not the local one
    pytest_args: tuple[str, ...] = ()
    marker: str | None = None  # a marker of its own: its tests carry it, no other tier runs them

    @property
    def marks(self) -> str:
        own = [self.marker] if self.marker else [f"not {m}" for m in OWN_MARKERS]
        return " and ".join(
            [*(m if on else f"not {m}" for m, on in (("cluster", self.cluster), ("engine", self.engine))), *own]
        )


TIERS = (
    # One pytest worker per core: a third of the tier's time is tests waiting on the processes they start.
    Tier(
        "unit",
        "no cluster and no engine",
        ("tests/unit",),
        cluster=False,
        engine=False,
        budget_s=120,
        pytest_args=("-n", "auto", "--dist", "worksteal"),
    ),
    Tier(
        "engine",
        "real vLLM without a cluster; the engine contract (simulator and vLLM)",
        ("tests/engine", "tests/sync", "tests/collective"),
        cluster=False,
        engine=True,
        budget_s=420,  # in the local lane, beside kind coming up, then the acceptance tier
    ),
    Tier(
        "multipod",
        "engines across processes (real vLLM, vLLM's multi-node modes), no cluster",
        ("tests/engine",),
        cluster=False,
        engine=True,
        budget_s=420,  # last in the local lane, beside the acceptance tier
        marker="multipod",
    ),
    Tier(
        "controlplane",
        "a real cluster, operator, gateway, sidecar and runner; simulated engines",
        ("e2e",),
        cluster=True,
        engine=False,
        budget_s=1020,  # in the local lane, beside the acceptance tier
    ),
    Tier(
        "acceptance",
        "real vLLM engines in real containers on kind",
        ("e2e",),
        cluster=True,
        engine=True,
        budget_s=1200,  # the kind lane, beside the local lane
        on_kind=True,
    ),
)
BY_NAME = {t.name: t for t in TIERS}
OWN_MARKERS = tuple(t.marker for t in TIERS if t.marker)


def tier_of(markers: Iterable[str]) -> Tier:
    """The tier a test's markers place it in."""
    names = set(markers)
    own = next((m for m in OWN_MARKERS if m in names), None)
    return next(
        t for t in TIERS if t.cluster == ("cluster" in names) and t.engine == ("engine" in names) and t.marker == own
    )


def misplaced(nodeid: str, tier: Tier) -> str | None:
    """Why `make test` would not run this test (its file is outside its tier's paths), or None."""
    if any(nodeid == p or nodeid.startswith(p.rstrip("/") + "/") for p in tier.paths):
        return None
    return f"{nodeid}: its markers place it in the {tier.name} tier, which runs only {', '.join(tier.paths)}"


class _Collector:
    def __init__(self) -> None:
        self.items: list[tuple[str, Tier]] = []

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.items = [(item.nodeid, tier_of(m.name for m in item.iter_markers())) for item in items]


def collect() -> list[tuple[str, Tier]]:
    """Every test id of the repository with its tier (a collection, no test run)."""
    collector = _Collector()
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT)], plugins=[collector])
        finally:
            sys.stdout = stdout
    if code != 0:
        raise SystemExit(f"collecting the tests failed (pytest exit {code}): run `pytest --collect-only` to see why")
    return collector.items


def function_id(nodeid: str) -> str:
    """The test function of an id: its parameter cases share it."""
    return nodeid.split("[", 1)[0]


_ROW = re.compile(r"^\| `([^`]+::[^`]+)` \| ([a-z, ]+) \|(.*)\|$")


def table(text: str) -> dict[str, tuple[set[str], set[str]]]:
    """docs/testing.md's table: test function (as it is now) -> (the tiers it names, the ids it was before)."""
    rows = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(1)] = ({t.strip() for t in m.group(2).split(",")}, set(re.findall(r"`([^`]+::[^`]+)`", m[3])))
    return rows


def unnamed(earlier: Iterable[str], rows: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """Ids of an earlier commit that the table names neither as a test now nor as what one was before."""
    named = set(rows) | {was for _, before in rows.values() for was in before}
    return sorted({function_id(i) for i in earlier} - named)


def table_problems(items: list[tuple[str, Tier]], rows: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """Where the table and the tests disagree: a test missing from it, or placed in another tier."""
    tiers: dict[str, set[str]] = {}
    for nodeid, tier in items:
        tiers.setdefault(function_id(nodeid), set()).add(tier.name)
    problems = [f"{fid}: not in the table" for fid in tiers if fid not in rows]
    for fid, found in tiers.items():
        if fid in rows and rows[fid][0] != found:
            named = ", ".join(sorted(rows[fid][0]))
            problems.append(f"{fid}: the table says {named}, it is {', '.join(sorted(found))}")
    problems += [f"{fid}: in the table, no such test" for fid in rows if fid not in tiers]
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.tiers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("tier", choices=BY_NAME)
    budget = sub.add_parser("budget")
    budget.add_argument("tier", choices=BY_NAME)
    check = sub.add_parser("check")
    check.add_argument("--table", action="store_true")
    check.add_argument("--was", type=Path, default=None)
    ids = sub.add_parser("ids")
    ids.add_argument("--functions", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.command == "run":
        tier = BY_NAME[args.tier]
        os.chdir(ROOT)
        if tier.on_kind and "ROLLFLEET_E2E_PROVIDER" not in os.environ:
            # `make kind-up` made the cluster; ROLLFLEET_E2E_PROVIDER=local runs the tier on the local one.
            from rollfleet_dev.kind.cluster import kubeconfig_path

            os.environ.update(ROLLFLEET_E2E_PROVIDER="existing", KUBECONFIG=str(kubeconfig_path()))
        plugin = ("-p", "tests.failures_now")
        argv = [sys.executable, "-m", "pytest", *plugin, "-m", tier.marks, *tier.pytest_args, *rest, *tier.paths]
        os.execvp(sys.executable, argv)
    if rest:
        parser.error(f"unexpected arguments: {' '.join(rest)}")
    if args.command == "budget":
        print(BY_NAME[args.tier].budget_s)
        return 0
    items = collect()
    if args.command == "ids":
        seen = dict.fromkeys((function_id(n) if args.functions else n, t.name) for n, t in items)
        for nodeid, name in seen:
            print(f"{nodeid}\t{name}")
        return 0
    problems = [p for p in (misplaced(n, t) for n, t in items) if p]
    if args.table or args.was:
        rows = table(TABLE_DOC.read_text())
        problems += table_problems(items, rows)
        if args.was:
            earlier = [line.strip() for line in args.was.read_text().splitlines() if "::" in line]
            problems += [f"{fid}: a test of {args.was} the table does not name" for fid in unnamed(earlier, rows)]
    for p in problems:
        print(p, file=sys.stderr)
    counts = {t.name: sum(1 for _, it in items if it is t) for t in TIERS}
    print(f"{len(items)} tests: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
