"""The Grafana dashboard (rollfleet.dashboard, manifests/monitoring/grafana/rollfleet.json): the committed JSON is
its rendering, every query is PromQL that Prometheus' own parser accepts (promtool, as recording rules), and
every metric it reads is one the components or vLLM export."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from rollfleet import dashboard
from rollfleet.metrics import CATALOG

REPO = Path(__file__).resolve().parents[3]
JSON = REPO / "manifests" / "monitoring" / "grafana" / "rollfleet.json"
METRIC = re.compile(r"\b((?:rollfleet|vllm:)[a-zA-Z0-9_:]*)")


def vllm_metric_names() -> set[str]:
    """The metric names vLLM's Prometheus logger defines (read from its source: importing vLLM takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    return set(re.findall(r'"(vllm:[a-z_]+)"', source))


def test_the_committed_dashboard_is_the_rendering() -> None:
    assert JSON.read_text() == dashboard.render(), (
        "manifests/monitoring/grafana/rollfleet.json is stale: python -m rollfleet.dashboard > it"
    )
    panels = json.loads(JSON.read_text())["panels"]
    assert [t["expr"] for p in panels for t in p["targets"]] == dashboard.queries()


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (Debian's package; .ci/run installs it)"
    rules = [
        {"record": f"rollfleet_dashboard_query_{i}", "expr": q.replace("$namespace", ".*").replace("$fleet", ".*")}
        for i, q in enumerate(dashboard.queries())
    ]
    path = tmp_path / "queries.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_metric_a_panel_reads_is_exported() -> None:
    ours = {s.exposed for s in CATALOG} | {f"{s.name}_bucket" for s in CATALOG if s.kind == "histogram"}
    vllm = vllm_metric_names()
    for q in dashboard.queries():
        for name in METRIC.findall(q):
            if name.startswith("vllm:"):
                assert re.sub(r"_(total|bucket|sum|count)$", "", name) in vllm, f"{name}: not a vLLM metric ({q})"
            else:
                assert name in ours, f"{name}: not in docs/metrics.md ({q})"
