"""Task functions of the same-host data plane: values whose payload sits in
a pooled shared-memory segment and whose Dask form, when sent to another
worker, is a handle of a few hundred bytes. numpy and the pool only.

Two uses:

* :class:`Publish` wraps any plan node's task whose readers on other workers
  all share its host: the value stays a tuple of private pieces for readers
  on its own worker, and a copy in a segment is what its pickle points to.
  The receiver copies the payload out while unpickling (Dask deserialises a
  dependency before its dependent runs), so it holds a private, writable
  array exactly as if it came over a socket.
* :func:`write`, :func:`reduce_slice`, :func:`gather` are the three levels of
  the one-level intra-host collective (:mod:`flowreduce.lower.shm_direct`):
  readers read peers' segments in place.

Values are the data plane's leases and handles (:mod:`flowreduce.shm.lease`): a lease lives as
long as the values that reference it on its worker (Dask drops a key's value once every dependent
has run, wherever it runs), and a reader checks a handle's generation after reading.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from dask.sizeof import sizeof

from flowreduce.kernels import dense as kernels
from flowreduce.ops import Op
from flowreduce.shm import pool as shm_pool
from flowreduce.shm import result_buffers
from flowreduce.shm.lease import Handle, Lease, layout

#: Copies through shared memory in this process, for traces: (seq, start,
#: stop, bytes, direction "write"/"read", the segment owner's pid, repr of
#: the task key). Times are this process's clock (time.time).
COPIES: deque[tuple] = deque(maxlen=100_000)
_seq = itertools.count(1)


def log_copy(direction: str, key: str, owner: int, nbytes: int, start: float, stop: float | None = None) -> None:
    COPIES.append((next(_seq), start, time.time() if stop is None else stop, nbytes, direction, owner, key))


def owner_pid(segment_name: str) -> int:
    try:
        return int(segment_name[len(shm_pool.PREFIX):].split("-")[0])
    except ValueError:
        return 0


def value_lease(nbytes: int, owner: str = "") -> Lease | None:
    """A lease for the call ``owner``, given back once no value references it (None: no segment)."""
    lease = Lease.taken(nbytes, owner)
    return None if lease is None else lease.until_dropped()


# -- any plan node: publish for same-host readers ------------------------------
class Shared(tuple):
    """A node's pieces, kept private on their worker; pickled (sent to a
    worker of the same host), a :class:`Handle` to a copy in shared memory,
    copied out on arrival."""

    _lease: Lease  # held so the segment stays leased while the value lives here
    handle: Handle

    def __new__(cls, pieces: Sequence[np.ndarray], lease: Lease, handle: Handle) -> Shared:
        self = super().__new__(cls, pieces)
        self._lease, self.handle = lease, handle
        return self

    def __reduce__(self) -> tuple[Callable[[Handle], tuple[np.ndarray, ...]], tuple[Handle]]:
        return (received, (self.handle,))


def received(handle: Handle) -> tuple[np.ndarray, ...]:
    """A published value on its reader's worker: private copies of its pieces."""
    t0 = time.time()
    seg = handle.segment()
    out = tuple(a.copy() for a in handle.arrays(seg))
    handle.check(seg)
    log_copy("read", handle.key, owner_pid(handle.name), sum(a.nbytes for a in out), t0)
    return out


class Publish:
    """A task function that runs ``func`` and publishes its tuple of pieces
    through shared memory (the pieces themselves when no segment can be had)."""

    def __init__(self, func: Callable, key: str = "", owner: str = ""):
        self.func, self.key, self.owner = func, key, owner

    def __call__(self, *args: Any) -> Any:
        value = self.func(*args)
        if not isinstance(value, tuple) or not all(isinstance(a, np.ndarray) for a in value):
            return value
        pieces, nbytes = layout(value)
        if nbytes < shm_pool.pool().min_bytes:
            return value
        t0 = time.time()
        lease = value_lease(nbytes, self.owner)
        if lease is None:
            return value
        handle = lease.handle(pieces, self.key)
        for a, dst in zip(value, handle.arrays(lease.segment)):
            np.copyto(dst, a.reshape(-1))
        log_copy("write", self.key, os.getpid(), nbytes, t0)
        return Shared(value, lease, handle)

    def __repr__(self) -> str:
        return f"Publish({getattr(self.func, '__name__', self.func)!r})"


