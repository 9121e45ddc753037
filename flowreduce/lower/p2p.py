"""method="p2p": what a worker extension needs to run a plan, and the small
graph that hands the ranks' inputs to it. Imports dask, never distributed.

The plan's nodes are not tasks here. A :class:`Spec` (a few hundred bytes:
the plan's name, chunks and options, the op's name, the inputs' dtype and
shape, each rank's worker) travels once per run and worker; every worker
rebuilds the plan from it (:func:`flowreduce.algorithms.plan`, cached) and
reads its :class:`Program`: for each chunk and node, the element range and
the slices of its inputs' pieces, decided here as :mod:`flowreduce.lower.graph`
decides them for the task graph.

The plan runs over the call's *workers*, not its ranks: ranks that share a
worker share a process, so the engine first combines them there (one numpy
operation per rank, in rank order) and the plan moves that worker's partial
(as MPI libraries combine a node's ranks before the network, and Horovod a
process's tensors). With one rank per worker this is the ranks' plan itself.
The graph (:func:`lower_p2p`) is ``workers + 1 + ranks`` tasks whatever the
algorithm and chunk count: per worker a *hand-in* (its ranks' inputs into the
engine), one *barrier*, per rank an *output* (its result out of the engine).

A call that does not wait for its inputs (:func:`lower_arrivals`) learns
where its ranks are when their inputs arrive. On futures, it is an output
per rank, depending on its input alone, and a barrier depending on nothing
that carries the call's decision; the worker plugin keeps each input in its
worker's engine as it goes to memory. On a Dask collection whose results are
computed together (:func:`lower_collection`), it is an output per rank on
its input alone too, each carrying the decision (no barrier). When only
some of a collection's results are computed (Dask culls the others), each
rank has an *arrive* task too (it runs next to its input and keeps it in
that worker's engine), the barrier depends on every arrival and every
output on the barrier, so that every rank's input is computed. Either way
the plan is chosen, and the outputs pinned, once the last rank arrived.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.task_spec import List, Task, TaskRef

from flowreduce import keys
from flowreduce.algorithms import frozen_options
from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms.ir import GATHER, REDUCE, Plan
from flowreduce.kernels import dense as _kernels
from flowreduce.lower.graph import Graph, chunk_bounds, contributions, owned_inputs, piece_layout, tree_nodes
from flowreduce.ops import Op, resolve_op
from flowreduce.reproducible import TreeNode, tree_root
from flowreduce.shm.lease import Handle


@dataclass(frozen=True)
class Spec:
    """A run, as every worker of it rebuilds it. ``where[r]`` indexes
    ``addresses`` (each worker once: the spec stays small at many ranks);
    the plan's rank ``i`` is the worker ``addresses[i]``, ``ranks`` is the
    call's rank count (a mean divides by it)."""

    algorithm: str
    ranks: int
    chunks: int
    options: tuple[tuple[str, Any], ...]
    op: str
    dtype: str
    shape: tuple[int, ...]
    addresses: tuple[str, ...]
    where: tuple[int, ...]
    in_place: bool = True  # received buffers are private copies (not inproc://): reduce into them
    #: the ranks whose results are taken out (None: all); a restarted run leaves out those already taken
    outputs: tuple[int, ...] | None = None
    #: per worker, the memory domain it shares with the others of its host (None: values go through
    #: Dask's comm); empty: none does
    domains: tuple[Any, ...] = ()
    #: deterministic=True: values carry partial sums of the reference tree over ranks, added only as
    #: siblings (one rank per worker: the plan's ranks are the call's)
    ordered: bool = False
    #: the library the ranks' inputs came in (an :class:`~flowreduce.arrays.ArrayKind`; None: numpy), and
    #: so the results go out in: calls placed on arrival take torch tensors and array API arrays
    native: Any = None
    #: per call rank, where its input was copied into a shared segment when it arrived (None: not
    #: every rank's was): each worker then folds every rank's input from there, in rank order, with
    #: no message and no wait for its peers (:meth:`flowreduce.schedule.p2p.Run.read_published`)
    published: tuple[Handle, ...] | None = None

    @classmethod
    def of(cls, plan: Plan, op: Op, dtype: np.dtype, shape: tuple[int, ...], workers: Sequence[str],
           in_place: bool, domains: Sequence[Any] = (), native: Any = None, ordered: bool = False) -> Spec:
        """The run of ``plan`` (over :func:`engine_workers` of ``workers``, in that order) for ranks on ``workers``."""
        addresses = engine_workers(workers)
        if plan.ranks != len(addresses):
            raise ValueError(f"a p2p plan runs over the {len(addresses)} workers of the ranks, not {plan.ranks} ranks")
        index = {w: i for i, w in enumerate(addresses)}
        return cls(plan.algorithm, len(workers), plan.chunks, frozen_options(dict(plan.options)), op.name,
                   np.dtype(dtype).str, tuple(shape), addresses, tuple(index[w] for w in workers), in_place,
                   domains=tuple(domains) if any(d is not None for d in domains) else (), native=native,
                   ordered=ordered)

    def worker(self, rank: int) -> str:
        """The worker of the call's rank ``rank``."""
        return self.addresses[self.where[rank]]

    def members(self, index: int) -> tuple[int, ...]:
        """The call's ranks on the worker ``addresses[index]`` (the plan's rank ``index``), in rank order."""
        return tuple(r for r, i in enumerate(self.where) if i == index)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def plan(self) -> Plan:
        return make_plan(self.algorithm, len(self.addresses), chunks=self.chunks, **dict(self.options))

    def resolved_op(self) -> Op:
        return resolve_op(self.op)


