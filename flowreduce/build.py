"""Lower a plan to a Dask task graph. Imports dask, never distributed.

Each plan node becomes one task per chunk, placed on its rank's worker. All
slicing is decided here, statically, from the element boundaries of every
(chunk, segment); the tasks (``_kernels``) just follow instructions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from dask.task_spec import List, Task, TaskRef

from flowreduce import _kernels, keys
from flowreduce._plan import GATHER, REDUCE, VIEW, Plan
from flowreduce.ops import Op


@dataclass
class Graph:
    """A lowered all-reduce: the tasks, the output key per rank, and the
    worker every key must run on."""

    tasks: dict[Hashable, Task]
    outputs: list[Hashable]
    placement: dict[Hashable, str]
    token: str


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    return [(n * j // chunks, n * (j + 1) // chunks) for j in range(chunks)]


def build_graph(
    plan: Plan,
    inputs: Sequence[Any],
    workers: Sequence[str],
    *,
    size: int,
    shape: tuple[int, ...],
    op: Op,
    token: str | None = None,
    in_place: bool = True,
    accumulate: Any = None,
) -> Graph:
    """Lower ``plan`` for rank inputs ``inputs`` (futures or TaskRefs) held on
    ``workers`` (one address per rank), vectors of ``size`` elements.

    ``in_place=False`` never reduces into received buffers: for transports
    that hand objects over without copying (distributed's ``inproc://``).
    ``accumulate`` is a dtype to cast inputs to before combining (see
    :meth:`flowreduce.ops.Op.accumulator`)."""
    if len(inputs) != plan.ranks or len(workers) != plan.ranks:
        raise ValueError(f"plan is for {plan.ranks} ranks, got {len(inputs)} inputs and {len(workers)} workers")
    token = token or keys.new_token()
    nodes, S = plan.nodes, plan.segments
    consumers = plan.consumers()
    worker_of = [workers[n.rank] for n in nodes]
    owned = _owned_inputs(plan, worker_of, consumers, in_place)
    count = _contributions(plan)

    layout: list[list[tuple[int, int]]] = []
    for n in nodes:
        if n.kind == GATHER:
            layout.append([(max(a, n.lo), min(b, n.hi)) for i in n.inputs for a, b in layout[i]
                           if max(a, n.lo) < min(b, n.hi)])
        else:
            layout.append([(n.lo, n.hi)])

    tasks: dict[Hashable, Task] = {}
    placement: dict[Hashable, str] = {}
    outputs = [keys.output_key(plan.algorithm, token, r) for r in range(plan.ranks)]
    merged = {plan.finals[r]: r for r in range(plan.ranks) if not plan.output_is_separate(r)}
    finals_by_rank: dict[int, list] = defaultdict(list)

    for c, (c0, c1) in enumerate(chunk_bounds(size, plan.chunks)):
        width = c1 - c0

        def elem(s: int) -> int:
            return c0 + width * s // S

        def picks(src: int, lo: int, hi: int):
            """Element slices of node ``src``'s pieces that cover [lo, hi)."""
            out = []
            for idx, (a, b) in enumerate(layout[src]):
                x, y = max(a, lo), min(b, hi)
                if x < y:
                    out.append((idx, elem(x) - elem(a), elem(y) - elem(a)))
            return tuple(out)

        key_of: dict[int, Hashable] = {}
        for n in nodes:
            final_rank = merged.get(n.id)
            if final_rank is not None:
                key = outputs[final_rank]
            else:
                key = keys.node_key(plan.algorithm, n.phase, token, n.step, n.rank, c, n.id)
            key_of[n.id] = key
            shape_arg = shape if final_rank is not None else None
            deps = List(*(TaskRef(key_of[i]) for i in n.inputs))
            if n.kind == VIEW:
                task = Task(key, _kernels.split, inputs[n.rank], elem(n.lo), elem(n.hi), accumulate)
            elif n.kind == REDUCE:
                task = Task(
                    key, _kernels.reduce, op, plan.ranks, count[n.id] == plan.ranks, shape_arg, deps,
                    tuple(picks(i, n.lo, n.hi) for i in n.inputs), owned[n.id],
                )
            else:
                task = Task(key, _kernels.gather, shape_arg, deps,
                            tuple(picks(i, n.lo, n.hi) for i in n.inputs))
            tasks[key] = task
            placement[key] = worker_of[n.id]
        for r, f in enumerate(plan.finals):
            finals_by_rank[r].append(key_of[f])

    for r in range(plan.ranks):
        if plan.output_is_separate(r):
            refs = List(*(TaskRef(k) for k in finals_by_rank[r]))
            tasks[outputs[r]] = Task(outputs[r], _kernels.output, refs, shape)
            placement[outputs[r]] = workers[r]
    return Graph(tasks, outputs, placement, token)


def _contributions(plan: Plan) -> list[int]:
    """How many ranks each node's values combine (uniform over its range)."""
    count = []
    for n in plan.nodes:
        if n.kind == VIEW:
            count.append(1)
        elif n.kind == REDUCE:
            count.append(sum(count[i] for i in n.inputs))
        else:
            count.append(min(count[i] for i in n.inputs))
    return count


def _owned_inputs(plan: Plan, worker_of: list[str], consumers, in_place: bool) -> dict[int, tuple[bool, ...]]:
    """For each reduce node, which inputs it may overwrite.

    A value that crossed workers arrives as a fresh, private copy. It may be
    reduced into when every task on the receiving worker that reads it is a
    reduce over a range disjoint from the others' (so nobody sees the
    overwrite). Inputs produced on the same worker are never overwritten:
    they may be views of user data or still waiting to be sent."""
    nodes = plan.nodes
    out = {}
    for n in nodes:
        if n.kind != REDUCE:
            continue
        flags = []
        for i in n.inputs:
            if not in_place or worker_of[i] == worker_of[n.id]:
                flags.append(False)
                continue
            readers = [nodes[c] for c in consumers[i] if worker_of[c] == worker_of[n.id]]
            ranges = sorted((r.lo, r.hi) for r in readers)
            disjoint = all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
            flags.append(disjoint and all(r.kind == REDUCE for r in readers))
        out[n.id] = tuple(flags)
    return out
