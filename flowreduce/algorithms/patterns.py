"""What the collectives share: how a pattern over a subset of ranks reads its
inputs and hands on its results.

Every flat algorithm is written once, in its own module, as a pattern that
adds nodes to a :class:`~flowreduce.algorithms.ir.Draft` for any subset of
ranks (``members``) and any segment range ``[lo, hi)``; its ``plan`` runs
that pattern over all ranks and the whole vector, and
:mod:`~flowreduce.algorithms.hierarchical` chains the same patterns:

* a *reduce-scatter* (:mod:`~flowreduce.algorithms.butterfly`,
  :mod:`~flowreduce.algorithms.ring`) -- every owner ends with a distinct
  shard of ``[lo, hi)`` reduced over all members (:class:`Shards`);
* an *all-gather* -- the inverse: every member ends with all of ``[lo, hi)``;
* an *all-reduce* -- both, or a full-vector algorithm
  (:mod:`~flowreduce.algorithms.recursive_doubling`,
  :mod:`~flowreduce.algorithms.reduce_broadcast`).

Two conventions glue them together:

``Source``  ``source(rank, a, b)`` returns nodes *on* ``rank``, each covering
            exactly ``[a, b)``, whose reduction is that rank's contribution
            to ``[a, b)``. Exactness matters: a remote input that covers more
            than the reader needs is transferred whole. :func:`view_source`
            is the leaf (zero-copy views of the rank's input). The source a
            reduce-scatter returns creates its last-step reductions lazily,
            cut to exactly the ranges the next stage asks for, so no shard
            is re-sliced by an extra task before it is sent.
``Tiles``   ``{rank: [node, ...]}``: nodes on ``rank`` whose ranges tile a
            range left to right, fully reduced. A gather may take them as
            inputs directly.

Every pattern takes ``step``, the last step label already used, and
returns the last one it used (step labels only name keys; the plan's
levels come from the edges).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowreduce import phases
from flowreduce.algorithms.ir import VIEW, Draft, Plan

#: ``source(rank, a, b) -> [node, ...]``: see the module docstring.
Source = Callable[[int, int, int], list[int]]
#: ``{rank: [node, ...]}`` tiling a range left to right.
Tiles = dict[int, list[int]]


def memoized(source: Source) -> Source:
    """``source`` with one node list per ``(rank, a, b)``, however often asked."""
    cache: dict[tuple[int, int, int], list[int]] = {}

    def get(rank: int, a: int, b: int) -> list[int]:
        key = (rank, a, b)
        if key not in cache:
            cache[key] = list(source(rank, a, b))
        return cache[key]

    return get


def view_source(d: Draft) -> Source:
    """The leaf source: a zero-copy view of each rank's own input."""
    return memoized(lambda rank, a, b: [d.view(rank, a, b)])


@dataclass(frozen=True)
class Shards:
    """What a reduce-scatter left: which member owns which shard, and a
    source for the owners' fully reduced values over any part of it."""

    members: tuple[int, ...]
    owned: dict[int, tuple[int, int]]  # owner rank -> its shard [a, b)
    source: Source
    step: int

    def owner_of(self, a: int, b: int) -> int:
        """The member whose shard contains ``[a, b)``."""
        for rank, (lo, hi) in self.owned.items():
            if lo <= a and b <= hi:
                return rank
        raise ValueError(f"no member of {list(self.members)} owns all of segments [{a}, {b})")

    def bounds(self) -> set[int]:
        return {x for ab in self.owned.values() for x in ab}

    def held(self) -> Tiles:
        """Every owner's fully reduced shard, one node each (what an
        all-gather of the same members starts from)."""
        return {o: self.source(o, a, b) for o, (a, b) in self.owned.items()}


def lazy_shards(d: Draft, owned: dict[int, tuple[int, int]], inputs: dict[int, list[int]], step: int,
                members: tuple[int, ...]) -> Shards:
    """Shards whose last reduce-scatter step (owner ``r`` reduces
    ``inputs[r]``) is created only for the ranges asked for."""
    def source(rank: int, a: int, b: int) -> list[int]:
        lo, hi = owned.get(rank, (0, 0))
        if not lo <= a < b <= hi:
            raise ValueError(f"rank {rank} owns no shard covering segments [{a}, {b})")
        return [d.reduce(rank, a, b, inputs[rank], step, phases.REDUCE_SCATTER)]

    return Shards(members, owned, memoized(source), step)


def finish(d: Draft, tiles: Tiles, step: int) -> Plan:
    """The plan whose rank ``r`` ends with ``tiles[r]`` (the whole vector):
    one node as it is, a lone view as a fresh copy (never the input
    itself), several pieces side by side (zero-copy, local)."""
    finals = []
    for r in range(d.ranks):
        t = tiles[r]
        node = d.nodes[t[0]]
        if len(t) == 1 and node.kind != VIEW and (node.lo, node.hi) == (0, d.segments):
            finals.append(t[0])
        elif len(t) == 1:
            finals.append(d.reduce(r, 0, d.segments, t, step + 1, phases.REDUCE))
        else:
            finals.append(d.gather(r, 0, d.segments, t, step + 1, phases.ALL_GATHER))
    return d.finish(finals)


# -- checks ---------------------------------------------------------------------


def check_members(d: Draft, members: tuple[int, ...]) -> None:
    if not members or len(set(members)) != len(members) or not all(0 <= r < d.ranks for r in members):
        raise ValueError(f"members must be distinct ranks in 0..{d.ranks - 1}, got {list(members)}")


def check_divides(width: int, parts: int, what: str) -> None:
    if width % parts:
        raise ValueError(f"{what} needs a multiple of {parts} segments, got {width}")


def lcm(values: Sequence[int]) -> int:
    return math.lcm(*values) if values else 1
