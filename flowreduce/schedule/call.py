"""The front door of an all-reduce on a dask.distributed cluster.

One path for every kind of call (dense arrays, pytrees, ``like=``
templates, scipy.sparse and block-sparse inputs):

1. :class:`Settings` checks the call's options; :func:`~flowreduce.schedule.inputs.rank_futures`
   the structure of the ranks' futures;
2. :func:`describe_inputs` places the ranks (:mod:`~flowreduce.schedule.placement`)
   and checks once that their inputs agree (:mod:`~flowreduce.schedule.inputs`),
   into one typed :class:`Ranks`;
3. :func:`lower` chooses the plans (:func:`choose_plan`, the cost model of
   :func:`~flowreduce.cost.model_for`, the hosts of :mod:`~flowreduce.schedule.hosts`),
   and for a dense call, of the candidates, the plan and the route that runs it
   (:func:`flowreduce.schedule.routes.choose`, once); the route lowers it
   (:mod:`flowreduce.lower`) into one :class:`Job`;
4. :func:`submit` hands the graph to the scheduler with every task pinned,
   and keeps the call's records (:mod:`~flowreduce.schedule.records`).

Nothing but the graph passes through the client.
"""

from __future__ import annotations

import logging
import math
import operator
import pickle
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import dask
import dask.utils
import numpy as np
from distributed import Client, Future

from flowreduce import config, dashboard
from flowreduce.algorithms import ALGORITHMS, SPARSE_ALGORITHMS
from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms.ir import Plan
from flowreduce.algorithms.sparse import SparsePlan
from flowreduce.cost import CostModel, Lowered, as_planned, choose, choose_sparse, model_for, tune
from flowreduce.errors import InputError, InputStateError, InputTypeError, OptionError, raised_as
from flowreduce.fusion import DEFAULT_BUCKET_BYTES, Layout, make_buckets
from flowreduce.keys import new_token, parse
from flowreduce.lower.buckets import build_pytree_graph
from flowreduce.lower.graph import Graph, named_graph
from flowreduce.lower.p2p import engine_workers
from flowreduce.lower.sparse import (
    BlockCall,
    SparseCall,
    SparseInputs,
    block_call,
    lower_blocks,
    lower_sparse,
    sparse_call,
)
from flowreduce.ops import Op, resolve_op
from flowreduce.pytree import LEAF, TreeDef, flatten, unflatten
from flowreduce.reproducible import MAX_RANKS, tree_ordered
from flowreduce.schedule import arrivals as _arrivals
from flowreduce.schedule import guard, hosts, placement, records, routes
from flowreduce.schedule import p2p as _p2p
from flowreduce.schedule import reproducible as _reproducible
from flowreduce.schedule import transport as _transport
from flowreduce.schedule.extension import ensure_extension
from flowreduce.schedule.inputs import (
    ArrayMeta,
    SparseMeta,
    TreeMeta,
    check_cluster,
    check_dtypes,
    checked_array,
    common_array,
    common_layout,
    common_sparse,
    rank_futures,
)
from flowreduce.schedule.records import CallRecord, PytreeRecord

logger = logging.getLogger("flowreduce")


def describe(futures: Sequence[Any]) -> CallRecord | PytreeRecord:
    """The :class:`~flowreduce.schedule.records.CallRecord` of the
    ``allreduce`` call that made ``futures`` (for example, which algorithm
    ``"auto"`` picked); a :class:`~flowreduce.schedule.records.PytreeRecord`
    (one record per bucket) when the call reduced pytrees. ``futures`` may be
    the call's result or any rank's part of it, down to one future (or
    ``Delayed``). For a call that did not wait for its inputs, this waits
    until they arrived and the plan was chosen (None if the call failed first)."""
    leaves = flatten(futures)[0]
    info = parse(leaves[0].key) if leaves and hasattr(leaves[0], "key") else None
    found = records.find(info["token"]) if info is not None else None
    if found is None and info is not None and _arrivals.was_placed(info["token"]):
        # a call that did not wait for its inputs: what it runs is known once they arrived (on the scheduler)
        futures_ = [f for f in leaves if isinstance(f, Future)]  # or Delayed, whose attributes are all Delayed
        client = futures_[0].client if futures_ else _default_client()
        call = _arrivals.record_of(client, info["token"], futures_, wait=None if futures_ else DESCRIBE_WAIT)
        if call is not None:
            records.remember(client, (call,))
            found = call
    if found is None:
        raise KeyError("these futures do not come from a recent flowreduce.allreduce call")
    return found