# -- the one-level intra-host collective ---------------------------------------
class Block:
    """A worker's partial vector in its segment (the collective's first
    level); pickled, a :class:`Handle` that peers read in place."""

    def __init__(self, lease: Lease, dtype: npt.DTypeLike, count: int, lo: int = 0, hi: int | None = None):
        self.lease, self.dtype, self.count = lease, np.dtype(dtype), count
        self.lo, self.hi = lo, count if hi is None else hi

    @property
    def array(self) -> np.ndarray:
        return self.lease.segment.view(self.dtype, self.count)

    def handle(self) -> Handle:
        return self.lease.handle([(self.dtype, 0, self.count)])

    def __reduce__(self) -> tuple[type[Remote], tuple[Handle, int, int]]:
        return (Remote, (self.handle(), self.lo, self.hi))

    def __deepcopy__(self, memo: dict) -> np.ndarray:
        # a task re-run after a loss works on private copies (schedule.recovery.private_copies): the
        # values its readers see, as a plain array, not the Remote handle __reduce__ would make of it
        return self.array[self.lo:self.hi].copy()


@sizeof.register(Block)
def _sizeof_block(b: Block) -> int:
    return (b.hi - b.lo) * b.dtype.itemsize  # the part its readers see (the segment counts in the worker's memory)


@dataclass(frozen=True)
class Remote:
    """A peer's :class:`Block` seen from another worker of its host."""

    handle: Handle
    lo: int
    hi: int


#: A peer's payload read in place, to check once the reader is done with it.
Check = tuple[Handle, shm_pool.Segment]


def _read(value: Any, lo: int, hi: int) -> tuple[np.ndarray, Check | None]:
    """Elements [lo, hi) of a collective value: a Block here, a peer's in
    shared memory, or a plain array (the fallback, sent by Dask)."""
    if isinstance(value, Block):
        return value.array[lo:hi], None
    if isinstance(value, Remote):
        seg = value.handle.segment()
        return value.handle.arrays(seg)[0][lo:hi], (value.handle, seg)
    return np.asarray(value).reshape(-1)[lo:hi], None


def write(op: Op, dtype: npt.DTypeLike, inputs: Sequence, share: bool = True, key: str = "", owner: str = "") -> Block | np.ndarray:
    """Level 1 on each worker: its ranks' inputs reduced into a leased
    segment (a private array when shared memory is unavailable, or not
    needed: ``share=False``, no peer reads it)."""
    t0 = time.time()
    dtype = np.dtype(dtype)
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    count = flat[0].size
    # a small vector is cheaper sent by Dask than leased, mapped and read by every peer
    share = share and count * dtype.itemsize >= shm_pool.pool().min_bytes
    lease = value_lease(count * dtype.itemsize, owner) if share else None
    dst = lease.segment.view(dtype, count) if lease is not None else np.empty(count, dtype)
    np.copyto(dst, flat[0], casting="unsafe")
    for x in flat[1:]:
        _combine_into(op, dst, x)
    if lease is None:
        return dst
    log_copy("write", key, os.getpid(), dst.nbytes, t0)
    return Block(lease, dtype, count)


def _combine_into(op: Op, acc: np.ndarray, x: np.ndarray) -> None:
    if op.in_place:
        op.combine(acc, x, out=acc)
    else:
        acc[...] = op.combine(acc, x)


def finishes_in_place(op: Op, dtype: npt.DTypeLike) -> bool:
    """Whether the op's last touch (mean's division) keeps the dtype, so the
    reduce-scatter can apply it to its slice; else every rank's gather does."""
    return not op.mean or np.issubdtype(np.dtype(dtype), np.inexact)


