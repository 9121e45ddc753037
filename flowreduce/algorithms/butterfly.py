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
"""

from __future__ import annotations

from flowreduce.algorithms.ir import Draft, Plan, digits, folded, mixed_radix, split_range, with_digit

NAME = "butterfly"


def plan(ranks: int, *, radix: int = 2) -> Plan:
    core, factors = mixed_radix(ranks, radix)
    riders = folded(ranks, core)
    d = Draft(NAME, ranks, core, radix=radix)
    if not factors:  # one rank: a fresh copy
        views = [d.view(r) for r in range(ranks)]
        return d.finish([d.reduce(0, 0, 1, views, 1, "reduce")])
    m = len(factors)
    # pieces[q][j]: the nodes holding q's contribution to part j of its range
    rng = {q: (0, core) for q in range(core)}
    pieces = {
        q: [[d.view(r, lo, hi) for r in [q, *riders[q]]] for lo, hi in split_range(0, core, factors[0])]
        for q in range(core)
    }
    ranges = [dict(rng)]
    for s, f in enumerate(factors):
        nxt_parts = factors[s + 1] if s + 1 < m else 1
        new_pieces, new_rng = {}, {}
        for q in range(core):
            mine = digits(q, factors)[s]
            lo, hi = split_range(*rng[q], f)[mine]
            group = [with_digit(q, factors, s, j) for j in range(f)]
            inputs = [i for g in group for i in pieces[g][mine]]
            new_pieces[q] = [[d.reduce(q, a, b, inputs, s + 1, "reduce-scatter")]
                             for a, b in split_range(lo, hi, nxt_parts)]
            new_rng[q] = (lo, hi)
        pieces, rng = new_pieces, new_rng
        ranges.append(dict(rng))
    held = {q: pieces[q][0][0] for q in range(core)}
    finals: dict[int, int] = {}
    for s in reversed(range(m)):
        step = m + (m - s)
        nxt = {}
        for q in range(core):
            group = [with_digit(q, factors, s, j) for j in range(len(split_range(0, factors[s], factors[s])))]
            inputs = [held[g] for g in group]
            lo, hi = ranges[s][q]
            nxt[q] = d.gather(q, lo, hi, inputs, step, "all-gather")
            if s == 0:
                for e in riders[q]:
                    finals[e] = d.gather(e, lo, hi, inputs, step, "all-gather")
        held = nxt
    finals.update(held)
    return d.finish([finals[r] for r in range(ranks)])
