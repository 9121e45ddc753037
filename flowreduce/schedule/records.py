"""One record per all-reduce call, kept for a while: what
:func:`flowreduce.describe` answers and what a trace reads
(:mod:`flowreduce.tracing.registry`). Pure Python.

A call over pytrees reduces one bucket per dense all-reduce: each bucket
has its own :class:`CallRecord` (its own key token) and the call as a whole
a :class:`PytreeRecord` holding them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from flowreduce.algorithms.ir import Plan


@dataclass(frozen=True)
class CallRecord:
    """What one all-reduce ran: its plan, bytes per rank, the cost model's
    predicted seconds, its key token, each rank's worker, the shape and
    dtype of a rank's input, and each rank's input key (no futures held)."""

    token: str
    plan: Plan
    nbytes: int
    predicted: float
    workers: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = ""
    input_keys: tuple[Hashable, ...] = ()
    transport: str = "dask"  # how links between workers moved bytes ("shared memory", ...)
    #: per pair of workers that exchanged values: (source, destination, "same worker" / "shared memory" / "dask")
    links: tuple[tuple[str, str, str], ...] = ()
    #: "tasks" (a task per plan node and chunk) or "p2p" (the plan run by a worker extension: docs/p2p.md)
    method: str = "tasks"
    #: False, or "exact": the correctly rounded sum, composed of ordinary all-reduces
    #: (docs/reproducibility.md); ``plan`` is then the plan of the limbs' all-reduce
    deterministic: bool | str = False
    #: the route the plan ran on (:data:`flowreduce.schedule.routes.ROUTES`: ``"dask-graph"``,
    #: ``"shm-direct"``, ``"p2p-engine"``...); empty for calls lowered outside the routes (pytrees, sparse)
    route: str = ""

    def link_transports(self) -> dict[tuple[str, str], str]:
        """``(source worker, destination worker) -> transport`` for every
        pair of workers the plan moved values between."""
        return {(a, b): how for a, b, how in self.links}

    @property
    def algorithm(self) -> str:
        return self.plan.algorithm

    @property
    def bytes_on_wire(self) -> float:
        """Bytes the plan moves between ranks, all messages (for sparse plans
        the expected bytes at the inputs' density; a trace measures them:
        ``flowreduce.tracing.summarize(tr).bytes_moved``)."""
        return float(self.plan.cost(self.nbytes).bytes_on_wire)


@dataclass(frozen=True)
class PytreeRecord:
    """What one ``allreduce`` call over pytrees ran: one dense all-reduce
    per bucket of fused tensors (:mod:`flowreduce.fusion`).

    ``tensors`` are ``(path, shape, dtype)`` in registration order,
    ``bucket_of[i]`` the bucket of tensor ``i``. ``plan`` is the first
    bucket's (the last layers'); ``nbytes`` and ``predicted`` add up the
    buckets (as if they ran one after another)."""

    buckets: tuple[CallRecord, ...]
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    bucket_of: tuple[int, ...]
    bucket_bytes: int | None
    workers: tuple[str, ...]

    @classmethod
    def of(cls, layout: Any, buckets: Any, calls: tuple[CallRecord, ...], bucket_bytes: int | None,
           workers: tuple[str, ...]) -> PytreeRecord:
        """The record of the tensors of ``layout`` (a :class:`~flowreduce.fusion.Layout`) reduced in
        ``buckets`` (:class:`~flowreduce.fusion.Bucket`), bucket ``b`` by the call ``calls[b]``."""
        bucket_of = [0] * len(layout.tensors)
        for b, bucket in enumerate(buckets):
            for t in bucket.tensors:
                bucket_of[t] = b
        return cls(calls, tuple((t.path, t.spec.shape, t.spec.dtype) for t in layout.tensors), tuple(bucket_of),
                   bucket_bytes, workers)

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

    @property
    def bytes_on_wire(self) -> float:
        return sum(b.bytes_on_wire for b in self.buckets)


Record = CallRecord | PytreeRecord

#: How many calls are kept: a training loop makes one (or one per bucket) per step.
MAX_CALLS = 1024


@dataclass(frozen=True)
class _Entry:
    call: CallRecord
    whole: PytreeRecord | None  # the pytree call a bucket belongs to


# token -> entry, oldest first: one store, so describe() and the tracer forget a call together
_RECORDS: OrderedDict[str, _Entry] = OrderedDict()


#: Told of every call as it is submitted, with the client: what open traces
#: hear calls by (:mod:`flowreduce.tracing.registry` adds itself on import, so
#: this layer imports nothing above it).
_LISTENERS: list[Callable[[Any, CallRecord], None]] = []


def listen(listener: Callable[[Any, CallRecord], None]) -> None:
    """Call ``listener(client, record)`` for every dense all-reduce submitted from now on."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def remember(client: Any, calls: tuple[CallRecord, ...], whole: PytreeRecord | None = None) -> None:
    """Keep the records of one call submitted through ``client``: its dense
    all-reduces (one, or one per bucket) and, for a pytree call, the whole;
    and tell the listeners."""
    for call in calls:
        _RECORDS[call.token] = _Entry(call, whole)
    while len(_RECORDS) > MAX_CALLS:
        _RECORDS.popitem(last=False)
    for listener in _LISTENERS:
        for call in calls:
            listener(client, call)


# token -> what describe() answers for keys carrying it, when that is not the call of that token
# itself: a deterministic="exact" call is several ordinary all-reduces, described as one
_DESCRIBED: OrderedDict[str, Record] = OrderedDict()


def describe_as(tokens: tuple[str, ...], record: Record) -> None:
    """Make :func:`find` answer ``record`` for keys carrying any of ``tokens``
    (the tracer still sees each ordinary all-reduce by its own record)."""
    for token in tokens:
        _DESCRIBED[token] = record
    while len(_DESCRIBED) > MAX_CALLS:
        _DESCRIBED.popitem(last=False)


def find(token: str) -> Record | None:
    """The record of the call whose keys carry ``token``: the whole pytree
    call for a bucket of one, else the call; None if forgotten or unknown."""
    if token in _DESCRIBED:
        return _DESCRIBED[token]
    entry = _RECORDS.get(token)
    if entry is None:
        return None
    return entry.whole or entry.call


def find_call(token: str) -> CallRecord | None:
    """The one dense all-reduce (a bucket of a pytree call included) whose keys carry ``token``."""
    entry = _RECORDS.get(token)
    return entry.call if entry is not None else None
