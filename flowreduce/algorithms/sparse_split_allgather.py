"""Sparse split-allgather (SparCML's SSAR_Split_allgather).

The index space is split into ranges, one per owner; a sparse reduce-scatter
brings every rank's non-zeros of a range to its owner, which merges them;
an all-gather then hands every owner's reduced range to every rank. The
communication pattern is the dense butterfly's (recursive halving, then
doubling; :mod:`~flowreduce.algorithms.butterfly`) or the ring's
(``inner="ring"``), with sparse messages::

    p = 4, ranges A B C D of the index space, radix 2
    reduce-scatter 1: 0,1 swap the pairs of half A B / C D; 2,3 likewise
    reduce-scatter 2: 0,2 swap quarters   -> 0 owns A merged over all ranks ...
    all-gather:       the same pairs in reverse; ranges travel as they are

Every merge chooses its representation by bytes (the dense switch): a range
whose union is denser than ``delta`` goes dense and stays dense, so with
dense data this is the dense butterfly (SparCML's DSAR_Split_allgather).

Cost (k non-zeros per rank at random places, n elements): 2·log_r p steps
(+1 for the pack); in the reduce-scatter a rank sends about k/2, k/2, ...
pairs (its shrinking share of the index space, grown by merging), in the
all-gather it receives every other owner's reduced range: about the union's
size K ≤ p·k in pairs, or n·(p-1)/p dense values once the union is dense.
Tasks ≈ 2p·log_r p per chunk. Better than recursive doubling once the data
is large or dense enough that bytes, not levels, set the time.
"""

from __future__ import annotations

from dataclasses import replace

from flowreduce.algorithms import butterfly, ring
from flowreduce.algorithms.hierarchical import SCATTER_ALGORITHMS
from flowreduce.algorithms.sparse import SparsePlan, sparse_plan

NAME = "sparse-split-allgather"


def plan(ranks: int, *, inner: str = "butterfly", radix: int = 2) -> SparsePlan:
    if inner == "butterfly":
        base = butterfly.plan(ranks, radix=radix)
        options = {"inner": inner, "radix": radix}
    elif inner == "ring":
        base = ring.plan(ranks)
        options = {"inner": inner}
    else:
        raise ValueError(f"inner must be one of {', '.join(SCATTER_ALGORITHMS)}; got {inner!r}")
    return replace(sparse_plan(base, NAME), options=options)