def allreduce(
    client: Client,
    inputs: Sequence[Any],
    *,
    op: Any = "sum",
    algorithm: str = "auto",
    chunks: int | None = None,
    chunk_bytes: int | str | None = None,
    model: CostModel | None = None,
    topology: Any = None,
    like: Any = None,
    bucket_bytes: int | str | None = DEFAULT_BUCKET_BYTES,
    timeout: float | str | None = None,
    transport: str = "auto",
    deterministic: bool | str | None = None,
    method: str | None = None,
    axis: int = 0,
    **options: Any,
) -> Any:
    """All-reduce numpy arrays held by futures or Dask collections: one
    array, or a pytree of arrays (a model's gradients), per rank.

    A call on futures that are still being computed, or on Dask
    collections, returns at once: it is a graph operation, placed where its
    inputs arrive, whose plan is chosen once they have (docs/workflows.md).

    Parameters
    ----------
    client : distributed.Client
    inputs : list, or a dask array
        Rank i's input, in one of these forms (every rank the same):

        * a Future of an array: ``result[i]`` is a Future of the reduced array;
        * a Future of a pytree (dict / list / tuple, nested) of arrays:
          ``result[i]`` is a Future of the same pytree;
        * a pytree of Futures, e.g. one per layer's gradient, each of an
          array or a pytree of arrays: ``result[i]`` is the same pytree of
          Futures. A bucket's all-reduce starts as soon as the futures its
          tensors come from are computed (DDP-style overlap).

        * a ``dask.delayed`` object of an array: ``result[i]`` is a
          ``Delayed`` of the reduced array, in a graph that holds the
          all-reduce (compute or persist it with the rest of yours);
        * a dask array (one rank's input, any chunks): ``result[i]`` is a
          one-block dask array of the reduced array;
        * or, instead of a list, one dask array with one block per rank
          along ``axis``: the result is a dask array of the same chunks
          whose every block is the reduced block.

        Arrays of any shape and dtype, reduced elementwise; all ranks must
        agree tensor by tensor. Ranks may share a worker.
    op : str, numpy ufunc or callable
        ``"sum"`` (default), ``"prod"``, ``"min"``, ``"max"``, ``"mean"``,
        the name of any binary numpy ufunc, a ufunc, or ``f(a, b) -> array``.
        Assumed associative and commutative.
    algorithm : str
        One of :data:`flowreduce.ALGORITHMS` or :data:`flowreduce.SPARSE_ALGORITHMS`;
        ``"auto"`` asks the cost model (the pick is logged at INFO and
        :func:`describe` tells it). scipy.sparse inputs (CSR, CSC, COO) take
        ``"sparse-recursive-doubling"``, ``"sparse-split-allgather"`` or ``"auto"``;
        ``"block-sparse"`` takes numpy inputs with zero blocks (docs/sparse.md).
    chunks, chunk_bytes : int, optional
        Split each vector (each bucket) into this many independent
        pipelines, or into pieces of about this many bytes (an int, or a
        string dask reads: ``"4MiB"``). Default: chosen by the cost model.
        At most ``flowreduce.max-chunks`` chunks per vector (dask config,
        default 1024): each chunk is a task per plan node.
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
    bucket_bytes : int, str or None
        Tensor fusion: tensors are copied into buckets of about this many
        bytes (``"25MiB"`` works too; per dtype, last tensors first) and each bucket is reduced as
        one vector. Default 25 MiB (PyTorch DDP's). ``0`` or ``None``: each
        tensor is reduced on its own.
    timeout : float or str, optional
        Seconds (or a Dask time string, ``"5min"``) the call may wait for
        its inputs (when it waits for them), and then its results for the
        reduction (default: the dask config key ``flowreduce.timeout``, else
        no limit). Past it the call raises, or the pending results fail,
        with :class:`flowreduce.errors.AllreduceTimeoutError` saying what
        they wait for. A worker that dies or leaves mid-call does not fail
        the call: it recovers (docs/failures.md).
    transport : str
        ``"auto"`` (default): between worker processes of one host, payloads
        go through shared memory (Dask moves a small handle), and ``auto``
        may pick the one-level intra-host collective ``"shm-direct"``;
        across hosts, ``"hierarchical"`` (and ``auto``, when the model says
        so) runs that collective inside each host and its outer algorithm
        between hosts (``inner="shm-direct"``; ``describe(result).links``
        says which transport each pair of workers used);
        ``"dask"``: every byte through Dask's comm (:mod:`flowreduce.schedule.routes`).
    deterministic : False, True or "exact"
        ``True``: floating-point sums and means (and other order-dependent
        float ops) add the ranks' values in one fixed order, the reference
        tree over rank indices of ``flowreduce.reference_reduce(arrays, op,
        order="tree")``, whatever the algorithm, chunking, transport,
        placement and recovery: the same bits as that function (not
        independent of the rank count; docs/reproducibility.md).
        ``"exact"``: float32 and float64 sums and means are the exact sum
        rounded once (float64: ``math.fsum`` over the ranks), the same bits
        for any algorithm, chunking, transport, placement and rank count
        (:mod:`flowreduce.schedule.reproducible`, docs/reproducibility.md);
        integers, min and max are exact already and pass through. Default:
        the dask config key ``flowreduce.deterministic`` (False).
    method : str, optional
        ``"tasks"``: a task per plan node and chunk; ``"p2p"``: the plan runs
        over the ranks' workers in their engines, with a task per worker and
        one per rank whatever the algorithm and chunks (dense numpy arrays,
        ops by name; docs/p2p.md); ``"auto"``: the one the cost model prices
        lower (``tasks`` for what p2p does not take). Default: the dask
        config key ``flowreduce.method`` (``"auto"``).
    axis : int
        The axis along which a dask array passed as ``inputs`` has one
        block per rank (default 0).
    model : CostModel, optional
        The cost model for ``auto`` and for the choices left open (default:
        the file named by the dask config key ``flowreduce.cost-model``,
        else the built-in constants).
    topology : Topology or callable, optional
        Which ranks share a host (and a rack...): a
        :class:`flowreduce.Topology` of the workers, or a key
        ``f(address, worker_info) -> label`` such as ``by_name_prefix()``
        (dask-jobqueue jobs) or ``by_resource("host-")``. Default: the node
        each worker runs on (the batch system's node name, else the host of
        its address; not the batch job: :mod:`flowreduce.schedule.hosts`). ``auto`` prices transfers between hosts on the
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
        reduction. On futures all computed, it places the ranks from what the
        scheduler knows (one request) and may run any route (``direct``...);
        on futures still being computed and on Dask collections it waits for
        nothing: one dense numpy array per rank runs on the p2p engine,
        placed where the inputs arrive (other inputs: with ``like=``, or
        after waiting for the futures, as before). Input errors of such a
        call come on the results, naming the ranks.

    Raises
    ------
    ValueError (flowreduce.errors.OptionError, InputError)
        Unknown algorithm or op, bad chunk or bucket settings, options a
        Dask collection cannot take; no inputs, a template without the
        structure of the inputs' futures.
    TypeError (flowreduce.errors.InputTypeError)
        An input that is not a future (nor a Dask collection).
    TimeoutError (flowreduce.errors.AllreduceTimeoutError)
        A call that waits for its inputs (pytrees of futures, ``like=``-less
        options the engine does not take) did not see them ready within
        ``timeout``.
    The input errors, from the result futures
        What the ranks hold is never raised by the call: ranks disagreeing
        on structure, shape or dtype (``InputError``, a ``ValueError``),
        holding no array or an array of a dtype the op cannot reduce
        (``InputTypeError``, a ``TypeError``), an input that failed, was
        cancelled or lost before the call (``InputStateError``, a
        ``RuntimeError``) fail every rank's result, whose ``.result()`` or
        ``client.gather`` raises them, naming the ranks; so do the same
        errors found later by the call's tasks (a template's check, the
        ``direct`` plan's, a call placed on arrival's decision). An input that
        fails while a call placed on arrival waits for it fails the results
        with its own exception, as any Dask task depending on it. A result
        whose rank cannot recover from a lost worker raises
        ``WorkerLostError``; one that takes longer than ``timeout``,
        ``AllreduceTimeoutError``.
        Every error raised on purpose, by the call or its results, is a
        :class:`flowreduce.FlowreduceError` and the built-in type above.
    """
    collection = _arrivals.is_collection(inputs)
    outer, futures = (LEAF, []) if collection else rank_futures(list(inputs))
    check_cluster(client, futures)
    settings = Settings.check(op, algorithm, chunks, chunk_bytes, model, topology, bucket_bytes, options, timeout, transport)
    exact = _reproducible.mode(config.get("deterministic") if deterministic is None else deterministic)
    if exact and algorithm in SPARSE_ALGORITHMS:
        raise OptionError(f"deterministic={exact!r} takes the dense algorithms, not {algorithm!r}")
    if exact is True:  # one fixed order of float additions (docs/reproducibility.md)
        settings, exact = replace(settings, deterministic=True), False
    # exact needs the inputs' dtype: a name glance() does not take makes describe_inputs learn it
    how = _method(method, like, algorithm, bool(exact))
    if collection or (_arrivals.pending([fs[0] for fs in futures]) and outer.is_leaf):
        if _on_arrival(outer, like, settings, exact, how):  # the call returns at once: docs/workflows.md
            token = new_token()
            if collection:
                return _arrivals.lower_collection(client, inputs, axis, settings.algorithm,
                                                  lambda t: OnArrival(settings, t, ()), token)
            decide = OnArrival(settings, token, tuple(fs[0].key for fs in futures))
            return _arrivals.submit_futures(client, [fs[0] for fs in futures], settings.algorithm, decide, token)
        if collection:
            raise OptionError("Dask collections are reduced on the p2p engine: one dense numpy array per rank, "
                              "an op by name, no like=, deterministic=, topology=, sparse algorithm or options "
                              f"naming ranks ({sorted(RANK_OPTIONS)}), and method 'auto' or 'p2p'")
    try:
        if how == "p2p":  # the ranks described as for a dense call, then the engine
            ranks = describe_inputs(client, outer, futures, None, replace(settings, algorithm="p2p"))
            if _converted_on_arrival(ranks, settings) and _on_arrival(outer, like, settings, exact, how):
                token = new_token()  # torch, pytrees, sparse: what a call placed on arrival converts or gathers
                decide = OnArrival(settings, token, tuple(fs[0].key for fs in futures))
                return _arrivals.submit_futures(client, [fs[0] for fs in futures], settings.algorithm, decide, token)
            return submit(client, lower_p2p(client, ranks, settings), ranks, settings.timeout)  # refuses what it cannot
        ranks = describe_inputs(client, outer, futures, like, replace(settings, algorithm="exact") if exact else settings)
    except (InputError, InputTypeError, InputStateError) as e:  # what the ranks hold: told on the results, as always
        return _failed_results(client, outer, futures, e)
    _refuse_unordered_sparse(ranks, settings)
    if exact and _reproducible.applies(ranks.held, settings.op):
        fold = _exact_fold_job(client, ranks, settings)
        if fold is not None:
            return submit(client, fold, ranks, settings.timeout)

        def run(parts: list[Future], op: str, template: Any) -> list[Any]:  # an ordinary call, the same options
            return allreduce(client, parts, op=op, algorithm=algorithm, chunks=chunks, chunk_bytes=chunk_bytes,
                             model=model, topology=topology, like=template, timeout=timeout, transport=transport,
                             deterministic=False, **options)
        return _reproducible.allreduce(client, ranks.futures, ranks.workers, ranks.held, settings.op, run,
                                       check=ranks.check)
    return submit(client, lower(client, ranks, settings, may_p2p=how == "auto"), ranks, settings.timeout)


