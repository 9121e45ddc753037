"""Lower a plan to a Dask task graph. Imports dask, never distributed.

Each plan node becomes one task per chunk, placed on its rank's worker. All
slicing is decided here, statically, from the element boundaries of every
(chunk, segment); the tasks (``_kernels``) just follow instructions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dask.task_spec import List, Task, TaskRef
from dask.typing import Key

from flowreduce import keys
from flowreduce.algorithms import partials
from flowreduce.algorithms.ir import GATHER, REDUCE, VIEW, Node, Plan
from flowreduce.kernels import dense as _kernels
from flowreduce.ops import Op
from flowreduce.reproducible import TreeNode, tree_root


@dataclass
class Graph:
    """A lowered all-reduce: the tasks, the output key per rank, and the
    worker every key must run on."""

    tasks: dict[Hashable, Task]
    outputs: list[Hashable]
    placement: dict[Hashable, str]
    token: str


def named_graph(tasks: Mapping[Hashable, Any], token: str) -> Any:
    """The graph as dask's low-level-graph expression, named by the call's
    token: handed a plain dict, dask hashes every task to name it (~10 ms
    for a few hundred tasks, growing with the graph) although our keys are
    already unique."""
    try:
        from dask._expr import LLGExpr
    except ImportError:  # a dask without expressions takes the dict as it is
        return tasks
    return LLGExpr(dict(tasks), _determ_token=token)


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    return [(n * j // chunks, n * (j + 1) // chunks) for j in range(chunks)]


@dataclass(frozen=True)
class Site:
    """One plan node in one chunk, as the task that lowers it sees it."""

    node: Node
    chunk: int
    key: Hashable
    deps: List  # TaskRefs of the node's inputs, in order
    picks: tuple  # per input: the element slices of its pieces that cover this node's range
    start: int  # the node's range in elements of the whole vector (views slice the input there)
    stop: int
    final: bool  # the node is its rank's result (one chunk, read by nobody else)


def lower(
    plan: Plan,
    workers: Sequence[str],
    *,
    size: int,
    token: str,
    task_for: Callable[[Site], Task],
    output_for: Callable[[Hashable, List, int], Task],
    layout: list[list[tuple[int, int]]] | None = None,
) -> Graph:
    """The skeleton every lowering shares: keys, pieces, element slices.

    A node's value is a tuple of 1-D pieces; a gather's pieces are its
    inputs' (zero-copy), so the builder tracks each node's piece layout and
    hands every task the slices of its inputs that cover its range.
    ``task_for`` makes the task of one :class:`Site`; ``output_for(key,
    refs, rank)`` the task assembling a rank's result from its chunks'
    finals (when its final is read remotely or there are several chunks).
    ``workers`` has one address per plan rank; ``layout``, each node's
    pieces as segment ranges (default: :func:`piece_layout`)."""
    nodes, S = plan.nodes, plan.segments
    if layout is None:
        layout = piece_layout(plan)

    tasks: dict[Hashable, Task] = {}
    placement: dict[Hashable, str] = {}
    outputs = [keys.output_key(plan.algorithm, token, r) for r in range(plan.ranks)]
    merged = {plan.finals[r]: r for r in range(plan.ranks) if not plan.output_is_separate(r)}
    finals_by_rank: dict[int, list] = defaultdict(list)

    for c, (c0, c1) in enumerate(chunk_bounds(size, plan.chunks)):
        width = c1 - c0

        def elem(s: int) -> int:
            return c0 + width * s // S

        def picks(src: int, lo: int, hi: int) -> tuple[_kernels.Pick, ...]:
            """Element slices of node ``src``'s pieces that cover [lo, hi)."""
            out: list[_kernels.Pick] = []
            for idx, (a, b) in enumerate(layout[src]):
                x, y = max(a, lo), min(b, hi)
                if x < y:
                    out.append((idx, elem(x) - elem(a), elem(y) - elem(a)))
            return tuple(out)

        key_of: dict[int, Key] = {}  # dask keys, for TaskRef
        for n in nodes:
            final_rank = merged.get(n.id)
            key = (outputs[final_rank] if final_rank is not None
                   else keys.node_key(plan.algorithm, n.phase, token, n.step, n.rank, c, n.id))
            key_of[n.id] = key
            site = Site(n, c, key, List(*(TaskRef(key_of[i]) for i in n.inputs)),
                        tuple(picks(i, n.lo, n.hi) for i in n.inputs), elem(n.lo), elem(n.hi),
                        final_rank is not None)
            tasks[key] = task_for(site)
            placement[key] = workers[n.rank]
        for r, f in enumerate(plan.finals):
            finals_by_rank[r].append(key_of[f])

    for r in range(plan.ranks):
        if plan.output_is_separate(r):
            tasks[outputs[r]] = output_for(outputs[r], List(*(TaskRef(k) for k in finals_by_rank[r])), r)
            placement[outputs[r]] = workers[r]
    return Graph(tasks, outputs, placement, token)


