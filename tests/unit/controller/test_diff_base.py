"""kopf's diff base, which the operator does not keep (`handlers.NoDiffBase`): right only while no handler reads it."""

from __future__ import annotations

import kopf

import rollfleet.controller.handlers as fleet_handlers
import rollfleet.controller.requests.handlers  # noqa: F401  (registers the RolloutRequest handlers, as the operator does)


def test_the_operator_registers_no_change_handler_so_it_needs_no_diff_base() -> None:
    registry = kopf.get_default_registry()
    assert registry._indexing.get_all_handlers() and registry._watching.get_all_handlers()  # what it does register
    assert fleet_handlers.unused_diff_base(registry)


def test_a_change_handler_would_need_the_diff_base() -> None:
    registry = kopf.OperatorRegistry()

    @kopf.on.update("pods", registry=registry)
    def changed(**_: object) -> None: ...

    assert not fleet_handlers.unused_diff_base(registry)


def test_nothing_is_copied_or_stored() -> None:
    pod = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "e-0", "annotations": {}}, "spec": {}})
    storage = fleet_handlers.NoDiffBase()
    assert storage.build(body=pod) == {} and storage.fetch(body=pod) is None
    patch = kopf.Patch()
    storage.store(body=pod, patch=patch, essence=storage.build(body=pod))
    assert not patch
