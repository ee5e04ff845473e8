"""Every component's one way to kube-apiserver: credentials, calls, errors and watches.

Owns
- `load_client`: which credentials a component uses (an explicit kubeconfig, else the pod's
  service account, else $KUBECONFIG or ~/.kube/config);
- `Kube`: async get, list, create, replace, merge patch (of an object or its status), JSON
  patch, server-side apply and delete of the kinds defined here (`POD`, `FLEET`, ...), objects as
  JSON dicts. The official client is blocking: its calls run in a bounded thread pool of
  their own and are counted (`rollfleet_operator_api_calls_total{call}`);
- the error mapping, here only: 404 → `NotFound`, 409 → `Conflict`, 410 → `Gone`, any other
  failure status → `ApiError`;
- `Kube.watch`: list, then watch from the list's resourceVersion; re-list on 410 Gone and,
  after a backoff, on any other failure.

Components choose what they call (kinds, names, selectors from `rollfleet.contract`), never
how. Talks to kube-apiserver only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import kubernetes
import orjson
import prometheus_client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from rollfleet import metrics
from rollfleet.api import fleet, request
from rollfleet.contract import GROUP, LWS_API, LWS_PLURAL, MANAGER, VERSION
from rollfleet.errors import RollfleetError

log = logging.getLogger(__name__)

Obj = dict[str, Any]  # an object as the API server serves it (JSON)
Objs = list[Obj]  # also JSON patch operations (Kube.list shadows `list` in the class body's annotations)

API_CALLS = metrics.counter(metrics.OPERATOR_API_CALLS, prometheus_client.REGISTRY)
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"
WATCH_TIMEOUT_S = 240  # the server ends each watch request after this; the next resumes where it stopped
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 10.0


class ApiError(RollfleetError, RuntimeError):
    """The API server answered a call with a failure status."""

    status = 0

    def __init__(self, message: str, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.reason = reason


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    """A write that lost a race: the object exists already, or changed since it was read."""

    status = 409


UNPROCESSABLE = 422  # what the API server answers a JSON patch whose test failed


class Gone(ApiError):
    """A watch's resourceVersion is too old: list again."""

    status = 410


def api_error(status: int, reason: str, message: str) -> ApiError:
    """The error for a failure status, from a call or a watch's ERROR event."""
    cls = {404: NotFound, 409: Conflict, 410: Gone}.get(status, ApiError)
    return cls(f"{status} {reason}: {message}", status, reason)


def _mapped(err: ApiException) -> ApiError:
    try:
        message = json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        message = err.body or ""
    return api_error(int(err.status or 0), str(err.reason or ""), str(message))


@dataclass(frozen=True)
class Kind:
    """A kind the components touch, as the official client's method names spell it."""

    kind: str  # as manifests spell it: "Pod"
    name: str  # in the client's method names ("config_map": read_namespaced_config_map) and in call counts
    plural: str  # in call counts of lists; a custom resource's URL
    api: str  # the client's API class, by name: loading one costs up to a second, so only those used are
    namespaced: bool = True
    group_version: tuple[str, str] | None = None  # a custom resource's (CustomObjectsApi) API group and version

    @property
    def custom(self) -> bool:
        return self.group_version is not None