@dataclass(frozen=True)
class Settings:
    """A call's options, checked: what decides its plans and buckets."""

    op: Op
    algorithm: str
    chunks: int | None
    chunk_bytes: int | None
    model: CostModel | None
    topology: Any
    bucket_bytes: int | None
    options: Mapping[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    transport: str = "auto"
    deterministic: bool = False  # True: float reductions in the reference tree's order

    @classmethod
    def check(cls, op: Any, algorithm: str, chunks: Any, chunk_bytes: Any, model: CostModel | None,
              topology: Any, bucket_bytes: Any, options: Mapping[str, Any], timeout: Any = None,
              transport: str = "auto") -> Settings:
        """The settings, or an :class:`~flowreduce.errors.OptionError` naming the bad one."""
        if algorithm not in ALGORITHMS and algorithm not in SPARSE_ALGORITHMS:
            raise OptionError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS + SPARSE_ALGORITHMS)}")
        with raised_as(OptionError):
            op_ = resolve_op(op)
        chunks = _count("chunks", chunks)
        if chunks is not None:
            _check_cap("chunks", chunks)
        chunk_bytes = _byte_count(chunk_bytes, smallest=1, what="chunk_bytes must be positive (bytes: an int or a "
                                  "string like '1MiB')")
        bucket_bytes = _byte_count(bucket_bytes, smallest=0, what="bucket_bytes must be >= 0 (0 or None: no fusion; "
                                   "bytes: an int or a string like '25MiB')")
        with raised_as(OptionError):
            _transport.check(transport)
        return cls(op_, algorithm, chunks, chunk_bytes, model, topology, bucket_bytes, dict(options),
                   guard.resolve_timeout(timeout), transport)

    def chunks_for(self, nbytes: int) -> int | None:
        """The chunk count of a vector of ``nbytes``: ``chunks`` if given,
        else from ``chunk_bytes``, else None (the cost model chooses)."""
        if self.chunks is None and self.chunk_bytes is not None:
            chunks = max(1, math.ceil(nbytes / self.chunk_bytes))
            _check_cap(f"chunk_bytes={self.chunk_bytes} on a vector of {nbytes} bytes", chunks)
            return chunks
        return self.chunks


def _refuse_unordered_sparse(ranks: Ranks, settings: Settings) -> None:
    """deterministic=True on scipy.sparse inputs, whose kernels cannot keep the tree order: an
    OptionError (integers, min, max... are exact in any order and pass). The p2p route refuses
    float sums itself (:func:`p2p_refusal`)."""
    dtype = getattr(ranks.held, "dtype", None)
    if (settings.deterministic and isinstance(ranks.held, SparseInputs) and dtype is not None
            and tree_ordered(settings.op.name, dtype)):
        raise OptionError("deterministic=True does not take scipy.sparse inputs; pass deterministic=False or "
                          "'exact' (docs/reproducibility.md)")


def _count(name: str, value: Any) -> int | None:
    """A positive integer option: ints and integer-likes (``np.int64(2)``),
    not booleans, not floats."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise OptionError(f"{name} must be a positive integer, got the boolean {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise OptionError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise OptionError(f"{name} must be a positive integer, got {value!r}")
    return n


def _byte_count(value: Any, *, smallest: int, what: str) -> int | None:
    """A number of bytes: an integer (or integer-like) or a string dask reads
    (``"1MiB"``, ``"25 MB"``: :func:`dask.utils.parse_bytes`); not a boolean.
    ``what`` says what is expected, naming the parameter."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise OptionError(f"{what}, got the boolean {value!r}")
    try:
        n = dask.utils.parse_bytes(value) if isinstance(value, str) else operator.index(value)
    except (TypeError, ValueError) as e:
        raise OptionError(f"{what}, got {value!r}") from e
    if n < smallest:
        raise OptionError(f"{what}, got {value!r}")
    return n


def _check_cap(what: str, chunks: int) -> None:
    """Every chunk is a task per plan node: refuse counts that would build
    tasks until memory runs out (the cap is the dask config key
    ``flowreduce.max-chunks``)."""
    cap = int(config.get("max-chunks"))
    if chunks > cap:
        raise OptionError(f"{what} asks for {chunks} chunks per vector; at most {cap} (each chunk is a task per "
                          "plan node; the dask config key 'flowreduce.max-chunks' sets the cap)")


@dataclass(frozen=True)
class Unseen:
    """Numpy arrays in memory, known only by their bytes (what the scheduler
    knows of them): the tasks of the call check the rest."""

    nbytes: int


#: What a call's ranks hold, agreed by all: one numpy array each, scipy.sparse
#: inputs, tensors (pytrees, or arrays described by a template), or numpy
#: arrays the call's tasks check.
Held = ArrayMeta | SparseInputs | Layout | Unseen


