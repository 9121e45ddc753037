"""The trainer's gradient all-reduce over shared memory, when every rank's
worker shares one host: the ``shm-direct`` collective
(:mod:`flowreduce.lower.shm_direct`) lowered into the trainer's own step
graph, so that a step costs at most two dependent task levels:

1. per rank, one ``torch-step`` task (:func:`flowreduce.torch.replica.step_direct`):
   the previous step's averaged gradients copied out of the peers' slices
   into ``.grad`` and the optimizer step, then forward/backward, then each
   bucket's gradients written into a pooled shared-memory segment
   (:func:`write`);
2. per worker and bucket, one reduce task (:func:`reduce_bucket`): its slice
   of the bucket summed over every worker's segment, read in place, and
   divided by the rank count, written back into its own segment.

The next step's task reads every worker's finished slice (:func:`average`):
the gather of ``shm-direct``'s third level is fused into the update. For a
small bucket (:data:`READ_ALL_BYTES`) the reduce level goes too: each
rank's next step reads every peer's whole segment and averages it itself,
so a model whose buckets are all small costs one task level per step.
Dask edges carry handles of a few hundred bytes; the scheduler orders
everything (a segment is given back to the pool once no value refers to it).

Buckets follow DDP (:func:`flowreduce.fusion.make_buckets`: last layers
first, ``bucket_bytes`` each); the flags saying which parameters a rank used
travel in the first bucket (one reduction per step for both).

With ``deterministic=True`` (:attr:`Flat.ordered`) every sum over ranks,
on every route here (averaged in the step tasks, by a reduce level, or in
fused steps' mailboxes), is the reference tree's
(:func:`flowreduce.kernels.dense.tree_fold`), divided by the rank count as
``flowreduce.reference_reduce(..., "mean", order="tree")`` does; otherwise
ranks are added one after the other (the reduce level: its own worker's
segment first).

With ``deterministic="exact"`` (:attr:`Flat.exact`) the same routes take
the same rank-ordered reads, but each sum over ranks is the exact sum
rounded once to the dtype (``MEAN.exactly()``: :func:`tree_fold` of an
exact op, :func:`flowreduce.reproducible.exact_fold`), then divided by the
rank count in the dtype: ``reference_reduce(..., "mean")`` of
``deterministic="exact"``, whatever the rank count and grouping (float32
and float64 gradients only: the trainer refuses "exact" for others).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flowreduce.fusion import Bucket, make_buckets
from flowreduce.kernels import shm as shm_kernels
from flowreduce.kernels.dense import tree_fold
from flowreduce.lower.graph import chunk_bounds
from flowreduce.ops import Op, resolve_op
from flowreduce.pytree import TensorSpec
from flowreduce.shm import pool as shm_pool

#: What the trainer computes: DDP's average of the ranks' gradients.
MEAN: Op = resolve_op("mean")
#: ``deterministic="exact"``'s average: the correctly rounded sum over ranks, divided by their count.
EXACT_MEAN: Op = MEAN.exactly()
#: A bucket costs no level of its own (every rank reads every peer's whole
#: bucket and averages it itself, in rank order, so all get the same bits)
#: while the bytes a rank reads beyond the reduce-scatter's, about
#: (ranks - 1) x the bucket, cost less than the task level they save: Dask's all-to-all
#: level is ~15 ms on a loaded 2-core host (benchmarks/results/dask-floor.txt),
#: in which memory moves some 16 MiB. Above it, two levels (reduce-scatter,
#: then the gather fused into the next step), each rank reading ~2x its gradients.
READ_ALL_BYTES = 16 * 2**20
#: The parameters' dtypes the shared-memory step reduces (one numpy dtype for every tensor).
DTYPES = (torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Flat:
    """Where each gradient (and, as the last tensor, the ``used`` flags)
    sits in the flat bucket vectors, and each worker's slice of a bucket."""

    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    dtype: str
    workers: int
    share: bool  # through shared memory (False: one process, values handed over by reference)
    #: per bucket, 1: every rank averages it itself; 2: one reduce task per worker, then a gather
    levels: tuple[int, ...]
    #: ``deterministic=True``: every element the reference tree's sum over ranks divided by their count
    #: (:func:`flowreduce.kernels.dense.tree_fold`, the bits of ``reference_reduce(..., "mean", order="tree")``)
    ordered: bool = False
    #: ``deterministic="exact"`` (implies :attr:`ordered`'s rank-ordered reads): every element the exact sum
    #: over ranks rounded once, divided by the rank count (:data:`EXACT_MEAN`)
    exact: bool = False

    @classmethod
    def of(cls, specs: Sequence[TensorSpec], bucket_bytes: int | None, workers: int, share: bool,
           ordered: bool = False, exact: bool = False) -> Flat:
        buckets = tuple(make_buckets(specs, bucket_bytes))
        return cls(tuple(specs), buckets, specs[0].dtype, workers, share,
                   tuple(1 if (workers - 1) * b.nbytes <= READ_ALL_BYTES else 2 for b in buckets),
                   ordered or exact, exact)

    @property
    def op(self) -> Op:
        """What a rank-ordered sum over ranks folds with: :data:`EXACT_MEAN` or :data:`MEAN`."""
        return EXACT_MEAN if self.exact else MEAN

    @property
    def scattered(self) -> list[int]:
        """The buckets with a reduce level."""
        return [b for b, n in enumerate(self.levels) if n == 2]

    def bounds(self, bucket: int) -> list[tuple[int, int]]:
        return chunk_bounds(self.buckets[bucket].size, self.workers)


