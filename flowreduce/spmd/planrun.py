"""An all-reduce plan of :mod:`flowreduce.algorithms` run between processes, by each of its ranks.

The plan's ranks here are the job's host groups (their leaders). Each
leader walks the plan's nodes in order (they are topologically ordered)
and computes its own: a *view* is a slice of its vector, a *reduce* folds
its inputs' slices in input order, a *gather* puts its inputs' slices side
by side. An input computed on another rank is taken from the mailbox; a
node read by other ranks is sent to each of them once. Every rank waits
only for nodes of lower index, so walking in order cannot deadlock. The
element range of segment ``k`` of ``n`` elements over ``S`` segments is
``[n*k//S, n*(k+1)//S)``, as :mod:`flowreduce.lower.graph` cuts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from flowreduce.algorithms.ir import GATHER, REDUCE, VIEW, Plan
from flowreduce.errors import InputError
from flowreduce.ops import Op

Send = Callable[[int, int, np.ndarray], None]  # (plan rank, node, value)
Receive = Callable[[int, int], np.ndarray]  # (plan rank, node) -> value


def run_plan(plan: Plan, me: int, x: np.ndarray, op: Op, send: Send, receive: Receive,
             who: Callable[[int], int] = int) -> tuple[np.ndarray, int, int]:
    """Rank ``me``'s result of ``plan`` over ``x`` (1-d, the accumulating dtype),
    with the bytes it sent and received. A value received with another size or
    dtype than this rank's would make of it (the ranks gave different shapes or
    dtypes) is an :class:`~flowreduce.errors.InputError` naming both ranks
    (``who``: a plan rank's name for it)."""
    if plan.chunks != 1:
        raise ValueError(f"run_plan runs one chunk; got a plan of {plan.chunks}")
    n, segs, nodes = x.size, plan.segments, plan.nodes
    consumers = plan.consumers()
    values: dict[int, np.ndarray] = {}
    sent = received = 0

    def edge(k: int) -> int:
        return n * k // segs

    for node in nodes:
        if node.rank != me:
            continue
        if node.kind == VIEW:
            value = x[edge(node.lo):edge(node.hi)]
        else:
            parts = []
            for i in node.inputs:
                src = nodes[i]
                got = values.get(i)
                if got is None:
                    got = values[i] = np.asarray(receive(src.rank, i))
                    received += got.nbytes
                    if got.dtype != x.dtype or got.size != edge(src.hi) - edge(src.lo):
                        raise InputError(
                            f"rank {who(src.rank)} sent {got.size} elements of {got.dtype.str!r} where rank {who(me)}, "
                            f"with {n} of {x.dtype.str!r}, expects {edge(src.hi) - edge(src.lo)} of "
                            f"{x.dtype.str!r}: every rank must give the same shape and dtype")
                lo, hi = max(src.lo, node.lo), min(src.hi, node.hi)
                if lo < hi or node.kind == REDUCE:
                    parts.append(got[edge(lo) - edge(src.lo):edge(hi) - edge(src.lo)])
            if node.kind == REDUCE:
                value = np.array(parts[0], dtype=x.dtype, copy=True)
                for p in parts[1:]:
                    value = op.combine(value, p, out=value) if op.in_place else np.asarray(op.func(value, p), x.dtype)
            elif node.kind == GATHER:
                value = parts[0] if len(parts) == 1 else np.concatenate(parts)
            else:
                raise ValueError(f"unknown node kind {node.kind!r}")
        values[node.id] = value
        for dest in sorted({nodes[c].rank for c in consumers[node.id]} - {me}):
            send(dest, node.id, value)
            sent += value.nbytes
    final = values[plan.finals[me]]
    return (final if final.size == n else _whole(final, n)), sent, received


def _whole(final: Any, n: int) -> np.ndarray:
    raise ValueError(f"the plan's final node holds {np.asarray(final).size} of {n} elements")