@dataclass(frozen=True)
class Ranks:
    """A call's inputs, placed and checked: rank ``r``'s futures
    ``futures[r]`` (in the order of ``outer``'s leaves) run on
    ``workers[r]``; ``held`` is what every rank holds. ``check``: the first
    task of each rank checks its input against ``held`` (from a template:
    nothing was waited for), or, for :class:`Unseen` inputs, all ranks'
    inputs against each other. ``search``: the call's plan search, when it
    was made before the inputs were described (:func:`glance`: it decided
    how they are checked, ``direct`` on :class:`Unseen` inputs, or that
    they are waited for); :func:`lower` runs its choice, or re-prices its
    candidates, and does not search again."""

    outer: TreeDef
    futures: tuple[tuple[Future, ...], ...]
    workers: tuple[str, ...]
    places: Mapping[str, hosts.Place]
    held: Held
    check: bool = False
    search: Search | None = None

    @property
    def in_place(self) -> bool:
        """Whether the engine (``method="p2p"``) may reduce into the buffers it
        received: inproc:// (in-process clusters) passes objects by reference,
        leaving no private copies. A task graph never does
        (:data:`TASKS_REDUCE_INTO_RECEIVED`)."""
        return not any(w.startswith("inproc://") for w in self.workers)


def describe_inputs(client: Client, outer: TreeDef, futures: list[list[Future]], like: Any,
                    settings: Settings) -> Ranks:
    """Place the ranks and check what they hold, once. With a template
    (``like``) nothing is waited for; numpy arrays already in memory, small
    enough that the cost model picks the one-level ``direct`` plan, are
    placed from one scheduler call and checked by that plan's tasks
    (:func:`glance`); else the inputs are waited for and the workers say
    what they hold."""
    frozen = tuple(tuple(fs) for fs in futures)
    seen = glance(client, outer, frozen, settings) if like is None else None
    if seen is not None and seen.choice.route is routes.DIRECT_READS:  # its tasks check the inputs
        site = seen.site
        return Ranks(outer, frozen, site.workers, seen.places, Unseen(site.nbytes), check=True, search=seen)
    if like is not None:
        with raised_as(InputError):
            layout = Layout.from_template(outer, like)
        check_dtypes(layout, settings.op)
        workers = placement.place(client, futures)
        return Ranks(outer, frozen, tuple(workers), hosts.worker_places(client, workers), layout, check=True)
    located, metas = placement.locate(client, futures, settings.timeout)
    # a rank whose futures sit on several workers runs where most of them are
    workers = [Counter(ws).most_common(1)[0][0] for ws in located]
    places = hosts.worker_places(client, workers)  # just learnt by locate
    held: Held
    if not outer.is_leaf or any(isinstance(m[0], TreeMeta) for m in metas):
        held = common_layout(outer, metas, settings.op)
    elif settings.algorithm == "block-sparse":
        held = common_array([m[0] for m in metas])
    elif settings.algorithm in SPARSE_ALGORITHMS or any(isinstance(m[0], SparseMeta) for m in metas):
        held = common_sparse([m[0] for m in metas])
    else:
        held = checked_array([m[0] for m in metas], settings.op)
    return Ranks(outer, frozen, tuple(workers), places, held, search=seen)


@dataclass(frozen=True)
class Search:
    """A dense call's plan search (:func:`dense_candidates`), made once, where
    the call first knows its ranks' workers and bytes: at the :func:`glance`
    for numpy arrays in memory, else in :func:`lower`. ``site``: where it
    was made (no lowering yet); ``places``: the workers' places; ``plans``:
    the candidates; ``choice``: the one
    :func:`~flowreduce.schedule.routes.choose` picks among them on the task
    routes (the glance's: ``direct``'s peer reads, or the inputs are waited
    for). :func:`lower` re-prices ``plans`` (and the engine's, under
    ``method="auto"``) on its site when it is this one (:meth:`made_for`)."""

    site: routes.Site
    places: Mapping[str, hosts.Place]
    plans: tuple[Plan, ...]
    choice: routes.Choice

    def made_for(self, site: routes.Site) -> bool:
        """Whether this search was made for ``site``'s question: the same workers and memory domains,
        hosts, model, bytes and order (what the glance saw and what the described inputs say agree)."""
        a, b = self.site, site
        return ((a.workers, a.domains, a.model, a.nbytes, a.ordered) == (b.workers, b.domains, b.model, b.nbytes,
                                                                         b.ordered)
                and [[list(g) for g in level] for level in a.levels] == [[list(g) for g in level] for level in b.levels])


#: The dtype a glance prices numpy arrays as (the scheduler knows their bytes, not their dtype): under
#: deterministic=True a float's partial sums (:func:`pricing`), what the call's values almost always are;
#: integers there (exact in any order) find the glance's search made for another model, and search again.
GLANCED_DTYPE = np.dtype("f8")


def glance(client: Client, outer: TreeDef, futures: tuple[tuple[Future, ...], ...],
           settings: Settings) -> Search | None:
    """The plan search of a call whose plan may be ``direct`` (named, or
    ``auto``), made from what the scheduler knows of its inputs
    (:func:`~flowreduce.schedule.placement.glance`: numpy arrays in memory,
    their workers and bytes) without asking the workers. When its choice is
    ``direct``'s peer reads, their tasks check the inputs; else the inputs
    are described and :func:`lower` re-prices these candidates. None when
    that does not apply."""
    if not outer.is_leaf or settings.algorithm not in ("auto", routes.DIRECT):
        return None
    seen = placement.glance(client, [fs[0] for fs in futures])
    if seen is None:
        return None
    workers, nbytes = seen
    places = hosts.worker_places(client, workers)  # asked once per worker and client, then kept
    model = pricing(model_for(settings.model, hosts.shared_cores(workers, places)), settings, GLANCED_DTYPE)
    levels = hosts.rank_levels(client, workers, places, settings.topology)
    site = call_site(workers, places, levels, model, nbytes, settings, ordered=ordered(settings, GLANCED_DTYPE))
    plans = tuple(dense_candidates(site, settings))
    return Search(site, places, plans, routes.choose(site, plans))


def ordered(settings: Settings, dtype: Any) -> bool:
    """Whether a call's values of ``dtype`` are reduced in the reference tree's order (``deterministic=True``
    on an op and dtype it orders)."""
    return settings.deterministic and tree_ordered(settings.op.name, np.dtype(dtype))


def pricing(model: CostModel, settings: Settings, dtype: Any) -> CostModel:
    """The model a call's plans of ``dtype`` values are chosen and predicted
    with: under ``deterministic=True`` on an op and dtype the reference tree
    orders (:func:`~flowreduce.reproducible.tree_ordered`: floats' sums,
    means...), every transfer weighed by the partial sums it carries
    (:meth:`CostModel.carrying_partials`); else ``model`` (integers, min,
    max carry one value, as by default)."""
    if ordered(settings, dtype):
        return model.carrying_partials()
    return model


