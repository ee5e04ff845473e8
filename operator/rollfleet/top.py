"""`rollfleet top [FLEET]`: a live view of fleets for people at a terminal, like `kubectl top` or k9s.

Each refresh shows, per fleet, its engines with their phase, weight version, requests running and tokens/s,
and the fleet's readiness, weights and pause. Engines, phases, versions, running requests and the pause are the
fleet's status (what the operator's metrics export too); tokens/s is the change of the gateway replicas'
`rollfleet_gateway_tokens_total` between two scrapes, read through the API server's pod proxy. So it needs
what `kubectl` needs for the same: get and list `rolloutfleets`, list `pods` and get `pods/proxy` in the
namespace. Decisions (`engine_rows`, `render`, `tokens_by_engine`) are pure; `Top` does the I/O.
Talks to kube-apiserver only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

from rollfleet import metrics as m
from rollfleet.api.fleet import RolloutFleetStatus
from rollfleet.contract import COMPONENT_GATEWAY, GATEWAY_PORT, component_labels, selector
from rollfleet.errors import RollfleetError
from rollfleet.kube import FLEET, POD, ApiError, Kube, context_namespace, load_client

TOKENS = m.GATEWAY_TOKENS.exposed
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: what `watch` does between refreshes


class TopError(RollfleetError):
    """The fleets could not be read; the message says why and what to do."""


@dataclass(frozen=True)
class EngineRow:
    name: str
    phase: str
    version: str
    running: str
    tokens_per_s: str
    node: str


@dataclass(frozen=True)
class FleetView:
    namespace: str
    name: str
    status: RolloutFleetStatus
    wanted: int
    rows: list[EngineRow]


def tokens_by_engine(scrapes: Sequence[str]) -> dict[str, float]:
    """Completion tokens each engine served, summed over the gateway replicas' /metrics texts."""
    out: dict[str, float] = {}
    for text in scrapes:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == TOKENS:
                    out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def engine_rows(
    status: RolloutFleetStatus, now: Mapping[str, float], before: Mapping[str, float] | None, seconds: float
) -> list[EngineRow]:
    """One row per engine of the status; tokens/s from two scrapes `seconds` apart (`-` before the second, and
    for an engine no gateway has sent a request to). A counter that went down (a gateway replica restarted) is
    read from zero."""
    rows = []
    for e in status.engines:
        rate = "-"
        if before is not None and seconds > 0 and e.name in now:
            grown = now[e.name] - before.get(e.name, 0.0)
            rate = f"{(grown if grown >= 0 else now[e.name]) / seconds:.1f}"
        running = "-" if e.in_flight is None else str(e.in_flight)
        rows.append(EngineRow(e.name, e.phase.value, e.weight_version or "-", running, rate, e.node or "-"))
    return rows


def headline(view: FleetView, at: datetime) -> str:
    st = view.status
    parts = [f"{st.ready_replicas}/{view.wanted} ready", f"weights {st.weight_version or '-'}"]
    if st.pause is not None:
        held = max(0, int((at - st.pause.since).total_seconds()))
        n = st.pause.paused_engines
        parts.append(f"paused ({st.pause.mode}) for {held}s, {n} engine{'' if n == 1 else 's'} paused")
    conditions = [c.type for c in st.conditions if c.status == "True" and c.type in ("Degraded", "Progressing")]
    if conditions:
        parts.append(", ".join(conditions))
    return f"{view.namespace}/{view.name}: " + "; ".join(parts)


HEADER = EngineRow("ENGINE", "PHASE", "WEIGHTS", "RUNNING", "TOKENS/S", "NODE")


def render(views: Sequence[FleetView], at: datetime) -> str:
    """The screen: a headline and a table of engines per fleet, columns aligned as kubectl aligns them."""
    if not views:
        return "no RolloutFleet here\n"
    blocks = []
    for view in views:
        table = [HEADER, *view.rows]
        widths = [max(len(getattr(r, f)) for r in table) for f in EngineRow.__dataclass_fields__]
        lines = [headline(view, at)]
        for r in table:
            cells = [getattr(r, f) for f in EngineRow.__dataclass_fields__]
            lines.append("   ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


class Top:
    """Reads the fleets of a namespace (or one of them) and their gateways' token counters."""

    def __init__(self, kube: Kube, namespace: str, fleet: str | None) -> None:
        self.kube, self.namespace, self.fleet = kube, namespace, fleet

    async def fleets(self) -> list[dict[str, Any]]:
        try:
            if self.fleet:
                return [await self.kube.get(FLEET, self.namespace, self.fleet)]
            listed = await self.kube.list(FLEET, self.namespace)
        except ApiError as err:
            what = f"rf/{self.fleet}" if self.fleet else "the RolloutFleets"
            raise TopError(f"cannot read {what} in namespace {self.namespace}: {err}") from err
        return sorted(listed, key=lambda f: f["metadata"]["name"])

    async def scrapes(self, fleet: str) -> list[str]:
        """Each of the fleet's running gateway replicas' /metrics (a replica that does not answer is left out)."""
        pods = await self.kube.list(POD, self.namespace, selector(component_labels(fleet, COMPONENT_GATEWAY)))
        running = [p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"]
        texts = await asyncio.gather(*(asyncio.to_thread(self._scrape, pod) for pod in running))
        return [t for t in texts if t is not None]

    def _scrape(self, pod: str) -> str | None:
        try:
            chunks = self.kube.pod_proxy_stream(self.namespace, pod, GATEWAY_PORT, m.METRICS_PATH, {}, 1 << 16)
            return b"".join(chunks).decode()
        except ApiError:
            return None

    async def views(
        self, before: Mapping[str, dict[str, float]], seconds: float
    ) -> tuple[list[FleetView], dict[str, dict[str, float]]]:
        """The fleets now, with tokens/s against the counters of `before` (per fleet), and the counters now."""
        views: list[FleetView] = []
        counters: dict[str, dict[str, float]] = {}
        for obj in await self.fleets():
            name = obj["metadata"]["name"]
            status = RolloutFleetStatus.model_validate(obj.get("status") or {})
            counters[name] = tokens_by_engine(await self.scrapes(name))
            rows = engine_rows(status, counters[name], before.get(name), seconds)
            views.append(FleetView(self.namespace, name, status, int(obj["spec"].get("replicas", 0)), rows))
        return views, counters


def run(
    namespace: str | None, fleet: str | None, kubeconfig: str | None, interval: float, once: bool, out: TextIO
) -> int:
    """Refresh every `interval` seconds until interrupted; `once`: one screen, its tokens/s over one interval."""
    kube = Kube(load_client(kubeconfig))
    try:
        return asyncio.run(
            _loop(Top(kube, namespace or context_namespace(kubeconfig) or "default", fleet), interval, once, out)
        )
    finally:
        kube.close()


async def _loop(top: Top, interval: float, once: bool, out: TextIO) -> int:
    _, counters = await top.views({}, 0.0)
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval)  # the rate's window: two scrapes `interval` apart
        now = time.monotonic()
        views, counters = await top.views(counters, now - last)
        last = now
        screen = render(views, datetime.now(UTC))
        if once:
            out.write(screen)
            return 0
        out.write(CLEAR + f"rollfleet top - every {interval:g}s - {datetime.now(UTC):%H:%M:%S}Z\n\n" + screen)
        out.flush()