def piece_layout(plan: Plan, parts: Sequence[int] | None = None) -> list[list[tuple[int, int]]]:
    """Each node's pieces as segment ranges: one for a view or a reduce
    (``parts[node]`` for a reduce whose value is that many partial sums over
    its whole range, ``deterministic=True``), its inputs' pieces within its
    range for a gather."""
    layout: list[list[tuple[int, int]]] = []
    nodes = plan.nodes
    for n in nodes:
        if n.kind == GATHER:
            pieces: list[tuple[int, int]] = []
            for i in n.inputs:
                if _inside(nodes[i], n):  # all its pieces, as they are (a gather of gathers: many)
                    pieces += layout[i]
                else:
                    pieces += [(max(a, n.lo), min(b, n.hi)) for a, b in layout[i] if max(a, n.lo) < min(b, n.hi)]
            layout.append(pieces)
        else:
            layout.append([(n.lo, n.hi)] * (parts[n.id] if parts is not None and n.kind == REDUCE else 1))
    return layout


def _inside(m: Node, n: Node) -> bool:
    """Whether node ``m``'s pieces all lie in ``n``'s range, none empty
    (a node's pieces lie in its range; a gather's are never empty)."""
    return n.lo <= m.lo < m.hi <= n.hi


def tree_nodes(plan: Plan) -> list[tuple[TreeNode, ...]]:
    """Under ``deterministic=True``, the partial sums each node's value
    carries: the maximal nodes of the reference tree
    (:func:`flowreduce.reproducible.tree_cover`) covering the ranks it
    combines. A gather's inputs must combine the same ranks. The walk the
    cost model counts them by (:func:`flowreduce.algorithms.partials.tree_nodes`),
    so the two never disagree."""
    return partials.tree_nodes(plan)


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
    ordered: bool = False,
) -> Graph:
    """Lower ``plan`` for rank inputs ``inputs`` (futures or TaskRefs) held on
    ``workers`` (one address per rank), vectors of ``size`` elements.

    ``in_place=False`` never reduces into received buffers: for transports
    that hand objects over without copying (distributed's ``inproc://``).
    ``accumulate`` is a dtype to cast inputs to before combining (see
    :meth:`flowreduce.ops.Op.accumulator`). ``ordered``: ``deterministic=True``,
    every value a set of partial sums of the reference tree, added in its
    order (:func:`tree_nodes`, :func:`flowreduce.kernels.dense.reduce_ordered`)."""
    if len(inputs) != plan.ranks or len(workers) != plan.ranks:
        raise ValueError(f"plan is for {plan.ranks} ranks, got {len(inputs)} inputs and {len(workers)} workers")
    owned = owned_inputs(plan, workers, in_place)
    count = contributions(plan)
    if ordered:
        return _build_ordered(plan, inputs, workers, size=size, shape=shape, op=op, token=token, owned=owned,
                              count=count)

    def task_for(s: Site) -> Task:
        n = s.node
        shape_arg = shape if s.final else None
        if n.kind == VIEW:
            return Task(s.key, _kernels.split, inputs[n.rank], s.start, s.stop, accumulate)
        if n.kind == REDUCE:
            return Task(s.key, _kernels.reduce, op, plan.ranks, count[n.id] == plan.ranks, shape_arg, s.deps,
                        s.picks, owned[n.id])
        return Task(s.key, _kernels.gather, shape_arg, s.deps, s.picks)

    return lower(plan, workers, size=size, token=token or keys.new_token(), task_for=task_for,
                 output_for=lambda key, refs, r: Task(key, _kernels.output, refs, shape))


