"""Rollfleet's alerts (manifests/monitoring/prometheusrule.yaml) under Prometheus' own rule engine: `promtool
check rules`, then `promtool test rules` with tests/unit/monitoring/alerts_test.yaml (each alert fires and
resolves). promtool is Debian's `prometheus` package, which .ci/run installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from rollfleet.metrics import CATALOG

REPO = Path(__file__).resolve().parents[3]
RULE = REPO / "manifests" / "monitoring" / "prometheusrule.yaml"
TESTS = Path(__file__).with_name("alerts_test.yaml")


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (Debian's package; .ci/run installs it)"
    return found


def rules_file(directory: Path) -> Path:
    rule = yaml.safe_load(RULE.read_text())
    assert rule["kind"] == "PrometheusRule"
    path = directory / "rollfleet.rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def test_the_rules_are_valid_and_every_alert_fires_and_resolves_in_promtool(tmp_path: Path) -> None:
    rules = rules_file(tmp_path)
    checked = run("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shutil.copy(TESTS, tmp_path / TESTS.name)
    tested = run("test", "rules", str(tmp_path / TESTS.name))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(TESTS.read_text())["tests"]
    exercised = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == exercised, f"alerts with no firing test: {sorted(alerts - exercised)}"


def test_every_alert_reads_metrics_the_components_export() -> None:
    exported = {s.exposed for s in CATALOG}
    rule = yaml.safe_load(RULE.read_text())
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            names = {word for word in _identifiers(r["expr"]) if word.startswith("rollfleet_")}
            assert names and names <= exported, f"{r['alert']}: {sorted(names - exported)} not in docs/metrics.md"


def _identifiers(expr: str) -> set[str]:
    import re

    return set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
