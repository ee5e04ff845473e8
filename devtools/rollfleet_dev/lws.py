"""LeaderWorkerSet on the development clusters: built from its Go module, installed by `rollfleet lws install`.

Engines of several pods are LeaderWorkerSet groups, and users install LWS themselves
(docs/operator.md, Prerequisites). The project's clusters get the same release, built here from
`sigs.k8s.io/lws` (no image registry or release download is reachable): the manager from its `cmd`
package, and the CRD, ClusterRole and webhook configurations from the module's `config/`, as its
release manifests are made from them.

On the local cluster the manager runs as a process beside the control plane (stopped with it), as
the static identity `rollfleet-lws-manager` bound to LWS's own ClusterRole. It serves its webhooks on
loopback with a certificate of the cluster's CA, and LWS's own certificate management is off: that
writes the certificate into a Secret for the webhook Service, which a process outside the cluster
does not have. The webhook configurations are LWS's own, with that address instead of the Service.

On kind it runs as LWS's release runs it: the module's `config/default` (kustomize, as `kubectl
kustomize` builds it) in namespace `lws-system`, with its own certificate management, from an image
built here (the Debian base and the manager binary, as LWS's distroless image holds it) and loaded
into the nodes.
"""

from __future__ import annotations

import base64
import copy
import functools
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rollfleet.controller.groups import LWS_CRD, LWS_VERSION
from rollfleet.kubectl import Kubectl
from rollfleet_dev.gobuild import GoTool, ensure_tool, log, module_dir
from rollfleet_dev.localcluster import controlplane, pki

MODULE = "sigs.k8s.io/lws"
LWS = GoTool("lws", MODULE, LWS_VERSION, (f"{MODULE}/cmd",), ("cmd",))
COMPONENT = "lws-manager"
WEBHOOK_PORT = 9443
HEALTH_PORT = 9444
# The names LWS's release gives its objects (config/default: namePrefix lws-).
PREFIX = "lws-"
USER = pki.IDENTITIES["lws"][0]
# kind: the image built here, and the one LWS's kustomization names (replaced by it).
IMAGE = f"rollfleet/lws:{LWS_VERSION}"
RELEASE_IMAGE_PREFIX = "us-central1-docker.pkg.dev/k8s-staging-images/lws/lws"
KIND_NAMESPACE = "lws-system"

Manifest = dict[str, Any]


def config_dir() -> Path:
    """The module's `config/` (downloaded into the module cache if missing)."""
    return module_dir(MODULE, LWS_VERSION) / "config"


def _docs(path: Path) -> list[Manifest]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _replace_webhooks(webhooks: list[Manifest], patch_file: Path) -> list[Manifest]:
    """LWS's own kustomize patches (`op: replace`, `/webhooks/N`): its pod webhooks only see pods labelled as LWS's."""
    out = copy.deepcopy(webhooks)
    for op in yaml.safe_load(patch_file.read_text()):
        kind, _, index = op["path"].strip("/").partition("/")
        if op["op"] != "replace" or kind != "webhooks":
            raise ValueError(f"{patch_file}: a patch this installer does not know: {op['op']} {op['path']}")
        out[int(index)] = op["value"]
    return out


