"""Where pod servers bind: every address in a pod network of its own, the pod's loopback IP on the
local cluster's shared network."""

from __future__ import annotations

from rollfleet_engine.listen import pod_local_host, serving_host


def test_a_pod_with_its_own_network_binds_every_address_or_localhost() -> None:
    # kubectl port-forward connects to localhost inside the pod: a pod-IP-only bind refused it.
    assert serving_host("10.244.3.9") == "0.0.0.0" and serving_host(None) == "0.0.0.0"
    assert pod_local_host("10.244.3.9") == "127.0.0.1" and pod_local_host(None) == "127.0.0.1"


def test_on_a_shared_loopback_network_each_pod_binds_its_own_address() -> None:
    assert serving_host("127.0.3.7") == "127.0.3.7"
    assert pod_local_host("127.0.3.7") == "127.0.3.7"