@dataclass(frozen=True)
class Site:
    """One node in one chunk: its element range in the vector and, per
    input, the ``(piece, start, stop)`` slices covering it."""

    start: int
    stop: int
    picks: tuple[tuple[_kernels.Pick, ...], ...]
    #: deterministic=True, a reduce: the reference tree node of each pick (parallel to ``picks``)
    nodes: tuple[tuple[TreeNode, ...], ...] | None = None


class Roles:
    """What one worker does in a plan, whatever the vector's size, dtype, op
    and chunk count (so one is built per plan and placement, and reused):
    its ranks and nodes, who reads each node here, where each local node
    goes, and each node's piece layout (in segments, built when first asked)."""

    def __init__(self, plan: Plan, workers: Sequence[str], address: str, in_place: bool, ordered: bool = False):
        self.plan = plan
        nodes = plan.nodes
        self.local_ranks = tuple(r for r in range(plan.ranks) if workers[r] == address)
        here = [workers[n.rank] == address for n in nodes]
        self.local_nodes = tuple(n.id for n in nodes if here[n.id])
        consumers = plan.consumers()
        #: node -> its consumers on this worker (once per input position)
        self.readers: dict[int, tuple[int, ...]] = {
            n.id: tuple(c for c in consumers[n.id] if here[c]) for n in nodes}
        #: a local node -> the other workers reading it, each sent the value once
        self.sends: dict[int, tuple[str, ...]] = {
            i: tuple(sorted({workers[nodes[c].rank] for c in consumers[i]} - {address})) for i in self.local_nodes}
        #: nodes computed elsewhere whose values this worker receives
        self.received = frozenset(i for i, cs in self.readers.items() if cs and not here[i])
        self.final_of = {plan.finals[r]: r for r in self.local_ranks}
        self.count = contributions(plan)
        self.owned = owned_inputs(plan, workers, in_place)
        self.views = {r: tuple(n.id for n in nodes if here[n.id] and n.rank == r and not n.inputs)
                      for r in self.local_ranks}
        self._layouts: dict[int, list[tuple[int, int]]] = {}
        #: deterministic=True: the reference tree node of every piece of every node (None: not ordered)
        self.piece_nodes: list[list[TreeNode]] | None = None
        if ordered:
            carried = tree_nodes(plan)
            root = (tree_root(plan.ranks),)
            if any(carried[f] != root for f in plan.finals):
                raise ValueError(f"{plan!r}: a rank's result does not sum every rank")
            self._layouts = dict(enumerate(piece_layout(plan, [len(c) for c in carried])))
            self.piece_nodes = []
            for n in nodes:  # as flowreduce.lower.graph lowers deterministic=True
                if n.kind == GATHER:
                    self.piece_nodes.append([t for i in n.inputs for (a, b), t in zip(self._layouts[i],
                                             self.piece_nodes[i]) if max(a, n.lo) < min(b, n.hi)])
                else:
                    self.piece_nodes.append(list(carried[n.id]))

    def layout(self, node: int) -> list[tuple[int, int]]:
        """The segment ranges of node's pieces: a gather's are its inputs' (as
        :func:`flowreduce.lower.graph.lower` tracks them), others have one piece."""
        found = self._layouts.get(node)
        if found is not None:
            return found
        nodes, stack = self.plan.nodes, [node]
        while stack:  # a stack, not recursion: a ring's all-gather chains are 'ranks' long
            n = nodes[stack[-1]]
            if n.kind == GATHER:
                todo = [i for i in n.inputs if i not in self._layouts]
                if todo:
                    stack.extend(todo)
                    continue
                self._layouts[n.id] = [(max(a, n.lo), min(b, n.hi)) for i in n.inputs for a, b in self._layouts[i]
                                       if max(a, n.lo) < min(b, n.hi)]
            else:
                self._layouts[n.id] = [(n.lo, n.hi)]
            stack.pop()
        return self._layouts[node]


