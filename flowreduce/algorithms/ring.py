"""Ring: reduce-scatter around the ring, then all-gather around it.

The vector is cut into p segments. In reduce-scatter step t rank r adds
its own slice of segment (r-t) mod p to the partial it receives from rank
r-1 and passes it on; after p-1 steps rank r owns segment (r+1) mod p in
full. The all-gather circulates the finished segments the same way::

    r0 -> r1 -> r2 -> r3 -> r0      (2(p-1) steps, one segment per message)

Cost: 2(p-1) steps, 2(p-1)/p·n bytes per rank on the wire (optimal), and
every link busy at every step; but 2(p-1) dependent levels make it the
slowest choice for small vectors on a task scheduler. Tasks ≈ 3p² per chunk.

The pattern runs over any subset of ranks and segment range
(:mod:`~flowreduce.algorithms.patterns`): :func:`reduce_scatter` and
:func:`all_gather` are what :mod:`~flowreduce.algorithms.hierarchical`
uses inside a host; :func:`plan` is their chain over all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowreduce import phases
from flowreduce.algorithms.ir import Draft, Plan, split_range
from flowreduce.algorithms.patterns import (
    Shards,
    Source,
    Tiles,
    check_divides,
    finish,
    lazy_shards,
    view_source,
)

NAME = "ring"


def plan(ranks: int) -> Plan:
    d = Draft(NAME, ranks, ranks)
    source = view_source(d)
    for r in range(ranks):  # every rank slices its segments up front (node ids in the picture's order)
        for s in range(ranks):
            source(r, s, s + 1)
    tiles, step = all_reduce(d, range(ranks), 0, ranks, source)
    return finish(d, tiles, step)


def shard_count(members: int) -> int:
    """Every member owns 1/g: a range handed to the pattern must be a multiple of g."""
    return members


def all_reduce(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
               step: int = 0) -> tuple[Tiles, int]:
    """Reduce-scatter, then all-gather ``[lo, hi)`` around the ring of ``members``."""
    shards = reduce_scatter(d, members, lo, hi, source, step=step)
    return all_gather(d, members, lo, hi, shards.held(), step=shards.step)


def reduce_scatter(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
                   step: int = 0) -> Shards:
    """g-1 steps around ``members``: member r starts part r, adds its own
    slice of the part it receives and passes it on; it ends owning part
    r+1 reduced over all members. The last step is not materialised:
    ``Shards.source`` creates it for exactly the ranges asked for."""
    members = tuple(members)
    g = len(members)
    if g == 1:
        return Shards(members, {members[0]: (lo, hi)}, source, step)
    check_divides(hi - lo, g, f"a ring over {g} ranks")
    parts = split_range(lo, hi, g)
    partial = [source(members[r], *parts[r]) for r in range(g)]  # step 0: r starts part r
    for t in range(1, g - 1):
        partial = [
            [d.reduce(members[r], *parts[(r - t) % g],
                      [*source(members[r], *parts[(r - t) % g]), *partial[(r - 1) % g]],
                      step + t, phases.REDUCE_SCATTER)]
            for r in range(g)
        ]
    t = g - 1
    last = {members[r]: [*source(members[r], *parts[(r - t) % g]), *partial[(r - 1) % g]] for r in range(g)}
    owned = {members[r]: parts[(r + 1) % g] for r in range(g)}
    return lazy_shards(d, owned, last, step + t, members)


def all_gather(d: Draft, members: Sequence[int], lo: int, hi: int, held: Tiles, *,
               step: int = 0) -> tuple[Tiles, int]:
    """g-1 steps around ``members``: each passes on the finished part it
    last received; every member ends with one gather of all of ``[lo, hi)``."""
    members = tuple(members)
    g = len(members)
    if g == 1:
        return {members[0]: list(held[members[0]])}, step
    parts = split_range(lo, hi, g)
    have = [{(r + 1) % g: list(held[members[r]])} for r in range(g)]  # part -> tiles
    moving = [list(held[members[r]]) for r in range(g)]
    for t in range(1, g - 1):
        moving = [[d.gather(members[r], *parts[(r + 1 - t) % g], moving[(r - 1) % g], step + t, phases.ALL_GATHER)]
                  for r in range(g)]
        for r in range(g):
            have[r][(r + 1 - t) % g] = moving[r]
    out: Tiles = {}
    for r in range(g):
        pieces = dict(have[r])
        pieces[(r + 2) % g] = moving[(r - 1) % g]
        inputs = [n for j in range(g) for n in pieces[j]]
        out[members[r]] = [d.gather(members[r], lo, hi, inputs, step + g - 1, phases.ALL_GATHER)]
    return out, step + g - 1
