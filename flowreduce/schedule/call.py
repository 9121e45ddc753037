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

from flowreduce.algorithms import ALGORITHMS, SPARSE_ALGORITHMS
from flowreduce.algorithms.ir import Plan
from flowreduce.cost import CostModel, choose, configured_model, tune
from flowreduce.fusion import DEFAULT_BUCKET_BYTES
from flowreduce.ops import resolve_op
from flowreduce.schedule import pytree_call as _tree_call
from flowreduce.schedule import transport as _transport
from flowreduce.schedule.guard import ensure_guard
from flowreduce.schedule.shm_plugin import ensure_shm
from flowreduce.schedule.sparse_inputs import describe_input, is_sparse
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
    transport: str = "dask"  # how links between workers moved bytes ("shared memory", ...)

    @property
    def algorithm(self) -> str:
        return self.plan.algorithm

    @property
    def bytes_on_wire(self) -> float:
        """Bytes the plan moves between ranks, all messages (for sparse plans
        the expected bytes at the inputs' density; a trace measures them:
        ``flowreduce.tracing.summarize(tr).bytes_moved``)."""
        return self.plan.cost(self.nbytes).bytes_on_wire


@dataclass(frozen=True)
class TreeCallInfo:
    """What one ``allreduce`` call over pytrees ran: one dense all-reduce
    per bucket of fused tensors (:mod:`flowreduce.fusion`).

    ``tensors`` are ``(path, shape, dtype)`` in registration order,
    ``bucket_of[i]`` the bucket of tensor ``i``. ``plan`` is the first
    bucket's (the last layers'); ``nbytes`` and ``predicted`` add up the
    buckets (as if they ran one after another)."""

    buckets: tuple[CallInfo, ...]
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    bucket_of: tuple[int, ...]
    bucket_bytes: int | None
    workers: tuple[str, ...]

    @property
    def plan(self) -> Plan:
        return self.buckets[0].plan

    @property
    def token(self) -> str:
        return self.buckets[0].token

    @property
    def algorithm(self) -> str:
        return ", ".join(dict.fromkeys(b.algorithm for b in self.buckets))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def predicted(self) -> float:
        return sum(b.predicted for b in self.buckets)


# Recent calls by token, so describe() can answer from the futures alone
# (_TREES: every bucket token of a pytree call -> the whole call).
# Bounded: a training loop makes one call per step.
_CALLS: OrderedDict[str, CallInfo] = OrderedDict()
_TREES: OrderedDict[str, TreeCallInfo] = OrderedDict()
_MAX_CALLS = 1024


def _remember(store: OrderedDict, token: str, info: Any) -> None:
    store[token] = info
    while len(store) > _MAX_CALLS:
        store.popitem(last=False)


def describe(futures: Sequence[Any]) -> CallInfo | TreeCallInfo:
    """The :class:`CallInfo` of the ``allreduce`` call that made ``futures``
    (for example, which algorithm ``"auto"`` picked); a
    :class:`TreeCallInfo` (one :class:`CallInfo` per bucket) when the call
    reduced pytrees. ``futures`` may be the call's result or any rank's part
    of it, down to one future."""
    from flowreduce.keys import parse
    from flowreduce.pytree import flatten

    leaves = flatten(futures)[0]
    info = parse(leaves[0].key) if leaves and hasattr(leaves[0], "key") else None
    if info is not None and info["token"] in _TREES:
        return _TREES[info["token"]]
    if info is None or info["token"] not in _CALLS:
        raise KeyError("these futures do not come from a recent flowreduce.allreduce call")
    return _CALLS[info["token"]]


