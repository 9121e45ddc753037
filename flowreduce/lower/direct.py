"""Lower the ``direct`` plan (:mod:`flowreduce.algorithms.direct`): one
dependent level. Imports dask, never distributed.

One task per worker, pinned there, depending only on the inputs of the
ranks that worker holds; it reads the other ranks' inputs itself, worker to
worker (``read``: :func:`flowreduce.schedule.peer_reads.reading`, passed
in by the schedule layer, the only one talking to distributed), checks that
the ranks agree (``check``: the client's own input check, run on what the
ranks hold) and reduces them. That task's key is the result of every rank
the worker holds: ranks sharing a worker share one result key (Dask keys
are immutable values, and one copy per worker serves them all, as
``client.replicate`` does), so the graph is one task per worker, in one
level, whatever the number of ranks. No input is fetched by Dask, so no
replica of an input is left behind on another worker.

The order of the reduction is fixed by the ranks' workers, so every rank
gets the same bits: each worker's ranks are reduced in rank order (a peer
worker holding several ranks does that itself and sends one array, their
:class:`Partial`), then the workers' partials in the order of their first
ranks. With one rank per worker that is rank order.

Without ``read`` (dask's synchronous scheduler, no workers to read from)
every input is a dependency of every task instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.task_spec import List, Task

from flowreduce import keys
from flowreduce.algorithms.ir import Plan
from flowreduce.kernels.dense import tree_fold
from flowreduce.lower.graph import Graph
from flowreduce.lower.shm_direct import worker_groups
from flowreduce.ops import Op
from flowreduce.reproducible import tree_ordered
from flowreduce.shm import result_buffers

#: Above this many bytes a task reduces off its worker's event loop (and a peer its ranks).
OFF_LOOP_BYTES = 4 << 20
#: ``(rank, worker, key)``: a peer rank's input, where it is held.
Peer = tuple[int, str, Hashable]


@dataclass(frozen=True)
class Partial:
    """What a peer worker sends for the ranks it holds: their values reduced
    in rank order (:func:`accumulate`) and what each of them is (a
    :data:`~flowreduce.schedule.inputs.Meta`, for the input check)."""

    value: Any
    metas: tuple[Any, ...]


#: Reads peers' inputs on a worker, in a task running on its event loop:
#: ``async with read(peers, op, key, local) as ({rank: value}, {first rank of
#: a worker's ranks: Partial})``, the values valid inside the block (they may
#: be views of memory given back after it); a peer worker holding several
#: ranks may send their :class:`Partial` instead of their values (and this
#: worker's own ranks may come back as one); ``key`` is the reading task's,
#: ``local`` its own ranks' inputs, ``{rank: value}`` (peers on its host may
#: read them where they lie); op None: every peer sends its ranks' values.
Read = Callable[[Sequence[Peer], Op | None, Hashable, Any],
                AbstractAsyncContextManager[tuple[dict[int, Any], dict[int, Partial]]]]
#: Checks the ranks' values or metas (in rank order) agree and suit the op, raising an error naming the ranks.
Check = Callable[[Sequence[Any], Op], None]


def accumulate(op: Op, values: Sequence[Any]) -> np.ndarray:
    """``values[0] op values[1] op ...`` into a fresh array, in the op's
    accumulating dtype (no finish): one worker's ranks, on any worker the
    same bits."""
    first = np.asarray(values[0])
    acc = first.astype(op.accumulator(first.dtype) or first.dtype, copy=True)
    for x in values[1:]:
        acc = np.asarray(op.combine(acc, x, out=acc))
    return acc


async def off_loop_if_large(nbytes: int, func: Callable[..., Any], *args: Any) -> Any:
    """``func(*args)`` from a coroutine on a worker's event loop: inline, or
    in a thread when it works through more than :data:`OFF_LOOP_BYTES`
    (a large reduction would stall the loop: heartbeats, transfers)."""
    if nbytes > OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, func, *args)
    return func(*args)


async def read_reduce(op: Op, ranks: int, groups: Sequence[Sequence[int]], local_ranks: Sequence[int],
                      local: Sequence[Any], peers: Sequence[Peer], read: Read, check: Check | None,
                      key: Hashable, ordered: bool = False) -> np.ndarray:
    """The task (a coroutine: the worker runs it on its event loop, where the
    reads go, with no hand-off to a thread and back): the local ranks'
    inputs (dependencies), the peers' read from their workers (or their
    workers' partials), checked and reduced (:func:`reduce_groups`).
    ``ordered`` (``deterministic=True``): peers holding several ranks send
    their values, not their sum, when the call may need the tree order."""
    how = None if ordered and any(len(g) > 1 for g in groups) else op
    async with read(peers, how, key, dict(zip(local_ranks, local))) if peers else nullcontext(({}, {})) as (
            got, partials):
        values = {**dict(zip(local_ranks, local)), **got}
        nbytes = sum(getattr(v, "nbytes", 0) for v in [*values.values(), *(part.value for part in partials.values())])
        out = await off_loop_if_large(nbytes, reduce_groups, op, ranks, groups, values, partials, check, ordered)
        # a callable op may return one of its arguments: never a view of memory given back after the block
        return out if not isinstance(out, np.ndarray) or out.flags.writeable else out.copy()


def reduce_local(op: Op, ranks: int, groups: Sequence[Sequence[int]], local: Sequence[Any],
                 check: Check | None, ordered: bool = False) -> np.ndarray:
    """The task without workers to read from: every rank's input is a dependency."""
    return reduce_groups(op, ranks, groups, dict(enumerate(local)), {}, check, ordered)


