"""The Helm chart (charts/rollfleet), with the Helm its users run (built from its module: `rollfleet_dev.helm`).

Control-plane tier: `helm lint`; rendered with its defaults, the chart holds exactly what manifests/base holds
(the same RBAC rules, Deployment and admission policies: the two cannot drift apart); with every option on, a
real API server accepts what it renders (a strict server-side dry run, prometheus-operator's CRDs installed);
bad values are refused by its schema, naming the value.

Acceptance tier, on kind: `helm install` beside the suite's own operator (serving only its own namespace), a
fleet of a real engine Ready, `helm upgrade` to a rebuilt operator image while the fleet serves without an error,
the upgraded operator pausing and resuming the fleet, and `helm uninstall` leaving no object of the release.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.fleet_helpers import OPERATOR_NS, REPO, Fleet, fleet_manifest, served_namespaces
from e2e.provider import Cluster, wait_for
from e2e.test_monitoring import dry_run
from rollfleet.api.common import DEFAULT_ROLLFLEET_IMAGE
from rollfleet.contract import ANNOTATION_PAUSE, GATEWAY_PORT, OPERATOR_HEALTH_PORT, OPERATOR_METRICS_PORT
from rollfleet_dev.helm import helm

pytestmark = pytest.mark.cluster
CHART = REPO / "charts" / "rollfleet"
# What Helm adds to every object (and the chart to the operator's pods): not in manifests/base.
HELM_LABELS = (
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)
# The chart's operator arguments that manifests/base leaves at the operator's defaults, and those defaults.
DEFAULT_ARGS = (
    f"--runner-image={DEFAULT_ROLLFLEET_IMAGE}",
    f"--health-port={OPERATOR_HEALTH_PORT}",
    f"--metrics-port={OPERATOR_METRICS_PORT}",
)
RELEASE = "rf-helm"  # the kind case's release: its cluster-wide objects are named after it
KUBE_VERSION = "1.37.1"  # `helm template` checks the chart's kubeVersion against this (it asks no cluster)

Obj = dict[str, Any]


def render(*args: str, release: str = "rollfleet", namespace: str = OPERATOR_NS) -> list[Obj]:
    out = helm(["template", release, str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION, *args])
    return [d for d in yaml.safe_load_all(out) if d]


def keyed(objs: list[Obj]) -> dict[tuple[str, str, str], Obj]:
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs}


def comparable(obj: Obj) -> Obj:
    """An object without what only one of the two installs adds: Helm's labels; kustomize's labels on the CRDs
    (Helm installs crds/ as they are); the chart's explicit operator arguments (checked to be the defaults)."""
    obj = copy.deepcopy(obj)
    meta_labels = [obj["metadata"].get("labels")]
    if obj["kind"] == "Deployment":
        meta_labels.append(obj["spec"]["template"]["metadata"]["labels"])
        container = obj["spec"]["template"]["spec"]["containers"][0]
        container["args"] = [a for a in container["args"] if a not in DEFAULT_ARGS]
    for labels in filter(None, meta_labels):
        for key in HELM_LABELS:
            labels.pop(key, None)
    if obj["kind"] == "CustomResourceDefinition":
        obj["metadata"].pop("labels", None)
    return obj


