"""Recursive doubling: full vectors are exchanged, lg p steps.

At step s each rank swaps its whole partial result with the partner whose
rank differs in bit s, and both combine::

    step 1:  0 <-> 1    2 <-> 3        (every rank now holds a pair's sum)
    step 2:  0 <-> 2    1 <-> 3        (every rank holds all four)

``radix=k`` exchanges within groups of k at once (⌈log_k p⌉ steps, k-1
messages per rank per step); ``radix >= p`` is the direct all-to-all
exchange in a single step, the lowest latency a task graph can reach.
Ranks beyond the largest size that factors into stages of at most ``radix``
are folded: they join their partner's first step and copy its last.

Cost: ⌈log_k p⌉ steps, (k-1)·n bytes per rank per step on the wire,
(k-1)·n combined per step. Tasks: p·(log_k p + 1) per chunk. Best for small
vectors (MPICH uses it below a few KiB).
"""

from __future__ import annotations

from flowreduce.algorithms.ir import Draft, Plan, folded, mixed_radix, with_digit

NAME = "recursive-doubling"


def plan(ranks: int, *, radix: int = 2) -> Plan:
    core, factors = mixed_radix(ranks, radix)
    riders = folded(ranks, core)
    d = Draft(NAME, ranks, 1, radix=radix)
    holding = {q: [d.view(r) for r in [q, *riders[q]]] for q in range(core)}
    finals: dict[int, int] = {}
    last_inputs: dict[int, list[int]] = {q: holding[q] for q in range(core)}
    for s, f in enumerate(factors):
        nxt = {}
        for q in range(core):
            group = [with_digit(q, factors, s, j) for j in range(f)]
            last_inputs[q] = [i for m in group for i in holding[m]]
            nxt[q] = [d.reduce(q, 0, 1, last_inputs[q], s + 1, "exchange")]
        holding = nxt
    step = len(factors) if factors else 1
    for q in range(core):
        finals[q] = holding[q][0] if factors else d.reduce(q, 0, 1, holding[q], 1, "exchange")
        for e in riders[q]:  # a folded rank repeats its partner's last combine
            finals[e] = d.reduce(e, 0, 1, last_inputs[q], step, "exchange")
    return d.finish([finals[r] for r in range(ranks)])
