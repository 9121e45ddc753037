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

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from flowreduce.algorithms.ir import GATHER, REDUCE, VIEW, Plan
from flowreduce.errors import InputError
from flowreduce.ops import Op

Send = Callable[[int, Hashable, np.ndarray], None]  # (plan rank, node's key, value)
Receive = Callable[[int, Hashable], np.ndarray]  # (plan rank, node's key) -> value


def run_plan(plan: Plan, me: int, x: np.ndarray, op: Op, send: Send, receive: Receive,
             who: Callable[[int], int] = int) -> tuple[np.ndarray, int, int]:
    """Rank ``me``'s result of ``plan`` over ``x`` (1-d, the accumulating dtype),
    with the bytes it sent and received. A value received with another size or
    dtype than this rank's would make of it (the ranks gave different shapes or
    dtypes) is an :class:`~flowreduce.errors.InputError` naming both ranks
    (``who``: a plan rank's name for it).

    A plan of ``C`` chunks runs on ``C`` slices of ``x`` (chunk ``c``: elements
    ``[n*c//C, n*(c+1)//C)``), node after node and, for each node, chunk after
    chunk: a rank sends a step's first chunk before it computes the next, so a
    chunk is reduced while the next is on the wire (a node's key is then
    ``"<node>c<chunk>"``). Every value a rank waits for comes earlier in that
    order, on every rank, so the walk cannot deadlock."""
    n, chunks, nodes = x.size, plan.chunks, plan.nodes
    consumers = plan.consumers()
    cuts = [n * c // chunks for c in range(chunks + 1)]
    values: list[dict[int, np.ndarray]] = [{} for _ in range(chunks)]
    sent = received = 0
    for node in nodes:
        if node.rank != me:
            continue
        dests = sorted({nodes[c].rank for c in consumers[node.id]} - {me})
        for c in range(chunks):
            key = _key(node.id, c, chunks)
            value, got = _node(plan, me, node, x[cuts[c]:cuts[c + 1]], op, values[c], chunks, c, receive, who)
            received += got
            values[c][node.id] = value
            for dest in dests:
                send(dest, key, value)
                sent += value.nbytes
    finals = [values[c][plan.finals[me]] for c in range(chunks)]
    for c, final in enumerate(finals):
        if final.size != cuts[c + 1] - cuts[c]:
            raise ValueError(f"the plan's final node holds {final.size} of {cuts[c + 1] - cuts[c]} elements")
    return (finals[0] if chunks == 1 else np.concatenate(finals)), sent, received


def _key(node: int, c: int, chunks: int) -> Hashable:
    """What node ``node``'s value in chunk ``c`` is sent as: the node, or ``"<node>c<chunk>"``."""
    return node if chunks == 1 else f"{node}c{c}"


def _node(plan: Plan, me: int, node: Any, x: np.ndarray, op: Op, values: dict[int, np.ndarray], chunks: int,
          c: int, receive: Receive, who: Callable[[int], int]) -> tuple[np.ndarray, int]:
    """Node ``node``'s value on chunk ``x`` (``values``: the chunk's values here so far), and the
    bytes received for it."""
    n, segs, nodes = x.size, plan.segments, plan.nodes
    received = 0

    def edge(k: int) -> int:
        return n * k // segs

    if node.kind == VIEW:
        return x[edge(node.lo):edge(node.hi)], 0
    parts = []
    for i in node.inputs:
        src = nodes[i]
        got = values.get(i)
        if got is None:
            got = values[i] = np.asarray(receive(src.rank, _key(i, c, chunks)))
            received += got.nbytes
            if got.dtype != x.dtype or got.size != edge(src.hi) - edge(src.lo):
                raise InputError(
                    f"rank {who(src.rank)} sent {got.size} elements of {got.dtype.str!r} where rank {who(me)}, "
                    f"with {n} of {x.dtype.str!r} in chunk {c}, expects {edge(src.hi) - edge(src.lo)} of "
                    f"{x.dtype.str!r}: every rank must give the same shape and dtype")
        lo, hi = max(src.lo, node.lo), min(src.hi, node.hi)
        if lo < hi or node.kind == REDUCE:
            parts.append(got[edge(lo) - edge(src.lo):edge(hi) - edge(src.lo)])
    if node.kind == REDUCE:
        value = np.array(parts[0], dtype=x.dtype, copy=True)
        for p in parts[1:]:
            value = op.combine(value, p, out=value) if op.in_place else np.asarray(op.func(value, p), x.dtype)
        return value, received
    if node.kind == GATHER:
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), received
    raise ValueError(f"unknown node kind {node.kind!r}")
