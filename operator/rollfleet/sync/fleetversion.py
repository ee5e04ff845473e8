"""``fleet_weight_version``: the fleet's weight version and each engine's routability. Pure.

The operator is the only writer of RolloutFleet status and of engine pods; the sync
sidecar records push outcomes in the fleet's ConfigMap ``<fleet>-weights``
(``protocol``). The operator calls this function on every reconcile with that record's
data and what each engine reports (``GET /rollfleet/v1/state``: its version, None when unknown, and the
manifest its last load was verified against), writes ``version`` to
``status.weightVersion``, and gives every engine in ``pending_sync`` the pod annotation
``rollfleet.dev/phase=PendingSync`` (never Ready or Paused) so the gateway does not
route to it. An engine leaves PendingSync when it reports the fleet's version, with the proof of its bytes
where the record pins them (``protocol.vouched``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rollfleet.sync.protocol import EngineObservation, PushPhase, decode_record, routable, vouched


@dataclass(frozen=True)
class FleetWeightVersion:
    version: str | None  # for status.weightVersion: what every routable engine serves
    generation: int | None
    routable: tuple[str, ...]  # engines that may get traffic (by weights)
    pending_sync: tuple[str, ...]  # engines that must not: wrong or unknown weights
    syncing_to: str | None  # the target of a push under way, if any
    # The generation of the weights each engine reports (None: unknown, or a version the record does not
    # remember); weights nobody pushed yet are generation 0. The gateway bounds a request's lag with these.
    engine_generations: Mapping[str, int | None]
    pristine: bool  # the record's (protocol.FleetRecord.pristine): an engine started now serves generation 0


def fleet_weight_version(
    record_data: Mapping[str, str] | None, engines: Mapping[str, EngineObservation]
) -> FleetWeightVersion:
    """The fleet's version and which engines may serve, from the record and the engines' reports.

    An engine is on the version it serves only if it proves the bytes the record pins for that version
    (``vouched``): a label alone, over other bytes, is no version.

    The version changes only at a push's commit, and then every routable engine has
    it, because routable means "reports the committed version" (or, while a push is
    InProgress, the target: such an engine is paused and only holds requests).
    A fleet with no record yet has a version only if all its engines agree on one.
    """
    record = decode_record(record_data)
    engine_versions = {name: vouched(o.served, o.manifest, record) for name, o in engines.items()}
    ok = tuple(sorted(name for name, v in engine_versions.items() if routable(v, record)))
    pending = tuple(sorted(set(engine_versions) - set(ok)))
    push = record.push
    syncing_to = push.target.version if push is not None and push.phase is PushPhase.IN_PROGRESS else None
    c = record.committed

    def generation(version: str | None) -> int | None:
        if version is None:
            return None
        if push is not None and version == push.target.version:
            return push.target.generation  # loaded in a push not committed yet
        known = record.generation_of(version)
        if known is None and c is None:
            return 0  # no push committed yet: the weights the engines started with
        return known

    generations = {name: generation(v) for name, v in engine_versions.items()}
    if c is not None:
        return FleetWeightVersion(c.version, c.generation, ok, pending, syncing_to, generations, record.pristine)
    reported = {v for v in engine_versions.values() if v is not None}
    agreed = reported.pop() if len(reported) == 1 and None not in engine_versions.values() else None
    return FleetWeightVersion(agreed, None, ok, pending, None, generations, record.pristine)
