"""Session fixtures of the end-to-end suite: one cluster for every test.

Starting a cluster (and, later, engines) is the expensive part on a 2-core machine,
so the cluster is shared by the whole session and torn down once at the end, only
if this session started it.
"""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes
import pytest

from e2e.fleet_helpers import OPERATOR_NS, sim_engine
from e2e.live_fleet import LiveFleet, live_fleet, release_live_engines
from e2e.provider import Cluster
from rollfleet_dev import monitoring


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    c = Cluster.start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def live(cluster: Cluster) -> Iterator[LiveFleet]:
    """The acceptance tier's real fleet: 2 engines, 2 gateway replicas, weight sync; shared by every acceptance
    module but the README walkthrough's and the GRPO example's, which apply their own manifests."""
    with live_fleet(cluster) as fleet:
        yield fleet


# The simulated engines' pace: a 120-token sample takes about 2.4 s, as long as on the real tiny engine
# when 16 decode at once, so that a fault lands while some samples are done and others decode.
SIM_TOKEN_DELAY_MS = 20.0


@pytest.fixture(scope="session")
def sim_live(cluster: Cluster) -> Iterator[LiveFleet]:
    """The control-plane tier's shared fleet: as `live`, with simulated engines (`rollfleet_dev.sim_engine`)."""
    with live_fleet(cluster, engine=sim_engine(cluster, SIM_TOKEN_DELAY_MS)) as fleet:
        yield fleet


@pytest.fixture(scope="session")
def lws_on_kind(cluster: Cluster) -> Iterator[None]:
    """LeaderWorkerSet on kind, installed by the project's script, for the modules whose engines span pods (marker
    `after_live`: the session's real fleet is scaled to no engine first); removed at the session's end. The local
    cluster has no DNS, by which a group's ranks find their leader: kind only."""
    if cluster.provider == "local":
        pytest.skip("a group's ranks find their leader by LWS's DNS name; the local cluster has no DNS (kind only)")
    from rollfleet_dev import lws

    release_live_engines(cluster)  # a group's workers and the live fleet's do not fit this machine's memory together
    lws.install_kind()
    yield
    lws.uninstall_kind()


@pytest.fixture(scope="module")
def prometheus_operator_crds(cluster: Cluster) -> Iterator[None]:
    """prometheus-operator's CRDs (v0.85, from its module: `rollfleet_dev.monitoring`) on the cluster, for checks of
    Rollfleet's PodMonitors and PrometheusRule against their schema; removed after the module."""
    files = monitoring.crd_files()
    args = [a for f in files for a in ("-f", str(f))]
    cluster.kubectl("apply", "--server-side", *args, timeout=180)
    cluster.kubectl("wait", "--for=condition=Established", *args, "--timeout=60s", timeout=90)
    cluster.kubectl("create", "namespace", OPERATOR_NS, check=False)
    try:
        yield
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", *args, check=False)


@pytest.fixture(scope="session")
def core(cluster: Cluster) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(cluster.api_client())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A module that changes the shared real fleet for good runs after the fleet's other users; modules that
    # need its memory for big fleets of their own run after that (`release_live_engines`); modules
    # that make the shared operator cluster-wide (the README's walkthrough) run after every module that
    # scopes it to its namespaces; tests that stop the shared cluster run after everything else. The
    # sort is stable: file and parameter order hold within each group.
    def group(item: pytest.Item) -> int:
        order = ("alters_live", "after_live", "cluster_wide", "last")
        return max((i + 1 for i, mark in enumerate(order) if item.get_closest_marker(mark)), default=0)

    items.sort(key=group)
