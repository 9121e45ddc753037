"""Reusable building blocks: collectives over a subset of ranks and a segment range.

The flat planners each own their whole plan. A composed algorithm
(:mod:`~flowreduce.algorithms.hierarchical`) needs the same patterns on a
*subset* of ranks and a *sub-range* ``[lo, hi)`` of the segments, chained
into each other, so they live here as functions that add nodes to a
:class:`~flowreduce.algorithms.ir.Draft`:

* :func:`reduce_scatter` -- every member ends owning a distinct shard of
  ``[lo, hi)`` reduced over all members (``"butterfly"`` or ``"ring"``);
* :func:`all_gather` -- the inverse: every member ends with all of ``[lo, hi)``;
* :func:`all_reduce` -- both, or a full-vector algorithm
  (``"recursive-doubling"``, ``"reduce-broadcast"``).

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

Every function takes ``step``, the last step label already used, and
returns the last one it used (step labels only name keys; the plan's
levels come from the edges).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowreduce.algorithms.ir import Draft, digits, folded, mixed_radix, split_range, with_digit

#: ``source(rank, a, b) -> [node, ...]``: see the module docstring.
Source = Callable[[int, int, int], list[int]]
#: ``{rank: [node, ...]}`` tiling a range left to right.
Tiles = dict[int, list[int]]

#: Algorithms that split into a reduce-scatter and an all-gather.
SCATTER_ALGORITHMS: tuple[str, ...] = ("butterfly", "ring")
#: Algorithms :func:`all_reduce` runs on a subset of ranks.
ALLREDUCE_ALGORITHMS: tuple[str, ...] = ("butterfly", "ring", "recursive-doubling", "reduce-broadcast")


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


def shard_count(algorithm: str, members: int, radix: int = 2) -> int:
    """How many members own a shard after a reduce-scatter (butterfly folds
    the ranks beyond its largest factorable core into partners)."""
    _check_name(algorithm, SCATTER_ALGORITHMS, "reduce-scatter")
    if algorithm == "ring":
        return members
    return mixed_radix(members, radix)[0]


def divisor(algorithm: str, members: int, radix: int = 2) -> int:
    """The number of segments a range handed to :func:`all_reduce` (or a
    reduce-scatter) must be a multiple of."""
    _check_name(algorithm, ALLREDUCE_ALGORITHMS, "all-reduce")
    if algorithm in SCATTER_ALGORITHMS:
        return shard_count(algorithm, members, radix)
    return 1


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


# -- butterfly layout -----------------------------------------------------------


@dataclass(frozen=True)
class _Butterfly:
    core: int
    factors: list[int]
    riders: dict[int, list[int]]  # core index -> member indices folded into it
    ranges: list[dict[int, tuple[int, int]]]  # ranges[s][q]: q's range before stage s

    def group(self, q: int, s: int) -> list[int]:
        """q's partners at stage s, ordered by the part of the range they keep."""
        return [with_digit(q, self.factors, s, j) for j in range(self.factors[s])]


def _butterfly(members: int, lo: int, hi: int, radix: int) -> _Butterfly:
    core, factors = mixed_radix(members, radix)
    _check_divides(hi - lo, core, f"a radix-{radix} butterfly over {members} ranks")
    rng = {q: (lo, hi) for q in range(core)}
    ranges = [rng]
    for s, f in enumerate(factors):
        rng = {q: split_range(*rng[q], f)[digits(q, factors)[s]] for q in range(core)}
        ranges.append(rng)
    return _Butterfly(core, factors, folded(members, core), ranges)


# -- reduce-scatter ---------------------------------------------------------------


def reduce_scatter(
    d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
    algorithm: str = "butterfly", radix: int = 2, step: int = 0,
) -> Shards:
    """Reduce ``[lo, hi)`` over ``members`` so that each owner ends with a
    distinct shard, the shards tiling ``[lo, hi)``.

    ``"butterfly"``: recursive halving (radix-k splitting), log_k g steps;
    members beyond the factorable core send their parts in the first step
    and own nothing. ``"ring"``: g-1 steps, every member owns 1/g.
    The last step is not materialised: ``Shards.source`` creates it for
    exactly the ranges asked for.
    """
    members = tuple(members)
    _check_members(d, members)
    if len(members) == 1:
        return Shards(members, {members[0]: (lo, hi)}, source, step)
    if algorithm == "butterfly":
        return _rs_butterfly(d, members, lo, hi, source, radix, step)
    if algorithm == "ring":
        return _rs_ring(d, members, lo, hi, source, step)
    _check_name(algorithm, SCATTER_ALGORITHMS, "reduce-scatter")
    raise AssertionError("unreachable")