def choose_plan(p: int, nbytes: int, levels: Sequence[Sequence[Sequence[int]]], model: CostModel, settings: Settings,
                wire: SparseCall | BlockCall | None = None, aggregators: int = 0, direct: bool = False,
                lowered: Lowered = as_planned) -> Plan:
    """The plan for ``p`` ranks of ``nbytes`` each, judged by ``model``, the
    ranks grouped by host (and coarser levels) as in ``levels``: ``auto``
    chooses among all algorithms (among the sparse ones for scipy.sparse
    inputs, ``wire``; ``direct`` only when the call can lower it: its
    inputs are arrays in memory on known workers); a named one is tuned in
    what the call leaves open (chunks; hierarchical's groups, inner and
    outer). Block-sparse calls (``wire``) have one plan, over
    ``aggregators`` aggregating workers. Under ``deterministic=True``,
    ``model`` is the call's :func:`pricing`. ``lowered``: how the route
    that will run each variant of a named algorithm changes its card
    (:func:`flowreduce.schedule.routes.cards`; default: the plan's own,
    as the Dask graph and the engine run it)."""
    chunks = settings.chunks_for(nbytes)
    options = dict(settings.options)
    with raised_as(OptionError):
        if isinstance(wire, BlockCall):
            blocks = make_plan("block-sparse", p, chunks=chunks or 1, aggregators=aggregators, block_size=wire.block)
            return replace(cast(SparsePlan, blocks), value_bytes=wire.dtype.itemsize, codec=wire.codec)
        if isinstance(wire, SparseCall):
            fields = wire.plan_fields()
            if settings.algorithm == "auto":
                chosen = choose_sparse(p, wire.info.size, fields["value_bytes"], wire.info.density, model=model,
                                       delta=wire.delta, codec=wire.codec)
                return replace(chosen, chunks=chunks or 1)
            named = make_plan(settings.algorithm, p, chunks=chunks or 1, **wire.planner)
            return replace(cast(SparsePlan, named), **fields)  # a sparse algorithm's name plans a SparsePlan
        if settings.algorithm == "auto":
            if options:
                raise OptionError(f"options {sorted(options)} need a named algorithm, not 'auto'")
            return choose(p, nbytes, model=model, chunks=chunks, groups=levels[0], direct=direct)
        if settings.algorithm == "hierarchical" and len(levels) > 1 and not {"groups", "group_size", "levels"} & set(options):
            options["levels"] = levels  # tune() defaults the one-level groups to the hosts itself
        # each variant priced as its route runs it (hierarchical with shm-direct inside: fused, over segments)
        return tune(settings.algorithm, p, nbytes, model=model, chunks=chunks, hosts=levels[0], lowered=lowered,
                    **options)


def call_site(workers: Sequence[str], places: Mapping[str, hosts.Place], levels: list[list[list[int]]],
              model: CostModel, nbytes: int, settings: Settings, *, ordered: bool = False,
              lowering: routes.Lowering | None = None, engines: routes.Engines | None = None) -> routes.Site:
    """Where a dense call's plans run (:class:`~flowreduce.schedule.routes.Site`): the ranks' workers and
    their memory domains under the call's ``transport``, their hosts, the model, the bytes."""
    domains = _transport.memory_domains(list(workers), places, settings.transport)
    return routes.Site(tuple(workers), tuple(domains), levels, model, nbytes, ordered, lowering, engines)


def dense_candidates(site: routes.Site, settings: Settings) -> list[Plan]:
    """The plan search of a dense call whose inputs are arrays in memory on
    the site's workers (so ``direct`` can read them): :func:`choose_plan`,
    and for ``auto`` what the routes propose besides (``shm-direct`` and
    ``direct`` over shared memory on one host, ``hierarchical`` over shared
    memory across hosts); a named ``hierarchical`` that leaves its inner
    algorithm and groups open runs ``shm-direct`` inside hosts that share
    memory. :func:`~flowreduce.schedule.routes.choose` picks among them, as
    each will be lowered. The one plan search of both paths of a dense call:
    the glance before submitting and :func:`lower`."""
    chunks = settings.chunks_for(site.nbytes)
    open_ = settings.algorithm == "auto" and chunks is None
    if settings.op.exact and open_:  # deterministic="exact": only these fold exactly
        return routes.gathering(site)
    plan = choose_plan(len(site.workers), site.nbytes, site.levels, site.model, settings, direct=True,
                       lowered=routes.cards(site))
    if settings.algorithm == "hierarchical" and chunks in (None, 1) and routes.inside_hosts(site, dict(settings.options)):
        plan = routes.shm_hierarchical_plan(site, **settings.options)
    return [plan] + (routes.proposals(site) if open_ else [])


@dataclass(frozen=True)
class Job:
    """A call lowered and ready to submit: its tasks, where each runs, the
    keys of the results, how the result futures are arranged per rank, and
    the call's records."""

    tasks: Mapping[Hashable, Any]
    placement: Mapping[Hashable, str]
    keys: list[Hashable]
    token: str
    arrange: Callable[[list[Future]], list[Any]]
    calls: tuple[CallRecord, ...]
    whole: PytreeRecord | None = None
    priority: int = 0
    summary: tuple[Any, ...] = ()  # what the log says of it: a format and its arguments
    hold: bool = False  # the tasks read inputs they do not depend on: the guard keeps them until the call is done