def local_manifests(config: Path, ca_bundle: bytes, port: int = WEBHOOK_PORT) -> list[Manifest]:
    """What the local cluster gets (pure): the CRD, LWS's ClusterRole bound to the manager's identity, and its
    webhook configurations calling https://127.0.0.1:`port`."""
    [crd] = _docs(config / "crd" / "bases" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml")
    assert crd["metadata"]["name"] == LWS_CRD, crd["metadata"]["name"]
    [role] = _docs(config / "rbac" / "role.yaml")
    role = {**role, "metadata": {"name": PREFIX + role["metadata"]["name"]}}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": PREFIX + "manager-rolebinding"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }
    patches = {
        "MutatingWebhookConfiguration": config / "webhook" / "mutating-patch.yaml",
        "ValidatingWebhookConfiguration": config / "webhook" / "validating-patch.yaml",
    }
    webhooks = []
    for doc in _docs(config / "webhook" / "manifests.yaml"):
        hooks = _replace_webhooks(doc["webhooks"], patches[doc["kind"]])
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://{controlplane.HOST}:{port}{path}",
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
        webhooks.append({**doc, "metadata": {"name": PREFIX + doc["metadata"]["name"]}, "webhooks": hooks})
    return [crd, role, binding, *webhooks]


def manager_config(cert_dir: Path, port: int = WEBHOOK_PORT, health_port: int = HEALTH_PORT) -> Manifest:
    """The manager's configuration file (LWS's `Configuration`) for a process on loopback."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},  # one manager per cluster
        "internalCertManagement": {"enable": False},
        "webhook": {"host": controlplane.HOST, "port": port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"{controlplane.HOST}:{health_port}"},
    }


def _serving(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((controlplane.HOST, port)) == 0


def _wait_established(kubectl: Kubectl, timeout_s: float = 60) -> None:
    # Not `kubectl wait`: it fails, rather than waits, on a CRD so new that it has no conditions yet.
    query = '{.status.conditions[?(@.type=="Established")].status}'
    deadline = time.monotonic() + timeout_s
    while kubectl.run("get", "crd", LWS_CRD, "-o", f"jsonpath={query}", check=False).stdout != "True":
        if time.monotonic() > deadline:
            raise controlplane.ClusterError(f"the CRD {LWS_CRD} was not established within {timeout_s:.0f}s")
        time.sleep(0.5)


def install_local(layout: controlplane.Layout | None = None) -> None:
    """Install LWS on the running local cluster (a running manager is left as it is)."""
    layout = layout or controlplane.Layout()
    if not controlplane.is_up(layout):
        raise controlplane.ClusterError("the local cluster is not running: `rollfleet cluster up` first")
    binary = ensure_tool(LWS) / "cmd"
    config = config_dir()
    root = layout.root / "lws"
    cert_dir = root / "certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    p = layout.pki
    if not (cert_dir / "tls.crt").is_file():
        pki.serving_certificate(p, COMPONENT, [controlplane.HOST], cert_dir / "tls.crt", cert_dir / "tls.key")
    (root / "config.yaml").write_text(yaml.safe_dump(manager_config(cert_dir)))
    kubeconfig = layout.component_kubeconfig("lws")
    kubeconfig.write_text(pki.kubeconfig(controlplane.server_url(), p.ca_crt, p.token("lws"), USER))
    kubeconfig.chmod(0o600)
    kubectl = Kubectl(layout.kubeconfig)
    manifests = local_manifests(config, p.ca_crt.read_bytes())
    crd_and_rbac, webhooks = _split(manifests)
    # The CRD and RBAC first; the webhooks once their server answers (they fail closed on LWS's objects).
    text = yaml.safe_dump_all(crd_and_rbac)
    kubectl.run("apply", "--server-side", "--force-conflicts", "--field-manager=rollfleet-lws", "-f", "-", input=text)
    _wait_established(kubectl)
    if controlplane.running_pid(layout, COMPONENT) is None:
        argv = [str(binary), f"--config={root / 'config.yaml'}", f"--kubeconfig={kubeconfig}"]
        t0 = time.monotonic()
        controlplane.start_component(layout, COMPONENT, argv, functools.partial(_serving, WEBHOOK_PORT))
        log(f"LWS {LWS_VERSION} manager serving ({time.monotonic() - t0:.1f}s)")
    text = yaml.safe_dump_all(webhooks)
    kubectl.run("apply", "--server-side", "--force-conflicts", "--field-manager=rollfleet-lws", "-f", "-", input=text)
    log(f"LWS {LWS_VERSION} installed; its manager's log: {layout.log_file(COMPONENT)}")


def uninstall_local(layout: controlplane.Layout | None = None) -> None:
    """Remove what `install_local` made: webhooks first (they fail closed), then the manager, RBAC and CRD."""
    layout = layout or controlplane.Layout()
    kubectl = Kubectl(layout.kubeconfig)
    crd_and_rbac, webhooks = _split(local_manifests(config_dir(), b""))

    def delete(docs: list[Manifest]) -> None:
        for doc in reversed(docs):
            kubectl.run("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", "--wait=true")

    delete(webhooks)
    pid = controlplane.running_pid(layout, COMPONENT)
    if pid is not None:
        controlplane.stop_process(pid, grace=10)
    delete(crd_and_rbac)  # the CRD last: deleting it deletes every LeaderWorkerSet
    log("LWS removed")


def _split(manifests: list[Manifest]) -> tuple[list[Manifest], list[Manifest]]:
    """`local_manifests` as (CRD and RBAC, webhook configurations): the webhooks go on only while their server runs."""
    return manifests[:3], manifests[3:]


def kind_manifests(kustomized: str, image: str = IMAGE) -> list[Manifest]:
    """LWS's release manifests (`kubectl kustomize config/default`) with the manager's image built here (pure)."""
    docs = [d for d in yaml.safe_load_all(kustomized) if d]
    replaced = 0
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        # One manager: its release runs two (leader election), and kind's one node for system pods here has
        # the CPU requests of one.
        doc["spec"]["replicas"] = 1
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith(RELEASE_IMAGE_PREFIX):
                c["image"], c["imagePullPolicy"] = image, "IfNotPresent"
                replaced += 1
    if replaced != 1:
        raise ValueError(f"LWS's manifests name its image {replaced} times, not once: look at config/default again")
    return docs


def _kind_text(kubectl: Kubectl) -> str:
    """What kind gets, as YAML: LWS's release manifests, kustomized from the module, with the image built here."""
    return yaml.safe_dump_all(kind_manifests(kubectl.run("kustomize", str(config_dir() / "default")).stdout))


def _image(binary: Path) -> None:
    """The manager's image: the Debian base every image here starts from, and the binary as /manager."""
    from rollfleet_dev.kind import nodeimage

    if nodeimage.image_exists(IMAGE):
        return
    with tempfile.TemporaryDirectory() as context:
        shutil.copy(binary, Path(context) / "manager")
        dockerfile = (
            f'FROM {nodeimage.debian_image()}\nCOPY manager /manager\nUSER 65532:65532\nENTRYPOINT ["/manager"]\n'
        )
        (Path(context) / "Dockerfile").write_text(dockerfile)
        subprocess.run(["docker", "build", "-q", "-t", IMAGE, context], check=True, capture_output=True)
    log(f"built {IMAGE}")


def install_kind() -> None:
    """Install LWS on the running kind cluster as its release does, from the image built here."""
    from rollfleet_dev.kind import cluster, tools

    kubectl = Kubectl(cluster.kubeconfig_path())
    _image(ensure_tool(LWS) / "cmd")
    subprocess.run(
        [str(ensure_tool(tools.KIND) / "kind"), "load", "docker-image", "--name", cluster.CLUSTER_NAME, IMAGE],
        check=True,
        capture_output=True,
    )
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", "-", input=_kind_text(kubectl))
    kubectl.run(
        "-n", KIND_NAMESPACE, "rollout", "status", "deployment/lws-controller-manager", "--timeout=300s", timeout=320
    )
    log(f"LWS {LWS_VERSION} installed on kind (namespace {KIND_NAMESPACE})")


def uninstall_kind() -> None:
    """Remove what `install_kind` applied (the CRD last: deleting it deletes every LeaderWorkerSet)."""
    from rollfleet_dev.kind import cluster

    kubectl = Kubectl(cluster.kubeconfig_path())
    kubectl.run("delete", "--ignore-not-found", "--wait=true", "-f", "-", input=_kind_text(kubectl), timeout=320)
    log("LWS removed from kind")