def reduce_slice(op: Op, ranks: int, lo: int, hi: int, blocks: Sequence, key: str = "") -> Block | np.ndarray:
    """Level 2 on worker i: slice [lo, hi) reduced over every worker's block,
    read in place from their segments, and written into its own block's
    slice (nobody else reads that slice of it)."""
    own, acc = _reduce_into(op, lo, hi, blocks, key)
    if finishes_in_place(op, acc.dtype):
        finished = op.finish(acc, ranks, owned=True)
        if finished is not acc:
            acc[...] = finished
    if isinstance(own, Block):
        return Block(own.lease, own.dtype, own.count, lo, hi)
    return acc


def reduce_slice_ordered(op: Op, ranks: int, lo: int, hi: int, blocks: Sequence, own: int,
                         key: str = "") -> Block | np.ndarray:
    """:func:`reduce_slice` in the fixed order of ``deterministic=True``:
    ``blocks[r]`` is rank ``r``'s input (one rank per :func:`write`), and
    slice [lo, hi) of their sum is the reference tree's
    (:func:`flowreduce.reproducible.tree_merge`), written into the slice of
    ``blocks[own]`` (this worker's: nobody else touches that slice)."""
    mine = blocks[own]
    acc = mine.array[lo:hi] if isinstance(mine, Block) else np.asarray(mine).reshape(-1)[lo:hi]
    reads = [(acc, None) if r == own else _read(value, lo, hi) for r, value in enumerate(blocks)]
    t0 = time.time()
    kernels.tree_fold(op, ranks, [x for x, _ in reads], acc)  # each block read before it is written
    _account_reads(reads, key, t0)
    if isinstance(mine, Block):
        return Block(mine.lease, mine.dtype, mine.count, lo, hi)
    return acc


def _reduce_into(op: Op, lo: int, hi: int, blocks: Sequence, key: str) -> tuple[Any, np.ndarray]:
    """Elements [lo, hi) of ``blocks[0]`` (this worker's, written by
    :func:`write`: private, and only this task touches [lo, hi) of it)
    combined in place with the same elements of every other block."""
    own = blocks[0]
    acc = own.array[lo:hi] if isinstance(own, Block) else np.asarray(own).reshape(-1)[lo:hi]
    reads = [_read(value, lo, hi) for value in blocks[1:]]
    t0 = time.time()
    if op.in_place:  # each peer's slice read once, a cache-sized block of the sum at a time
        op.fold([acc, *(x for x, _ in reads)], acc)
    else:
        for x, _ in reads:
            _combine_into(op, acc, x)
    _account_reads(reads, key, t0)
    return own, acc


def _account_reads(reads: Sequence[tuple[np.ndarray, Any]], key: str, t0: float) -> None:
    """After a sum that began at ``t0``: each read's share of its time, by bytes, logged
    for traces; then every peer segment read is checked to still hold the lease it was read under."""
    t, span, total = t0, time.time() - t0, sum(x.nbytes for x, _ in reads) or 1
    for x, check in reads:
        share = span * x.nbytes / total
        if check is not None:
            log_copy("read", key, owner_pid(check[0].name), x.nbytes, t, t + share)
        t += share
    for _, check in reads:
        if check is not None:
            check[0].check(check[1])


# -- hierarchical across hosts: shared memory inside each host -------------------
class Private(tuple):
    """A plan node's pieces that are views of this worker's segment (held
    here, so the lease lives while they do); sent to another host, a plain
    tuple of copies."""

    _keep: Any

    def __new__(cls, pieces: Sequence[np.ndarray], keep: Any) -> Private:
        self = super().__new__(cls, pieces)
        self._keep = keep
        return self

    def __reduce__(self) -> tuple[type[tuple], tuple[tuple[np.ndarray, ...]]]:
        return (tuple, (tuple(self),))


def reduce_range(op: Op, ranks: int, lo: int, hi: int, finish: bool, blocks: Sequence,
                 key: str = "") -> tuple[np.ndarray, ...]:
    """A host's part of elements [lo, hi): this worker's block reduced with
    every peer's of its host, read in place (as :func:`reduce_slice`), as a
    plan node's pieces for the inter-host algorithm; ``finish`` when that
    already covers every rank (one host)."""
    own, acc = _reduce_into(op, lo, hi, blocks, key)
    if finish:
        acc = op.finish(acc, ranks, owned=True)
    return Private((acc,), own) if isinstance(own, Block) else (acc,)