def _build_ordered(plan: Plan, inputs: Sequence[Any], workers: Sequence[str], *, size: int, shape: tuple[int, ...],
                   op: Op, token: str | None, owned: dict[int, tuple[bool, ...]], count: list[int]) -> Graph:
    """:func:`build_graph` with ``ordered=True``."""
    carried = tree_nodes(plan)
    root = (tree_root(plan.ranks),)
    for r, f in enumerate(plan.finals):
        if carried[f] != root:
            raise ValueError(f"{plan!r}: rank {r}'s result does not sum every rank")
    layout = piece_layout(plan, [len(c) for c in carried])
    # the tree node of every piece of every node, parallel to layout
    piece_nodes: list[list[TreeNode]] = []
    for n in plan.nodes:
        if n.kind == GATHER:
            ts: list[TreeNode] = []
            for i in n.inputs:
                ts += piece_nodes[i] if _inside(plan.nodes[i], n) else \
                    [t for (a, b), t in zip(layout[i], piece_nodes[i]) if max(a, n.lo) < min(b, n.hi)]
            piece_nodes.append(ts)
        else:
            piece_nodes.append(list(carried[n.id]))

    def task_for(s: Site) -> Task:
        n = s.node
        shape_arg = shape if s.final else None
        if n.kind == VIEW:
            return Task(s.key, _kernels.split, inputs[n.rank], s.start, s.stop, None)
        if n.kind == REDUCE:
            nodes = tuple(tuple(piece_nodes[i][idx] for idx, _, _ in pk) for i, pk in zip(n.inputs, s.picks))
            return Task(s.key, _kernels.reduce_ordered, op, plan.ranks, count[n.id] == plan.ranks, shape_arg, s.deps,
                        s.picks, owned[n.id], nodes)
        return Task(s.key, _kernels.gather, shape_arg, s.deps, s.picks)

    return lower(plan, workers, size=size, token=token or keys.new_token(), task_for=task_for,
                 output_for=lambda key, refs, r: Task(key, _kernels.output, refs, shape), layout=layout)


def gathers_every_rank(plan: Plan) -> bool:
    """Whether every reduction of ``plan`` combines all ranks' own values at
    once (views of each rank's input, nothing summed before): ``direct``,
    ``reduce-broadcast`` (its root), and ``butterfly`` or ``recursive-doubling``
    with a radix of at least the rank count (a reduce-scatter by direct sends). Such a plan can fold the
    values exactly (``deterministic="exact"``) at the default's bytes."""
    reductions = [n for n in plan.nodes if n.kind == REDUCE]
    return bool(reductions) and all(
        all(plan.nodes[i].kind == VIEW for i in n.inputs)
        and sorted(plan.nodes[i].rank for i in n.inputs) == list(range(plan.ranks)) for n in reductions)


def contributions(plan: Plan) -> list[int]:
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


def owned_inputs(plan: Plan, workers: Sequence[str], in_place: bool) -> dict[int, tuple[bool, ...]]:
    """For each reduce node, which inputs it may overwrite (``workers``: one
    address per plan rank).

    A value that crossed workers arrives as a fresh, private copy. It may be
    reduced into when every task on the receiving worker that reads it is a
    reduce over a range disjoint from the others' (so nobody sees the
    overwrite). Inputs produced on the same worker are never overwritten:
    they may be views of user data or still waiting to be sent."""
    nodes, consumers = plan.nodes, plan.consumers()
    worker_of = [workers[n.rank] for n in nodes]
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