def tree_ordered_values(op: Op, values: dict[int, Any]) -> bool:
    """Whether ``deterministic=True`` changes this reduction (:func:`flowreduce.reproducible.tree_ordered`)."""
    first = next(iter(values.values()), None)
    return first is not None and tree_ordered(op.name, np.asarray(first).dtype)


def reduce_tree(op: Op, ranks: int, values: dict[int, Any]) -> np.ndarray:
    """Every rank's value combined in the reference tree's order
    (``deterministic=True``: :func:`flowreduce.kernels.dense.tree_fold`),
    into a fresh result (in a warm buffer)."""
    first = np.asarray(values[0])
    out = result_buffers.buffers().empty(first.size, first.dtype).reshape(first.shape)
    return tree_fold(op, ranks, [values[r] for r in range(ranks)], out)


def reduce_groups(op: Op, ranks: int, groups: Sequence[Sequence[int]], values: dict[int, Any],
                  partials: dict[int, Partial], check: Check | None, ordered: bool = False) -> np.ndarray:
    """Every rank's value (or its worker's partial) checked, then reduced
    worker group by worker group (``groups``: the ranks of each worker, in
    order), each group in rank order: the same bits on every rank."""
    if check is not None:
        metas: dict[int, Any] = {}
        for g in groups:
            if g[0] in partials:
                metas.update(zip(g, partials[g[0]].metas))
        check([metas[r] if r in metas else values[r] for r in range(ranks)], op)
    if ordered and not partials and tree_ordered_values(op, values):
        return reduce_tree(op, ranks, values)
    if ordered and partials and tree_ordered_values(op, {0: next(iter(partials.values())).value}):
        raise RuntimeError("deterministic=True: a peer sent the sum of its ranks, not their values")
    if op.in_place:  # every part read once, into a fresh result, a cache-sized block at a time
        parts = [partials[g[0]].value if g[0] in partials else
                 accumulate(op, [values[r] for r in g]) if len(g) > 1 else values[g[0]] for g in groups]
        first = np.asarray(parts[0])
        out = result_buffers.buffers().empty(first.size, op.accumulator(first.dtype) or first.dtype)
        return op.finish(op.fold(parts, out.reshape(first.shape)), ranks, owned=True)
    acc: np.ndarray | None = None
    for g in groups:
        if g[0] in partials:
            part = partials[g[0]].value
        elif acc is None or len(g) > 1:
            part = accumulate(op, [values[r] for r in g])
        else:  # one rank: combined as it is, as accumulate would
            part = values[g[0]]
        if acc is None:
            acc = part if part.flags.writeable else part.copy()  # a received array may be read-only
        else:
            acc = np.asarray(op.combine(acc, part, out=acc))
    assert acc is not None
    return op.finish(acc, ranks, owned=True)


def build_direct(plan: Plan, inputs: Sequence[Any], workers: Sequence[str], *, input_keys: Sequence[Hashable],
                 op: Op, read: Read | None, check: Check | None = None, token: str | None = None,
                 ordered: bool = False) -> Graph:
    """The graph of ``plan`` (``direct``, one chunk) for rank inputs
    ``inputs`` (futures or TaskRefs, keyed ``input_keys``) held on
    ``workers``; ``read`` None makes every input a dependency (no workers).
    ``ordered`` (``deterministic=True``): float sums and means in the
    reference tree's order over ranks (:func:`reduce_tree`), not by worker."""
    p = plan.ranks
    if len(inputs) != p or len(workers) != p or len(input_keys) != p:
        raise ValueError(f"plan is for {p} ranks, got {len(inputs)} inputs, {len(workers)} workers, "
                         f"{len(input_keys)} keys")
    token = token or keys.new_token()
    name = plan.algorithm
    tasks: dict[Hashable, Task] = {}
    placement: dict[Hashable, str] = {}
    outputs: list[Hashable] = [None] * p
    groups = tuple(tuple(g) for g in worker_groups(workers))
    for ranks in groups:
        key = keys.output_key(name, token, ranks[0])  # the result of every rank on this worker
        if read is None:
            tasks[key] = (Task(key, reduce_local, op, p, groups, List(*inputs), check, ordered) if ordered else
                          Task(key, reduce_local, op, p, groups, List(*inputs), check))
        else:
            peers = tuple((r, workers[r], input_keys[r]) for r in range(p) if r not in ranks)
            args = (op, p, groups, tuple(ranks), List(*(inputs[r] for r in ranks)), peers, read, check, key)
            tasks[key] = Task(key, read_reduce, *args, ordered) if ordered else Task(key, read_reduce, *args)
        placement[key] = workers[ranks[0]]
        for r in ranks:
            outputs[r] = key
    return Graph(tasks, outputs, placement, token)