_CORE, _APPS, _RBAC, _NET = "CoreV1Api", "AppsV1Api", "RbacAuthorizationV1Api", "NetworkingV1Api"
_BATCH, _POLICY = "BatchV1Api", "PolicyV1Api"
POD = Kind("Pod", "pod", "pods", _CORE)
NODE = Kind("Node", "node", "nodes", _CORE, namespaced=False)
SECRET = Kind("Secret", "secret", "secrets", _CORE)
CONFIG_MAP = Kind("ConfigMap", "config_map", "configmaps", _CORE)
PERSISTENT_VOLUME_CLAIM = Kind("PersistentVolumeClaim", "persistent_volume_claim", "persistentvolumeclaims", _CORE)
SERVICE = Kind("Service", "service", "services", _CORE)
SERVICE_ACCOUNT = Kind("ServiceAccount", "service_account", "serviceaccounts", _CORE)
EVENT = Kind("Event", "event", "events", _CORE)
DEPLOYMENT = Kind("Deployment", "deployment", "deployments", _APPS)
JOB = Kind("Job", "job", "jobs", _BATCH)
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # on every pod of a Job, set by its controller
ROLE = Kind("Role", "role", "roles", _RBAC)
ROLE_BINDING = Kind("RoleBinding", "role_binding", "rolebindings", _RBAC)
NETWORK_POLICY = Kind("NetworkPolicy", "network_policy", "networkpolicies", _NET)
POD_DISRUPTION_BUDGET = Kind("PodDisruptionBudget", "pod_disruption_budget", "poddisruptionbudgets", _POLICY)
CRD = Kind(
    "CustomResourceDefinition",
    "custom_resource_definition",
    "customresourcedefinitions",
    "ApiextensionsV1Api",
    namespaced=False,
)
_CUSTOM, _ROLLFLEET = "CustomObjectsApi", (GROUP, VERSION)
FLEET = Kind(fleet.KIND, "fleet", fleet.PLURAL, _CUSTOM, group_version=_ROLLFLEET)
REQUEST = Kind(request.KIND, "request", request.PLURAL, _CUSTOM, group_version=_ROLLFLEET)
# An engine of several pods (rollfleet.controller.groups): LWS's API, which the operator only creates and deletes.
LEADER_WORKER_SET = Kind("LeaderWorkerSet", "leader_worker_set", LWS_PLURAL, _CUSTOM, group_version=LWS_API)
_BY_KIND = {
    k.kind: k
    for k in (
        POD,
        NODE,
        SECRET,
        CONFIG_MAP,
        SERVICE,
        SERVICE_ACCOUNT,
        EVENT,
        DEPLOYMENT,
        JOB,
        ROLE,
        ROLE_BINDING,
        NETWORK_POLICY,
        POD_DISRUPTION_BUDGET,
        CRD,
        FLEET,
        REQUEST,
        LEADER_WORKER_SET,
    )
}


def kind_named(kind: str) -> Kind:
    """The Kind of a manifest's `kind`."""
    return _BY_KIND[kind]


def load_client(kubeconfig: str | None = None) -> kubernetes.client.ApiClient:
    """An explicit kubeconfig; else in-cluster credentials when running in a pod; else $KUBECONFIG
    (or ~/.kube/config)."""
    config = kubernetes.client.Configuration()
    if kubeconfig:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    else:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
    # Calls run in a thread pool; the default of 4 pooled connections would serialise them.
    config.connection_pool_maxsize = 32
    return kubernetes.client.ApiClient(config)


def context_namespace(kubeconfig: str | None = None) -> str | None:
    """The namespace of the kubeconfig's current context, if it names one (and the file is readable)."""
    try:
        namespace: str | None = kubernetes.config.list_kube_config_contexts(kubeconfig)[1]["context"].get("namespace")
    except (kubernetes.config.ConfigException, OSError, KeyError):
        return None
    return namespace


@dataclass(frozen=True)
class Listed:
    """A watch's (re-)list: every selected object; replaces whatever the consumer knew."""

    items: list[Obj]


@dataclass(frozen=True)
class Changed:
    """A watch event: ADDED, MODIFIED or DELETED."""

    type: str
    object: Obj


