"""What a fleet owns is applied again only when the watch shows it otherwise than the loop left it."""

from __future__ import annotations

from rollfleet.api.fleet import RolloutFleetSpec
from rollfleet.controller import desired, handlers
from rollfleet.controller.owned import ABSENT, UNSEEN, Applied, OwnedObjects, must_write, version_of
from rollfleet.controller.owner import FleetRef
from rollfleet.kube import kind_named

KEY = ("ns", "f")
SVC = "Service/f-gateway"


def test_an_object_is_written_when_never_written_or_its_manifest_changed() -> None:
    assert must_write(None, "d1", UNSEEN)
    assert must_write(Applied("d1", "7"), "d2", "7")
    assert not must_write(Applied("d1", "7"), "d1", UNSEEN)  # the watch has not shown it yet
    assert not must_write(Applied("d1", "7"), "d1", "7")  # as the loop left it


def test_an_object_someone_else_changed_or_deleted_is_written_again() -> None:
    assert must_write(Applied("d1", "7"), "d1", "9")  # edited: another version
    assert must_write(Applied("d1", "7"), "d1", None)  # deleted


def test_an_object_the_spec_switched_off_is_deleted_again_only_if_it_comes_back() -> None:
    gone = Applied(ABSENT, None)
    assert not must_write(gone, ABSENT, UNSEEN)
    assert not must_write(gone, ABSENT, None)
    assert must_write(gone, ABSENT, "3")  # made again by someone
    assert must_write(Applied("d1", "7"), ABSENT, "7")  # switched off since it was applied


def test_a_status_update_is_no_change_but_an_object_made_again_by_someone_else_is() -> None:
    deployment = {"uid": "u1", "generation": 3, "resourceVersion": "10"}
    assert version_of(deployment) == version_of(deployment | {"resourceVersion": "11"})  # its status moved
    assert version_of(deployment) != version_of(deployment | {"generation": 4})  # its spec
    assert version_of(deployment) != version_of(deployment | {"uid": "u2"})  # deleted and made again, same generation
    role = {"uid": "u1", "resourceVersion": "10"}  # no generation: every change counts
    assert version_of(role) != version_of(role | {"resourceVersion": "11"})


def test_changes_count_only_for_fleets_with_a_loop_and_only_when_the_version_moves() -> None:
    owned = OwnedObjects()
    owned.saw(KEY, SVC, "1")  # no loop yet: not kept (its first pass applies everything anyway)
    assert owned.seen(KEY, SVC) is UNSEEN and owned.changes(KEY) == 0
    owned.track(KEY)
    owned.saw(KEY, SVC, "1")
    owned.saw(KEY, SVC, "1")  # a re-list's copy
    assert owned.seen(KEY, SVC) == "1" and owned.changes(KEY) == 1
    owned.saw(KEY, SVC, None)
    assert owned.seen(KEY, SVC) is None and owned.changes(KEY) == 2
    owned.saw(("ns", "other"), SVC, "4")
    assert owned.changes(KEY) == 2


def test_a_fleet_made_again_under_its_name_keeps_its_view_until_both_loops_end() -> None:
    owned = OwnedObjects()
    owned.track(KEY)
    owned.track(KEY)  # the new fleet's loop starts before the old one's has ended
    owned.saw(KEY, SVC, "1")
    owned.forget(KEY)
    assert owned.seen(KEY, SVC) == "1"
    owned.forget(KEY)
    assert owned.seen(KEY, SVC) is UNSEEN


def test_every_kind_a_fleet_owns_is_watched() -> None:
    spec = RolloutFleetSpec.model_validate(
        {"model": {"servedName": "tiny", "hostPath": "/models/tiny"}, "networkPolicy": {"enabled": True}}
    )
    objects = desired.owned_objects(FleetRef(name="f", namespace="ns", uid="u"), spec, "rollfleet-system")
    made = {(o["apiVersion"], o["kind"]) for o in objects}
    assert len(made) >= 8
    for api_version, kind in made:
        group, _, version = api_version.rpartition("/")
        assert (group, version, kind_named(kind).plural) in handlers.OWNED_WATCHED, f"{kind} is owned, not watched"
