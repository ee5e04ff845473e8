"""`rollfleet top` against the control-plane tier's fleet (`sim_live`): the screen names every engine with its phase
and weights as the status has them, and tokens/s for the engines decoding a stream through the gateway, read from
the gateways' metrics through the API server's pod proxy. Its decisions: tests/unit/test_top.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from e2e.fleet_helpers import Stream
from e2e.live_fleet import LiveFleet
from e2e.provider import Cluster, wait_for

pytestmark = pytest.mark.cluster


def test_top_shows_each_engine_its_phase_weights_and_tokens_per_second(cluster: Cluster, sim_live: LiveFleet) -> None:
    fleet = sim_live
    fleet.ready()
    status = fleet.fleet.status()
    # 1,500 tokens take 30 s on a simulated engine: they outlast `top`'s two scrapes.
    streams = [Stream(g.url, max_tokens=1500, auth=fleet.inference).start() for g in fleet.gateways for _ in range(2)]
    try:
        wait_for(lambda: all(s.tokens() >= 5 for s in streams), 60, what="streams decoding")
        argv = ["-m", "rollfleet.cli", "top", fleet.fleet.name, "-n", fleet.namespace, "--once", "--interval", "2"]
        out = subprocess.run(
            [sys.executable, *argv, "--kubeconfig", str(cluster.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    finally:
        for s in streams:
            s.wait(120)
    print(out)
    headline, header, *rows = out.strip().splitlines()
    assert headline.startswith(f"{fleet.namespace}/{fleet.fleet.name}: 2/2 ready; weights "), headline
    assert header.split() == ["ENGINE", "PHASE", "WEIGHTS", "RUNNING", "TOKENS/S", "NODE"]
    cells = {row.split()[0]: row.split() for row in rows}
    assert sorted(cells) == sorted(e["name"] for e in status["engines"]), out
    for engine in status["engines"]:
        name, phase, weights, _running, _rate, node = cells[engine["name"]]
        assert (phase, weights, node) == ("Ready", engine["weightVersion"], engine["node"]), cells[name]
    # The streams decode at 50 tokens/s each on the simulated engines: some engine shows it.
    assert max(float(c[4]) for c in cells.values() if c[4] != "-") > 10, out
