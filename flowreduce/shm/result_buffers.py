"""Warm memory for results: a per-process pool of private buffers that a
call's result arrays are made in, and that go back to the pool when the
result does. Pure (mmap, numpy, weakref).

A fresh array of tens of MB is a fresh mapping (glibc maps large blocks
anew and unmaps them on free), and its first write faults every page in:
on the development machine filling 80 MB took 32 ms fresh and 18 ms in a
buffer touched before. Open MPI writes into the user's own, warm, buffer;
a Dask task has to return a new array. So the result is an ordinary numpy
array, private to its worker and writable, whose memory is a buffer from
this pool: when the last reference to it goes (Dask releases the result key
and the user holds no view), a ``weakref.finalize`` on the array gives the
buffer back, and the next call's result is written into pages already
touched. Nothing can reuse a buffer while any view of the result lives, so
a held result never changes.

Only free buffers are bounded (``flowreduce.shm.result-pool-bytes``, the
worker plugin's share of its memory limit, and :data:`HOST_RESERVE` of the
host's memory left available): results themselves are
ordinary memory that Dask counts as such. Free buffers unused for
``flowreduce.shm.idle-seconds`` are dropped, as the shared-memory pool's
are.
"""

from __future__ import annotations

import mmap
import threading
import time
import weakref
from collections import defaultdict

import numpy as np
import numpy.typing as npt

from flowreduce.shm import pool as shm_pool
from flowreduce.shm.pool import GRAIN  # sized as the segments are, so calls of nearby sizes share them

#: Results smaller than this are plain ``np.empty`` (few pages to fault). An SPMD job's collectives of a
#: few hundred KB, thousands of times, are why it is not higher.
MIN_BYTES = 64 << 10
#: A freed buffer is kept only while this share of the host's memory stays
#: available to everybody (``MemAvailable``): every worker of the host keeps
#: its own pool, and their bounds are per worker, so this is the one bound that
#: sees them all (and whatever else runs there). A quarter, not a half: 4 SPMD ranks all-reducing 1e8
#: float64 hold ~14 GB of this 24 GB machine, and a result made in fresh pages took 1.35-1.9 s a call
#: against 0.43 s in a kept buffer (4 processes through flowreduce.shm.host_group, 2026-11-28).
HOST_RESERVE = 0.25


def host_memory() -> tuple[int, int] | None:
    """``(available, total)`` bytes of this host's memory (Linux
    ``/proc/meminfo``); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


class Buffers:
    """Free private buffers by size; :meth:`empty` lends one as an array."""

    def __init__(self, limit: int = 1 << 30, idle: float = 30.0, recheck: float = 0.1):
        self.limit, self.idle = limit, idle
        #: seconds a reading of the host's memory is trusted (reading it takes ~30 us, and an SPMD job may
        #: give a buffer back every millisecond)
        self.recheck = recheck
        self._host: tuple[float, bool] = (-float("inf"), True)  # (when read, whether the host had memory to spare)
        self._free: dict[int, list[tuple[mmap.mmap, float]]] = defaultdict(list)
        self._free_bytes = 0
        self._lent = 0  # buffers behind live arrays (for stats and tests)
        self._lock = threading.Lock()
        self.closed = False

    def empty(self, count: int, dtype: npt.DTypeLike) -> np.ndarray:
        """A 1-d array of ``count`` elements of ``dtype``, uninitialised, in
        a warm buffer when one of its size is free (a fresh one otherwise)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if nbytes < MIN_BYTES or self.closed:
            return np.empty(count, dtype)
        # sizes in classes, so that results of nearby sizes share buffers: GRAIN's multiples, powers of two below
        size = -(-nbytes // GRAIN) * GRAIN if nbytes >= GRAIN else 1 << (nbytes - 1).bit_length()
        with self._lock:
            free = self._free.get(size)
            buf = free.pop()[0] if free else None
            if buf is not None:
                self._free_bytes -= size
            self._lent += 1
        if buf is None:
            buf = mmap.mmap(-1, size)  # private, anonymous
        out = np.frombuffer(buf, dtype, count)
        weakref.finalize(out, self._give_back, buf, size)
        return out

    def _give_back(self, buf: mmap.mmap, size: int) -> None:
        # runs as the array dies, which still holds its export of ``buf``: keep it or drop
        # the reference (the mapping goes with the array), never close it here
        with self._lock:
            self._lent -= 1
            if self.closed or self._free_bytes + size > self.limit:
                return
        if not self._spare():  # the host is short of memory: let it go
            return
        with self._lock:
            if self.closed or self._free_bytes + size > self.limit:
                return
            self._free[size].append((buf, time.monotonic()))
            self._free_bytes += size

    def _spare(self) -> bool:
        """Whether the host has memory to spare (:data:`HOST_RESERVE`), read at most every ``recheck`` s."""
        read_at, spare = self._host
        now = time.monotonic()
        if now - read_at >= self.recheck:
            host = host_memory()
            spare = host is None or host[0] >= HOST_RESERVE * host[1]
            self._host = (now, spare)
        return spare

    def release_idle(self, now: float | None = None) -> int:
        """Drop free buffers unused for :attr:`idle` seconds; how many."""
        now = time.monotonic() if now is None else now
        dropped = 0
        with self._lock:
            for size, free in list(self._free.items()):
                keep = [(b, t) for b, t in free if now - t < self.idle]
                dropped += len(free) - len(keep)
                self._free_bytes -= (len(free) - len(keep)) * size
                self._free[size] = keep
        return dropped

    def stats(self) -> dict:
        with self._lock:
            return {"result_buffers_free": sum(map(len, self._free.values())),
                    "result_buffers_free_bytes": self._free_bytes, "result_buffers_lent": self._lent}

    def close(self) -> None:
        """Keep nothing more (the worker is closing); lent buffers go with their arrays."""
        with self._lock:
            self.closed = True
            self._free.clear()
            self._free_bytes = 0


_BUFFERS: Buffers | None = None
_LOCK = threading.Lock()


def buffers() -> Buffers:
    """This process's buffers, bounded by the dask config on first use."""
    global _BUFFERS
    with _LOCK:
        if _BUFFERS is None or _BUFFERS.closed:
            c = shm_pool.config()
            _BUFFERS = Buffers(c["result-pool-bytes"], c["idle-seconds"])
        return _BUFFERS


def current() -> Buffers | None:
    """The buffers if this process made them (housekeeping must not make them)."""
    return _BUFFERS


def close() -> None:
    global _BUFFERS
    with _LOCK:
        if _BUFFERS is not None:
            _BUFFERS.close()
            _BUFFERS = None
