"""The `rollfleet` command: subcommands from installed packages, and errors as one line."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from rollfleet import cli
from rollfleet.errors import RollfleetError

REPO = Path(__file__).resolve().parents[2]


def test_the_dev_tooling_adds_cluster_and_demo() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["cluster", "status"]).func.__module__ == "rollfleet_dev.cli"
    assert parser.parse_args(["demo"]).func.__module__ == "rollfleet_dev.cli"


def _with_command(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Adds `rollfleet boom`, which raises `error`, as an installed package would add a command."""

    def add(sub: argparse._SubParsersAction) -> None:
        def run(args: argparse.Namespace) -> int:
            raise error

        sub.add_parser("boom").set_defaults(func=run)

    monkeypatch.setattr(cli, "_add_installed", add)


def test_an_error_of_rollfleet_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _with_command(monkeypatch, RollfleetError("no local cluster: run `rollfleet cluster up`"))
    assert cli.main(["boom"]) == 1
    assert capsys.readouterr().err == "rollfleet: no local cluster: run `rollfleet cluster up`\n"


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_command(monkeypatch, KeyError("bug"))
    with pytest.raises(KeyError):
        cli.main(["boom"])


def test_no_product_module_imports_the_dev_tooling() -> None:
    offenders = []
    for path in sorted((REPO / "operator").rglob("*.py")) + sorted((REPO / "engine_image").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "rollfleet_dev"]
    assert offenders == []
