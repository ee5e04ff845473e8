"""The control plane is a real Kubernetes API: CRDs with status and scale subresources."""

from __future__ import annotations

import json

import pytest

from e2e.provider import Cluster, wait_for

pytestmark = pytest.mark.cluster

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.e2e.rollfleet.dev}
spec:
  group: e2e.rollfleet.dev
  names: {kind: Widget, plural: widgets, singular: widget, shortNames: [wd]}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    subresources:
      status: {}
      scale: {specReplicasPath: .spec.replicas, statusReplicasPath: .status.replicas}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              replicas: {type: integer, minimum: 0}
          status:
            type: object
            properties:
              replicas: {type: integer}
              note: {type: string}
"""


@pytest.fixture(scope="module")
def widget_crd(cluster: Cluster):
    cluster.kubectl("apply", "-f", "-", input=CRD)
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.e2e.rollfleet.dev", "--timeout=60s")
    yield
    cluster.kubectl("delete", "crd/widgets.e2e.rollfleet.dev", "--wait=true")


def test_crd_with_status_and_scale_subresources(cluster: Cluster, widget_crd: None) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input="""
apiVersion: e2e.rollfleet.dev/v1
kind: Widget
metadata: {name: w1, namespace: default}
spec: {replicas: 1}
""",
    )
    # `kubectl scale` goes through the scale subresource.
    cluster.kubectl("scale", "widget/w1", "--replicas=3", "-n", "default")
    spec = json.loads(cluster.kubectl("get", "widget/w1", "-n", "default", "-o", "json").stdout)["spec"]
    assert spec["replicas"] == 3

    # Status goes through /status; a status write to the main resource is ignored.
    cluster.kubectl(
        "patch",
        "widget/w1",
        "-n",
        "default",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"replicas": 3, "note": "via-subresource"}}',
    )
    cluster.kubectl("patch", "widget/w1", "-n", "default", "--type=merge", "-p", '{"status": {"note": "ignored"}}')
    obj = json.loads(cluster.kubectl("get", "widget/w1", "-n", "default", "-o", "json").stdout)
    assert obj["status"] == {"replicas": 3, "note": "via-subresource"}

    scale = json.loads(
        cluster.kubectl("get", "--raw", "/apis/e2e.rollfleet.dev/v1/namespaces/default/widgets/w1/scale").stdout
    )
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3


def test_schema_rejects_invalid_object(cluster: Cluster, widget_crd: None) -> None:
    bad = cluster.kubectl(
        "apply",
        "-f",
        "-",
        check=False,
        input="""
apiVersion: e2e.rollfleet.dev/v1
kind: Widget
metadata: {name: w-bad, namespace: default}
spec: {replicas: -1}
""",
    )
    assert bad.returncode != 0
    assert "spec.replicas" in bad.stderr and "greater than or equal to 0" in bad.stderr


def test_rbac_and_serviceaccount_admission_are_on(cluster: Cluster) -> None:
    cluster.kubectl("create", "namespace", "e2e-rbac", check=False)
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", "e2e-rbac", check=False)
    can = cluster.kubectl(
        "auth", "can-i", "list", "pods", "-n", "e2e-rbac", "--as=system:serviceaccount:e2e-rbac:nobody", check=False
    )
    assert can.stdout.strip() == "no"
    # The ServiceAccount token controller and TokenRequest API work.
    token = cluster.kubectl("create", "token", "nobody", "-n", "e2e-rbac").stdout.strip()
    assert token.count(".") == 2
    wait_for(
        lambda: cluster.kubectl("get", "configmap", "kube-root-ca.crt", "-n", "e2e-rbac", check=False).returncode == 0,
        30,
        what="kube-root-ca.crt published into the namespace",
    )
    cluster.kubectl("delete", "namespace", "e2e-rbac", "--wait=false")
