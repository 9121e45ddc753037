"""The same-host data plane's one value type and lifetime rule on their own (no cluster): a lease
goes back to its pool when its last holder lets go and is discarded when one let go after a
failure; a handle crosses the wire as plain data, is refused when it names anything else, and
tells a reader when its payload was leased again under it."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from flowreduce.shm import pool as shm_pool
from flowreduce.shm.lease import Handle, Lease, layout
from flowreduce.shm.pool import GRAIN, Pool


@pytest.fixture
def pool(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    p = Pool(str(d), limit=8 * GRAIN)
    yield p
    p.close()


def on_disk(pool):
    return sorted(n for n in os.listdir(pool.directory) if n.startswith(shm_pool.PREFIX))


def test_a_lease_goes_back_once_its_last_holder_lets_go(pool):
    lease = Lease.take(1000, pool=pool)
    lease.hold()  # a second reader of the same values
    lease.release()
    assert pool.stats()["leased"] == 1 and pool.stats()["free"] == 0  # one holder left
    lease.release()
    assert pool.stats()["leased"] == 0 and pool.stats()["free"] == 1
    again = Lease.take(1000, pool=pool)  # the next lease reuses it, a generation later
    assert again.segment.name == lease.segment.name and again.generation == lease.generation + 1


def test_a_lease_released_more_often_than_held_or_held_after_says_so_and_leaves_the_next_lease_alone(pool):
    lease = Lease.take(1000, pool=pool)
    lease.release()
    again = Lease.take(1000, pool=pool)  # the same segment, leased again
    with pytest.raises(RuntimeError, match=f"{lease.segment.name} released more often than held"):
        lease.release()
    with pytest.raises(RuntimeError, match=f"{lease.segment.name} held after it was given back"):
        lease.hold()
    assert again.segment.name == lease.segment.name and pool.stats()["leased"] == 1  # still the new holder's


def test_a_lease_let_go_after_a_failure_is_never_reused(pool):
    lease = Lease.take(1000, pool=pool)
    lease.hold()
    lease.release(failed=True)  # a send failed: its peer may still read the segment
    assert on_disk(pool) == [lease.segment.name]  # the other holder still has it
    lease.release()
    assert on_disk(pool) == [] and pool.stats()["leased"] == pool.stats()["free"] == 0
    assert Lease.take(1000, pool=pool).segment.name != lease.segment.name


def test_a_value_lease_goes_back_when_nothing_references_it(pool):
    lease = Lease.take(1000, pool=pool).until_dropped()
    name = lease.segment.name
    held = [lease]
    gc.collect()
    assert pool.stats()["leased"] == 1
    del held, lease
    gc.collect()
    assert pool.stats()["leased"] == 0 and pool.names() == [name]


def test_a_handle_reads_the_pieces_where_they_were_written_and_crosses_the_wire_as_plain_data(pool):
    values = [np.arange(5, dtype=np.int16), np.linspace(0, 1, 7).astype(">f8"), np.array([1 + 2j], np.complex64)]
    where, nbytes = layout(values, align=64)
    assert [o for _, o, _ in where] == [0, 64, 128] and nbytes == 192
    lease = Lease.take(nbytes, pool=pool)
    handle = lease.handle(where, key="k")
    for a, view in zip(values, handle.arrays(lease.segment)):
        view[:] = a
    wired = handle.wire()
    assert all(isinstance(x, (str, int, list)) for x in wired)
    back = Handle.from_wire(wired)
    reader = Pool(pool.directory, limit=8 * GRAIN)  # another process's pool: the segment mapped by name
    try:
        seg = reader.attach(back.name, back.size)
        got = back.arrays(seg)
        for a, b in zip(values, got):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
        back.check(seg)
    finally:
        reader.close()


def test_a_handle_tells_its_reader_the_segment_was_leased_again(pool):
    lease = Lease.take(64, pool=pool)
    handle = lease.handle([(np.float64, 0, 8)])
    lease.release()
    Lease.take(64, pool=pool)  # the same segment, a later lease
    assert not handle.current(lease.segment)
    with pytest.raises(RuntimeError, match="leased again before its reader"):
        handle.check(lease.segment)


@pytest.mark.parametrize("data,why", [
    ("x", "not \\[name, size, generation, pieces\\]"), (["n", 1, 1], "not \\[name, size, generation, pieces\\]"),
    (["n", "1", 1, []], "not \\[name, size, generation, pieces\\]"), (["n", 1, 1.0, []], "not \\[name, size"),
    (["n", 1, 1, [["<f8", 0]]], "a piece is not"), (["n", 1, 1, "<f8"], "not \\[name, size")])
def test_a_handle_that_is_not_one_is_refused_on_the_wire(data, why):
    with pytest.raises(shm_pool.Refused, match=why):
        Handle.from_wire(data)


@pytest.mark.parametrize("piece,kinds,why", [
    (("<f8", 0, GRAIN), None, "does not lie inside"), (("<f8", -8, 1), None, "does not lie inside"),
    (("<f8", 0, -1), None, "does not lie inside"), (("|O", 0, 1), None, "is not a plain dtype"),
    ((None, 0, 1), None, "is not a plain dtype"), (("<U2", 0, 1), "biufc", "is not numeric")])
def test_pieces_outside_their_segment_or_of_other_dtypes_are_refused(pool, piece, kinds, why):
    lease = Lease.take(64, pool=pool)
    handle = Handle(lease.segment.name, lease.segment.size, lease.generation, (piece,))
    with pytest.raises(shm_pool.Refused, match=why):
        handle.arrays(lease.segment, kinds)
