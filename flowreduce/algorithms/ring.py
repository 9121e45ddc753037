"""Ring: reduce-scatter around the ring, then all-gather around it.

The vector is cut into p segments. In reduce-scatter step t rank r adds
its own slice of segment (r-t) mod p to the partial it receives from rank
r-1 and passes it on; after p-1 steps rank r owns segment (r+1) mod p in
full. The all-gather circulates the finished segments the same way::

    r0 -> r1 -> r2 -> r3 -> r0      (2(p-1) steps, one segment per message)

Cost: 2(p-1) steps, 2(p-1)/p·n bytes per rank on the wire (optimal), and
every link busy at every step; but 2(p-1) dependent levels make it the
slowest choice for small vectors on a task scheduler. Tasks ≈ 3p² per chunk.
"""

from __future__ import annotations

from flowreduce.algorithms.ir import Draft, Plan

NAME = "ring"


def plan(ranks: int) -> Plan:
    p = ranks
    d = Draft(NAME, p, p)
    if p == 1:
        return d.finish([d.reduce(0, 0, 1, [d.view(0)], 1, "reduce")])
    views = [[d.view(r, s, s + 1) for s in range(p)] for r in range(p)]
    partial = [views[r][r] for r in range(p)]  # step 0: rank r starts segment r
    for t in range(1, p):
        partial = [
            d.reduce(r, (r - t) % p, (r - t) % p + 1,
                     [views[r][(r - t) % p], partial[(r - 1) % p]], t, "reduce-scatter")
            for r in range(p)
        ]
    # have[r][seg] -> node on rank r holding the finished segment
    have = [{(r + 1) % p: partial[r]} for r in range(p)]
    moving = list(partial)
    for t in range(1, p - 1):
        moving = [d.gather(r, *_seg_of(d, moving[(r - 1) % p]), [moving[(r - 1) % p]],
                           p - 1 + t, "all-gather") for r in range(p)]
        for r in range(p):
            have[r][d.nodes[moving[r]].lo] = moving[r]
    finals = []
    for r in range(p):
        last = moving[(r - 1) % p]
        pieces = dict(have[r])
        pieces[d.nodes[last].lo] = last
        finals.append(d.gather(r, 0, p, [pieces[s] for s in range(p)], 2 * (p - 1), "all-gather"))
    return d.finish(finals)


def _seg_of(d: Draft, node: int) -> tuple[int, int]:
    return d.range_of(node)