def lower(client: Client, ranks: Ranks, settings: Settings, may_p2p: bool = False) -> Job:
    """Choose the plans and lower them to one graph for the whole call;
    ``may_p2p`` (``method="auto"``): the p2p engine's routes are candidates
    too, taken where the cost model prices them below the task graph's.
    A dense call's route is :func:`~flowreduce.schedule.routes.choose`'s."""
    asked = settings
    workers = list(ranks.workers)
    p = len(workers)
    model = model_for(settings.model, hosts.shared_cores(workers, ranks.places))
    if settings.op.exact:
        model = model.folding_exactly()
    held = ranks.held
    if isinstance(held, Layout):
        levels = hosts.rank_levels(client, workers, ranks.places, settings.topology)
        return _lower_tensors(ranks, held, levels, model, settings)
    inputs = [fs[0] for fs in ranks.futures]
    keys = tuple(f.key for f in inputs)
    recorded = "exact" if settings.op.exact else settings.deterministic

    def job(graph: Graph, plan: Plan, nbytes: int, shape: tuple[int, ...], dtype: str) -> Job:
        record = CallRecord(graph.token, plan, nbytes, model.predict(plan, nbytes), tuple(workers), tuple(shape),
                            dtype, keys, deterministic=recorded)
        summary = ("allreduce %s: %d ranks, %d bytes each, %d tasks", plan, p, nbytes, len(graph.tasks))
        return Job(graph.tasks, graph.placement, list(graph.outputs), graph.token, list, (record,), summary=summary)

    if isinstance(held, Unseen):  # glance() chose direct's peer reads, whose tasks check the inputs
        assert ranks.search is not None
        lowering = routes.Lowering(tuple(inputs), keys, 0, (), None, settings.op,
                                   deterministic=settings.deterministic, check=ranks.check, recorded=recorded)
        return routed_job(replace(ranks.search.site, lowering=lowering), ranks.search.choice)

    if isinstance(held, SparseInputs):
        if settings.chunks is None and settings.chunk_bytes is not None:
            raise OptionError("chunk_bytes applies to dense inputs; pass chunks= for sparse ones")
        with raised_as(OptionError):
            sparse = sparse_call(held, op=settings.op, algorithm=settings.algorithm, options=settings.options)
        plan = choose_plan(p, held.size * np.dtype(held.dtype).itemsize, [], model, settings, sparse)
        low = lower_sparse(cast(SparsePlan, plan), inputs, workers, sparse, in_place=TASKS_REDUCE_INTO_RECEIVED)
        return job(low.graph, low.plan, low.nbytes, low.shape, low.dtype.str)
    shape, dtype = held.shape, np.dtype(held.dtype)
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    if settings.algorithm == "block-sparse":
        options = dict(settings.options)
        aggregators = _aggregators(client, options.pop("aggregators", None))
        with raised_as(OptionError):
            blocks = block_call(shape=shape, dtype=dtype, op=settings.op, options=options)
        plan = choose_plan(p, nbytes, [], model, settings, blocks, aggregators=len(aggregators))
        low = lower_blocks(cast(SparsePlan, plan), inputs, workers, blocks, in_place=TASKS_REDUCE_INTO_RECEIVED,
                           aggregators=aggregators)
        return job(low.graph, low.plan, low.nbytes, low.shape, low.dtype.str)
    model = pricing(model, settings, dtype)  # the plan's choice, the route's and the record's prediction
    levels = hosts.rank_levels(client, workers, ranks.places, settings.topology)
    if settings.algorithm == routes.SHM_DIRECT:  # its groups: the ranks of each worker; one chunk unless asked
        settings = replace(settings, options=routes.shm_direct_options(dict(settings.options), workers),
                           chunks=settings.chunks_for(nbytes) or 1)
    lowering = routes.Lowering(tuple(inputs), keys, size, tuple(shape), dtype, settings.op,
                               settings.op.accumulator(dtype), TASKS_REDUCE_INTO_RECEIVED, settings.deterministic,
                               ranks.check, recorded)
    engines, p2p = p2p_candidates(client, ranks, asked) if may_p2p and p2p_refusal(ranks, asked) is None \
        else (None, [])
    site = call_site(workers, ranks.places, levels, model, nbytes, settings, ordered=ordered(settings, dtype),
                     lowering=lowering, engines=engines)
    searched = ranks.search  # the glance's search, re-priced here (with the engine's candidates), not made again
    tasks = searched.plans if searched is not None and searched.made_for(site) else dense_candidates(site, settings)
    choice = routes.choose(site, tasks, p2p + routes.proposals(site, routes.P2P))
    if settings.op.exact and not routes.gathers(choice):
        raise _Ungathered(choice.plan.algorithm)
    return routed_job(site, choice)


def routed_job(site: routes.Site, choice: routes.Choice) -> Job:
    """The job of a dense call's chosen plan on its route (:func:`~flowreduce.schedule.routes.choose`):
    the route's graph, and the record of what it runs and the route's price of it."""
    low = site.built()
    lowered = choice.lower(site)
    graph, plan = lowered.graph, choice.plan
    dtype = low.dtype.str if low.dtype is not None else ""
    record = CallRecord(graph.token, plan, site.nbytes, choice.price, site.workers, low.shape, dtype, low.input_keys,
                        lowered.how, lowered.links, method=choice.route.method, deterministic=lowered.deterministic,
                        route=choice.route.name)
    summary = ("allreduce %s on %s: %d ranks, %d bytes each, %d tasks", plan, choice.route.name, len(site.workers),
               site.nbytes, len(graph.tasks))
    return Job(graph.tasks, graph.placement, list(graph.outputs), graph.token, list, (record,), summary=summary,
               hold=lowered.hold)


class _Ungathered(Exception):
    """The plan chosen for an exact call does not bring every rank's values to one place."""


def _exact_fold_job(client: Client, ranks: Ranks, settings: Settings) -> Job | None:
    """``deterministic="exact"`` for one numpy float array per rank on a plan
    that gathers every rank's values where they are reduced (:func:`~flowreduce.schedule.routes.gathers`;
    what ``auto`` picks among :func:`~flowreduce.schedule.routes.gathering`): the
    ordered lowering, folding the values with the exact sum
    (:func:`flowreduce.reproducible.exact_fold`) instead of the reference
    tree, at the default's bytes. None for other plans and inputs, which
    take the codec's all-reduces (:mod:`flowreduce.schedule.reproducible`).
    Both give the same bits."""
    held = ranks.held
    if not isinstance(held, ArrayMeta) or held.native is not None or not ranks.outer.is_leaf:
        return None
    if len(ranks.workers) > MAX_RANKS:
        return None
    try:
        return lower(client, ranks, replace(settings, deterministic=True, op=settings.op.exactly()))
    except _Ungathered:
        return None


def _lower_tensors(ranks: Ranks, layout: Layout, levels: list[list[list[int]]], model: CostModel,
                   settings: Settings) -> Job:
    """Buckets of the tensors (:mod:`flowreduce.fusion`), a plan per bucket,
    one graph for them all (:mod:`flowreduce.lower.buckets`)."""
    workers = list(ranks.workers)
    p = len(workers)
    buckets = make_buckets([t.spec for t in layout.tensors], settings.bucket_bytes)
    models = [pricing(model, settings, b.dtype) for b in buckets]
    plans = [choose_plan(p, b.nbytes, levels, m, settings) for b, m in zip(buckets, models)]
    g = build_pytree_graph(layout, buckets, plans, [list(fs) for fs in ranks.futures], workers, op=settings.op,
                         check=ranks.check, in_place=TASKS_REDUCE_INTO_RECEIVED, ordered=settings.deterministic)
    calls = []
    for bg, plan, m in zip(g.buckets, plans, models):
        b = bg.bucket
        shape = (b.size,) if b.fused else layout.tensors[b.tensors[0]].spec.shape
        calls.append(CallRecord(bg.token, plan, b.nbytes, m.predict(plan, b.nbytes, levels[0]), tuple(workers),
                                tuple(shape), b.dtype, tuple(bg.inputs), deterministic=settings.deterministic))
    whole = None
    if not layout.single_array:
        whole = PytreeRecord.of(layout, buckets, tuple(calls), settings.bucket_bytes, tuple(workers))
    n = len(layout.inner)

    def arrange(futures: list[Future]) -> list[Any]:
        return [unflatten(layout.outer, futures[r * n:(r + 1) * n]) for r in range(p)]

    # priority: a rank's single thread runs a bucket's pack and reductions as soon as they are
    # ready, ahead of the backward tasks submitted before (dask favours older graphs otherwise),
    # so the reduction of the last layers' bucket overlaps the first layers' backward pass
    summary = ("allreduce of %d tensors in %d buckets: %d ranks, %d bytes each, %d tasks", len(layout.tensors),
               len(buckets), p, sum(b.nbytes for b in buckets), len(g.tasks))
    return Job(g.tasks, g.placement, [k for row in g.outputs for k in row], g.buckets[0].token, arrange,
               tuple(calls), whole, priority=1, summary=summary)