def _lazy(d: Draft, owned: dict[int, tuple[int, int]], inputs: dict[int, list[int]], step: int,
          members: tuple[int, ...]) -> Shards:
    def source(rank: int, a: int, b: int) -> list[int]:
        lo, hi = owned.get(rank, (0, 0))
        if not lo <= a < b <= hi:
            raise ValueError(f"rank {rank} owns no shard covering segments [{a}, {b})")
        return [d.reduce(rank, a, b, inputs[rank], step, "reduce-scatter")]

    return Shards(members, owned, memoized(source), step)


def _rs_butterfly(d: Draft, members: tuple[int, ...], lo: int, hi: int, source: Source,
                  radix: int, step: int) -> Shards:
    b = _butterfly(len(members), lo, hi, radix)
    m = len(b.factors)
    # pieces[q][j]: nodes holding q's (and its riders') contribution to part j of q's range
    pieces = {
        q: [[n for r in [q, *b.riders[q]] for n in source(members[r], x, y)]
            for x, y in split_range(lo, hi, b.factors[0])]
        for q in range(b.core)
    }
    for s in range(m - 1):
        new = {}
        for q in range(b.core):
            mine = digits(q, b.factors)[s]
            inputs = [n for g in b.group(q, s) for n in pieces[g][mine]]
            new[q] = [[d.reduce(members[q], x, y, inputs, step + s + 1, "reduce-scatter")]
                      for x, y in split_range(*b.ranges[s + 1][q], b.factors[s + 1])]
        pieces = new
    last = {
        members[q]: [n for g in b.group(q, m - 1) for n in pieces[g][digits(q, b.factors)[m - 1]]]
        for q in range(b.core)
    }
    owned = {members[q]: b.ranges[m][q] for q in range(b.core)}
    return _lazy(d, owned, last, step + m, members)


def _rs_ring(d: Draft, members: tuple[int, ...], lo: int, hi: int, source: Source, step: int) -> Shards:
    g = len(members)
    _check_divides(hi - lo, g, f"a ring over {g} ranks")
    parts = split_range(lo, hi, g)
    partial = [source(members[r], *parts[r]) for r in range(g)]  # step 0: r starts part r
    for t in range(1, g - 1):
        partial = [
            [d.reduce(members[r], *parts[(r - t) % g],
                      [*source(members[r], *parts[(r - t) % g]), *partial[(r - 1) % g]],
                      step + t, "reduce-scatter")]
            for r in range(g)
        ]
    t = g - 1
    last = {members[r]: [*source(members[r], *parts[(r - t) % g]), *partial[(r - 1) % g]] for r in range(g)}
    owned = {members[r]: parts[(r + 1) % g] for r in range(g)}
    return _lazy(d, owned, last, step + t, members)


# -- all-gather -----------------------------------------------------------------


def all_gather(
    d: Draft, members: Sequence[int], lo: int, hi: int, held: Tiles, *,
    algorithm: str = "butterfly", radix: int = 2, step: int = 0,
) -> tuple[Tiles, int]:
    """The inverse of :func:`reduce_scatter` with the same arguments:
    ``held[owner]`` tiles the owner's shard (fully reduced); every member
    ends with tiles of all of ``[lo, hi)`` (one gather node each)."""
    members = tuple(members)
    _check_members(d, members)
    if len(members) == 1:
        return {members[0]: list(held[members[0]])}, step
    if algorithm == "butterfly":
        return _ag_butterfly(d, members, lo, hi, held, radix, step)
    if algorithm == "ring":
        return _ag_ring(d, members, lo, hi, held, step)
    _check_name(algorithm, SCATTER_ALGORITHMS, "all-gather")
    raise AssertionError("unreachable")


def _ag_butterfly(d: Draft, members: tuple[int, ...], lo: int, hi: int, held: Tiles,
                  radix: int, step: int) -> tuple[Tiles, int]:
    b = _butterfly(len(members), lo, hi, radix)
    m = len(b.factors)
    cur = {q: list(held[members[q]]) for q in range(b.core)}
    out: Tiles = {}
    for s in reversed(range(m)):
        st = step + (m - s)
        nxt = {}
        for q in range(b.core):
            inputs = [n for g in b.group(q, s) for n in cur[g]]
            x, y = b.ranges[s][q]
            nxt[q] = [d.gather(members[q], x, y, inputs, st, "all-gather")]
            if s == 0:
                for e in b.riders[q]:
                    out[members[e]] = [d.gather(members[e], x, y, inputs, st, "all-gather")]
        cur = nxt
    out.update({members[q]: cur[q] for q in range(b.core)})
    return out, step + m


