"""kopf registration for RolloutFleet: each fleet's task, fed by three indexes and the watches of what fleets own.

Fleet events start, feed and stop the fleet's task (`tasks.ObjectTasks`), which runs its
`reconciler.FleetLoop`. The loop reads the fleet's engine pods, gateway Deployment and
weight-sync record (ConfigMap) from kopf's indexes (kopf fills them before it hands over any
event, so a restarted operator never decides on a partial view) and wakes when they change.
The other kinds a fleet owns (ServiceAccounts, RBAC, its PodDisruptionBudget, NetworkPolicy and
gateway Service) are watched into `owned.OwnedObjects`, so that the loop puts back what someone else
changed or deleted. Every watch carries a server-side label selector: the operator is sent
Rollfleet's own objects, not the cluster's. No finalizer: a deleted fleet never
waits for the operator; the garbage collector removes what it owns. The shared clients and
the tasks live in kopf's memo from startup to cleanup. Talks to nobody itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
import prometheus_client

from rollfleet.api.fleet import PLURAL
from rollfleet.contract import (
    APP_NAME,
    COMPONENT_ENGINE,
    COMPONENT_GATEWAY,
    COMPONENT_WEIGHTS,
    GROUP,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGER,
    VERSION,
    component_labels,
    selector,
)
from rollfleet.controller.metrics import FleetMetrics
from rollfleet.controller.owned import Key, object_key, version_of
from rollfleet.controller.reconciler import FleetLoop, NodeHealth, Shared, WeightsRecord
from rollfleet.controller.status import GatewayObs
from rollfleet.controller.tasks import ObjectTasks
from rollfleet.engine_client import EngineClient
from rollfleet.kube import Kube, load_client

log = logging.getLogger("rollfleet.operator")


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base is the last handled state that its change handlers (on.create, on.update, on.field) diff
    against. This operator registers none (indexes and event handlers only: `unused_diff_base` checks), so it
    keeps none: kopf builds it on every watch event of every object, a deep copy of the whole object, and
    that copy was a tenth of the operator's CPU while 2,000 engine pods came up (py-spy, bench_scale)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        """Nothing to keep (and no annotation to write on the object)."""


def unused_diff_base(registry: kopf.OperatorRegistry) -> bool:
    """Whether `registry` has no change handler, which alone reads kopf's diff base (see NoDiffBase)."""
    return not registry._changing.get_all_handlers()


