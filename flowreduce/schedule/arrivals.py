"""An all-reduce as a graph operation: the call returns at once, whatever
state its inputs are in, and learns what it needs inside the graph.

Used when the caller cannot know the inputs without waiting: futures still
computing, and Dask collections (a list of ``Delayed``, a dask array with one
block per rank along an axis, a list of dask arrays). The graph is the p2p
engine's placed-on-arrival form: on futures, and on collections whose every
result is computed together (:func:`flowreduce.schedule.p2p.lower_collection`),
each rank's result depends on its input alone, carries the call's decision,
and the worker plugin keeps the input in the engine as it goes to memory; on collections culled for some of their
results (:class:`CallLayer`, :func:`flowreduce.schedule.p2p.lower_arrivals`)
each rank's *arrive* task does that, next to its input, so that every
rank's input is computed still. When the last rank has arrived, the
scheduler checks what the ranks hold (errors name the ranks, on the
results) and chooses the plan from where they arrived (``decide``, made by
the front door with the call's settings and the cost model, carried by each
result, or by the barrier task of a collection culled for some results) and pins each rank's result to its rank's worker. Nothing is asked of the scheduler or the workers while the
call is made: the futures' graph is sent with one stream message, and a
collection's graph waits for the user's compute.

:func:`flowreduce.describe` of such a call asks the scheduler for what ran,
once it is chosen.
"""

from __future__ import annotations

import pickle
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, cast

import dask
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.task_spec import Task, TaskRef

from flowreduce import keys
from flowreduce.errors import InputError, InputTypeError
from flowreduce.lower.graph import named_graph
from flowreduce.phases import OUTPUT
from flowreduce.schedule import p2p as _p2p
from flowreduce.schedule import records
from flowreduce.schedule.extension import ensure_extension
from flowreduce.schedule.records import CallRecord

Decide = _p2p.Decide


#: Tokens of the calls placed on arrival made here, newest last (describe() asks the scheduler for those only).
_PLACED: OrderedDict[str, None] = OrderedDict()


def placed(token: str) -> None:
    _PLACED[token] = None
    while len(_PLACED) > records.MAX_CALLS:
        _PLACED.popitem(last=False)


def was_placed(token: str) -> bool:
    """Whether call ``token`` was made here as a call placed on arrival."""
    return token in _PLACED


def is_collection(inputs: Any) -> bool:
    """Whether ``inputs`` is a dask collection, or a list of them (what :func:`lower_collection` takes)."""
    if dask.is_dask_collection(inputs):
        return True
    return isinstance(inputs, (list, tuple)) and bool(inputs) and all(dask.is_dask_collection(x) for x in inputs)


def pending(futures: Sequence[Any]) -> bool:
    """Whether any of ``futures`` is still being computed, as the client knows it (no round trip); one that
    failed, was cancelled or lost takes the call that checks its inputs first and names it."""
    states = {f.status for f in futures}
    return "pending" in states and not states & {"error", "cancelled", "lost"}


def submit_futures(client: Any, futures: Sequence[Any], algorithm: str, decide: Decide, token: str) -> list[Any]:
    """Submit the call on ``futures`` (one per rank) without waiting for them: its graph, the one
    message it sends. The scheduler's extension watches it as its graph comes, as a call on
    collections (the timeout its decision carries, lost inputs)."""
    graph = _p2p.lower_collection(futures, algorithm, decide, token=token)
    placed(token)
    # its record comes from the scheduler's extension once the call begins; big values between workers of a
    # host go through shared segments
    ensure_extension(client)
    # no barrier: each result carries the decision, which the scheduler plugin keeps as the first waits to run
    return client.get(named_graph(graph.tasks, token), list(graph.outputs), sync=False)