def supports(specs: Sequence[TensorSpec]) -> bool:
    """Whether gradients of these specs can share one flat dtype."""
    return bool(specs) and len({s.dtype for s in specs}) == 1 and \
        np.dtype(specs[0].dtype) in {np.dtype(torch.empty(0, dtype=d).numpy().dtype) for d in DTYPES}


def _lease(nbytes: int, owner: str) -> shm_kernels.Lease | None:
    pool = shm_pool.pool()
    if nbytes < pool.min_bytes:  # cheaper sent by Dask than leased, mapped and read by every peer
        return None
    try:
        return shm_kernels.Lease(pool, pool.lease(nbytes, owner))
    except shm_pool.Unavailable:  # logged once by the pool: Dask's comm carries the data
        return None


def write(flat: Flat, grads: Sequence[torch.Tensor | None], tokens: Sequence[str]) -> list:
    """Each bucket's gradients (zeros for a None: a parameter this rank did
    not use) copied into a leased segment (a private array when no segment
    can be had). ``grads`` holds the ``used`` flags last."""
    dtype = np.dtype(flat.dtype)
    out: list[Any] = []
    for bucket, token in zip(flat.buckets, tokens):
        # the lease's owner: the bucket's reduce tasks (the worker plugin gives it back once they are gone)
        owner = token if flat.levels[len(out)] == 2 else ""
        lease = _lease(bucket.size * dtype.itemsize, owner) if flat.share else None
        dst = lease.segment.view(dtype, bucket.size) if lease is not None else np.empty(bucket.size, dtype)
        _pack(flat, bucket, grads, dst)
        out.append(shm_kernels.Block(lease, dtype, bucket.size) if lease is not None else dst)
    return out


def _pack(flat: Flat, bucket: Bucket, grads: Sequence[torch.Tensor | None], dst: np.ndarray) -> None:
    """``bucket``'s gradients copied into the flat vector ``dst`` (zeros for a parameter this rank did not use)."""
    vec = torch.from_numpy(dst)
    for i, at in zip(bucket.tensors, bucket.offsets):
        g, n = grads[i], flat.specs[i].size
        if g is None:
            vec[at:at + n].zero_()
        else:
            vec[at:at + n].copy_(g.reshape(-1))


