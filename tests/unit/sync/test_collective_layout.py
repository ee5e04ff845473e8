"""Who takes which ranks in a collective group: pure."""

from __future__ import annotations

from rollfleet.engine_client import EngineRef
from rollfleet.sync.collective import layout, world_size
from rollfleet_client.sync_protocol import CollectiveMember


def test_the_trainer_is_rank_0_and_each_engine_takes_its_workers_ranks_in_order() -> None:
    engines = [EngineRef(n, f"http://{n}:8000") for n in ("e0", "e1", "e2")]
    members = layout(engines, ["i0", "i1", "i2"], [1, 2, 1])
    assert members == [
        CollectiveMember(name="e0", instance="i0", rank_offset=1, ranks=1),
        CollectiveMember(name="e1", instance="i1", rank_offset=2, ranks=2),
        CollectiveMember(name="e2", instance="i2", rank_offset=4, ranks=1),
    ]
    assert world_size(members) == 5


def test_a_restarted_engine_at_the_same_address_is_another_member() -> None:
    engine = [EngineRef("e0", "http://e0:8000")]
    assert layout(engine, ["before"], [1]) != layout(engine, ["after"], [1])