def _ag_ring(d: Draft, members: tuple[int, ...], lo: int, hi: int, held: Tiles,
             step: int) -> tuple[Tiles, int]:
    g = len(members)
    parts = split_range(lo, hi, g)
    have = [{(r + 1) % g: list(held[members[r]])} for r in range(g)]  # part -> tiles
    moving = [list(held[members[r]]) for r in range(g)]
    for t in range(1, g - 1):
        moving = [[d.gather(members[r], *parts[(r + 1 - t) % g], moving[(r - 1) % g], step + t, "all-gather")]
                  for r in range(g)]
        for r in range(g):
            have[r][(r + 1 - t) % g] = moving[r]
    out: Tiles = {}
    for r in range(g):
        pieces = dict(have[r])
        pieces[(r + 2) % g] = moving[(r - 1) % g]
        inputs = [n for j in range(g) for n in pieces[j]]
        out[members[r]] = [d.gather(members[r], lo, hi, inputs, step + g - 1, "all-gather")]
    return out, step + g - 1


# -- all-reduce -----------------------------------------------------------------


def all_reduce(
    d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
    algorithm: str = "butterfly", radix: int = 2, step: int = 0,
) -> tuple[Tiles, int]:
    """All-reduce ``[lo, hi)`` among ``members``: every member ends with
    tiles of ``[lo, hi)`` reduced over all members' sources.

    ``"butterfly"``/``"ring"``: reduce-scatter then all-gather (2(g-1)/g of
    the range per member on the wire); ``"recursive-doubling"``: full
    ranges exchanged in log_k g steps; ``"reduce-broadcast"``: the first
    member reduces everything and sends it back (2 steps).
    """
    _check_name(algorithm, ALLREDUCE_ALGORITHMS, "all-reduce")
    members = tuple(members)
    _check_members(d, members)
    if len(members) == 1:
        r = members[0]
        nodes = source(r, lo, hi)
        if len(nodes) == 1:
            return {r: list(nodes)}, step
        return {r: [d.reduce(r, lo, hi, nodes, step + 1, "reduce")]}, step + 1
    if algorithm in SCATTER_ALGORITHMS:
        shards = reduce_scatter(d, members, lo, hi, source, algorithm=algorithm, radix=radix, step=step)
        held = {o: shards.source(o, a, b) for o, (a, b) in shards.owned.items()}
        return all_gather(d, members, lo, hi, held, algorithm=algorithm, radix=radix, step=shards.step)
    if algorithm == "recursive-doubling":
        return _ar_doubling(d, members, lo, hi, source, radix, step)
    return _ar_reduce_broadcast(d, members, lo, hi, source, step)


def _ar_doubling(d: Draft, members: tuple[int, ...], lo: int, hi: int, source: Source,
                 radix: int, step: int) -> tuple[Tiles, int]:
    core, factors = mixed_radix(len(members), radix)
    riders = folded(len(members), core)
    holding = {q: [n for r in [q, *riders[q]] for n in source(members[r], lo, hi)] for q in range(core)}
    last = dict(holding)
    for s, f in enumerate(factors):
        nxt = {}
        for q in range(core):
            last[q] = [n for g in (with_digit(q, factors, s, j) for j in range(f)) for n in holding[g]]
            nxt[q] = [d.reduce(members[q], lo, hi, last[q], step + s + 1, "exchange")]
        holding = nxt
    end = step + len(factors)
    out: Tiles = {members[q]: holding[q] for q in range(core)}
    for q in range(core):
        for e in riders[q]:  # a folded member repeats its partner's last combine
            out[members[e]] = [d.reduce(members[e], lo, hi, last[q], end, "exchange")]
    return out, end


def _ar_reduce_broadcast(d: Draft, members: tuple[int, ...], lo: int, hi: int, source: Source,
                         step: int) -> tuple[Tiles, int]:
    root = members[0]
    total = d.reduce(root, lo, hi, [n for r in members for n in source(r, lo, hi)], step + 1, "reduce")
    out: Tiles = {root: [total]}
    for r in members[1:]:
        out[r] = [d.gather(r, lo, hi, [total], step + 2, "broadcast")]
    return out, step + 2


# -- checks ---------------------------------------------------------------------


def _check_name(algorithm: str, valid: tuple[str, ...], what: str) -> None:
    if algorithm not in valid:
        raise ValueError(f"{algorithm!r} cannot run as a {what}; valid: {', '.join(valid)}")


def _check_members(d: Draft, members: tuple[int, ...]) -> None:
    if not members or len(set(members)) != len(members) or not all(0 <= r < d.ranks for r in members):
        raise ValueError(f"members must be distinct ranks in 0..{d.ranks - 1}, got {list(members)}")


def _check_divides(width: int, parts: int, what: str) -> None:
    if width % parts:
        raise ValueError(f"{what} needs a multiple of {parts} segments, got {width}")


def lcm(values: Sequence[int]) -> int:
    return math.lcm(*values) if values else 1