def _unpack(flat: Flat, bucket: Bucket, vec: np.ndarray, out: list) -> None:
    """``out[i]``, for each tensor ``i`` of ``bucket``: its view of the averaged flat vector ``vec``."""
    t = torch.from_numpy(vec)
    for i, at in zip(bucket.tensors, bucket.offsets):
        spec = flat.specs[i]
        out[i] = t[at:at + spec.size].view(spec.shape)


def reduce_bucket(ranks: int, bucket: int, lo: int, hi: int, written: Sequence[tuple], key: str = "") -> Any:
    """Elements [lo, hi) of ``bucket``: the mean over every worker's segment
    (``written``: each worker's :func:`write`, this worker's first)."""
    return shm_kernels.reduce_slice(MEAN, ranks, lo, hi, [w[bucket] for w in written], key)


def reduce_bucket_ordered(ranks: int, bucket: int, lo: int, hi: int, written: Sequence[tuple], own: int,
                          key: str = "", exact: bool = False) -> Any:
    """:func:`reduce_bucket` with ``deterministic=True`` (:attr:`Flat.ordered`):
    ``written`` in rank order, ``own`` this worker's rank; elements [lo, hi)
    summed in the reference tree's order, then divided by the rank count
    (:func:`flowreduce.kernels.shm.reduce_slice_ordered`). ``exact``
    (:attr:`Flat.exact`): the correctly rounded sum instead of the tree's."""
    op = EXACT_MEAN if exact else MEAN
    return shm_kernels.reduce_slice_ordered(op, ranks, lo, hi, [w[bucket] for w in written], own, key)


def _whole(value: Any) -> tuple[np.ndarray, Any]:
    """A worker's bucket: a Block here, a peer's read in place (and what to
    check once read), or a plain array (sent by Dask)."""
    if isinstance(value, shm_kernels.Block):
        return value.array, None
    if isinstance(value, shm_kernels.Remote):
        seg = value.handle.segment()
        return value.handle.arrays(seg)[0], (value.handle, seg)
    return np.asarray(value), None


def average(flat: Flat, written: Sequence[Sequence[Any]], slices: Sequence[Sequence[Any]],
            key: str = "") -> list[torch.Tensor]:
    """Every tensor (the ``used`` flags last) as a view of a fresh vector
    per bucket: a one-level bucket averaged here over every rank's
    :func:`write` (``written``, in rank order: every rank adds in the same
    order, so every rank gets the same bits; the reference tree's with
    :attr:`Flat.ordered`, the correctly rounded sum with :attr:`Flat.exact`); a two-level one copied from
    every worker's reduced slice (``slices[j]``: the ``j``-th of
    :attr:`Flat.scattered`, in worker order)."""
    out: list[Any] = [None] * len(flat.specs)
    scattered = {b: j for j, b in enumerate(flat.scattered)}
    for b, bucket in enumerate(flat.buckets):
        if b in scattered:
            vec = shm_kernels.gather(MEAN, len(written), (bucket.size,), flat.dtype, slices[scattered[b]], key)
        else:
            vec = _mean_of([w[b] for w in written], flat)
        _unpack(flat, bucket, vec, out)
    return out


def _mean_of(values: Sequence[Any], flat: Flat) -> np.ndarray:
    """The ranks' buckets (``values``, in rank order) averaged as ``flat`` says: one after the
    other, in the reference tree's order (:attr:`Flat.ordered`) or exactly (:attr:`Flat.exact`)."""
    if flat.ordered:
        return _tree_mean_of(values, flat.op)
    acc: np.ndarray | None = None
    checks = []
    for value in values:
        x, check = _whole(value)
        if acc is None:
            acc = x.copy()
        else:
            MEAN.combine(acc, x, out=acc)
        if check is not None:
            checks.append(check)
    for handle, seg in checks:
        handle.check(seg)
    assert acc is not None
    return MEAN.finish(acc, len(values), owned=True)


