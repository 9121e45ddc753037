"""Block-sparse all-reduce (OmniReduce) for dense arrays with zero blocks.

The vector is cut into blocks of ``block_size`` elements and the blocks into
ranges, one per aggregator. Every rank packs, per range, the ids and values
of its blocks that are non-zero and sends them to the range's aggregator;
the aggregator adds what arrives -- the union of the non-zero blocks -- and
sends the summed non-zero blocks back to every rank, which unpacks them into
a dense result. A block travels only if it is non-zero on some rank::

    p = 4 ranks, 2 aggregators (a0 owns blocks [0, B/2), a1 the rest)

    r0 r1 r2 r3 --pack--> a0 (union of ranges' non-zero blocks, summed)
    r0 r1 r2 r3 --pack--> a1
    a0 a1 --------------> r0 r1 r2 r3 (every rank unpacks the sums)

Aggregators are either separate workers (``aggregators=k``: plan ranks
``p..p+k-1``, which the lowering places on workers with the Dask resource
``aggregator``, as OmniReduce's cheap CPU servers) or co-located on the ranks
(``aggregators=0``, the default: rank r owns range r, a one-step
reduce-scatter and all-gather, the radix-p butterfly).

Cost (p ranks, k aggregators, n bytes per rank at block density d, union
density D): 2 steps after the pack (3 levels); a rank sends d·n and
receives D·n (co-located: (p-1)/p of each); an aggregator receives p·d·n/k
and sends p·D·n/k; tasks p·k + k + p per chunk. With fully dense data it
moves what the radix-p butterfly moves, plus one block id per block.
"""

from __future__ import annotations

from flowreduce import phases
from flowreduce.algorithms.ir import Draft
from flowreduce.algorithms.sparse import SparsePlan, sparse_plan

NAME = "block-sparse"
DEFAULT_BLOCK = 256


def plan(ranks: int, *, aggregators: int = 0, block_size: int = DEFAULT_BLOCK) -> SparsePlan:
    if not isinstance(aggregators, int) or aggregators < 0:
        raise ValueError(f"aggregators must be a count >= 0 (0: co-located on the ranks), got {aggregators!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    owners = list(range(ranks)) if aggregators == 0 else [ranks + a for a in range(aggregators)]
    k = len(owners)
    d = Draft(NAME, ranks, k, aggregators=aggregators, block_size=block_size)
    packs = [[d.view(r, a, a + 1) for a in range(k)] for r in range(ranks)]
    sums = [d.reduce(owners[a], a, a + 1, [packs[r][a] for r in range(ranks)], 1, phases.AGGREGATE)
            for a in range(k)]
    finals = [d.gather(r, 0, k, sums, 2, phases.ALL_GATHER) for r in range(ranks)]
    return sparse_plan(d.finish(finals), NAME, block=block_size)
