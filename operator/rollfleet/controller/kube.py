"""The operator's writes and reads against kube-apiserver, counted.

A thin async layer over the official client (its blocking calls run in threads):
create-if-absent, server-side apply, merge patches, deletes, status patches and Events.
Every request goes through `Kube._call`, which counts it in the Prometheus counter
`rollfleet_operator_api_calls_total` (kopf's watch streams are the only calls not counted).
Talks to kube-apiserver only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

import kubernetes
import prometheus_client
from kubernetes.client.exceptions import ApiException

from rollfleet.api.fleet import KIND, PLURAL
from rollfleet.contract import API_VERSION, GROUP, MANAGER, VERSION
from rollfleet.controller.desired import FleetRef, Manifest

T = TypeVar("T")
API_CALLS = prometheus_client.Counter("rollfleet_operator_api_calls", "Requests the operator made to the API server "
                                      "(watch streams not included)", ["call"])
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


def load_client(kubeconfig: str | None = None) -> kubernetes.client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (or $KUBECONFIG)."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    # Calls run in a thread pool; the default of 4 pooled connections would serialise them.
    config.connection_pool_maxsize = 32
    return kubernetes.client.ApiClient(config)


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient, concurrency: int = 16) -> None:
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        self.networking = kubernetes.client.NetworkingV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        # A pool of its own: the default executor has cpu_count + 4 threads (6 on two cores),
        # which would cap a 200-pod scale-up at 6 requests in flight.
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kube")
        self._instance = socket.gethostname()

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        API_CALLS.labels(what).inc()
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def create_pod(self, manifest: Manifest) -> bool:
        """Create a pod; False when one of that name exists already (names are stable: no duplicates)."""
        try:
            await self._call("create pod", self.core.create_namespaced_pod, manifest["metadata"]["namespace"],
                             manifest)
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    async def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        try:
            await self._call("patch pod", self.core.patch_namespaced_pod, name, namespace,
                             {"metadata": {"annotations": annotations}})
        except ApiException as err:
            if err.status != 404:  # gone meanwhile: nothing to annotate
                raise

    async def delete_pod(self, namespace: str, name: str, force: bool = False) -> None:
        try:
            await self._call("delete pod", self.core.delete_namespaced_pod, name, namespace,
                             grace_period_seconds=0 if force else None)
        except ApiException as err:
            if err.status != 404:
                raise

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        # _preload_content=False: plain dicts, the same shape kopf's watch events carry.
        resp = await self._call("list pods", self.core.list_namespaced_pod, namespace, label_selector=selector,
                                _preload_content=False)
        return list(_json(resp).get("items", []))

    async def list_nodes(self) -> list[dict[str, Any]]:
        resp = await self._call("list nodes", self.core.list_node, _preload_content=False)
        return list(_json(resp).get("items", []))

    async def read_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            resp = await self._call("read secret", self.core.read_namespaced_secret, name, namespace,
                                    _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return dict(_json(resp).get("data") or {})

    async def create_secret(self, manifest: Manifest) -> bool:
        try:
            await self._call("create secret", self.core.create_namespaced_secret,
                             manifest["metadata"]["namespace"], manifest)
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    async def apply(self, manifest: Manifest) -> None:
        """Server-side apply as the operator's field manager: creates, or converges, the object."""
        kind, ns, name = manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        fn = {
            "ServiceAccount": self.core.patch_namespaced_service_account,
            "Service": self.core.patch_namespaced_service,
            "Deployment": self.apps.patch_namespaced_deployment,
            "Role": self.rbac.patch_namespaced_role,
            "RoleBinding": self.rbac.patch_namespaced_role_binding,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
        }[kind]
        await self._call(f"apply {kind}", fn, name, ns, manifest, field_manager=MANAGER, force=True,
                         _content_type=APPLY)

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object the fleet's spec switched off; one that is gone already is fine."""
        fn = {"NetworkPolicy": self.networking.delete_namespaced_network_policy}[kind]
        try:
            await self._call(f"delete {kind}", fn, name, namespace)
        except ApiException as err:
            if err.status != 404:
                raise

    async def patch_fleet(self, ref: FleetRef, patch: dict[str, Any], status: bool = False) -> None:
        fn = self.custom.patch_namespaced_custom_object_status if status else self.custom.patch_namespaced_custom_object
        try:
            await self._call("patch fleet status" if status else "patch fleet", fn, GROUP, VERSION, ref.namespace,
                             PLURAL, ref.name, patch, _content_type=MERGE)
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile
                raise

    async def event(self, ref: FleetRef, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the fleet (`kubectl describe rf` and `kubectl get events` show it)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{ref.name}.{uuid.uuid4().hex[:16]}", "namespace": ref.namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": ref.name,
                               "namespace": ref.namespace, "uid": ref.uid},
            "type": type_, "reason": reason, "message": message[:1024],
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "source": {"component": MANAGER},
            "reportingComponent": MANAGER, "reportingInstance": self._instance,
        }
        await self._call("create event", self.core.create_namespaced_event, ref.namespace, body)


def _json(resp: Any) -> dict[str, Any]:
    return dict(json.loads(resp.data))