@kopf.on.startup()
async def start_fleets(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf would log, and post as a Kubernetes Event, "Handler succeeded" for every watch
    # event of every pod; our own Events say what changed.
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if unused_diff_base(kopf.get_default_registry()):
        settings.persistence.diffbase_storage = NoDiffBase()
    for resource, component in _INDEXED.items():
        settings.watching.label_selectors[resource] = selector({LABEL_NAME: APP_NAME, LABEL_COMPONENT: component})
    for resource in _OWNED_ONLY:
        settings.watching.label_selectors[resource] = selector({LABEL_NAME: APP_NAME, LABEL_MANAGED_BY: MANAGER})
    # The downward API's namespace (manifests/base/operator.yaml): fleets' NetworkPolicies
    # admit this operator's pods to the engines by it.
    namespace = os.environ.get("POD_NAMESPACE") or None
    if namespace is None:
        log.warning(
            "POD_NAMESPACE is not set (not running in a pod?): fleets' NetworkPolicies admit no operator "
            "pod; where they are enforced, admit this operator through spec.networkPolicy.extraIngressFrom"
        )
    kube = Kube(load_client())
    metrics = FleetMetrics(prometheus_client.REGISTRY)  # served on --metrics-port (controller/main.py)
    memo.fleets = Shared(kube, EngineClient(), NodeHealth(kube), namespace, memo.operator_key, metrics)
    memo.fleet_tasks = ObjectTasks("fleet")


@kopf.on.cleanup()
async def stop_fleets(memo: kopf.Memo, **_: Any) -> None:
    await memo.fleet_tasks.stop_all()
    shared: Shared = memo.fleets
    await shared.engines.aclose()
    shared.kube.close()
    shared.metrics.close()


def _owned(component: str) -> dict[str, Any]:
    """kopf's label filter for what the operator makes for some fleet: the component's labels."""
    return {**component_labels("", component), LABEL_FLEET: kopf.PRESENT}


# The indexed resources (as kopf's decorators name them) and the component each watch is cut to.
_PODS, _DEPLOYMENTS, _CONFIG_MAPS = ("", "v1", "pods"), ("apps", "v1", "deployments"), ("", "v1", "configmaps")
_INDEXED = {_PODS: COMPONENT_ENGINE, _DEPLOYMENTS: COMPONENT_GATEWAY, _CONFIG_MAPS: COMPONENT_WEIGHTS}
# The other kinds a fleet owns (desired.owned_objects): watched only so that the loop puts back what someone else
# changed or deleted.
_OWNED_ONLY = (
    ("", "v1", "serviceaccounts"),
    ("", "v1", "services"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
)


# The indexers are coroutines: kopf runs a plain function in its thread pool, a hop per watch event (2,000
# engines coming up are some 10,000 pod events).
@kopf.index(*_PODS, labels=_owned(COMPONENT_ENGINE))
async def engine_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict[Key, dict[str, Any]]:
    return {(namespace, labels[LABEL_FLEET]): dict(body)}


@kopf.index(*_DEPLOYMENTS, labels=_owned(COMPONENT_GATEWAY))
async def gateways(
    body: kopf.Body, status: kopf.Status, namespace: str, labels: kopf.Labels, **_: Any
) -> dict[Key, GatewayObs]:
    obs = GatewayObs(int(status.get("replicas") or 0), int(status.get("readyReplicas") or 0), _owner(body))
    return {(namespace, labels[LABEL_FLEET]): obs}


@kopf.index(*_CONFIG_MAPS, labels=_owned(COMPONENT_WEIGHTS))
async def weight_records(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict[Key, WeightsRecord]:
    record = WeightsRecord(dict(body.get("data") or {}), str(body["metadata"]["resourceVersion"]), _owner(body))
    return {(namespace, labels[LABEL_FLEET]): record}


OWNED_WATCHED = (*_OWNED_ONLY, _DEPLOYMENTS, _CONFIG_MAPS)  # every kind desired.owned_objects makes


def _watch_owned(fn: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    for resource in OWNED_WATCHED:
        fn = kopf.on.event(*resource, labels={LABEL_MANAGED_BY: MANAGER, LABEL_FLEET: kopf.PRESENT})(fn)
    return fn


@_watch_owned
async def owned_object(
    event: kopf.RawEvent,
    resource: kopf.Resource,
    name: str,
    namespace: str,
    labels: kopf.Labels,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """What the watch shows of an object some fleet owns: its loop applies it again if it is not as left."""
    shared: Shared = memo.fleets
    version = None if event.get("type") == "DELETED" else version_of(event["object"]["metadata"])
    shared.owned.saw((namespace, labels[LABEL_FLEET]), object_key(resource.kind, name), version)


def _owner(body: kopf.Body) -> str | None:
    """The uid of the fleet that owns an object (its controller owner reference)."""
    refs = body.get("metadata", {}).get("ownerReferences") or []
    return next((str(r["uid"]) for r in refs if r.get("controller")), None)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def fleet_event(
    event: kopf.RawEvent,
    memo: kopf.Memo,
    engine_pods: kopf.Index[Key, dict[str, Any]],
    gateways: kopf.Index[Key, GatewayObs],
    weight_records: kopf.Index[Key, WeightsRecord],
    **_: Any,
) -> None:
    tasks: ObjectTasks = memo.fleet_tasks
    tasks.on_event(
        event.get("type"),
        event["object"],
        lambda body: FleetLoop(memo.fleets, body, engine_pods, gateways, weight_records),
    )