def reduce_published(op: Op, ranks: int, finish: bool, shape: Any, inputs: Sequence[tuple[np.ndarray, ...]],
                     picks: Sequence[Sequence[tuple[int, int, int]]], owned: Sequence[bool], key: str = "",
                     owner: str = "") -> Block | np.ndarray:
    """A worker's finished slice reduced straight into a leased segment (the
    inter-host algorithm's last reduction fused with :func:`publish_slice`:
    one copy and one level fewer); the plan kernel and a copy otherwise."""
    arrays = [np.concatenate([v[i][a:b] for i, a, b in p]) if len(p) > 1 else v[p[0][0]][p[0][1]:p[0][2]]
              for v, p in zip(inputs, picks)]
    dtype = np.result_type(*arrays)
    count = arrays[0].size
    fits = op.in_place and len(arrays) > 1 and (not finish or finishes_in_place(op, dtype))
    lease = value_lease(count * dtype.itemsize, owner) if fits and count * dtype.itemsize >= shm_pool.pool().min_bytes \
        else None
    if lease is None:
        acc = kernels.reduce(op, ranks, finish, None, inputs, picks, owned)[0]  # pieces: shape is None
        return publish_slice([(acc,)], [[(0, 0, acc.size)]], key, owner)
    t0 = time.time()
    out = lease.segment.view(dtype, count)
    op.combine(arrays[0], arrays[1], out=out)
    for x in arrays[2:]:
        op.combine(out, x, out=out)
    if finish:
        op.finish(out, ranks, owned=True)
    log_copy("write", key, os.getpid(), out.nbytes, t0)
    return Block(lease, dtype, count)


def publish_slice(inputs: Sequence[tuple[np.ndarray, ...]], picks: Sequence[Sequence[tuple[int, int, int]]],
                  key: str = "", owner: str = "") -> Block | np.ndarray:
    """A worker's finished slice (its tiles from the inter-host algorithm)
    copied into a leased segment, for its host's ranks to copy out in
    place; a plain array when no segment can be had or it is small."""
    parts = [v[i][a:b] for v, p in zip(inputs, picks) for i, a, b in p]
    dtype = np.result_type(*parts) if parts else np.dtype("f8")
    count = sum(x.size for x in parts)
    nbytes = count * dtype.itemsize
    t0 = time.time()
    lease = value_lease(nbytes, owner) if nbytes >= shm_pool.pool().min_bytes else None
    out = lease.segment.view(dtype, count) if lease is not None else np.empty(count, dtype)
    at = 0
    for x in parts:
        out[at:at + x.size] = x
        at += x.size
    if lease is None:
        return out
    log_copy("write", key, os.getpid(), nbytes, t0)
    return Block(lease, dtype, count)


def gather(op: Op, ranks: int, shape: tuple[int, ...], dtype: npt.DTypeLike, slices: Sequence,
           key: str = "", finish: bool = True) -> np.ndarray:
    """Level 3 on each rank: its result, an array of its own (in a warm
    buffer: :mod:`~flowreduce.shm.result_buffers`), copied from every
    worker's finished slice (``finish=False``: already finished)."""
    parts = [_slice_of(v) for v in slices]
    count = sum(x.size for x, _ in parts)
    out = result_buffers.buffers().empty(count, dtype)
    at = 0
    for x, check in parts:
        t0 = time.time()
        out[at:at + x.size] = x
        at += x.size
        if check is not None:
            log_copy("read", key, owner_pid(check[0].name), x.nbytes, t0)
    for _, check in parts:
        if check is not None:
            handle, seg = check
            handle.check(seg)
    if finish and not finishes_in_place(op, out.dtype):
        out = op.finish(out, ranks, owned=True)
    return out.reshape(shape)


def _slice_of(value: Any) -> tuple[np.ndarray, Check | None]:
    if isinstance(value, Block):
        return value.array[value.lo:value.hi], None
    if isinstance(value, Remote):
        return _read(value, value.lo, value.hi)
    return np.asarray(value).reshape(-1), None
