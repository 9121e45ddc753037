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
on every route here (averaged in the step tasks or by a reduce level), is
the reference tree's
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
from flowreduce.shm.lease import Lease

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
    return bool(specs) and len({s.dtype for s in specs}) == 1 and packs(specs)


def packs(specs: Sequence[TensorSpec]) -> bool:
    """Whether gradients of these specs can be packed into flat numpy vectors, one per dtype
    (:func:`pack`): every dtype one of :data:`DTYPES` (a bfloat16 gradient's spec is float32, the dtype
    it is averaged in: it packs with the float32 ones and is rounded back as it is unpacked)."""
    return bool(specs) and {np.dtype(s.dtype) for s in specs} <= _NUMPY_DTYPES


_NUMPY_DTYPES = {np.dtype(torch.empty(0, dtype=d).numpy().dtype) for d in DTYPES}


def _lease(nbytes: int, owner: str) -> Lease | None:
    if nbytes < shm_pool.pool().min_bytes:  # cheaper sent by Dask than leased, mapped and read by every peer
        return None
    return shm_kernels.value_lease(nbytes, owner)


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
    """``out[i]``, for each tensor ``i`` of ``bucket``: its view of the averaged flat vector ``vec``
    (a copy rounded back to nearest even for a bfloat16 gradient, packed and averaged as float32)."""
    t = torch.from_numpy(vec)
    for i, at in zip(bucket.tensors, bucket.offsets):
        spec = flat.specs[i]
        view = t[at:at + spec.size].view(spec.shape)
        native = spec.native
        if native is not None and native.library == "torch" and native.dtype != str(view.dtype).removeprefix("torch."):
            view = view.to(getattr(torch, native.dtype))
        out[i] = view


def _by_dtype(flat: Flat) -> dict[str, list[Bucket]]:
    """The buckets of each dtype, the dtypes in the order their first bucket fills."""
    out: dict[str, list[Bucket]] = {}
    for b in flat.buckets:
        out.setdefault(b.dtype, []).append(b)
    return out


def pack(flat: Flat, grads: Sequence[torch.Tensor | None]) -> list[np.ndarray]:
    """Every bucket's gradients (``grads`` holds the ``used`` flags last; zeros for a None), one
    bucket after the other in new flat vectors, one per dtype (one for a model of one dtype): what
    a fused step averages, one all-reduce per vector."""
    out = []
    for dtype, buckets in _by_dtype(flat).items():
        vec = np.empty(sum(b.size for b in buckets), np.dtype(dtype))
        at = 0
        for bucket in buckets:
            _pack(flat, bucket, grads, vec[at:at + bucket.size])
            at += bucket.size
        out.append(vec)
    return out


def unpack(flat: Flat, vectors: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Every tensor (the ``used`` flags last) as a view of the averaged :func:`pack` vectors."""
    out: list[Any] = [None] * len(flat.specs)
    for buckets, vec in zip(_by_dtype(flat).values(), vectors):
        at = 0
        for bucket in buckets:
            _unpack(flat, bucket, vec[at:at + bucket.size], out)
            at += bucket.size
    return out


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