def engine_workers(workers: Sequence[str]) -> tuple[str, ...]:
    """The workers a p2p plan runs over, in the order of their first rank: its rank ``i`` is the ``i``-th."""
    return tuple(dict.fromkeys(workers))


@functools.lru_cache(maxsize=32)
def roles(algorithm: str, options: tuple[tuple[str, Any], ...], addresses: tuple[str, ...], in_place: bool,
          address: str, ordered: bool = False) -> Roles:
    plan = make_plan(algorithm, len(addresses), **dict(options))
    return Roles(plan, addresses, address, in_place, ordered)


class Program:
    """A run's plan as one worker runs it: its :class:`Roles`, and each
    node's element slices per chunk (computed when first asked)."""

    def __init__(self, spec: Spec, address: str):
        self.spec = spec
        self.roles = r = roles(spec.algorithm, spec.options, spec.addresses, spec.in_place, address, spec.ordered)
        self.plan = r.plan
        self.local_ranks, self.local_nodes, self.readers, self.sends = r.local_ranks, r.local_nodes, r.readers, r.sends
        self.received, self.final_of, self.count, self.owned, self.views = (
            r.received, r.final_of, r.count, r.owned, r.views)
        self.op = spec.resolved_op()
        self.dtype = np.dtype(spec.dtype)
        self.accumulate = self.op.accumulator(self.dtype)
        self.itemsize = (self.accumulate or self.dtype).itemsize
        self.bounds = chunk_bounds(spec.size, spec.chunks)
        #: plan rank here -> the call's ranks combined into its input (a restarted run may give a worker two)
        self.members = {i: spec.members(i) for i in self.local_ranks}
        #: the call's ranks whose results this worker hands out
        self.outputs = tuple(r for i in self.local_ranks for r in self.members[i]
                             if spec.outputs is None or r in spec.outputs)
        self._sites: dict[tuple[int, int], Site] = {}

    def elem(self, chunk: int, segment: int) -> int:
        c0, c1 = self.bounds[chunk]
        return c0 + (c1 - c0) * segment // self.plan.segments

    def site(self, chunk: int, node: int) -> Site:
        found = self._sites.get((chunk, node))
        if found is None:
            found = self._sites[chunk, node] = self._site(chunk, node)
        return found

    def _site(self, chunk: int, node: int) -> Site:
        n = self.plan.nodes[node]
        picks = []
        for i in n.inputs:
            out: list[_kernels.Pick] = []
            for idx, (a, b) in enumerate(self.roles.layout(i)):
                x, y = max(a, n.lo), min(b, n.hi)
                if x < y:
                    out.append((idx, self.elem(chunk, x) - self.elem(chunk, a), self.elem(chunk, y) - self.elem(chunk, a)))
            picks.append(tuple(out))
        nodes = None
        if self.roles.piece_nodes is not None and n.kind == REDUCE:  # the tree node of each pick
            nodes = tuple(tuple(self.roles.piece_nodes[i][idx] for idx, _, _ in pk) for i, pk in zip(n.inputs, picks))
        return Site(self.elem(chunk, n.lo), self.elem(chunk, n.hi), tuple(picks), nodes)

    def expected(self, chunk: int, node: int) -> int:
        """Elements of node's value in ``chunk`` (a received message must hold exactly these)."""
        return sum(self.elem(chunk, b) - self.elem(chunk, a) for a, b in self.roles.layout(node))


@functools.lru_cache(maxsize=32)
def program(spec: Spec, address: str) -> Program:
    """The :class:`Program` of ``spec`` on the worker at ``address``, built once per run shape."""
    return Program(spec, address)


class EngineTask(Task):
    """A task that talks to the engine: never fused with its neighbours (a
    fused chain would call a coroutine function inside another task, and
    the engine's tasks must keep their keys: the scheduler plugin follows
    them)."""

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True


@dataclass(frozen=True)
class Named:
    """Keys passed to a task as data, not as dependencies (dask reads keys
    found in a task's plain arguments as dependencies when it culls)."""

    keys: tuple[Hashable, ...]


