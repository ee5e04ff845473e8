"""fleet_weight_version: what the operator writes to status and which engines may serve."""

from __future__ import annotations

from rollfleet.sync.fleetversion import fleet_weight_version
from rollfleet.sync.protocol import (
    EngineObservation,
    FleetRecord,
    WeightsRef,
    adopt_initial,
    begin_push,
    commit,
    complete,
    encode_record,
)

B = WeightsRef("B", 1, url="http://10.0.0.5:8472", manifest_sha256="abc", source="/spool/B")


def as_annotations(record: FleetRecord) -> dict[str, str]:
    return {k: v for k, v in encode_record(record).items() if v is not None}


def reports(**versions: str | None) -> dict[str, EngineObservation]:
    """Engines' reports; one on B proves B's pinned manifest."""
    return {
        name: EngineObservation(v, manifest=B.manifest_sha256 if v == "B" else None) for name, v in versions.items()
    }


def test_no_record_the_version_is_the_one_all_engines_agree_on() -> None:
    fv = fleet_weight_version({}, reports(e0="A", e1="A"))
    assert (fv.version, fv.routable, fv.pending_sync) == ("A", ("e0", "e1"), ())
    assert fleet_weight_version({}, reports(e0="A", e1="B")).version is None
    assert fleet_weight_version({}, reports(e0="A", e1=None)).version is None


def test_a_fleet_is_pristine_until_its_first_push() -> None:
    """Pristine: an engine started now serves what the fleet serves (rollfleet.controller.plan.born_ready)."""
    assert fleet_weight_version({}, reports(e0="A")).pristine
    adopted = adopt_initial(FleetRecord(), ["A"])
    assert fleet_weight_version(as_annotations(adopted), reports(e0="A")).pristine  # what they started with
    pushing = begin_push(adopted, B, now=0.0)
    assert not fleet_weight_version(as_annotations(pushing), reports(e0="A")).pristine
    done = complete(commit(pushing))
    assert not fleet_weight_version(as_annotations(done), reports(e0="B")).pristine


def test_during_a_push_the_version_stays_until_commit() -> None:
    pushing = begin_push(adopt_initial(FleetRecord(), ["A"]), B, now=0.0)
    fv = fleet_weight_version(as_annotations(pushing), reports(e0="A", e1="B", e2=None))
    assert (fv.version, fv.generation, fv.syncing_to) == ("A", 0, "B")
    assert fv.routable == ("e0", "e1")  # both paused by the sidecar: they hold requests
    assert fv.pending_sync == ("e2",)


def test_after_commit_only_engines_on_the_new_version_serve() -> None:
    done = complete(commit(begin_push(adopt_initial(FleetRecord(), ["A"]), B, now=0.0), failed=["e0"]))
    fv = fleet_weight_version(as_annotations(done), reports(e0="A", e1="B", e9="B"))
    assert (fv.version, fv.generation, fv.syncing_to) == ("B", 1, None)
    assert fv.routable == ("e1", "e9") and fv.pending_sync == ("e0",)


def test_each_engine_s_generation_is_that_of_the_weights_it_reports() -> None:
    # No record: what the engines started with is generation 0, whatever its label.
    assert fleet_weight_version({}, reports(e0="A", e1=None)).engine_generations == {"e0": 0, "e1": None}
    pushing = begin_push(adopt_initial(FleetRecord(), ["A"]), B, now=0.0)
    fv = fleet_weight_version(as_annotations(pushing), reports(e0="A", e1="B", e2=None))
    assert fv.engine_generations == {"e0": 0, "e1": 1, "e2": None}  # e1 loaded B before the commit
    done = complete(commit(pushing))
    fv = fleet_weight_version(as_annotations(done), reports(e0="A", e1="B", e9="Z"))
    assert fv.engine_generations == {"e0": 0, "e1": 1, "e9": None}  # Z: nothing the record remembers


def test_an_engine_on_the_fleets_label_over_other_bytes_is_on_no_version() -> None:
    done = complete(commit(begin_push(adopt_initial(FleetRecord(), ["A"]), B, now=0.0)))
    relabelled = {"e0": EngineObservation("B", manifest="other"), "e1": EngineObservation("B", manifest="abc")}
    fv = fleet_weight_version(as_annotations(done), relabelled)
    assert fv.routable == ("e1",) and fv.pending_sync == ("e0",)
    assert fv.engine_generations == {"e0": None, "e1": 1}
    # Unproven is not proven: an engine that reports no manifest for a pinned version.
    fv = fleet_weight_version(as_annotations(done), {"e0": EngineObservation("B")})
    assert fv.pending_sync == ("e0",)
    # Weights no push pinned (those the engines started with) have only their label.
    fv = fleet_weight_version({}, {"e0": EngineObservation("A"), "e1": EngineObservation("A", manifest="x")})
    assert fv.routable == ("e0", "e1") and fv.version == "A"