def allreduce(
    client: Client,
    inputs: Sequence[Any],
    *,
    op: Any = "sum",
    algorithm: str = "auto",
    chunks: int | None = None,
    chunk_bytes: int | None = None,
    model: CostModel | None = None,
    topology: Any = None,
    like: Any = None,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    transport: str = "auto",
    **options: Any,
) -> list[Any]:
    """All-reduce numpy arrays held by futures: one array, or a pytree of
    arrays (a model's gradients), per rank.

    Parameters
    ----------
    client : distributed.Client
    inputs : list
        Rank i's input, in one of these forms (every rank the same):

        * a Future of an array: ``result[i]`` is a Future of the reduced array;
        * a Future of a pytree (dict / list / tuple, nested) of arrays:
          ``result[i]`` is a Future of the same pytree;
        * a pytree of Futures, e.g. one per layer's gradient, each of an
          array or a pytree of arrays: ``result[i]`` is the same pytree of
          Futures. A bucket's all-reduce starts as soon as the futures its
          tensors come from are computed (DDP-style overlap).

        Arrays of any shape and dtype, reduced elementwise; all ranks must
        agree tensor by tensor. Ranks may share a worker.
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
        Split each vector (each bucket) into this many independent
        pipelines, or into pieces of about this many bytes. Default: chosen
        by the cost model.
    like : array, pytree, optional
        A template of one rank's input: the same structure with, for each
        future, what it resolves to (arrays, or
        :func:`flowreduce.pytree.spec` shapes and dtypes). With it the call
        does not wait for the inputs: ranks are placed where their futures
        are pinned (``submit(..., workers=[w])``) and the first task of each
        rank checks its input against the template (a mismatch fails every
        rank's result with an error naming the rank and the tensor).
        Without it, the call waits until the inputs are in memory and checks
        them first.
    bucket_bytes : int or None
        Tensor fusion: tensors are copied into buckets of about this many
        bytes (per dtype, last tensors first) and each bucket is reduced as
        one vector. Default 25 MiB (PyTorch DDP's). ``0`` or ``None``: each
        tensor is reduced on its own.
    transport : str
        ``"auto"`` (default): between worker processes of one host, payloads
        go through shared memory (Dask moves a small handle), and ``auto``
        may pick the one-level intra-host collective ``"shm-direct"``;
        ``"dask"``: every byte through Dask's comm (:mod:`flowreduce.schedule.transport`).
    model : CostModel, optional
        The cost model for ``auto`` and for the choices left open (default:
        the file named by the dask config key ``flowreduce.cost-model``,
        else the built-in constants).
    topology : Topology or callable, optional
        Which ranks share a host (and a rack...): a
        :class:`flowreduce.topology.Topology` of the workers, or a key
        ``f(address, worker_info) -> label`` such as ``by_name_prefix()``
        (dask-jobqueue jobs) or ``by_resource("host-")``. Default: the node
        each worker runs on (the batch system's node name, else the host of
        its address). ``auto`` prices transfers between hosts on the
        model's inter-host link and considers ``hierarchical``.
    **options
        Algorithm options: ``radix`` (butterfly, recursive-doubling),
        ``fan_in`` (tree), ``root`` (reduce-broadcast), ``groups``,
        ``levels``, ``inner``, ``outer`` (hierarchical; the ones left out
        are chosen by the cost model). Sparse and
        block-sparse: ``compression`` (None, ``"fp16"``, ``"int8"``),
        ``seed``; sparse: ``delta`` (density of the dense switch), ``output``
        (None: the input's format, ``"dense"``, ``"csr"``, ``"csc"``, ``"coo"``),
        ``inner``; block-sparse: ``block_size``, ``aggregators``.

    Returns
    -------
    list
        ``result[i]`` is held on the worker of rank ``i`` (the worker holding
        ``inputs[i]``, or the one it is pinned to), in the structure
        described above. :func:`describe` on it tells what ran (plan,
        predicted time, buckets). The call returns without waiting for the
        reduction; without ``like`` it first waits for the inputs.

    Raises
    ------
    ValueError
        No inputs, unknown algorithm or op, ranks disagreeing on structure,
        shape or dtype (the message names the ranks), bad chunk or bucket
        settings, a template that does not fit the inputs.
    TypeError
        An input that is not a future or not a numpy array (or pytree of them).
    RuntimeError
        An input future that failed, was cancelled or whose data was lost.
    """
    inputs = list(inputs)
    if not inputs:
        raise ValueError("allreduce needs one input future per rank; got an empty list")
    outer, ranks = _tree_call.rank_futures(inputs)
    if algorithm not in ALGORITHMS and algorithm not in SPARSE_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS + SPARSE_ALGORITHMS)}")
    op_ = resolve_op(op)
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
    _transport.check(transport)
    if bucket_bytes is not None and bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0 (0 or None: no fusion), got {bucket_bytes!r}")
    settings = _tree_call.Settings(op_, algorithm, chunks, chunk_bytes, model, options, bucket_bytes, topology)
    if like is not None or not outer.is_leaf:
        return _tree_call.allreduce_tree(client, outer, ranks, like, settings)

    located, cpus = _locate(client, inputs)
    workers = [w for w, _ in located]
    metas = [m for _, m in located]
    if any(m is not None and m[0] == "pytree" for m in metas):
        return _tree_call.allreduce_located(client, outer, ranks, workers, metas, cpus, settings)
    if algorithm in SPARSE_ALGORITHMS or any(is_sparse(m) for m in metas):
        return _allreduce_sparse(client, inputs, workers, metas, cpus, op_, algorithm, chunks, chunk_bytes,
                                 model, options)
    shape, dtype = _check_inputs(metas)
    if op_.mean and dtype == np.bool_:
        raise TypeError("op='mean' of boolean arrays is ambiguous; cast them to a number type first")
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    p = len(inputs)
    levels = rank_groups(client, workers, cpus, settings.topology)
    domains = _transport.memory_domains(workers, cpus, transport)
    if algorithm == _transport.DIRECT:  # its groups: the ranks of each worker; one chunk unless asked
        settings = replace(settings, options=_transport.direct_options(options, workers),
                           chunks=chunks if chunks or chunk_bytes else 1)
    plan, model = choose_plan(p, nbytes, workers, cpus, settings, levels)
    if algorithm == "auto" and chunks is None and chunk_bytes is None:
        plan = _transport.prefer_direct(plan, model, nbytes, workers, domains, levels[0])
    # inproc:// (in-process clusters) passes objects by reference: no private copies to reduce into
    in_place = not any(w.startswith("inproc://") for w in workers)
    graph, how = _transport.lower(plan, inputs, workers, domains, size=size, shape=shape, dtype=dtype, op=op_,
                                  in_place=in_place, accumulate=op_.accumulator(dtype))
    if how != "dask":
        ensure_shm(client)
    return _submit(client, inputs, plan, graph, nbytes, model, workers, shape, dtype, levels[0], how)


