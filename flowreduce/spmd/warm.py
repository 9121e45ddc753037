"""Warm memory for the results of collectives, per process.

A collective returns a new array each call. In a Dask worker's thread, a
fresh array of a few hundred KB is a fresh mapping whose pages all fault on
first write: 0.41 ms for 800 KB against 0.02 ms in memory touched before
(measured in a worker on this machine, where first writes are slow). So a
result of at least :data:`MIN_BYTES` is an ordinary numpy array over a
private buffer from this pool, which returns to the pool when the array
(and every view of it) dies, as :mod:`flowreduce.shm.result_buffers` does
for all-reduce results from 1 MiB (this pool starts lower: an SPMD job
calls collectives of a few hundred KB thousands of times).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import defaultdict

import numpy as np
import numpy.typing as npt

#: Smaller results are plain ``np.empty``.
MIN_BYTES = 64 << 10
#: Free bytes kept per process (the rest is unmapped when its array dies).
KEEP_BYTES = 512 << 20

_free: dict[int, list[mmap.mmap]] = defaultdict(list)
_lock = threading.Lock()
_kept = [0]


def empty(count: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A 1-d array of ``count`` elements, uninitialised, in warm memory when it is big."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES:
        return np.empty(count, dtype)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    with _lock:
        free = _free.get(size)
        buf = free.pop() if free else None
        if buf is not None:
            _kept[0] -= size
    if buf is None:
        buf = mmap.mmap(-1, size)
    out = np.frombuffer(buf, dtype, count)
    weakref.finalize(out, _give_back, buf, size)
    return out


def _give_back(buf: mmap.mmap, size: int) -> None:
    with _lock:
        if _kept[0] + size <= KEEP_BYTES:
            _free[size].append(buf)
            _kept[0] += size


def copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` (same shape and dtype) in warm memory."""
    out = empty(a.size, a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out