def _tree_mean_of(values: Sequence[Any], op: Op = MEAN) -> np.ndarray:
    """The ranks' buckets (``values``, in rank order) summed in the
    reference tree's order (``deterministic=True``; exactly, rounded once,
    with :data:`EXACT_MEAN`) and divided by their count:
    :func:`flowreduce.kernels.dense.tree_fold` into a fresh vector."""
    reads = [_whole(value) for value in values]
    first = reads[0][0]
    out = tree_fold(op, len(values), [x for x, _ in reads], np.empty(first.size, first.dtype))
    for _, check in reads:
        if check is not None:
            check[0].check(check[1])
    return out


# -- fused steps: several optimizer steps in one task per rank ---------------------------------
#: Bytes before a mailbox's two slots: each slot's step stamp (int64), padded to a cache line.
STAMPS = 64
#: The stamp a rank's failing fused task leaves in both its slots: its peers stop waiting and fail too.
FAILED = -2
#: Seconds a fused step waits for its peers when ``flowreduce.timeout`` is not set.
WAIT_SECONDS = 600.0
#: Machines whose stores reach other cores in program order (x86's total store order): a
#: stamp written after the data is never seen before it, with no fence (Python has none).
ORDERED_STORES = ("x86_64", "AMD64", "i386", "i686")
#: Seconds between checks, while waiting for peers, that their workers are alive.
ALIVE_EVERY = 1.0
#: Seconds a fused task waits for its peers before it leaves its worker's thread
#: slot (``distributed.secede``): a peer may be queued behind a task that needs this worker.
SECEDE_AFTER = 0.05


class PeerFailed(RuntimeError):
    """A fused step's peer rank failed first: the other ranks stop with this; the trainer raises the peer's own error."""


@dataclass
class Waiting:
    """A fused task's state across its steps: whether it left its worker's slot."""

    seceded: bool = False

    def long_wait(self) -> None:
        """Leave the worker's thread slot, once (a task not run by a worker thread has none)."""
        if not self.seceded:
            self.seceded = True
            from distributed import secede

            try:
                secede()
            except (KeyError, ValueError, AttributeError):  # not in a worker's task thread
                pass


def mailbox_bytes(flat: Flat) -> int:
    """A rank's mailbox: two stamps, then two slots of every bucket's gradients."""
    return STAMPS + 2 * sum(b.size for b in flat.buckets) * np.dtype(flat.dtype).itemsize


def mailbox(flat: Flat, owner: str = "") -> shm_kernels.Block | None:
    """A rank's mailbox for fused steps (:func:`exchange`), leased from its
    worker's pool with both stamps cleared; None when no segment can be had,
    or the machine may reorder stores (:data:`ORDERED_STORES`)."""
    import platform

    if platform.machine() not in ORDERED_STORES:
        return None
    pool = shm_pool.pool()
    nbytes = mailbox_bytes(flat)
    try:
        lease = shm_kernels.Lease(pool, pool.lease(nbytes, owner))
    except shm_pool.Unavailable:  # logged once by the pool
        return None
    block = shm_kernels.Block(lease, np.uint8, nbytes)
    block.array[:STAMPS].view(np.int64)[:] = -1
    return block