def lower_collection(client: Any, inputs: Any, axis: int, algorithm: str, decide_for: Callable[[str], Decide],
                     token: str) -> Any:
    """The call on Dask collections, as a collection of the same kind whose
    graph holds the all-reduce: a list of ``Delayed`` gives a list of
    ``Delayed``; a dask array with one block per rank along ``axis`` (other
    axes are made one block), a dask array of the same chunks whose every
    block is the reduced value; a list of dask arrays (each one rank's
    input, made one block), a list of one-block dask arrays."""
    import dask.array as da
    from dask.delayed import Delayed

    placed(token)
    ensure_extension(client)  # the engine must be there when the user computes
    decide = decide_for(token)
    if isinstance(inputs, da.Array):
        if not 0 <= axis < max(inputs.ndim, 1):
            raise InputError(f"axis {axis} is not an axis of the {inputs.ndim}-d dask array")
        whole = {a: -1 for a in range(inputs.ndim) if a != axis}
        x = inputs.rechunk(whole) if whole else inputs
        p = x.numblocks[axis]
        block = [(x.name, *(r if a == axis else 0 for a in range(x.ndim))) for r in range(p)]
        name = keys.name(algorithm, OUTPUT, token)
        out_keys = [(name, *(r if a == axis else 0 for a in range(x.ndim))) for r in range(p)]
        hlg = HighLevelGraph.from_collections(name, CallLayer(block, algorithm, decide, token, out_keys),
                                              dependencies=[cast(Any, x)])
        return da.Array(hlg, name, x.chunks, meta=x._meta)
    items = list(inputs)
    bad = [r for r, v in enumerate(items) if not dask.is_dask_collection(v)]
    if bad:
        raise InputTypeError(f"inputs of ranks {bad} are not Dask collections while others are; pass one kind")
    arrays = [isinstance(v, da.Array) for v in items]
    if any(arrays) and not all(arrays):
        raise InputTypeError(f"ranks {[r for r, a in enumerate(arrays) if not a]} hold Delayed objects and ranks "
                             f"{[r for r, a in enumerate(arrays) if a]} dask arrays; pass one kind")
    if all(arrays):
        items = [v.rechunk(-1) if v.npartitions > 1 else v for v in items]
        block = [(v.name, *(0,) * v.ndim) for v in items]
    else:
        block = [v.key for v in items]
        if any(len(v.__dask_keys__()) != 1 for v in items):
            raise InputTypeError("each rank's Delayed must be one object (one key)")
    call = CallLayer(block, algorithm, decide, token)
    layer = keys.name(algorithm, OUTPUT, token)
    hlg = HighLevelGraph.from_collections(layer, call, dependencies=items)
    if all(arrays):
        out = []
        for r, v in enumerate(items):  # each rank's result: a one-block array of its own name
            name = f"allreduced-{token}-{r}"
            key = (name, *(0,) * v.ndim)
            alias = {key: Task(key, _same, TaskRef(cast(Any, call.outputs[r])))}  # a task, not an Alias: Dask renames those
            both = HighLevelGraph({**hlg.layers, name: MaterializedLayer(alias)},
                                  {**hlg.dependencies, name: {layer}})
            out.append(da.Array(both, name, tuple((n,) for n in v.shape), meta=v._meta))
        return out
    return [Delayed(k, hlg, layer=layer) for k in call.outputs]


class CallLayer(MaterializedLayer):
    """The graph layer of a call on Dask collections. As built (and as Dask
    runs it when it does not optimise the graph), an output per rank on its
    input alone, each carrying the call's decision, the call on futures'
    graph (:func:`flowreduce.schedule.p2p.lower_collection`): the inputs are
    kept in the engines as they go to memory, the scheduler begins the call
    when the last rank arrived. Culled for only some of its results (Dask
    optimising a graph that asks for those: ``out[1].compute()``), the layer
    becomes the graph with an arrive task per rank and a barrier
    (:func:`flowreduce.schedule.p2p.lower_arrivals`), on which every asked
    result depends, so that every rank's input is computed still."""

    def __init__(self, inputs: Sequence[Any], algorithm: str, decide: Decide, token: str,
                 output_keys: Sequence[Any] | None = None):
        graph = _p2p.lower_collection([TaskRef(k) for k in inputs], algorithm, decide, output_keys=output_keys,
                                      token=token)
        super().__init__(cast(Any, graph.tasks))
        self.inputs, self.algorithm, self.decide, self.token = list(inputs), algorithm, decide, token
        self.outputs = list(graph.outputs)

    def cull(self, keys: set[Any], all_hlg_keys: Any) -> tuple[Any, Any]:
        asked = keys & set(self.outputs)
        if not asked:
            return super().cull(keys, all_hlg_keys)
        if len(asked) == len(self.outputs):  # itself: culled again later, for some results, it culls as here
            return self, {k: set(t.dependencies) for k, t in self.mapping.items()}
        graph = _p2p.lower_arrivals([TaskRef(k) for k in self.inputs], self.algorithm, self.decide,
                                    output_keys=self.outputs, token=self.token)
        return MaterializedLayer(cast(Any, graph.tasks), annotations=self.annotations).cull(keys, all_hlg_keys)


def _same(x: Any) -> Any:
    return x


def record_of(client: Any, token: str, futures: Sequence[Any], wait: float | None = None) -> CallRecord | None:
    """What call ``token`` ran, asked of the scheduler once it chose
    it (waiting for that up to ``wait`` s, None: until it began or one of
    ``futures`` failed); None if it did not begin."""
    deadline = None if wait is None else time.monotonic() + wait
    while True:
        step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        got = client.sync(client.scheduler.flowreduce_p2p_record, token=token, timeout=step)
        if got is not None:
            return pickle.loads(got)
        if any(f.status in ("error", "cancelled", "lost") for f in futures) or (
                futures and all(f.status == "finished" for f in futures)):  # failed, or began and forgotten
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return None
