"""Rollfleet's Grafana dashboard as code: `python -m rollfleet.dashboard` renders manifests/monitoring/grafana/.

Each panel is a title and its PromQL queries over the catalogued metrics (`rollfleet.metrics`) and vLLM's own;
a unit test holds the committed JSON to this rendering and checks every query's syntax with promtool and its
metric names against the catalogue and vLLM. `$namespace` and `$fleet` are the dashboard's variables (the
label each scrape job gives its targets: manifests/monitoring/).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

SELECT = 'namespace=~"$namespace",fleet=~"$fleet"'


def quantile(q: float, histogram: str, by: str, window: str, select: str = SELECT) -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({histogram}_bucket{{{select}}}[{window}])))"


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    width: int = 12


def latency_panel(title: str, histogram: str, window: str) -> Panel:
    """A histogram's median and 99th percentile over `window`."""
    return Panel(
        title, tuple((quantile(q, histogram, "le", window), f"p{round(q * 100)}") for q in (0.5, 0.99)), unit="s"
    )


PANELS: tuple[Panel, ...] = (
    Panel(
        "Engines serving / wanted",
        (
            (f'sum by (namespace, fleet) (rollfleet_operator_engines{{{SELECT},phase=~"Ready|Paused"}})', "serving"),
            (f"sum by (namespace, fleet) (rollfleet_operator_engines_wanted{{{SELECT}}})", "wanted"),
        ),
    ),
    Panel("Engines by phase", ((f"sum by (phase) (rollfleet_operator_engines{{{SELECT}}})", "{{phase}}"),)),
    Panel(
        "Tokens/s per engine",
        ((f"sum by (pod) (rate(vllm:generation_tokens_total{{{SELECT}}}[1m]))", "{{pod}}"),),
        unit="tokens/s",
    ),
    Panel(
        "Running and waiting requests per engine",
        (
            (f"sum by (pod) (vllm:num_requests_running{{{SELECT}}})", "{{pod}} running"),
            (f"sum by (pod) (vllm:num_requests_waiting{{{SELECT}}})", "{{pod}} waiting"),
        ),
    ),
    Panel(
        "KV cache use per engine", ((f"max by (pod) (vllm:kv_cache_usage_perc{{{SELECT}}})", "{{pod}}"),), "percentunit"
    ),
    Panel(
        "Pause",
        (
            (f"max by (fleet) (rollfleet_operator_fleet_paused{{{SELECT}}})", "{{fleet}} paused"),
            (f"max by (fleet) (rollfleet_operator_fleet_pause_seconds{{{SELECT}}})", "{{fleet}} pause length (s)"),
        ),
    ),
    Panel(
        "Weight push phases (median, 1 h)",
        ((quantile(0.5, "rollfleet_sync_push_phase_seconds", "le, phase", "1h", 'fleet=~"$fleet"'), "{{phase}}"),),
        unit="s",
    ),
    Panel(
        "Weight pushes by result (1 h)",
        (('sum by (result) (increase(rollfleet_sync_pushes_total{fleet=~"$fleet"}[1h]))', "{{result}}"),),
    ),
    Panel(
        "Weight generation: fleet and each engine",
        (
            (f"max by (fleet) (rollfleet_operator_fleet_weight_generation{{{SELECT}}})", "{{fleet}}"),
            (f"max by (engine) (rollfleet_operator_engine_weight_generation{{{SELECT}}})", "{{engine}}"),
        ),
    ),
    Panel(
        "Engines off the fleet's version",
        ((f"sum by (fleet) (rollfleet_operator_fleet_version_skew_engines{{{SELECT}}})", "{{fleet}}"),),
    ),
    Panel(
        "Gateway requests/s by outcome",
        ((f"sum by (outcome) (rate(rollfleet_gateway_requests_total{{{SELECT}}}[1m]))", "{{outcome}}"),),
        unit="reqps",
    ),
    latency_panel("Gateway request latency", "rollfleet_gateway_request_seconds", "5m"),
    Panel(
        "Aborts by answer (pending, unconfirmed: the engine did not confirm)",
        ((f"sum by (result) (increase(rollfleet_gateway_abort_results_total{{{SELECT}}}[5m]))", "{{result}}"),),
    ),
    latency_panel("Abort to engine idle (from the call to the engine's word)", "rollfleet_gateway_abort_seconds", "1h"),
    Panel(
        "Tokens/s served by weight lag (generations behind the newest)",
        ((f"sum by (lag) (rate(rollfleet_gateway_tokens_total{{{SELECT}}}[1m]))", "lag {{lag}}"),),
        unit="tokens/s",
    ),
    Panel(
        "RolloutRequests: samples/s by outcome",
        (
            (
                "sum by (outcome) (rate(rollfleet_operator_request_samples_finished_total"
                '{namespace=~"$namespace"}[5m]))',
                "{{outcome}}",
            ),
        ),
    ),
    Panel(
        "RolloutRequests: samples by outcome",
        (('sum by (outcome) (rollfleet_operator_request_samples{namespace=~"$namespace"})', "{{outcome}}"),),
    ),
)


def queries() -> list[str]:
    return [q for p in PANELS for q, _ in p.queries]


def _variable(name: str, query: str) -> dict[str, object]:
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "refresh": 2,
    }


def render() -> str:
    panels = []
    for i, p in enumerate(PANELS):
        x = (i * p.width) % 24
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": p.title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": p.width, "x": x, "y": (i * p.width) // 24 * 8},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": q, "legendFormat": legend}
                    for j, (q, legend) in enumerate(p.queries)
                ],
            }
        )
    dashboard = {
        "uid": "rollfleet",
        "title": "Rollfleet",
        "tags": ["rollfleet", "rl"],
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                _variable("namespace", "label_values(rollfleet_operator_engines_wanted, namespace)"),
                _variable("fleet", 'label_values(rollfleet_operator_engines_wanted{namespace=~"$namespace"}, fleet)'),
            ]
        },
        "panels": panels,
    }
    return json.dumps(dashboard, indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
