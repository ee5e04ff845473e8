"""kopf registration for RolloutFleet: watch events feed the fleet loops in `reconciler`.

Event handlers only (no on.create/on.update progress, no daemon): kopf is the watch
machinery here, and all decisions happen in the per-fleet loops. Without handlers that
need finalizers, deleting a fleet never waits for the operator; the garbage collector
removes what the fleet owns. The shared `Operator` lives in kopf's memo from startup
to cleanup. Talks to nobody itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from rollfleet.api.fleet import PLURAL
from rollfleet.contract import (
    APP_NAME,
    COMPONENT_ENGINE,
    COMPONENT_GATEWAY,
    GROUP,
    LABEL_COMPONENT,
    LABEL_NAME,
    VERSION,
)
from rollfleet.controller.reconciler import Operator
from rollfleet.engine_client import EngineClient
from rollfleet.kube import Kube, load_client

log = logging.getLogger("rollfleet.operator")


@kopf.on.startup()
async def start_fleets(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf would log, and post as a Kubernetes Event, "Handler succeeded" for every watch
    # event of every pod; our own Events say what changed.
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    engines = EngineClient(max_connections=256)
    # The downward API's namespace (manifests/base/operator.yaml): fleets' NetworkPolicies
    # admit this operator's pods to the engines by it.
    namespace = os.environ.get("POD_NAMESPACE") or None
    if namespace is None:
        log.warning(
            "POD_NAMESPACE is not set (not running in a pod?): fleets' NetworkPolicies admit no operator "
            "pod; where they are enforced, admit this operator through spec.networkPolicy.extraIngressFrom"
        )
    memo.kube = Kube(load_client())
    memo.fleets = Operator(memo.kube, engines, namespace)
    memo.engines = engines


@kopf.on.cleanup()
async def stop_fleets(memo: kopf.Memo, **_: Any) -> None:
    await memo.fleets.stop()
    await memo.engines.aclose()
    memo.kube.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def fleet_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    memo.fleets.on_fleet(event.get("type"), event["object"])


@kopf.on.event("", "v1", "pods", labels={LABEL_NAME: APP_NAME, LABEL_COMPONENT: COMPONENT_ENGINE})
async def engine_pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    memo.fleets.on_pod(event.get("type"), event["object"])


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_NAME: APP_NAME, LABEL_COMPONENT: COMPONENT_GATEWAY})
async def gateway_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    memo.fleets.on_gateway(event.get("type"), event["object"])
