"""A real Prometheus for the e2e suite: Debian's `prometheus` (the package .ci/run installs), run as a process on
loopback, scraping the targets a test reaches (port-forwards on kind, pod IPs on the local cluster) every second.

Static targets with the labels the PodMonitors of manifests/monitoring/ give theirs (namespace, fleet, pod; the
operator's own `namespace` label honoured), so the dashboard's queries and the alerts' expressions run on
Prometheus as they would in a cluster. Debian's build has no kubernetes_sd: discovery is the test's.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from rollfleet_dev import oneshot

SCRAPE_INTERVAL_S = 1


@dataclass(frozen=True)
class Target:
    job: str
    url: str  # the base URL this process reaches it at; /metrics is scraped
    labels: dict[str, str] = field(default_factory=dict)
    honor_labels: bool = False  # the operator's series carry their fleet's namespace themselves


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (Prometheus' own evaluation of `expr`)."""
        r = oneshot.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {expr!r}: {body.get('error')}")
        return list(body["data"]["result"])

    def scrapes(self) -> float:
        """Scrapes made so far, of every target (each leaves one sample of `up`)."""
        result = self.query("sum(count_over_time(up[1d]))")
        return float(result[0]["value"][1]) if result else 0.0

    def targets_up(self) -> dict[str, bool]:
        """Each target's scrape health, by `job/instance`."""
        active = oneshot.get(f"{self.url}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
        return {f"{t['labels']['job']}/{t['labels']['instance']}": t["health"] == "up" for t in active}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(targets: list[Target], interval_s: float = SCRAPE_INTERVAL_S) -> dict[str, Any]:
    jobs: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for t in targets:
        jobs.setdefault((t.job, t.honor_labels), []).append(
            {"targets": [urlsplit(t.url).netloc], "labels": dict(t.labels)}
        )
    return {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "scrape_configs": [
            {"job_name": job, "honor_labels": honor, "static_configs": groups} for (job, honor), groups in jobs.items()
        ],
    }


@contextlib.contextmanager
def running(targets: list[Target], interval_s: float = SCRAPE_INTERVAL_S) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` every `interval_s` until the block ends; its data goes with it."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: apt-get install prometheus (Debian's package; .ci/run installs it)"
    work = Path(tempfile.mkdtemp(prefix="rollfleet-prometheus-"))
    (work / "prometheus.yml").write_text(yaml.safe_dump(config(targets, interval_s)))
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if oneshot.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"Prometheus did not start: {(work / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        if proc.poll() is None:
            proc.kill()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