class Mailbox:
    """Views of a rank's mailbox: its own (a Block, written) or a peer's (read in place)."""

    def fail(self) -> None:
        """Stamp both slots :data:`FAILED` (this rank's task is failing)."""
        self.stamps[:2] = FAILED

    def check(self) -> None:
        """Raise if the segment was given back and leased again (e.g. its value was spilled)."""
        if self.segment.stamped() != self.generation:
            raise RuntimeError(f"mailbox segment {self.segment.name} was leased again during fused steps "
                               "(was the trainer's mailbox spilled or released?)")

    def __init__(self, value: Any, flat: Flat, own: bool = False):
        if own and not isinstance(value, shm_kernels.Block):  # a handle: its lease is on another worker
            raise RuntimeError("this rank's mailbox is not in its worker's memory any more (was it moved "
                               "or released?); its segment cannot be written here")
        if isinstance(value, shm_kernels.Block):
            buf, self.segment, self.generation = value.array, value.lease.segment, value.lease.generation
        else:
            self.segment = value.handle.segment()
            buf, self.generation = value.handle.arrays(self.segment)[0], value.handle.generation
        dtype = np.dtype(flat.dtype)
        size = sum(b.size for b in flat.buckets)
        self.stamps = buf[:STAMPS].view(np.int64)
        self.slots = [buf[STAMPS + i * size * dtype.itemsize:STAMPS + (i + 1) * size * dtype.itemsize].view(dtype)
                      for i in (0, 1)]
        starts = np.cumsum([0] + [b.size for b in flat.buckets])
        self.buckets = [[slot[lo:hi] for lo, hi in zip(starts[:-1], starts[1:])] for slot in self.slots]


def exchange(flat: Flat, boxes: Sequence[Mailbox], rank: int, stamp: int, grads: Sequence[torch.Tensor | None],
             timeout: float, waiting: Waiting | None = None) -> list[torch.Tensor]:
    """One step's all-reduce inside a fused task: this rank's gradients (the
    ``used`` flags last) written into slot ``stamp % 2`` of its mailbox and
    stamped, then, once every peer's slot carries the same stamp, every
    bucket averaged over all ranks in rank order, or the reference tree's
    with :attr:`Flat.ordered`, or exactly with :attr:`Flat.exact` (the bits of :func:`average`: every rank adds
    in the same order). A rank writes a
    slot again two steps later, after every peer has stamped the step in
    between, so after every peer has averaged this one. Raises
    :class:`~flowreduce.errors.WorkerLostError` when a peer's worker is gone,
    :class:`TimeoutError` after ``timeout`` seconds without every peer.
    A wait past :data:`SECEDE_AFTER` leaves the worker's thread slot
    (``waiting``), so that whatever a late peer waits for can run here."""
    import time

    from flowreduce.errors import WorkerLostError

    slot = stamp % 2
    own = boxes[rank]
    for bucket, dst in zip(flat.buckets, own.buckets[slot]):
        _pack(flat, bucket, grads, dst)
    own.stamps[slot] = stamp  # after the data: x86 keeps stores in order, and peers read the stamp first
    start = checked = time.monotonic()
    pause = 0.0
    while True:
        missing = [r for r, box in enumerate(boxes) if box.stamps[slot] != stamp]
        if not missing:
            break
        failed = [r for r in missing if boxes[r].stamps[slot] == FAILED]
        if failed:
            raise PeerFailed(f"rank {', '.join(map(str, failed))} of the trainer failed before step {stamp} "
                             "(its own error is the trainer's); the other ranks stop with it")
        now = time.monotonic()
        if now - checked > ALIVE_EVERY:
            checked = now
            gone = [r for r in missing if not shm_pool.owner_alive(boxes[r].segment.name)]
            if gone:
                raise WorkerLostError(f"rank {', '.join(map(str, gone))} of the trainer died during step {stamp} "
                                      "(its worker process is gone); the fused steps cannot go on without it")
        if now - start > timeout:
            from flowreduce.errors import AllreduceTimeoutError

            raise AllreduceTimeoutError(f"ranks {missing} of the trainer did not reach step {stamp} within "
                                        f"{timeout:g} s (flowreduce.timeout; {WAIT_SECONDS:g} s when unset)")
        if waiting is not None and now - start > SECEDE_AFTER:
            waiting.long_wait()
        time.sleep(pause)  # yield the core to the ranks being waited for
        pause = min(max(2 * pause, 2e-5), 1e-3)
    out: list[Any] = [None] * len(flat.specs)
    for b, bucket in enumerate(flat.buckets):
        _unpack(flat, bucket, _mean_of([box.buckets[slot][b] for box in boxes], flat), out)
    for box in boxes:  # what was read was still the mailbox it was stamped in
        box.check()
    return out