def _submit(client, inputs, plan, graph, nbytes, model, workers, shape, dtype, hosts=None,
            transport="dask") -> list[Future]:
    """Submit a lowered graph with every task pinned, and remember the call
    (with the time ``model`` predicts for it, ranks grouped by ``hosts``)."""
    ensure_guard(client)
    with dask.annotate(workers=graph.placement.get, allow_other_workers=False):
        futures = client.get(named_graph(graph.tasks, graph.token), graph.outputs, sync=False)
    _remember(_CALLS, graph.token, CallInfo(plan, nbytes, model.predict(plan, nbytes, hosts), graph.token,
                                            tuple(workers), tuple(shape), dtype.str, transport))
    _trace_registry.note(futures, inputs)
    logger.info("allreduce %s: %d ranks, %d bytes each, %d tasks", plan, len(inputs), nbytes, len(graph.tasks))
    return futures


def rank_groups(client: Client, workers: list[str], cpus: dict, topology: Any) -> list[list[list[int]]]:
    """Ranks grouped by host (and coarser levels): from ``topology`` when
    given, else by the node each rank's worker runs on (two jobs on one node are one group)."""
    if topology is None:
        return [_groups_by_place(workers, cpus)]
    from flowreduce.topology import rank_levels

    return rank_levels(client, workers, topology)