def test_helm_lint_passes_with_the_defaults_and_with_every_option(tmp_path: Path) -> None:
    helm(["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION])
    helm(["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION, "-f", str(every_option(tmp_path, "ns-a"))])


def test_the_chart_with_its_defaults_holds_what_manifests_base_holds(cluster: Cluster) -> None:
    chart = keyed(render("--include-crds"))
    base = keyed(list(yaml.safe_load_all(cluster.kubectl("kustomize", str(REPO / "manifests" / "base")).stdout)))
    # Helm makes the release's namespace (--create-namespace); the base names it.
    assert base.pop(("Namespace", "", OPERATOR_NS))
    assert sorted(chart) == sorted(base), set(chart) ^ set(base)
    for key, obj in base.items():
        assert comparable(chart[key]) == comparable(obj), key
    [deployment] = [o for o in chart.values() if o["kind"] == "Deployment"]
    assert set(DEFAULT_ARGS) <= set(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def every_option(directory: Path, namespace: str) -> Path:
    """A values file that turns every option on, serving `namespace`."""
    values = {
        "image": {"tag": "0.1.0-rc1", "pullPolicy": "Never"},
        "imagePullSecrets": [{"name": "registry"}],
        "watchNamespaces": [namespace],
        "operator": {
            "extraArgs": ["--verbose"],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            "podAnnotations": {"example.com/team": "rl"},
        },
        "monitoring": {
            "podMonitors": {"enabled": True, "labels": {"release": "prometheus"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
            "dashboard": {"enabled": True},
        },
    }
    path = directory / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.usefixtures("prometheus_operator_crds")
def test_every_option_renders_objects_the_api_server_accepts(cluster: Cluster, tmp_path: Path) -> None:
    served = f"chart-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", served)
    values = every_option(tmp_path, served)
    try:
        objs = render("-f", str(values), release="rf-chart")
        kinds = sorted({o["kind"] for o in objs})
        assert {"PodMonitor", "PrometheusRule", "ConfigMap", "Role", "ValidatingAdmissionPolicy"} <= set(kinds), kinds
        rc, out = dry_run(cluster, yaml.safe_dump_all(objs))
        assert rc == 0, out
        assert out.count("(server dry run)") == len(objs), out
        # Serving one namespace: the operator's rules there are a Role's; cluster-wide it keeps discovery only.
        [cluster_role] = [o for o in objs if o["kind"] == "ClusterRole"]
        assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
            "nodes",
            "namespaces",
            "customresourcedefinitions",
        }, cluster_role["rules"]
        roles = [o for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == served]
        assert len(roles) == 1 and any("pods" in r["resources"] for r in roles[0]["rules"]), roles
        # Its key's namespace serves no fleet: there it may still make the key at its first start.
        [key] = [o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == "rollfleet-operator-key"]
        assert {v for r in key["rules"] for v in r["verbs"]} == {"get", "create"}, key["rules"]
        [deployment] = [o for o in objs if o["kind"] == "Deployment"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "rollfleet/rollfleet:0.1.0-rc1", container["image"]
        assert f"--namespace={served}" in container["args"] and "--verbose" in container["args"], container["args"]
        assert "--runner-image=rollfleet/rollfleet:0.1.0-rc1" in container["args"], container["args"]
        rule = next(o for o in objs if o["kind"] == "PrometheusRule")
        assert rule["metadata"]["labels"]["release"] == "prometheus"
        # The alerts' own templates reach Prometheus as they are, not as Helm's.
        assert "{{ $labels.fleet }}" in json.dumps(rule["spec"]), rule["spec"]["groups"][0]["rules"][0]
    finally:
        cluster.kubectl("delete", "namespace", served, "--wait=false", check=False)


@pytest.mark.parametrize(
    ("flag", "setting", "named"),
    [
        ("--set", "image.pullPolicy=Sometimes", "pullPolicy"),
        ("--set", "watchNamespaces[0]=Not_A_Namespace", "watchNamespaces"),
        ("--set", "operator.replicas=2", "replicas"),
        ("--set-string", "monitoring.podMonitors.enabled=yes", "enabled"),
    ],
)
def test_bad_values_are_refused_naming_the_value(flag: str, setting: str, named: str) -> None:
    with pytest.raises(RuntimeError) as refused:
        render(flag, setting)
    assert "schema" in str(refused.value) and named in str(refused.value), str(refused.value)


# --- on kind: install, upgrade, uninstall ---------------------------------------------------------------


def rebuilt(image: str, tag: str) -> str:
    """`image` rebuilt under a new tag (one new config, no new layer), and loaded into every kind node."""
    from rollfleet_dev.kind import cluster as kind

    new = f"{image.rsplit(':', 1)[0]}:{tag}"
    dockerfile = f"FROM {image}\nLABEL dev.rollfleet.e2e-rebuilt={uuid.uuid4().hex}\n"
    subprocess.run(["docker", "build", "-q", "-t", new, "-"], input=dockerfile, text=True, check=True, timeout=300)
    kind.load_image(new, kind.all_nodes())
    return new


class Traffic(threading.Thread):
    """Completions through a fleet's gateway, one after another until stopped: what each one answered."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = url, headers
        self.ok = 0
        self.errors: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "helm", "max_tokens": 8, "ignore_eos": True}
        with httpx.Client(timeout=120) as client:
            while not self.done.is_set():
                try:
                    r = client.post(f"{self.url}/v1/completions", json=body, headers=self.headers)
                except httpx.HTTPError as err:
                    self.errors.append(repr(err))
                    continue
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8:
                    self.ok += 1
                else:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")

    def stop(self) -> None:
        self.done.set()
        self.join(150)


@pytest.fixture
def namespaces(cluster: Cluster) -> Iterator[tuple[str, str]]:
    """The release's namespace and the one its operator serves (which the suite's own operator must not)."""
    tag = uuid.uuid4().hex[:6]
    release_ns, fleet_ns = f"rf-helm-{tag}", f"helm-e2e-{tag}"
    shared = cluster.kubectl("-n", OPERATOR_NS, "get", "deployment/rollfleet-operator", check=False)
    if shared.returncode == 0 and not served_namespaces(cluster):
        pytest.fail("the suite's operator serves every namespace, so two operators would reconcile this case's fleet")
    cluster.kubectl("create", "namespace", fleet_ns)
    try:
        yield release_ns, fleet_ns
    finally:
        # A case that failed midway leaves its release, whose cluster-wide objects would refuse the next one.
        with contextlib.suppress(RuntimeError):
            helm(
                ["uninstall", RELEASE, "-n", release_ns, "--ignore-not-found", "--wait"], kubeconfig=cluster.kubeconfig
            )
        for ns in (fleet_ns, release_ns):
            cluster.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false", check=False)


def release_objects(manifest: str) -> list[str]:
    """`kind/name` (with `-n namespace` where it has one) of every object a release's manifest holds."""
    out = []
    for obj in (d for d in yaml.safe_load_all(manifest) if d):
        ns = obj["metadata"].get("namespace")
        out.append(f"{obj['kind']}/{obj['metadata']['name']}" + (f" -n {ns}" if ns else ""))
    return out


def exists(cluster: Cluster, ref: str) -> bool:
    name, *ns = ref.split(" -n ")
    args = ["-n", ns[0]] if ns else []
    proc = cluster.kubectl(*args, "get", name, "--ignore-not-found", "-o", "name", check=False)
    assert proc.returncode == 0, proc.stderr
    return bool(proc.stdout.strip())


@pytest.mark.engine
def test_helm_install_upgrade_with_the_fleet_serving_and_uninstall(
    cluster: Cluster, namespaces: tuple[str, str]
) -> None:
    release, (release_ns, fleet_ns) = RELEASE, namespaces
    kubeconfig = cluster.kubeconfig
    helm(
        [
            "install", release, str(CHART), "-n", release_ns, "--create-namespace",
            "--set", "image.pullPolicy=Never", "--set", f"watchNamespaces={{{fleet_ns}}}",
            "--wait", "--timeout=5m",
        ],
        kubeconfig=kubeconfig,
    )  # fmt: skip
    fleet = Fleet(cluster, "helm", fleet_ns)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(fleet_manifest("helm", fleet_ns, 1)))
    fleet.wait_ready(1)

    gateway = fleet.pods("gateway")[0]["metadata"]["name"]
    with cluster.reach(fleet_ns, gateway, GATEWAY_PORT) as url:
        traffic = Traffic(url, fleet.inference())
        traffic.start()
        wait_for(lambda: traffic.ok >= 3, 120, what="completions through the fleet's gateway")
        image = rebuilt(DEFAULT_ROLLFLEET_IMAGE, "helm-e2e")
        try:
            served_before = traffic.ok
            helm(
                [
                    "upgrade", release, str(CHART), "-n", release_ns, "--reuse-values",
                    "--set", "image.tag=helm-e2e", "--wait", "--timeout=5m",
                ],
                kubeconfig=kubeconfig,
            )  # fmt: skip
            pods = json.loads(
                cluster.kubectl(
                    "-n", release_ns, "get", "pods", "-l", "app.kubernetes.io/component=operator", "-o", "json"
                ).stdout
            )["items"]
            running = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            assert [p["spec"]["containers"][0]["image"] for p in running] == [image], running
            wait_for(lambda: traffic.ok >= served_before + 3, 120, what="completions after the upgrade")
        finally:
            traffic.stop()
            subprocess.run(["docker", "rmi", image], capture_output=True, check=False)
    print(f"\nhelm upgrade with the fleet serving: {traffic.ok} completions, {len(traffic.errors)} failed")
    assert not traffic.errors, traffic.errors[:5]

    # The upgraded operator serves the fleet: it pauses its engine and resumes it.
    cluster.kubectl("-n", fleet_ns, "annotate", "rf", "helm", f"{ANNOTATION_PAUSE}=keep")
    fleet.wait(
        lambda st: (st.get("pause") or {}).get("pausedEngines") == 1, "its engine paused by the new operator", 120
    )
    cluster.kubectl("-n", fleet_ns, "annotate", "rf", "helm", f"{ANNOTATION_PAUSE}-")
    fleet.wait(lambda st: not st.get("pause"), "the pause lifted", 120)

    # Nothing of the release stays: its objects go with it, and a fleet's with the fleet.
    cluster.kubectl("-n", fleet_ns, "delete", "rf", "helm", "--wait=true", "--timeout=300s", timeout=320)
    wait_for(lambda: not fleet.pods("engine") and not fleet.pods("gateway"), 300, what="the fleet's pods gone")
    objects = release_objects(helm(["get", "manifest", release, "-n", release_ns], kubeconfig=kubeconfig))
    assert len(objects) >= 9, objects
    helm(["uninstall", release, "-n", release_ns, "--wait", "--timeout=5m"], kubeconfig=kubeconfig)
    assert [ref for ref in objects if exists(cluster, ref)] == []
    # Kubernetes' own, and the operator's key (kept on purpose: it signs the tokens of any fleet still there). The
    # operator's pod goes after its Deployment (the garbage collector's, in its grace period).
    kept = ["configmap/kube-root-ca.crt", "secret/rollfleet-operator-key", "serviceaccount/default"]
    kinds = "all,serviceaccounts,roles,rolebindings,configmaps,secrets"
    left: list[str] = []

    def only_kept() -> bool:
        left[:] = sorted(cluster.kubectl("-n", release_ns, "get", kinds, "-o", "name").stdout.split())
        return left == kept

    wait_for(only_kept, 120, interval=1, what=f"nothing but {kept} left in {release_ns} (left: {left})")
    # Helm never deletes the CRDs of crds/ (docs/operations.md): the fleets of other releases live on.
    assert exists(cluster, "customresourcedefinition/rolloutfleets.rollfleet.dev")
