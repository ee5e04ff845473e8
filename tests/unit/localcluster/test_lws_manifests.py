"""LeaderWorkerSet's manifests as the project's scripts install them (rollfleet_dev.lws), from LWS's own files."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from rollfleet_dev import lws

WEBHOOKS = """\
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- {name: mlws.kb.io, clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-lws}}}
- {name: mpod.kb.io, clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: validating-webhook-configuration}
webhooks:
- {name: vpod.kb.io, clientConfig: {service: {name: webhook-service, namespace: system, path: /validate--v1-pod}}}
"""
POD_HOOK = """\
- op: replace
  path: /webhooks/{i}
  value:
    name: {name}
    clientConfig: {{service: {{name: webhook-service, namespace: system, path: {path}}}}}
    objectSelector: {{matchExpressions: [{{key: leaderworkerset.sigs.k8s.io/name, operator: Exists}}]}}
"""


def config(tmp_path: Path) -> Path:
    """A `config/` of LWS's shape (the real one is the module's: e2e/test_lws.py installs from it)."""
    (tmp_path / "crd" / "bases").mkdir(parents=True)
    (tmp_path / "rbac").mkdir()
    (tmp_path / "webhook").mkdir()
    crd = {"kind": "CustomResourceDefinition", "metadata": {"name": lws.LWS_CRD}}
    (tmp_path / "crd" / "bases" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml").write_text(yaml.safe_dump(crd))
    (tmp_path / "rbac" / "role.yaml").write_text(yaml.safe_dump({"kind": "ClusterRole", "metadata": {"name": "r"}}))
    (tmp_path / "webhook" / "manifests.yaml").write_text(WEBHOOKS)
    (tmp_path / "webhook" / "mutating-patch.yaml").write_text(
        POD_HOOK.format(i=1, name="mpod.kb.io", path="/mutate--v1-pod")
    )
    (tmp_path / "webhook" / "validating-patch.yaml").write_text(
        POD_HOOK.format(i=0, name="vpod.kb.io", path="/validate--v1-pod")
    )
    return tmp_path


def test_local_webhooks_call_loopback_with_the_clusters_ca_and_see_only_lws_pods(tmp_path: Path) -> None:
    crd, role, binding, mutating, validating = lws.local_manifests(config(tmp_path), b"CA", port=9443)
    assert crd["metadata"]["name"] == lws.LWS_CRD
    assert binding["roleRef"]["name"] == role["metadata"]["name"] == "lws-r"
    assert binding["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": lws.USER}]
    assert [h["clientConfig"]["url"] for h in mutating["webhooks"]] == [
        "https://127.0.0.1:9443/mutate-lws",
        "https://127.0.0.1:9443/mutate--v1-pod",
    ]
    assert all(base64.b64decode(h["clientConfig"]["caBundle"]) == b"CA" for h in mutating["webhooks"])
    for hook in (mutating["webhooks"][1], validating["webhooks"][0]):
        assert hook["objectSelector"]["matchExpressions"][0]["key"] == "leaderworkerset.sigs.k8s.io/name"
    assert "objectSelector" not in mutating["webhooks"][0]


def test_kind_runs_lws_release_manifests_with_the_image_built_here() -> None:
    manager = {
        "kind": "Deployment",
        "spec": {
            "template": {"spec": {"containers": [{"name": "manager", "image": f"{lws.RELEASE_IMAGE_PREFIX}:main"}]}}
        },
    }
    docs = lws.kind_manifests(yaml.safe_dump_all([{"kind": "Namespace"}, manager]))
    [container] = docs[1]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == lws.IMAGE and container["imagePullPolicy"] == "IfNotPresent"
    assert docs[1]["spec"]["replicas"] == 1
    with pytest.raises(ValueError, match="not once"):
        lws.kind_manifests(yaml.safe_dump_all([{"kind": "Namespace"}]))