def choose_plan(p: int, nbytes: int, workers: list[str], cpus: dict, settings: Any,
                levels: list[list[list[int]]]) -> tuple[Plan, CostModel]:
    """The plan for ``p`` ranks of ``nbytes`` each (and the cost model that
    judged it, knowing the workers' cores and the hosts in ``levels``)."""
    chunks, options, algorithm = settings.chunks, settings.options, settings.algorithm
    if chunks is None and settings.chunk_bytes is not None:
        chunks = max(1, math.ceil(nbytes / settings.chunk_bytes))
    model = settings.model or configured_model()
    if model.cores is None:
        model = replace(model, cores=_shared_cores(workers, cpus))
    if algorithm == "hierarchical" and not {"groups", "group_size", "levels"} & set(options):
        options = {**options, **({"levels": levels} if len(levels) > 1 else {"groups": levels[0]})}
    if algorithm == "auto":
        if options:
            raise ValueError(f"options {sorted(options)} need a named algorithm, not 'auto'")
        plan = choose(p, nbytes, model=model, chunks=chunks, groups=levels[0])
    else:  # what the call leaves open (chunks; hierarchical's inner/outer) chosen by the model
        plan = tune(algorithm, p, nbytes, model=model, chunks=chunks, hosts=levels[0], **options)
    return plan, model


def named_graph(tasks: dict, token: str) -> Any:
    """The graph as dask's low-level-graph expression, named by the call's
    token: handed a plain dict, dask hashes every task to name it (~10 ms
    for a few hundred tasks, growing with the graph) although our keys are
    already unique."""
    try:
        from dask._expr import LLGExpr
    except ImportError:  # a dask without expressions takes the dict as it is
        return tasks
    return LLGExpr(tasks, _determ_token=token)


def _allreduce_sparse(client, inputs, workers, metas, cpus, op, algorithm, chunks, chunk_bytes, model,
                      options) -> list[Future]:
    """scipy.sparse inputs (SparCML) or ``block-sparse`` (OmniReduce): plan and
    lower in :mod:`flowreduce.build.sparse`, submit here."""
    from flowreduce.build import sparse as sparse_build

    model = model or configured_model()
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
    """Ranks grouped by the node their worker runs on, groups in order of
    their first rank and ranks in rank order: what the hierarchical
    algorithm reduces inside before crossing nodes.

    The innermost level is the ranks that share a host, because that is
    where transfers are cheap (loopback or shared memory) and the outer
    all-reduce is what crosses the network. So the node alone decides,
    not the batch job: two jobs placed on one node share its host and
    form one group, and one job spanning two nodes is two groups (its
    ranks on different nodes talk over the network like any others).
    The node is the batch system's name for the machine when it has one
    (SLURM's virtual nodes on one box stay distinct, as on a real
    cluster), else the worker's host: ``places`` maps a worker to (node,
    cpus, job, host) as :func:`worker_place` reports it, and a worker
    missing from it is a node of its own."""
    groups: dict[str, list[int]] = {}
    for r, w in enumerate(workers):
        node = places.get(w, (w, 1, "", w))[0]
        groups.setdefault(node, []).append(r)
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
    for r, f in enumerate(inputs):  # wait() would raise a CancelledError that names no rank
        if f.cancelled():
            raise RuntimeError(f"input of rank {r} was cancelled (key {f.key!r}); nothing to reduce")
    with client.as_current():  # distributed.wait runs on the default client's loop, not theirs
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


def worker_place(dask_worker=None) -> tuple[str, int, str, str]:
    """(node, usable CPUs, job, hostname) of a worker; run by ``client.run``."""
    import os
    import socket

    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        ncpu = os.cpu_count() or 1
    node, job = place_of(dask_worker)
    return node, ncpu, job, socket.gethostname()


def _describe(keys, dask_worker=None):
    from flowreduce.pytree import describe_value

    out = {}
    for k in keys:
        if k in dask_worker.data:
            x = dask_worker.data[k]
            if isinstance(x, (np.ndarray, np.generic)):  # a numpy scalar is a 0-d array
                out[k] = ("ndarray", np.shape(x), x.dtype.str)
            elif isinstance(x, (dict, list, tuple)):  # a pytree of arrays: structure and leaf specs
                out[k] = ("pytree", *describe_value(x))
            else:
                out[k] = describe_input(x) or (type(x).__name__, None, None)
    return out, worker_place(dask_worker)


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
