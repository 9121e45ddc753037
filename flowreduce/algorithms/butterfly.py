"""Butterfly: recursive-halving reduce-scatter, then recursive-doubling
all-gather (Rabenseifner; the task-based all-reduce of the Spark paper).

Reduce-scatter: at each step a rank keeps half its current range and sends
the other half to its partner, which combines it with its own::

    p=4, segments A B C D
    step 1: 0,1 swap halves  -> 0 owns A B (of 0+1), 1 owns C D (of 0+1)
            2,3 likewise     -> 2 owns A B (of 2+3), 3 owns C D (of 2+3)
    step 2: 0,2 swap quarters-> 0 owns A, 2 owns B (all four ranks) ...
    all-gather: the same pairs in reverse, doubling the range each step

``radix=k`` splits into k parts per step (log_k p steps, k-1 messages per
rank per step), cutting levels and tasks for large p. Ranks beyond the
largest size that factors into stages of at most ``radix`` are folded:
their slices join their partner's first step; they gather its last.

Cost: 2·log_k p steps (+1 for the split), 2(p-1)/p·n bytes per rank on the
wire (the lower bound), (p-1)/p·n combined per rank. Tasks ≈ 2p·log_k p
per chunk, each step's reductions split so that no range is re-sliced by
an extra task before it is sent.

The pattern runs over any subset of ranks and segment range
(:mod:`~flowreduce.algorithms.patterns`): :func:`reduce_scatter` and
:func:`all_gather` are what :mod:`~flowreduce.algorithms.hierarchical`
uses inside a host; :func:`plan` is their chain over all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowreduce import phases
from flowreduce.algorithms.ir import Draft, Plan, digits, folded, mixed_radix, split_range, with_digit
from flowreduce.algorithms.patterns import (
    Shards,
    Source,
    Tiles,
    check_divides,
    finish,
    lazy_shards,
    view_source,
)

NAME = "butterfly"


def plan(ranks: int, *, radix: int = 2) -> Plan:
    d = Draft(NAME, ranks, shard_count(ranks, radix), radix=radix)
    tiles, step = all_reduce(d, range(ranks), 0, d.segments, view_source(d), radix=radix)
    return finish(d, tiles, step)


def shard_count(members: int, radix: int = 2) -> int:
    """How many members own a shard after a reduce-scatter: the largest
    core that factors into stages of at most ``radix`` (the rest fold into
    partners). A range handed to the pattern must be a multiple of it."""
    return mixed_radix(members, radix)[0]


def all_reduce(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
               radix: int = 2, step: int = 0) -> tuple[Tiles, int]:
    """Reduce-scatter, then all-gather ``[lo, hi)`` among ``members``."""
    shards = reduce_scatter(d, members, lo, hi, source, radix=radix, step=step)
    return all_gather(d, members, lo, hi, shards.held(), radix=radix, step=shards.step)


@dataclass(frozen=True)
class _Layout:
    core: int
    factors: list[int]
    riders: dict[int, list[int]]  # core index -> member indices folded into it
    ranges: list[dict[int, tuple[int, int]]]  # ranges[s][q]: q's range before stage s

    def group(self, q: int, s: int) -> list[int]:
        """q's partners at stage s, ordered by the part of the range they keep."""
        return [with_digit(q, self.factors, s, j) for j in range(self.factors[s])]


def _layout(members: int, lo: int, hi: int, radix: int) -> _Layout:
    core, factors = mixed_radix(members, radix)
    check_divides(hi - lo, core, f"a radix-{radix} butterfly over {members} ranks")
    rng = {q: (lo, hi) for q in range(core)}
    ranges = [rng]
    for s, f in enumerate(factors):
        rng = {q: split_range(*rng[q], f)[digits(q, factors)[s]] for q in range(core)}
        ranges.append(rng)
    return _Layout(core, factors, folded(members, core), ranges)


def reduce_scatter(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
                   radix: int = 2, step: int = 0) -> Shards:
    """Recursive halving of ``[lo, hi)`` among ``members`` (radix-k
    splitting, log_k g steps): each core member ends owning a distinct
    shard; members beyond the factorable core send their parts in the first
    step and own nothing. The last step is not materialised:
    ``Shards.source`` creates it for exactly the ranges asked for."""
    members = tuple(members)
    if len(members) == 1:
        return Shards(members, {members[0]: (lo, hi)}, source, step)
    b = _layout(len(members), lo, hi, radix)
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
            new[q] = [[d.reduce(members[q], x, y, inputs, step + s + 1, phases.REDUCE_SCATTER)]
                      for x, y in split_range(*b.ranges[s + 1][q], b.factors[s + 1])]
        pieces = new
    last = {
        members[q]: [n for g in b.group(q, m - 1) for n in pieces[g][digits(q, b.factors)[m - 1]]]
        for q in range(b.core)
    }
    owned = {members[q]: b.ranges[m][q] for q in range(b.core)}
    return lazy_shards(d, owned, last, step + m, members)


def all_gather(d: Draft, members: Sequence[int], lo: int, hi: int, held: Tiles, *,
               radix: int = 2, step: int = 0) -> tuple[Tiles, int]:
    """Recursive doubling of the shards :func:`reduce_scatter` left
    (``held[owner]`` tiles the owner's shard): the same partners in reverse,
    every member ending with one gather of all of ``[lo, hi)``; folded
    members take their partner's last gather."""
    members = tuple(members)
    if len(members) == 1:
        return {members[0]: list(held[members[0]])}, step
    b = _layout(len(members), lo, hi, radix)
    m = len(b.factors)
    cur = {q: list(held[members[q]]) for q in range(b.core)}
    out: Tiles = {}
    for s in reversed(range(m)):
        st = step + (m - s)
        nxt = {}
        for q in range(b.core):
            inputs = [n for g in b.group(q, s) for n in cur[g]]
            x, y = b.ranges[s][q]
            nxt[q] = [d.gather(members[q], x, y, inputs, st, phases.ALL_GATHER)]
            if s == 0:
                for e in b.riders[q]:
                    out[members[e]] = [d.gather(members[e], x, y, inputs, st, phases.ALL_GATHER)]
        cur = nxt
    out.update({members[q]: cur[q] for q in range(b.core)})
    return out, step + m
