"""Warm buffers for results (flowreduce.shm.result_buffers): a result's
buffer is lent while any view of the result lives, given back when the last
one goes, and lent again to the next result of its size."""

from __future__ import annotations

import gc

import numpy as np

from flowreduce.shm.result_buffers import GRAIN, MIN_BYTES, Buffers

N = 2 * MIN_BYTES // 8  # float64 elements: large enough for a buffer


def _mapping(a):
    """The mmap under an array (through its views and numpy's memoryview)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_a_buffer_is_lent_again_only_after_its_array_and_views_are_gone():
    b = Buffers(limit=1 << 30, idle=60)
    a = b.empty(N, np.float64)
    first = _mapping(a)
    assert first is not None
    view = a.reshape(2, -1)[1]  # a view keeps the buffer lent
    a[:] = 1.0
    del a
    gc.collect()
    other = b.empty(N, np.float64)
    assert _mapping(other) is not first  # still lent to ``view``
    other[:] = 2.0
    np.testing.assert_array_equal(view, 1.0)
    del view
    gc.collect()
    again = b.empty(N, np.float64)
    assert _mapping(again) is first  # given back, lent again: the pages are warm
    assert b.stats()["result_buffers_lent"] == 2
    del other, again
    gc.collect()
    assert b.stats() == {"result_buffers_free": 2, "result_buffers_free_bytes": 2 * N * 8,
                         "result_buffers_lent": 0}


def test_sizes_share_buffers_by_grain_and_small_arrays_are_plain():
    b = Buffers()
    large = 2 * GRAIN // 8
    a = b.empty(large, np.float64)
    m = _mapping(a)
    del a
    gc.collect()
    c = b.empty((large * 8 - GRAIN // 2) // 4, np.int32)  # within the same grain
    assert _mapping(c) is m and c.dtype == np.int32 and c.flags.writeable
    below = b.empty(3 * MIN_BYTES // 8, np.float64)  # under a grain: classes of powers of two
    m = _mapping(below)
    del below
    gc.collect()
    d = b.empty(MIN_BYTES * 4 - 1, np.uint8)  # 4 x MIN_BYTES is the class of 3 x MIN_BYTES
    assert _mapping(d) is m
    small = b.empty(10, np.float64)
    assert small.base is None  # plain np.empty
    assert b.stats()["result_buffers_lent"] == 2


def test_free_buffers_are_bounded_and_dropped_when_idle():
    b = Buffers(limit=N * 8, idle=10)
    arrays = [b.empty(N, np.float64) for _ in range(3)]
    del arrays
    gc.collect()
    assert b.stats()["result_buffers_free"] == 1  # the limit keeps one
    assert b.release_idle(now=0) == 0
    import time

    assert b.release_idle(now=time.monotonic() + 11) == 1
    assert b.stats()["result_buffers_free_bytes"] == 0
    b.close()
    x = b.empty(N, np.float64)  # closed: plain memory
    assert x.base is None


def test_a_buffer_is_kept_only_while_the_host_has_memory_to_spare(monkeypatch):
    """Each worker's pool is bounded on its own; the host's available
    memory (``/proc/meminfo``) is the bound that sees them all: under half
    of it available, a freed buffer is let go instead of kept."""
    from flowreduce.shm import result_buffers

    available, total = result_buffers.host_memory()  # this Linux host's, read as the pool reads it
    assert 0 < available <= total
    b = Buffers(limit=1 << 30, idle=60, recheck=0)  # read at every give-back (by default a reading lasts 0.1 s)
    for share, kept in ((0.9, 1), (0.1, 0)):
        monkeypatch.setattr(result_buffers, "host_memory", lambda s=share: (int(s * total), total))
        x = b.empty(N, np.float64)
        del x
        gc.collect()
        assert b.stats()["result_buffers_free"] == kept, share
        b.release_idle(now=float("inf"))