METHODS = ("auto", "tasks", "p2p")
#: Whether a task may reduce into a value it received from another worker. It may not: Dask keeps the
#: received copy as a replica of its key, and after a worker loss a task of the next attempt (or a peer)
#: may read that replica again, already summed into: one rank counted twice (docs/failures.md). The
#: engine reduces into its own receive buffers, which no key names (Ranks.in_place).
TASKS_REDUCE_INTO_RECEIVED = False
#: Plan options that name ranks (a plan over workers cannot take them when ranks share workers).
RANK_OPTIONS = frozenset({"groups", "group_size", "levels", "workers", "root"})


def _method(method: str | None, like: Any, algorithm: str, exact: bool) -> str:
    """How the call runs: ``method``, else the dask config key
    ``flowreduce.method``. ``"p2p"`` refuses what the engine does not take
    yet; ``"auto"`` is ``"tasks"`` for those calls (and the cost model
    chooses for the others, in :func:`lower`)."""
    method = config.get("method") if method is None else method
    if method not in METHODS:
        raise OptionError(f"unknown method {method!r}; valid: {', '.join(map(repr, METHODS))}")
    why = ("like= templates" if like is not None else f"the sparse algorithm {algorithm!r}"
           if algorithm in SPARSE_ALGORITHMS else "deterministic='exact'" if exact else None)
    if why is not None and method == "p2p":
        raise OptionError(f"method='p2p' does not take {why} yet; use method='tasks'")
    return "tasks" if why is not None else method


def _by_name(op: Op) -> bool:
    """Whether ``op`` is one the engine runs: an in-place op given by name or numpy ufunc (it travels by name)."""
    return op.in_place and resolve_op(op.name).func is op.func


def p2p_refusal(ranks: Ranks, settings: Settings, converts: bool = False) -> str | None:
    """Why the p2p engine cannot run this call (yet), or None. ``converts``:
    its tasks convert other libraries' arrays (a call placed on arrival)."""
    held = ranks.held
    if not isinstance(held, ArrayMeta) or (held.native is not None and not converts) or not ranks.outer.is_leaf:
        what = ("sparse" if isinstance(held, SparseInputs) else "torch" if isinstance(held, ArrayMeta)
                and held.native is not None else "pytree" if isinstance(held, (ArrayMeta, Layout)) else "unseen")
        return f"method='p2p' takes one dense numpy array per rank; {what} inputs are not there yet"
    if not _by_name(settings.op):
        return f"method='p2p' takes ops by name or numpy ufunc, not the callable {settings.op.name!r} yet"
    if (settings.deterministic and tree_ordered(settings.op.name, np.dtype(held.dtype))  # ints, min, max: exact
            and len(set(ranks.workers)) < len(ranks.workers)):
        return ("method='p2p' combines ranks sharing a worker first, in rank order, which is not deterministic=True's "
                "tree order")
    named = sorted(RANK_OPTIONS & set(settings.options))
    if named and len(set(ranks.workers)) < len(ranks.workers):
        return (f"method='p2p' plans over the ranks' workers, and options {named} name ranks, several of which "
                "share a worker")
    return None


def _converted_on_arrival(ranks: Ranks, settings: Settings) -> bool:
    """Whether ``method="p2p"`` takes these ranks only as a call placed on arrival does: torch or
    array API arrays (converted to numpy and back there), pytrees or scipy.sparse matrices (gathered
    and reduced on one worker: :class:`~flowreduce.schedule.p2p.GatherSpec`), while
    :func:`lower_p2p` takes one dense numpy array per rank."""
    held = ranks.held
    return isinstance(held, (SparseInputs, Layout)) or (
        isinstance(held, ArrayMeta) and held.native is not None and p2p_refusal(ranks, settings, converts=True) is None)


def p2p_candidates(client: Client | None, ranks: Ranks, settings: Settings) -> tuple[routes.Engines, list[Plan]]:
    """The call as the p2p engine runs it (its distinct workers, their memory domains and hosts, the
    model) and the engine's plan search: :func:`choose_plan` over the ranks' distinct workers, its
    variants ranked as the engine runs them (:meth:`~flowreduce.cost.CostModel.engine`: a message per
    step, no task). The engine's routes propose the rest once the site holds these (a host group's
    ``shm-direct``)."""
    held = cast(ArrayMeta, ranks.held)
    engines = engine_workers(list(ranks.workers))  # the plan runs over these: a worker's ranks are combined there
    model = pricing(model_for(settings.model, hosts.shared_cores(engines, ranks.places)), settings, held.dtype)
    levels = hosts.rank_levels(client, engines, ranks.places, settings.topology)
    nbytes = math.prod(held.shape) * np.dtype(held.dtype).itemsize
    domains = _transport.through_segments(_transport.memory_domains(list(engines), ranks.places, settings.transport))
    asked = settings.algorithm in ("auto", routes.SHM_DIRECT) and not settings.chunks_for(nbytes)
    found = routes.Engines(tuple(engines), domains, levels[0], model, asked, ranks.in_place, held.native)
    return found, [choose_plan(len(engines), nbytes, levels, model.engine(), settings)]


def p2p_site(client: Client | None, ranks: Ranks, settings: Settings) -> tuple[routes.Site, list[Plan]]:
    """A dense call's site when it runs on the p2p engine, and the engine's candidate plans
    (:func:`p2p_candidates`, with what the routes propose)."""
    held = cast(ArrayMeta, ranks.held)
    dtype = np.dtype(held.dtype)
    engines, plans = p2p_candidates(client, ranks, settings)
    inputs = tuple(fs[0] for fs in ranks.futures)
    lowering = routes.Lowering(inputs, tuple(f.key for f in inputs), math.prod(held.shape), tuple(held.shape), dtype,
                               settings.op)
    site = call_site(ranks.workers, ranks.places, [], engines.model, math.prod(held.shape) * dtype.itemsize,
                     settings, ordered=ordered(settings, dtype),
                     lowering=lowering, engines=engines)
    return site, plans + routes.proposals(site, routes.P2P)


def lower_p2p(client: Client, ranks: Ranks, settings: Settings) -> Job:
    """method="p2p": the engine's route the model prices lowest
    (:func:`~flowreduce.schedule.routes.choose`), run by the workers'
    engine (:mod:`flowreduce.schedule.p2p`), one array per rank."""
    why = p2p_refusal(ranks, settings)
    if why is not None:
        raise OptionError(f"{why} (use method='tasks')")
    site, plans = p2p_site(client, ranks, settings)
    return routed_job(site, routes.choose(site, p2p=plans))


