"""Run a plan on a dask.distributed cluster: the only module that imports
distributed. It finds where each rank's input lives, checks the inputs
agree, lowers the plan with every task pinned to its rank's worker, and
submits the graph. Nothing but the graph passes through the client.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import dask
import numpy as np
from distributed import Client, Future, wait

from flowreduce._guard import ensure_guard
from flowreduce._plan import Plan
from flowreduce.algorithms import ALGORITHMS, SPARSE_ALGORITHMS
from flowreduce.algorithms import plan as make_plan
from flowreduce.build import build_graph
from flowreduce.cost import DEFAULT_MODEL, CostModel, best_chunks, choose
from flowreduce.ops import resolve_op
from flowreduce.sparse.inputs import describe_input, is_sparse
from flowreduce.tracing import registry as _trace_registry

logger = logging.getLogger("flowreduce")


@dataclass(frozen=True)
class CallInfo:
    """What one ``allreduce`` call ran: its plan, bytes per rank, the cost
    model's predicted seconds, its key token and each rank's worker."""

    plan: Plan
    nbytes: int
    predicted: float
    token: str
    workers: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def algorithm(self) -> str:
        return self.plan.algorithm

    @property
    def bytes_on_wire(self) -> float:
        """Bytes the plan moves between ranks, all messages (for sparse plans
        the expected bytes at the inputs' density; a trace measures them:
        ``flowreduce.tracing.summarize(tr).bytes_moved``)."""
        return self.plan.cost(self.nbytes).bytes_on_wire


# Recent calls by token, so describe() can answer from the futures alone.
# Bounded: a training loop makes one call per step.
_CALLS: OrderedDict[str, CallInfo] = OrderedDict()
_MAX_CALLS = 1024


def describe(futures: Sequence[Future]) -> CallInfo:
    """The :class:`CallInfo` of the ``allreduce`` call that made ``futures``
    (for example, which algorithm ``"auto"`` picked)."""
    from flowreduce.keys import parse

    info = parse(futures[0].key) if futures else None
    if info is None or info["token"] not in _CALLS:
        raise KeyError("these futures do not come from a recent flowreduce.allreduce call")
    return _CALLS[info["token"]]


def allreduce(
    client: Client,
    inputs: Sequence[Future],
    *,
    op: Any = "sum",
    algorithm: str = "auto",
    chunks: int | None = None,
    chunk_bytes: int | None = None,
    model: CostModel | None = None,
    **options: Any,
) -> list[Future]:
    """All-reduce numpy arrays held by futures, one future per rank.

    Parameters
    ----------
    client : distributed.Client
    inputs : list of Future
        Rank i's array. Arrays of any shape, reduced elementwise; all ranks
        must agree on shape and dtype. Ranks may share a worker.
    op : str, numpy ufunc or callable
        ``"sum"`` (default), ``"prod"``, ``"min"``, ``"max"``, ``"mean"``,
        the name of any binary numpy ufunc, a ufunc, or ``f(a, b) -> array``.
        Assumed associative and commutative.
    algorithm : str
        One of :data:`flowreduce.ALGORITHMS` or :data:`flowreduce.SPARSE_ALGORITHMS`;
        ``"auto"`` asks the cost model (the pick is logged at INFO and kept in
        ``result.plan``). scipy.sparse inputs (CSR, CSC, COO) take
        ``"sparse-recursive-doubling"``, ``"sparse-split-allgather"`` or ``"auto"``;
        ``"block-sparse"`` takes numpy inputs with zero blocks (docs/sparse.md).
    chunks, chunk_bytes : int, optional
        Split each vector into this many independent pipelines, or into
        pieces of about this many bytes. Default: chosen by the cost model.
    **options
        Algorithm options: ``radix`` (butterfly, recursive-doubling),
        ``fan_in`` (tree), ``root`` (reduce-broadcast). Sparse and
        block-sparse: ``compression`` (None, ``"fp16"``, ``"int8"``),
        ``seed``; sparse: ``delta`` (density of the dense switch), ``output``
        (None: the input's format, ``"dense"``, ``"csr"``, ``"csc"``, ``"coo"``),
        ``inner``; block-sparse: ``block_size``, ``aggregators``.

    Returns
    -------
    list of Future
        ``result[i]`` is a Future held on the worker that holds ``inputs[i]``.
        :func:`describe` on it tells what ran (plan, predicted time).
        The call waits until the inputs are in memory (their workers decide
        the placement), then returns without waiting for the reduction.

    Raises
    ------
    ValueError
        No inputs, unknown algorithm or op, ranks disagreeing on shape or
        dtype (the message names the ranks), bad chunk settings.
    TypeError
        An input that is not a future or not a numpy array.
    RuntimeError
        An input future that failed, was cancelled or whose data was lost.
    """
    inputs = list(inputs)
    if not inputs:
        raise ValueError("allreduce needs one input future per rank; got an empty list")
    for r, f in enumerate(inputs):
        if not isinstance(f, Future):
            raise TypeError(f"input of rank {r} is a {type(f).__name__}, not a distributed.Future; "
                            "scatter or submit it first")
    if algorithm not in ALGORITHMS and algorithm not in SPARSE_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS + SPARSE_ALGORITHMS)}")
    op_ = resolve_op(op)
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")

    located, cpus = _locate(client, inputs)
    workers = [w for w, _ in located]
    metas = [m for _, m in located]
    if algorithm in SPARSE_ALGORITHMS or any(is_sparse(m) for m in metas):
        return _allreduce_sparse(client, inputs, workers, metas, cpus, op_, algorithm, chunks, chunk_bytes,
                                 model, options)
    shape, dtype = _check_inputs(metas)
    if op_.mean and dtype == np.bool_:
        raise TypeError("op='mean' of boolean arrays is ambiguous; cast them to a number type first")
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    p = len(inputs)
    if chunks is None and chunk_bytes is not None:
        chunks = max(1, math.ceil(nbytes / chunk_bytes))
    model = model or DEFAULT_MODEL
    if model.cores is None:
        model = replace(model, cores=_shared_cores(workers, cpus))
    if algorithm == "hierarchical" and not {"groups", "group_size"} & set(options):
        options = {**options, "groups": _groups_by_place(workers, cpus)}  # topology from the workers
    if algorithm == "auto":
        if options:
            raise ValueError(f"options {sorted(options)} need a named algorithm, not 'auto'")
        plan = choose(p, nbytes, model=model, chunks=chunks)
    elif chunks is None:  # the named algorithm, with the chunk count the model likes best for it
        plan = best_chunks(make_plan(algorithm, p, **options), nbytes, model)
    else:
        plan = make_plan(algorithm, p, chunks=chunks, **options)
    # inproc:// (in-process clusters) passes objects by reference: no private copies to reduce into
    in_place = not any(w.startswith("inproc://") for w in workers)
    graph = build_graph(plan, inputs, workers, size=size, shape=shape, op=op_, in_place=in_place,
                        accumulate=op_.accumulator(dtype))
    return _submit(client, inputs, plan, graph, nbytes, model, workers, shape, dtype)


def _submit(client, inputs, plan, graph, nbytes, model, workers, shape, dtype) -> list[Future]:
    """Submit a lowered graph with every task pinned, and remember the call."""
    ensure_guard(client)
    with dask.annotate(workers=graph.placement.get, allow_other_workers=False):
        futures = client.get(graph.tasks, graph.outputs, sync=False)
    _CALLS[graph.token] = CallInfo(plan, nbytes, model.predict(plan, nbytes), graph.token,
                                   tuple(workers), tuple(shape), dtype.str)
    while len(_CALLS) > _MAX_CALLS:
        _CALLS.popitem(last=False)
    _trace_registry.note(futures, inputs)
    logger.info("allreduce %s: %d ranks, %d bytes each, %d tasks", plan, len(inputs), nbytes, len(graph.tasks))
    return futures


def _allreduce_sparse(client, inputs, workers, metas, cpus, op, algorithm, chunks, chunk_bytes, model,
                      options) -> list[Future]:
    """scipy.sparse inputs (SparCML) or ``block-sparse`` (OmniReduce): plan and
    lower in :mod:`flowreduce.sparse.build`, submit here."""
    from flowreduce.sparse import build as sparse_build

    model = model or DEFAULT_MODEL
    if model.cores is None:
        model = replace(model, cores=_shared_cores(workers, cpus))
    in_place = not any(w.startswith("inproc://") for w in workers)
    options = dict(options)
    if algorithm == "block-sparse":
        shape, dtype = _check_inputs(metas)
        if chunks is None and chunk_bytes is not None:
            chunks = max(1, math.ceil(math.prod(shape) * dtype.itemsize / chunk_bytes))
        aggregators = _aggregators(client, options.pop("aggregators", None))
        low = sparse_build.lower_blocks(inputs, workers, shape=shape, dtype=dtype, op=op, chunks=chunks,
                                        model=model, in_place=in_place, aggregators=aggregators, options=options)
    else:
        if chunks is None and chunk_bytes is not None:
            raise ValueError("chunk_bytes applies to dense inputs; pass chunks= for sparse ones")
        low = sparse_build.lower_sparse(inputs, workers, metas, op=op, algorithm=algorithm, chunks=chunks,
                                        model=model, in_place=in_place, options=options)
    return _submit(client, inputs, low.plan, low.graph, low.nbytes, model, workers, low.shape, low.dtype)


def _aggregators(client: Client, option) -> list[str]:
    """Workers that aggregate block-sparse packs: ``option`` as given (a list
    of addresses), none (``"ranks"``: co-located), or by default the workers
    started with the Dask resource ``aggregator`` (``--resources aggregator=1``)."""
    if option == "ranks":
        return []
    found = client.run_on_scheduler(_resource_workers, "aggregator")
    if option is None:
        return found
    if isinstance(option, (list, tuple)) and option and all(isinstance(w, str) for w in option):
        known = set(client.run_on_scheduler(_all_workers))
        missing = [w for w in option if w not in known]
        if missing:
            raise ValueError(f"aggregators {missing} are not workers of this cluster")
        return list(option)
    raise ValueError(f"aggregators must be None (the workers with resource 'aggregator', else the ranks), "
                     f"'ranks', or a list of worker addresses; got {option!r}")


def _resource_workers(resource, dask_scheduler=None) -> list[str]:
    return sorted(w for w, ws in dask_scheduler.workers.items() if ws.resources.get(resource, 0) > 0)


def _all_workers(dask_scheduler=None) -> list[str]:
    return sorted(dask_scheduler.workers)


def _groups_by_place(workers: list[str], places: dict) -> list[list[int]]:
    """Ranks grouped by the (node, job) their worker runs in, in rank order:
    what the hierarchical algorithm reduces inside before crossing nodes."""
    groups: dict[tuple, list[int]] = {}
    for r, w in enumerate(workers):
        node, _, job, _ = places.get(w, (w, 1, "", w))
        groups.setdefault((node, job), []).append(r)
    return list(groups.values())


def _shared_cores(workers: list[str], cpus: dict[str, tuple]) -> int | None:
    """CPU cores the ranks run on: per host, the fewer of its CPUs and its
    ranks. None when every rank has a core of its own (the model's default)."""
    per_host: dict[str, list[int]] = {}
    for w in workers:  # the machine, not the batch system's node: virtual nodes share its CPUs
        _, n, _, host = cpus.get(w, (w, 1, "", w))
        per_host.setdefault(host, []).append(n)
    cores = sum(min(len(ranks), max(ranks)) for ranks in per_host.values())
    return cores if cores < len(workers) else None


def _locate(client: Client, inputs: list[Future]) -> tuple[list[tuple[str, tuple | None]], dict]:
    """For each rank, the worker holding its input and what it holds there
    (type, shape, dtype), once all inputs are in memory; and each worker's
    host and usable CPUs (for the cost model). One broadcast."""
    wait(inputs)
    for r, f in enumerate(inputs):
        if f.status == "error":
            raise RuntimeError(f"input of rank {r} failed: {f.exception()!r}") from f.exception()
        if f.status != "finished":
            raise RuntimeError(f"input of rank {r} is {f.status} (key {f.key!r}); nothing to reduce")
    keys = list(dict.fromkeys(f.key for f in inputs))
    holders: dict = {}
    meta: dict = {}
    cpus: dict = {}
    for worker, (held, host_cpus) in sorted(client.run(_describe, keys).items()):
        cpus[worker] = host_cpus
        for k, m in held.items():
            holders.setdefault(k, []).append(worker)
            meta.setdefault(k, m)
    for r, f in enumerate(inputs):
        if f.key not in holders:
            raise RuntimeError(f"input of rank {r} (key {f.key!r}) is held by no worker: its data was lost")
    # A replicated input (fetched earlier by some other task) may sit on
    # several workers: keep it where its submitter pinned it if that is one of
    # them, else spread ranks over the holders, sole holders first.
    replicated = [k for k in keys if len(holders[k]) > 1]
    if replicated:
        pinned = client.run_on_scheduler(_restrictions, replicated)
        for k in replicated:
            holders[k] = [w for w in holders[k] if w in pinned.get(k, ())] or holders[k]
    load: dict[str, int] = {}
    chosen: dict[int, str] = {}
    for r in sorted(range(len(inputs)), key=lambda r: len(holders[inputs[r].key])):
        w = min(holders[inputs[r].key], key=lambda w: load.get(w, 0))
        chosen[r] = w
        load[w] = load.get(w, 0) + 1
    return [(chosen[r], meta[f.key]) for r, f in enumerate(inputs)], cpus


def _restrictions(keys, dask_scheduler=None) -> dict:
    tasks = dask_scheduler.tasks
    return {k: sorted(tasks[k].worker_restrictions or ()) for k in keys if k in tasks}


#: Environment variables naming the batch job a worker runs in, per queue system.
_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "JOB_ID", "LSB_JOBID", "OAR_JOB_ID", "_CONDOR_JOB_AD")


def place_of(dask_worker=None) -> tuple[str, str]:
    """Where a worker runs: (node, job). The node is the batch system's name
    for it when there is one (SLURM's virtual nodes on one machine are
    distinct nodes), else the host of the worker's address (workers in
    separate network namespaces are distinct hosts); the job is the batch
    job id, or ``""`` outside a batch job. Run on a worker by ``client.run``."""
    import os
    import socket

    from flowreduce.topology import host_of

    address = getattr(dask_worker, "address", None)
    node = os.environ.get("SLURMD_NODENAME") or (host_of(address) if address else socket.gethostname())
    job = next((os.environ[v] for v in _JOB_VARS if os.environ.get(v)), "")
    return node, job


def _describe(keys, dask_worker=None):
    import os
    import socket

    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        ncpu = os.cpu_count() or 1
    out = {}
    for k in keys:
        if k in dask_worker.data:
            x = dask_worker.data[k]
            if isinstance(x, np.ndarray):
                out[k] = ("ndarray", x.shape, x.dtype.str)
            else:
                out[k] = describe_input(x) or (type(x).__name__, None, None)
    node, job = place_of(dask_worker)
    return out, (node, ncpu, job, socket.gethostname())


def _check_inputs(metas: list[tuple]):
    """Shape and dtype shared by all ranks, or an error naming the ranks."""
    bad = [r for r, m in enumerate(metas) if m is None or m[0] != "ndarray"]
    if bad:
        kinds = {r: (metas[r][0] if metas[r] else "missing") for r in bad}
        raise TypeError(f"inputs must be numpy arrays; ranks {bad} hold {kinds}")
    groups: dict[tuple, list[int]] = {}
    for r, (_, shape, dt) in enumerate(metas):
        groups.setdefault((tuple(shape), dt), []).append(r)
    if len(groups) > 1:
        shapes = {tuple(s) for s, _ in groups}
        what = "shapes" if len(shapes) > 1 else "dtypes"
        detail = "; ".join(f"ranks {rs}: shape {s}, dtype {np.dtype(d)}" for (s, d), rs in groups.items())
        raise ValueError(f"ranks disagree on {what}: {detail}")
    (shape, dt), = groups
    dtype = np.dtype(dt)
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
        raise TypeError(f"inputs must have a numeric or boolean dtype, got {dtype}")
    return shape, dtype
