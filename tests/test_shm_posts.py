"""Posts on their own (no cluster): a value put up in one pool and read in
place through another, the acknowledgements that decide when its segment
may be reused, stale links, and the reclaim of a killed poster's post."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from utils import ready_child

from flowreduce.schedule.inputs import ArrayMeta
from flowreduce.shm import pool as shm_pool
from flowreduce.shm import posts as shm_posts
from flowreduce.shm.pool import GRAIN, Pool


@pytest.fixture
def directory(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def put(pool, token, rank, value, metas=None, slots=3, readers=(1, 2)):
    return shm_posts.post(pool, shm_posts.name(token, rank), value.dtype, value.shape, metas,
                          lambda out: np.copyto(out, value), slots=slots, readers=readers)


def test_a_post_is_read_in_place_by_a_peer(directory):
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    value = (np.arange(12, dtype=np.int32).reshape(3, 4) - 5).astype(">i4")  # its byte order too
    assert shm_posts.find(reader, "t1", 0) is None  # not up yet
    metas = (ArrayMeta((3, 4), ">i4"), ArrayMeta((3, 4), ">i4"))
    mine = put(writer, "t1", 0, value, metas)
    got = shm_posts.find(reader, "t1", 0)
    assert isinstance(got, shm_posts.Found)
    np.testing.assert_array_equal(got.value, value)
    assert got.value.dtype == value.dtype and got.metas == metas
    assert not got.value.flags.writeable and not mine.value.flags.writeable
    # in place: what the writer's segment holds is what the reader sees, no copy
    assert np.shares_memory(got.value, reader.attach(mine.segment.name, mine.segment.size).buf)
    assert shm_posts.find(reader, "t1", 1) is None and shm_posts.find(reader, "t2", 0) is None


def test_the_segment_is_reused_only_once_every_reader_has_acknowledged(directory):
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    mine = put(writer, "t", 0, np.ones(1000))
    first, second = shm_posts.find(reader, "t", 0), shm_posts.find(reader, "t", 0)
    assert not mine.read_by_all()
    first.acknowledge(1)
    assert not mine.read_by_all()
    second.acknowledge(2)
    assert mine.read_by_all()
    mine.withdraw(writer, reuse=True)
    assert shm_posts.find(reader, "t", 0) is None  # the link is down
    assert writer.stats()["free"] == 1 and writer.stats()["leased"] == 0
    again = writer.lease(1000 * 8)  # the same warm segment, a later generation
    assert again.name == mine.segment.name and again.generation == mine.generation + 1
    with pytest.raises(RuntimeError, match="overwritten"):
        first.acknowledge(1)
    first.acknowledge(1, check=False)  # after a failure: nothing to say


def test_a_stale_link_is_not_read(directory):
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    mine = put(writer, "t", 0, np.ones(10))
    target = os.readlink(os.path.join(directory, mine.link))
    mine.withdraw(writer, reuse=True)
    writer.lease(80)  # leased again: a new generation
    os.symlink(target, os.path.join(directory, mine.link))  # a link to the old generation
    assert shm_posts.find(reader, "t", 0) is None


def test_a_post_withdrawn_unread_is_unlinked_not_reused_and_its_reader_keeps_its_view(directory):
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    value = np.arange(5000.0)
    mine = put(writer, "t", 3, value)
    got = shm_posts.find(reader, "t", 3)
    mine.withdraw(writer, reuse=False)
    assert shm_pool.segments(directory) == []  # neither link nor segment
    assert writer.stats()["free"] == 0
    np.testing.assert_array_equal(got.value, value)  # the mapping outlives the name


def test_withdrawing_leaves_a_link_that_replaced_its_own(directory):
    """A task run again posts under the same name; the first attempt's
    withdrawal must not take the second's link down."""
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    old = put(writer, "t", 0, np.zeros(10))
    new = put(writer, "t", 0, np.ones(10))
    old.withdraw(writer, reuse=False)
    np.testing.assert_array_equal(shm_posts.find(reader, "t", 0).value, np.ones(10))
    new.withdraw(writer, reuse=True)
    assert shm_posts.find(reader, "t", 0) is None


def test_a_link_that_is_not_a_post_is_read_over_dasks_comm(directory):
    reader = Pool(directory)
    os.symlink(f"{reader.stem}0", os.path.join(directory, shm_posts.name("t", 0)))
    assert shm_posts.find(reader, "t", 0) == shm_posts.UNFIT


def test_unfit_values_say_so_at_once(directory):
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    mine = shm_posts.unfit(writer, shm_posts.name("t", 0))
    assert shm_posts.find(reader, "t", 0) == shm_posts.UNFIT
    assert mine.read_by_all()
    mine.withdraw(writer, reuse=True)
    assert shm_pool.segments(directory) == []


def test_no_room_posts_unfit(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    full = Pool(str(d), limit=GRAIN)  # one grain: a 2 MB value does not fit the pool's bound
    mine = put(full, "t", 0, np.ones(250_000))
    assert mine.segment is None
    assert shm_posts.find(Pool(str(d)), "t", 0) == shm_posts.UNFIT


def test_a_link_replaces_an_older_one_and_close_removes_links(directory):
    writer = Pool(directory, limit=8 * GRAIN)
    put(writer, "t", 0, np.zeros(10))
    newer = put(writer, "t", 0, np.ones(10))  # a task run again
    np.testing.assert_array_equal(shm_posts.find(Pool(directory), "t", 0).value, np.ones(10))
    assert newer.link in shm_pool.segments(directory)
    writer.close()
    assert shm_pool.segments(directory) == []


def test_a_killed_posters_post_is_reclaimed(directory):
    code = f"""
        import time
        import numpy as np
        from flowreduce.shm import posts as shm_posts
        from flowreduce.shm.pool import Pool
        p = Pool({directory!r}, limit=1 << 26)
        v = np.ones(100)
        shm_posts.post(p, shm_posts.name("t", 0), v.dtype, v.shape, None, lambda o: np.copyto(o, v),
                       slots=2, readers=(1,))
        shm_posts.unfit(p, shm_posts.name("t", 1))
        print("ready", flush=True)
        time.sleep(60)
    """
    with ready_child(code) as child:
        names = shm_pool.segments(directory)
        assert len(names) == 3  # the segment and two links
        assert Pool(directory).reclaim_orphans() == []  # its owner lives
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert shm_pool.segments(directory) == names
        Pool(directory)  # the next pool on the host reclaims them: the links by the owner they point at
        assert shm_pool.segments(directory) == []