def _failed_results(client: Client, outer: TreeDef, futures: Sequence[Sequence[Future]], exc: BaseException) -> list[Any]:
    """Results that fail with ``exc``, in the structure of the call's (an
    input error found before submitting comes where the errors of a call
    that checks its inputs in its tasks come: on the results)."""
    from dask.task_spec import Task

    token = new_token()
    keys = [(f"allreduce-input-error-{token}", r) for r in range(len(futures))]  # not flowreduce-: nothing ran
    graph = {k: Task(k, _raise, exc) for k in keys}
    got = client.get(graph, keys, sync=False)
    return [got[r] if outer.is_leaf else unflatten(outer, [got[r]] * len(futures[r])) for r in range(len(futures))]


def _raise(exc: BaseException) -> None:
    raise exc


#: Seconds describe() waits for a call on Dask collections to begin (nothing says it ever will: they
#: may not be computed); on futures it waits until the call began or failed.
DESCRIBE_WAIT = 60.0


def _default_client() -> Any:
    from distributed import get_client

    return get_client()


@dataclass(frozen=True)
class OnArrival:
    """The decision of a call that did not wait for its inputs, made on the
    scheduler when its last rank arrived
    (:meth:`flowreduce.schedule.p2p.P2PSchedulerPlugin._begin_if_arrived`)
    from where the ranks arrived and what they hold: the same checks (errors
    naming the ranks), the same plan choice and price as :func:`lower_p2p`."""

    settings: Settings
    token: str
    input_keys: tuple[Hashable, ...]

    def __call__(self, arrivals: Sequence[Any]) -> tuple[Any, bytes, dict[str, Any]]:
        workers = tuple(a[0] for a in arrivals)
        places = {a[0]: hosts.Place(*a[1]) for a in arrivals}
        metas = [a[2] for a in arrivals]
        if any(isinstance(m, (TreeMeta, SparseMeta)) for m in metas):  # gathered, reduced, sent back
            return self._gathered(workers, metas)
        bad = {r: m.kind for r, m in enumerate(metas) if not isinstance(m, ArrayMeta)}
        if bad:
            raise InputTypeError(
                f"this call did not wait for its inputs (they were being computed, or Dask collections), so it "
                f"runs on the p2p engine, which takes one array per rank (numpy, torch, array API); ranks "
                f"{sorted(bad)} hold {bad}. "
                "Wait for the inputs first (or pass method='tasks', which waits) to reduce these")
        held = replace(checked_array(metas, self.settings.op), native=cast(ArrayMeta, metas[0]).native)
        ranks = Ranks(LEAF, (), workers, places, held)
        why = p2p_refusal(ranks, self.settings, converts=True)
        if why is not None:
            raise OptionError(f"{why}; this call did not wait for its inputs (wait for them, or pass method='tasks')")
        site, plans = p2p_site(None, ranks, self.settings)  # no topology= here: the hosts are the arrivals' places
        choice = routes.choose(site, p2p=plans)
        record = CallRecord(self.token, choice.plan, site.nbytes, choice.price, workers, tuple(held.shape),
                            held.dtype, self.input_keys, method="p2p", route=choice.route.name)
        # on one host, each worker folds the inputs where they arrived (published), if every rank's was
        spec = _p2p.with_published(routes.engine_spec(choice.plan, site), [a[3] for a in arrivals])
        return spec, pickle.dumps(record), dashboard.record_of(record).message()


    def _gathered(self, workers: tuple[str, ...], metas: Sequence[Any]) -> tuple[Any, bytes, dict[str, Any]]:
        """Ranks holding pytrees or scipy.sparse matrices: checked as any such call's (errors naming the
        ranks and the tensor), reduced on the first rank's worker (:class:`~flowreduce.schedule.p2p.GatherSpec`)."""
        if any(isinstance(m, SparseMeta) for m in metas):
            held = common_sparse(metas)
            nbytes = held.size * np.dtype(held.dtype).itemsize
        else:
            layout = common_layout(LEAF, [[m] for m in metas], self.settings.op)
            nbytes = sum(math.prod(t.spec.shape) * np.dtype(t.spec.dtype).itemsize for t in layout.tensors)
        engines = engine_workers(workers)
        index = {w: i for i, w in enumerate(engines)}
        spec = _p2p.GatherSpec(self.settings.op.name, len(workers), engines, tuple(index[w] for w in workers))
        plan = make_plan("reduce-broadcast", len(engines))
        model = model_for(self.settings.model, None)
        record = CallRecord(self.token, plan, nbytes, model.predict(plan, nbytes), workers, (), "", self.input_keys,
                            method="p2p")
        return spec, pickle.dumps(record), dashboard.record_of(record).message()


def _on_arrival(outer: TreeDef, like: Any, settings: Settings, exact: Any, how: str) -> bool:
    """Whether a call whose inputs the client would wait for runs placed on
    their arrival instead: one dense array per rank is all the engine takes
    (the inputs' kind is not known yet), with its options decided without them."""
    return (how != "tasks" and outer.is_leaf and like is None and not exact and not settings.deterministic
            and settings.algorithm in ALGORITHMS and settings.topology is None
            and _by_name(settings.op)
            and not RANK_OPTIONS & set(settings.options))


def submit(client: Client, job: Job, ranks: Ranks | None = None, timeout: float | None = None) -> list[Any]:
    """Submit a lowered call with every task pinned to its worker, and keep its records;
    the guard watches it (``ranks``' inputs, ``timeout``: docs/failures.md). Every lowered call is
    submitted here: the extension its route needs (the engine, peer reads, shared memory, the guard)
    is installed here, once per client."""
    ensure_extension(client)
    with dask.annotate(workers=job.placement.get, allow_other_workers=False):
        futures = client.get(named_graph(job.tasks, job.token), job.keys, sync=False, priority=job.priority)
    inputs = [[f.key for f in fs] for fs in ranks.futures] if ranks is not None else []
    guard.watch(client, job.token, job.keys, inputs, timeout, hold=job.hold)
    records.remember(client, job.calls, job.whole)
    dashboard.publish(client, job.calls, group=job.token)
    logger.info(*job.summary)
    return job.arrange(futures)


def _aggregators(client: Client, option: Any) -> list[str]:
    """Workers that aggregate block-sparse packs: ``option`` as given (a list
    of addresses), none (``"ranks"``: co-located), or by default the workers
    started with the Dask resource ``aggregator`` (``--resources aggregator=1``)."""
    if option == "ranks":
        return []
    found: list[str] = client.run_on_scheduler(_resource_workers, "aggregator")
    if option is None:
        return found
    if isinstance(option, (list, tuple)) and option and all(isinstance(w, str) for w in option):
        known = set(client.run_on_scheduler(_all_workers))
        missing = [w for w in option if w not in known]
        if missing:
            raise OptionError(f"aggregators {missing} are not workers of this cluster")
        return list(option)
    raise OptionError(f"aggregators must be None (the workers with resource 'aggregator', else the ranks), "
                      f"'ranks', or a list of worker addresses; got {option!r}")


def _resource_workers(resource: str, dask_scheduler: Any = None) -> list[str]:
    return sorted(w for w, ws in dask_scheduler.workers.items() if ws.resources.get(resource, 0) > 0)


def _all_workers(dask_scheduler: Any = None) -> list[str]:
    return sorted(dask_scheduler.workers)
