"""Which engine stages a push from which (pure): the relay plan of `Orchestrator._stage_all`.

An engine that stages relays what it has received so far to the engines below it, so the sidecar's uplink
carries each byte once. In a chain every engine receives at its link's full rate, and each engine adds a hop:
the receive piece it must have before it forwards it (`PIECE_BYTES`, 1 MiB) at the link's rate. A binary tree
shares each uplink between two engines, so each receives at half the rate, but none is more than log2(n) + 1
hops from the sidecar. So a chain takes about (pieces + n) piece-times and a tree about 2 x pieces + 2 log2(n):
the chain is the faster while the engines are no more than the pieces of the weights (a 16 GiB model: 16,384),
and the tree past that (128 MiB to 2,000 engines). Measured on a simulated network by bench/push_sim.py
(docs/architecture.md, "Scale"). A tree also bounds what a slow engine delays to the engines below it.

Two trees (`second_parents`): the first half of every shard goes down the tree above, the second half down
the same tree laid over the engines in reverse order, so the engines that relay in one tree are leaves of the
other. Each engine then sends about what it receives, two halves at half the rate each: the rate of a chain
at the depth of a tree, about pieces + 2 log2(n) piece-times (NCCL's double binary tree, for a broadcast).
"""

from __future__ import annotations

from rollfleet_engine.safetensors_stream import PIECE_BYTES

TREE_FANOUT = 2


def relay_fanout(engines: int, total_bytes: int, chain_max: int | None = None) -> int:
    """How many engines each one relays to: 1 (a chain) while `engines` are no more than the weights' receive
    pieces, else a binary tree; `chain_max` (the sidecar's --relay-chain-max) sets the bound instead."""
    bound = chain_max if chain_max is not None else -(-total_bytes // PIECE_BYTES)
    return 1 if engines <= bound else TREE_FANOUT


def relay_parents(engines: int, fanout: int) -> list[int | None]:
    """Each engine's upstream, by index (None: the sidecar): a tree of `fanout` children per engine, laid out
    as a heap, so every engine's upstream comes before it (it is asked to stage first) and no engine is more
    than log_fanout(n) + 1 hops from the sidecar. A fanout of 1 is the chain."""
    if fanout < 1:
        raise ValueError(f"a relay fanout must be 1 or more, got {fanout}")
    return [None if i == 0 else (i - 1) // fanout for i in range(engines)]


def second_parents(engines: int, fanout: int) -> list[int | None]:
    """Each engine's upstream in the second tree (None: the sidecar): `relay_parents` laid over the engines in
    reverse order. The engines with children in one tree have none in the other (an odd count leaves the middle
    engine a leaf of both)."""
    first = relay_parents(engines, fanout)
    mirrored = [first[engines - 1 - i] for i in range(engines)]
    return [None if p is None else engines - 1 - p for p in mirrored]


def depth(parents: list[int | None]) -> int:
    """The most hops from the sidecar to an engine of the plan (the sidecar's own: 1)."""
    hops: list[int] = [0] * len(parents)
    for engine in range(len(parents)):
        path: list[int] = []
        at: int | None = engine
        while at is not None and not hops[at]:  # up to the sidecar, or an engine already counted
            path.append(at)
            at = parents[at]
        count = 0 if at is None else hops[at]
        for below in reversed(path):
            count += 1
            hops[below] = count
    return max(hops, default=0)