def lower_p2p(spec: Spec, inputs: Sequence[Any], *, token: str, run: str,
              hand_in: Callable[..., Any], barrier: Callable[..., Any], take_out: Callable[..., Any]) -> Graph:
    """The graph of a p2p run: ``hand_in(run, index, spec, *xs)`` pinned to
    each worker (``xs`` its ranks' inputs, in rank order; its value is the run
    handed in to), ``barrier(run, hand_ins, handed)`` once (``hand_ins`` the
    hand-ins' keys, ``handed`` their values; its value is ``run``),
    ``take_out(barrier, run, rank)`` pinned to each rank's worker (the rank's
    result). ``workers + 1 + ranks`` tasks."""
    tasks: dict[Hashable, Task] = {}
    placement: dict[Hashable, str] = {}
    handed, hand_ins = [], []
    for i, address in enumerate(spec.addresses):
        members = spec.members(i)
        key = keys.hand_in_key(spec.algorithm, token, members[0])
        tasks[key] = EngineTask(key, hand_in, run, i, spec, *(inputs[r] for r in members))
        placement[key] = address
        handed.append(TaskRef(key))
        hand_ins.append(key)
    gate = keys.barrier_key(spec.algorithm, token)
    tasks[gate] = EngineTask(gate, barrier, run, Named(tuple(hand_ins)), List(*handed))
    placement[gate] = spec.addresses[0]
    outputs = [keys.output_key(spec.algorithm, token, r) for r in range(spec.ranks)]
    for r, key in enumerate(outputs):
        tasks[key] = EngineTask(key, take_out, TaskRef(gate), run, r)
        placement[key] = spec.worker(r)
    return Graph(tasks, outputs, placement, token)


def _output_keys(algorithm: str, token: str, ranks: int, given: Sequence[Hashable] | None = None) -> list[Hashable]:
    """The results' keys of a call placed on arrival: ``given`` (e.g. a dask array's block keys), else
    :func:`keys.output_key`'s per rank."""
    return list(given) if given is not None else [keys.output_key(algorithm, token, r) for r in range(ranks)]


def lower_arrivals(inputs: Sequence[Any], *, algorithm: str, token: str, arrive: Callable[..., Any],
                   begin: Callable[..., Any], take_out: Callable[..., Any], decide: Any,
                   output_keys: Sequence[Hashable] | None = None) -> Graph:
    """The graph of a p2p call on Dask collections, placed when its inputs
    arrive: per rank ``arrive(token, rank, x)`` (not pinned: Dask runs it
    next to its input), a barrier ``begin(token, decide, outputs,
    *arrivals)`` that carries the call's decision for the scheduler, which
    begins the call when the last rank arrived, and per rank
    ``take_out(arrival, token, rank, key, barrier)``. A result is sent to its
    worker as soon as its rank arrived and the barrier ran, and waits there
    for the run. Every result depends on the barrier, which depends on every
    arrival, so that computing one rank's result alone (Dask culls the
    others) computes every rank's input. ``2 * ranks + 1`` tasks;
    ``output_keys``: the results' keys (default :func:`keys.output_key`),
    e.g. a dask array's block keys.
    """
    tasks: dict[Hashable, Task] = {}
    arrived = []
    for r, x in enumerate(inputs):
        key = keys.arrive_key(algorithm, token, r)
        tasks[key] = EngineTask(key, arrive, token, r, x)
        arrived.append(TaskRef(key))
    outputs = _output_keys(algorithm, token, len(inputs), output_keys)
    gate = keys.barrier_key(algorithm, token)
    tasks[gate] = EngineTask(gate, begin, token, decide, Named(tuple(outputs)), *arrived)
    for r, key in enumerate(outputs):
        tasks[key] = EngineTask(key, take_out, arrived[r], token, r, Named((key,)), TaskRef(gate))
    return Graph(tasks, outputs, {}, token)


def lower_collection(inputs: Sequence[Any], *, algorithm: str, token: str, take_out: Callable[..., Any],
                     decide: Any, output_keys: Sequence[Hashable] | None = None) -> Graph:
    """The graph of a p2p call on Dask collections whose every result is
    computed together, and on futures: per rank
    ``take_out(x, token, rank, key, decide, outputs)``, depending on its
    input alone, and no barrier: each result carries the call's decision
    (``decide``, the results' keys ``outputs``), which the scheduler plugin
    takes as the first of them waits to run. ``ranks`` tasks;
    ``output_keys`` as for :func:`lower_arrivals`."""
    outputs = _output_keys(algorithm, token, len(inputs), output_keys)
    every = Named(tuple(outputs))
    tasks: dict[Hashable, Task] = {}
    for r, (x, key) in enumerate(zip(inputs, outputs)):
        tasks[key] = EngineTask(key, take_out, x, token, r, Named((key,)), decide, every)
    return Graph(tasks, outputs, {}, token)
