"""Which engine stages a push from which (pure): the relay plan of `Orchestrator._stage_all`.

An engine that stages relays what it has received so far to the engines below it, so the sidecar's uplink
carries each byte once. Up to `RELAY_CHAIN_MAX` engines the plan is a chain: every engine receives at its link's
full rate, and each one adds a hop (a relay piece's time, and a thread's hand-off in the engine that relays it).
Past that, the hops of a chain cost more than its rate buys: at 2,000 engines the last one waits on 1,999 before
it, and any slow engine slows every one after it. So larger fleets get a binary tree: an engine's uplink is
shared by two, each receives at half the rate, but at most log2(n) hops from the sidecar, and a slow engine
delays only the ones below it. docs/weight-sync.md ("Relay") has the measurements behind the choice.
"""

from __future__ import annotations

# Where a chain stops paying: n hops of a relay piece (at most 4 MiB) against half the rate over the whole set.
RELAY_CHAIN_MAX = 16
TREE_FANOUT = 2


def relay_fanout(engines: int, chain_max: int = RELAY_CHAIN_MAX) -> int:
    """How many engines each one relays to: 1 (a chain) up to `chain_max` engines, else a binary tree."""
    return 1 if engines <= chain_max else TREE_FANOUT


def relay_parents(engines: int, fanout: int) -> list[int | None]:
    """Each engine's upstream, by index (None: the sidecar): a tree of `fanout` children per engine, laid out
    as a heap, so every engine's upstream comes before it (it is asked to stage first) and no engine is more
    than log_fanout(n) + 1 hops from the sidecar. A fanout of 1 is the chain."""
    if fanout < 1:
        raise ValueError(f"a relay fanout must be 1 or more, got {fanout}")
    return [None if i == 0 else (i - 1) // fanout for i in range(engines)]


def depth(parents: list[int | None]) -> int:
    """The most hops from the sidecar to an engine of the plan (the sidecar's own: 1)."""
    hops: list[int] = []
    for parent in parents:
        hops.append(1 if parent is None else hops[parent] + 1)
    return max(hops, default=0)
