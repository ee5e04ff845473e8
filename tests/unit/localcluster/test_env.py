"""Environment and `$(VAR)` expansion, checked against kubelet's rules."""

from __future__ import annotations

import base64

import pytest

from rollfleet_dev.localcluster.nodeagent.env import (
    EnvError,
    Refs,
    container_argv,
    container_env,
    expand,
    referenced_objects,
    service_links,
)

VARS = {"A": "1", "B": "two"}


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)", "x1ytwo"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$1"),
        ("$A", "$A"),
        ("$", "$"),
        ("a$", "a$"),
        ("$(A", "$(A"),
        ("$()", "$()"),
        ("", ""),
    ],
)
def test_expand_follows_kubelet(text: str, want: str) -> None:
    assert expand(text, VARS.get) == want


def _pod(**container: object) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
        "spec": {
            "nodeName": "gpu-0",
            "serviceAccountName": "sa",
            "containers": [{"name": "c", "image": "busybox", **container}],
        },
        "status": {"podIP": "127.10.0.2", "hostIP": "127.10.0.1"},
    }


def test_env_order_expansion_and_references() -> None:
    refs = Refs(
        config_maps={"cm": {"data": {"k": "v", "bad=key": "skip"}}},
        secrets={"s": {"data": {"pw": base64.b64encode(b"secret").decode()}}},
    )
    pod = _pod(
        envFrom=[{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        env=[
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
            {"name": "URL", "value": "http://$(IP):8000/$(CM_k)/$(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": True}}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        ],
        resources={"limits": {"memory": "1Gi"}},
    )
    env = container_env(pod, pod["spec"]["containers"][0], refs, {"PATH": "/bin"}, {})
    assert env["CM_k"] == "v" and "CM_bad=key" not in env
    assert env["IP"] == "127.10.0.2" and env["APP"] == "x" and env["PW"] == "secret"
    assert env["URL"] == "http://127.10.0.2:8000/v/$(LATER)"  # only variables defined before expand
    assert "OPT" not in env
    assert env["MEM"] == "1024"
    assert env["PATH"] == "/bin"


def test_services_of_the_namespace_are_in_the_environment_as_kubelet_puts_them() -> None:
    services = [
        {
            "metadata": {"name": "tiny-gateway"},
            "spec": {"clusterIP": "127.96.0.7", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]},
        },
        {"metadata": {"name": "headless"}, "spec": {"clusterIP": "None", "ports": [{"port": 80}]}},
    ]
    assert service_links(services) == {
        "TINY_GATEWAY_SERVICE_HOST": "127.96.0.7",
        "TINY_GATEWAY_SERVICE_PORT": "8080",
        "TINY_GATEWAY_SERVICE_PORT_HTTP": "8080",
        "TINY_GATEWAY_PORT": "tcp://127.96.0.7:8080",
    }


def test_missing_secret_key_is_a_config_error() -> None:
    pod = _pod(env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}])
    with pytest.raises(EnvError, match="couldn't find key nope"):
        container_env(pod, pod["spec"]["containers"][0], Refs(secrets={"s": {"data": {}}}), {}, {})
    with pytest.raises(EnvError, match='secret "s" not found'):
        container_env(pod, pod["spec"]["containers"][0], Refs(secrets={"s": None}), {}, {})


def test_resource_limit_defaults_to_node_allocatable() -> None:
    pod = _pod(env=[{"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}])
    env = container_env(pod, pod["spec"]["containers"][0], Refs(), {}, {"cpu": "64"})
    assert env["CPU"] == "64"


@pytest.mark.parametrize(
    ("container", "entrypoint", "cmd", "want"),
    [
        ({"command": ["python"], "args": ["-c", "$(X)"]}, ["ignored"], ["ignored"], ["python", "-c", "1"]),
        ({"command": ["sleep"]}, ["e"], ["c"], ["sleep"]),
        ({"args": ["--port", "8"]}, ["rollfleet"], ["help"], ["rollfleet", "--port", "8"]),
        ({}, ["python", "-m", "m"], ["--x"], ["python", "-m", "m", "--x"]),
        ({}, [], ["sh"], ["sh"]),
    ],
)
def test_argv_like_docker(container: dict, entrypoint: list[str], cmd: list[str], want: list[str]) -> None:
    assert container_argv(container, {"X": "1"}, entrypoint, cmd) == want


def test_referenced_objects_cover_env_and_volumes() -> None:
    pod = _pod(
        envFrom=[{"secretRef": {"name": "s1"}}],
        env=[{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "c1", "key": "k"}}}],
    )
    pod["spec"]["volumes"] = [
        {"name": "v", "secret": {"secretName": "s2"}},
        {"name": "p", "projected": {"sources": [{"configMap": {"name": "kube-root-ca.crt"}}]}},
    ]
    assert referenced_objects(pod) == ({"c1", "kube-root-ca.crt"}, {"s1", "s2"})