class Kube:
    """Async calls through one ApiClient; each raises `ApiError` (or a subclass) on a failure status."""

    def __init__(self, client: kubernetes.client.ApiClient, concurrency: int = 16) -> None:
        self.client = client
        self._apis: dict[str, Any] = {}
        # The official client's methods are pydantic validate_call wrappers: looking one up on its API object
        # builds a new bound wrapper every time (a tenth of the operator's CPU while it patched 2,000 pods).
        self._methods: dict[tuple[Kind, str, bool], Callable[..., Any]] = {}
        # A pool of its own: the default executor has cpu_count + 4 threads (6 on two cores),
        # which would cap a 200-pod scale-up at 6 requests in flight.
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kube")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # --- the verbs ---------------------------------------------------------------------
    def pod_proxy_stream(
        self, namespace: str, pod: str, port: int, path: str, headers: Mapping[str, str], chunk: int
    ) -> Iterator[bytes]:
        """GET `path` on a pod's port through the API server's pod proxy, streamed (blocking: run it in a thread)."""
        API_CALLS.labels("proxy pod").inc()
        try:
            resp = self._api(_CORE).connect_get_namespaced_pod_proxy_with_path(
                f"{pod}:{port}", namespace, path.lstrip("/"), _preload_content=False, _headers=dict(headers)
            )
        except ApiException as err:
            raise _mapped(err) from err
        try:
            yield from resp.stream(chunk)
        finally:
            resp.release_conn()

    async def get(self, kind: Kind, namespace: str, name: str) -> Obj:
        return await self._call(f"read {kind.name}", self._method(kind, "read"), kind, namespace, name)

    async def exists(self, kind: Kind, namespace: str, name: str, uid: str) -> bool:
        """Whether `name` is still the object of `uid`: neither deleted nor made again under that name."""
        try:
            obj = await self.get(kind, namespace, name)
        except NotFound:
            return False
        return bool(obj["metadata"]["uid"] == uid)

    async def list(self, kind: Kind, namespace: str | None = None, label_selector: str | None = None) -> Objs:
        return list((await self._list(kind, namespace, label_selector)).get("items") or [])

    async def create(self, manifest: Mapping[str, Any]) -> Obj:
        kind = kind_named(manifest["kind"])
        return await self._call(
            f"create {kind.name}",
            self._method(kind, "create"),
            kind,
            manifest["metadata"].get("namespace"),
            None,
            manifest,
        )

    async def create_kept(self, manifest: Mapping[str, Any]) -> None:
        """Create it; one of that name that exists already (made by an earlier try, by another operator, or before
        a restart) is kept as it is."""
        with contextlib.suppress(Conflict):
            await self.create(manifest)

    async def replace(self, manifest: Mapping[str, Any]) -> Obj:
        """A full update; conditional on metadata.resourceVersion when the manifest carries one."""
        kind, meta = kind_named(manifest["kind"]), manifest["metadata"]
        return await self._call(
            f"replace {kind.name}", self._method(kind, "replace"), kind, meta["namespace"], meta["name"], manifest
        )

    async def patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        status: bool = False,
        field_manager: str | None = None,
    ) -> Obj:
        """A JSON merge patch (None deletes a key; a metadata.resourceVersion in it makes it conditional).
        `field_manager` names the writer in managedFields (who asked, for those who read it)."""
        what = f"patch {kind.name} status" if status else f"patch {kind.name}"
        manager = {"field_manager": field_manager} if field_manager else {}
        return await self._call(
            what, self._method(kind, "patch", status), kind, namespace, name, patch, _content_type=MERGE, **manager
        )

    async def json_patch(self, kind: Kind, namespace: str, name: str, ops: Objs) -> Obj:
        """An RFC 6902 JSON patch. A patch that opens with `test` operations is a compare-and-swap on the fields
        they test: the API server refuses one that fails (422 Invalid) as `Conflict`, the object having moved."""
        try:
            return await self._call(
                f"patch {kind.name}", self._method(kind, "patch"), kind, namespace, name, ops, _content_type=JSON_PATCH
            )
        except ApiError as err:
            if err.status == UNPROCESSABLE:
                raise Conflict(str(err), err.status, err.reason) from err
            raise

    async def apply(self, manifest: Mapping[str, Any]) -> Obj:
        """Server-side apply as the operator's field manager: creates, or converges, the object."""
        kind, meta = kind_named(manifest["kind"]), manifest["metadata"]
        return await self._call(
            f"apply {kind.name}",
            self._method(kind, "patch"),
            kind,
            meta["namespace"],
            meta["name"],
            manifest,
            field_manager=MANAGER,
            force=True,
            _content_type=APPLY,
        )

    async def delete(self, kind: Kind, namespace: str, name: str, options: Mapping[str, Any] | None = None) -> Obj:
        """Delete; `options` is a DeleteOptions body (preconditions, gracePeriodSeconds, propagationPolicy)."""
        return await self._call(
            f"delete {kind.name}", self._method(kind, "delete"), kind, namespace, name, body=options
        )

    async def watch(
        self,
        kind: Kind,
        namespace: str,
        label_selector: str | None = None,
        timeout_s: int = WATCH_TIMEOUT_S,
        field_selector: str | None = None,
        since: str | None = None,
    ) -> AsyncIterator[Listed | Changed]:
        """List, then every change, until the consumer stops; re-lists on 410 Gone at once and after
        any other failure (an API error, a dropped connection) with a backoff of 0.5 s doubling to 10 s.
        `since`: a resourceVersion the consumer has already read everything at (a get of the one object
        selected): the first list is skipped, and changes come from there."""
        backoff = BACKOFF_MIN_S
        selectors = {"label_selector": label_selector, "field_selector": field_selector}
        while True:
            try:
                if since is None:
                    listed = await self._list(kind, namespace, **selectors)
                    yield Listed(list(listed.get("items") or []))
                    backoff = BACKOFF_MIN_S
                    version = listed["metadata"]["resourceVersion"]
                else:
                    version, since = since, None  # once: a re-list after a failure starts over
                while True:  # each watch request ends after timeout_s; the next resumes at `version`
                    async for event in self._stream(kind, namespace, selectors, version, timeout_s):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise api_error(
                                int(obj.get("code") or 0), str(obj.get("reason", "")), str(obj.get("message", obj))
                            )
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            yield Changed(event["type"], obj)
            except Gone as err:
                log.info("%s watch expired (%s); re-listing", kind.plural, err)
            except Exception as err:  # the watch must outlive any failure: its consumer has no other source
                log.warning("%s watch failed (%s); re-listing in %.1fs", kind.plural, err, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    # --- how ---------------------------------------------------------------------------
    def _method(self, kind: Kind, verb: str, status: bool = False) -> Callable[..., Any]:
        """The official client's method: read_namespaced_pod, list_node, get_namespaced_custom_object, ..."""
        known = self._methods.get((kind, verb, status))
        if known is not None:
            return known
        api = self._api(kind.api)
        if kind.custom:
            name = f"{'get' if verb == 'read' else verb}_namespaced_custom_object"
        else:
            name = f"{verb}_namespaced_{kind.name}" if kind.namespaced else f"{verb}_{kind.name}"
        method: Callable[..., Any] = getattr(api, name + ("_status" if status else ""))
        self._methods[(kind, verb, status)] = method
        return method

    def preload(self, *kinds: Kind) -> None:
        """Make the client's API objects of these kinds now (each class an import of its own, on first use; a
        CoreV1Api alone takes most of a second), so that a first call later does not wait for one."""
        for kind in kinds:
            self._api(kind.api)

    def _api(self, name: str) -> Any:
        """The official client's API object of that class name, made on first use."""
        api = self._apis.get(name)
        if api is None:
            api = self._apis[name] = getattr(kubernetes.client, name)(self.client)
        return api

    @staticmethod
    def _args(kind: Kind, namespace: str | None, name: str | None) -> tuple[Any, ...]:
        """The positional arguments before the body: the custom resource's API, then name and namespace in the
        order the client wants them."""
        if kind.group_version is not None:
            return *kind.group_version, namespace, kind.plural, *([name] if name is not None else [])
        return tuple(a for a in (name, namespace if kind.namespaced else None) if a is not None)

    async def _list(
        self, kind: Kind, namespace: str | None, label_selector: str | None, field_selector: str | None = None
    ) -> Obj:
        selectors = {k: v for k, v in (("label_selector", label_selector), ("field_selector", field_selector)) if v}
        return await self._call(f"list {kind.plural}", self._method(kind, "list"), kind, namespace, None, **selectors)

    async def _call(
        self,
        what: str,
        method: Callable[..., Any],
        kind: Kind,
        namespace: str | None,
        name: str | None,
        *body: Any,
        **kwargs: Any,
    ) -> Obj:
        API_CALLS.labels(what).inc()
        # _preload_content=False: plain JSON, the same shape watch events (and kopf's) carry.
        call = functools.partial(method, *self._args(kind, namespace, name), *body, _preload_content=False, **kwargs)
        try:
            resp = await asyncio.get_running_loop().run_in_executor(self._pool, call)
        except ApiException as err:
            raise _mapped(err) from err
        return dict(orjson.loads(resp.data))

    async def _stream(
        self, kind: Kind, namespace: str, selectors: Mapping[str, str | None], version: str, timeout_s: int
    ) -> AsyncIterator[Obj]:
        """One watch request's events. Read in a daemon thread of its own, not the pool: a stream blocks its
        reader for up to `timeout_s`, and the pool's threads are joined when the interpreter exits."""
        API_CALLS.labels(f"watch {kind.plural}").inc()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Obj | BaseException | None] = asyncio.Queue()
        stop = threading.Event()
        call = functools.partial(
            self._method(kind, "list"),
            *self._args(kind, namespace, None),
            **{k: v for k, v in selectors.items() if v},
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_s,
            _preload_content=False,
        )

        def put(item: Obj | BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads any more
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def read() -> None:
            try:
                response = call()
                try:
                    for line in iter_resp_lines(response):
                        if stop.is_set():
                            return
                        put(json.loads(line))
                finally:
                    # Closed, not only released: a half-read stream must not go back to the pool. Never closed
                    # from another thread: closing a TLS socket while this one reads it deadlocks in ssl.
                    response.close()
                    response.release_conn()
                put(None)
            except ApiException as err:
                put(_mapped(err))
            except Exception as err:
                put(err)

        threading.Thread(target=read, name=f"watch-{kind.plural}", daemon=True).start()
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
