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

The walk is a generator (:func:`plan_walk`) that yields what it waits for;
:func:`walk` drives such a walk on a thread, :func:`walk_async` on an event
loop. Every other exchange between hosts (a broadcast, an all-gather, a
barrier, the link's probe) is written as a walk too and driven by the same two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Hashable
from typing import Any

import numpy as np

from flowreduce.algorithms.ir import GATHER, REDUCE, VIEW, Plan
from flowreduce.errors import InputError
from flowreduce.ops import Op
from flowreduce.shm.host_group import fold_into

Send = Callable[[int, Hashable, Any], None]  # (plan rank, node's key, value)
Receive = Callable[[int, Hashable], np.ndarray]  # (plan rank, node's key) -> value

#: A value received by a walk on the event loop over which the walk's next stretch (its reduce, mostly)
#: runs on a thread: the loop also reads every message of the worker, and a named plan that is not cut
#: in chunks may reduce hundreds of MB at once (4 MiB adds in about a millisecond here, the engine's
#: limit for folding on its loop, flowreduce.schedule.p2p.FOLD_INLINE_BYTES)
LOOP_BYTES = 4 << 20


Walk = Generator[tuple[int, Hashable], Any, Any]  # yields (plan rank, key) of what it waits for, is sent it


def run_plan(plan: Plan, me: int, x: np.ndarray, op: Op, send: Send, receive: Receive,
             who: Callable[[int], int] = int, out: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """Rank ``me``'s result of ``plan`` over ``x`` (1-d, the accumulating dtype),
    written into ``out`` (default: a new array of ``x``'s size and dtype), with the
    bytes it sent and received.

    Every value handed to ``send`` is the sender's to forget: it never changes
    afterwards, and is neither ``x`` nor ``out`` nor a view of them (such values
    are copied first; the others are this walk's own temporaries, sent as they
    are). A received value is only read. A value received with another size or
    dtype than this rank's would make of it (the ranks gave different shapes or
    dtypes) is an :class:`~flowreduce.errors.InputError` naming both ranks
    (``who``: a plan rank's name for it).

    A plan of ``C`` chunks runs on ``C`` slices of ``x`` (chunk ``c``: elements
    ``[n*c//C, n*(c+1)//C)``), node after node and, for each node, chunk after
    chunk: a rank sends a step's first chunk before it computes the next, so a
    chunk is reduced while the next is on the wire (a node's key is then
    ``"<node>c<chunk>"``). Every value a rank waits for comes earlier in that
    order, on every rank, so the walk cannot deadlock."""
    return walk(plan_walk(plan, me, x, op, send, who, out), receive)


async def run_plan_async(plan: Plan, me: int, x: np.ndarray, op: Op, send: Send,
                         receive: Callable[[int, Hashable], Awaitable[np.ndarray]],
                         who: Callable[[int], int] = int,
                         out: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """:func:`run_plan` on an event loop (:func:`walk_async`)."""
    return await walk_async(plan_walk(plan, me, x, op, send, who, out), receive)


def walk(steps: Walk, receive: Callable[[int, Hashable], Any]) -> Any:
    """Run ``steps`` (a plan's walk, or any exchange written as one: it yields the (rank, key) of each
    value it waits for, is sent the value, and sends through a function of its own) on this thread,
    taking each value with ``receive``; its result."""
    try:
        wanted = next(steps)
        while True:
            wanted = steps.send(receive(*wanted))
    except StopIteration as done:
        return done.value


async def walk_async(steps: Walk, receive: Callable[[int, Hashable], Awaitable[Any]]) -> Any:
    """:func:`walk` on an event loop: ``receive`` is awaited, and the walk runs on the loop between the
    arrivals it waits for, but for its stretches after a value over :data:`LOOP_BYTES`, which run on a
    thread of the loop's (its sends may then be called from that thread)."""
    loop = asyncio.get_running_loop()
    done, got = _step(steps, None)
    while not done:
        value = await receive(*got)
        if getattr(value, "nbytes", 0) > LOOP_BYTES:
            done, got = await loop.run_in_executor(None, _step, steps, value)
        else:
            done, got = _step(steps, value)
    return got


def _step(steps: Walk, value: Any) -> tuple[bool, Any]:
    """The walk on to the next value it waits for (False, what it waits for), or to its end (True, its
    result): a StopIteration cannot cross a thread's future."""
    try:
        return False, steps.send(value)
    except StopIteration as end:
        return True, end.value


def plan_walk(plan: Plan, me: int, x: np.ndarray, op: Op, send: Send, who: Callable[[int], int],
              out: np.ndarray | None, write_received: bool = False
              ) -> Generator[tuple[int, Hashable], np.ndarray, tuple[np.ndarray, int, int]]:
    """The walk of :func:`run_plan`: yields the (plan rank, key) of each value it waits for, and is sent the value.
    ``write_received``: every writable value received is this rank's own (a transport that gives each
    receiver a copy; a value it shares is read-only, :func:`shared`), so a reduce may write over one (:func:`_node`);
    else (:func:`run_plan`'s contract) a received value is only read."""
    n, chunks, nodes, final = x.size, plan.chunks, plan.nodes, plan.finals[me]
    consumers = plan.consumers()
    #: how many nodes of this rank read each node's value (a value received for one only is the reduce's to write)
    uses = {i: sum(nodes[c].rank == me for c in cs) for i, cs in consumers.items()} if write_received else None
    cuts = [n * c // chunks for c in range(chunks + 1)]
    values: list[dict[int, np.ndarray]] = [{} for _ in range(chunks)]
    sent = received = 0
    if out is None:
        out = np.empty(n, x.dtype)
    for node in nodes:
        if node.rank != me:
            continue
        dests = sorted({nodes[c].rank for c in consumers[node.id]} - {me})
        for c in range(chunks):
            key = _key(node.id, c, chunks)
            into = out[cuts[c]:cuts[c + 1]] if node.id == final else None
            value, got = yield from _node(plan, me, node, x[cuts[c]:cuts[c + 1]], op, values[c], chunks, c, who,
                                          into, uses)
            received += got
            values[c][node.id] = value
            if dests and (into is not None or np.may_share_memory(value, x)):
                value = value.copy()  # the caller may change x and the result once this returns
            for dest in dests:
                send(dest, key, value)
                sent += value.nbytes
    return out, sent, received


def _key(node: int, c: int, chunks: int) -> Hashable:
    """What node ``node``'s value in chunk ``c`` is sent as: the node, or ``"<node>c<chunk>"``."""
    return node if chunks == 1 else f"{node}c{c}"


def _node(plan: Plan, me: int, node: Any, x: np.ndarray, op: Op, values: dict[int, np.ndarray], chunks: int,
          c: int, who: Callable[[int], int], into: np.ndarray | None = None, uses: dict[int, int] | None = None
          ) -> Generator[tuple[int, Hashable], np.ndarray, tuple[np.ndarray, int]]:
    """Node ``node``'s value on chunk ``x`` (``values``: the chunk's values here so far), and the
    bytes received for it; ``into``: where the value goes (the final node's part of the result),
    else a new array, a view, or (a reduce of two inputs by a ufunc) the one of its inputs received
    for it alone, written over (``uses``: how many nodes of this rank read each node; a received
    value is this rank's own, unless it is read-only: a value handed over in the worker, see
    :func:`shared`)."""
    n, segs, nodes = x.size, plan.segments, plan.nodes
    received = 0
    owned: list[np.ndarray] = []  # whole values received for this node alone, writable

    def edge(k: int) -> int:
        return n * k // segs

    if node.kind == VIEW:
        view = x[edge(node.lo):edge(node.hi)]
        if into is not None:
            _fits(into, view)
            np.copyto(into, view)
            return into, 0
        return view, 0
    parts = []
    for i in node.inputs:
        src = nodes[i]
        got = values.get(i)
        if got is None:
            got = values[i] = np.asarray((yield src.rank, _key(i, c, chunks)))
            received += got.nbytes
            if got.dtype != x.dtype or got.size != edge(src.hi) - edge(src.lo):
                raise InputError(
                    f"rank {who(src.rank)} sent {got.size} elements of {got.dtype.str!r} where rank {who(me)}, "
                    f"with {n} of {x.dtype.str!r} in chunk {c}, expects {edge(src.hi) - edge(src.lo)} of "
                    f"{x.dtype.str!r}: every rank must give the same shape and dtype")
            if uses is not None and uses.get(i) == 1 and got.flags.writeable and got.flags.c_contiguous:
                owned.append(got)
        lo, hi = max(src.lo, node.lo), min(src.hi, node.hi)
        if lo < hi or node.kind == REDUCE:
            parts.append(got[edge(lo) - edge(src.lo):edge(hi) - edge(src.lo)])
    if node.kind == REDUCE:
        if into is None and op.in_place and len(parts) == 2 and parts[0].dtype == parts[1].dtype == x.dtype:
            # a received input, whole, read by this node only: the sum is written over it (one ufunc call,
            # the bits of fold_into's), not into fresh memory (over 128 kB, fresh pages each time)
            mine = next((p for p in parts if any(p.size == g.size and np.may_share_memory(p, g) for g in owned)), None)
            if mine is not None:
                op.func(parts[0], parts[1], out=mine)
                return mine, received
        value = np.empty(parts[0].size, x.dtype) if into is None else _fits(into, parts[0])
        if op.in_place:  # the first combine writes the new value: no copy of parts[0]
            return fold_into(op, parts, value), received
        np.copyto(value, parts[0])
        for p in parts[1:]:
            value[...] = np.asarray(op.func(value, p), x.dtype)
        return value, received
    if node.kind == GATHER:
        if into is not None:
            np.concatenate(parts, out=_fits(into, sum(p.size for p in parts)))
            return into, received
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), received
    raise ValueError(f"unknown node kind {node.kind!r}")


def shared(v: Any) -> Any:
    """``v`` as handed to a rank on the same worker, which does not serialise it: a read-only view of an
    array (the sender may still read it; a receiver writes only over values of its own, :func:`_node`)."""
    if isinstance(v, np.ndarray) and v.flags.writeable:
        v = v.view()
        v.flags.writeable = False
    return v


def _fits(into: np.ndarray, like: np.ndarray | int) -> np.ndarray:
    """``into``, which must hold as many elements as ``like`` (the plan's final node and the result's chunk)."""
    size = like if isinstance(like, int) else like.size
    if into.size != size:
        raise ValueError(f"the plan's final node holds {size} of {into.size} elements")
    return into
