"""Sparse recursive doubling (SparCML's SSAR_Recursive_double).

The recursive-doubling plan (:mod:`~flowreduce.algorithms.recursive_doubling`)
with sparse messages: at step s every rank sends its whole partial result
-- the index+value pairs of the union of the non-zeros it has merged so far
-- to the partner whose rank differs in digit s, and both merge::

    k non-zeros per rank, p = 4, random positions
    step 1:  0 <-> 1    2 <-> 3     send k pairs,    hold ~2k
    step 2:  0 <-> 2    1 <-> 3     send ~2k pairs,  hold ~4k (everything)

Each merge chooses its representation by bytes (the dense switch, DSAR):
once the union holds more than ``delta`` of the index space it is sent as a
dense array, and every later step stays dense.

Cost (k non-zeros per rank at random places, n elements, v value bytes,
i index bytes): ⌈log_r p⌉ steps; a rank sends (r-1)·min(2^s·k·(v+i), n·v)
bytes at step s (less when the patterns overlap); tasks p·(log_r p + 1) per
chunk. Fewest levels of any sparse plan: the choice for small or very sparse
data (SparCML), where latency and not bytes sets the time.
"""

from __future__ import annotations

from flowreduce.algorithms import recursive_doubling
from flowreduce.algorithms.sparse import SparsePlan, sparse_plan

NAME = "sparse-recursive-doubling"


def plan(ranks: int, *, radix: int = 2) -> SparsePlan:
    return sparse_plan(recursive_doubling.plan(ranks, radix=radix), NAME)
