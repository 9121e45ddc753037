"""The shared-memory pool on its own (no cluster): reuse, bound, idle
release, orphan reclaim, and the fallback when the segment directory is
missing, unwritable, read-only or too small."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import uuid

import numpy as np
import pytest
from utils import ready_child

from flowreduce.shm import pool as shm_pool
from flowreduce.shm.pool import GRAIN, Pool, Unavailable


@pytest.fixture
def directory(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def listing(directory):
    return shm_pool.segments(directory)


def test_segments_are_reused_not_remapped(directory):
    pool = Pool(directory, limit=16 * GRAIN)
    a = pool.lease(3 * GRAIN)
    a.view(np.float64, 10)[:] = np.arange(10)
    pool.give_back(a)
    b = pool.lease(3 * GRAIN - 100)
    assert b is a and b.generation == 2  # the same mapping, a new lease
    assert listing(directory) == [a.name]
    pool.close()
    assert listing(directory) == []


def test_leases_do_not_share_a_segment(directory):
    pool = Pool(directory, limit=16 * GRAIN)
    a, b = pool.lease(GRAIN), pool.lease(GRAIN)
    assert a.name != b.name
    a.view(np.int64, 4)[:] = 1
    b.view(np.int64, 4)[:] = 2
    assert a.view(np.int64, 4).tolist() == [1] * 4
    pool.close()


def test_pool_is_bounded(directory, caplog):
    pool = Pool(directory, limit=4 * GRAIN)
    unit = GRAIN - shm_pool.HEADER  # a lease of this takes one GRAIN
    held = [pool.lease(unit) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="flowreduce"), pytest.raises(Unavailable, match="pool-bytes"):
        pool.lease(2 * unit)
    for s in held:
        pool.give_back(s)
    big = pool.lease(3 * unit)  # free segments make room for a bigger one
    assert pool.nbytes <= 4 * GRAIN
    assert big.size >= 3 * GRAIN
    pool.close()
    assert sum("pool-bytes" in r.message for r in caplog.records) == 1


def test_many_leases_stay_bounded(directory):
    pool = Pool(directory, limit=8 * GRAIN)
    for i in range(1000):
        s = pool.lease((i % 5 + 1) * GRAIN // 2)
        pool.give_back(s)
        assert pool.nbytes <= 8 * GRAIN
    assert len(listing(directory)) <= 8
    pool.close()
    assert listing(directory) == []


def test_idle_segments_and_peers_are_released(directory):
    pool = Pool(directory, limit=8 * GRAIN, idle=10.0)
    other = Pool(directory, limit=8 * GRAIN, idle=10.0)
    s = pool.lease(GRAIN)
    peer = other.attach(s.name, s.size)
    assert peer.stamped() == s.generation
    pool.give_back(s)
    assert pool.release_idle(now=s.used + 5) == 0
    assert pool.release_idle(now=s.used + 11) == 1
    assert listing(directory) == []
    assert other.release_idle(now=peer.used + 1) == 1  # its file is gone: unmapped at once
    assert other.stats()["peers"] == 0


def test_a_peer_mapped_for_a_smaller_lease_is_mapped_again_whole(directory):
    """A reader maps a peer's segment for the bytes of one lease; the owner reuses the segment for a
    bigger payload: the next attach maps it again, whole, instead of handing back the short mapping."""
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    s = writer.lease(GRAIN)
    assert reader.attach(s.name, shm_pool.HEADER + 8).size == shm_pool.HEADER + 8
    s.view(np.float64, 100)[:] = np.arange(100.0)
    bigger = reader.attach(s.name, shm_pool.HEADER + 800)
    assert bigger.size == shm_pool.HEADER + 800
    np.testing.assert_array_equal(bigger.view(np.float64, 100), np.arange(100.0))
    writer.close()


def test_attach_reads_the_writers_bytes(directory):
    writer, reader = Pool(directory, limit=8 * GRAIN), Pool(directory, limit=8 * GRAIN)
    s = writer.lease(GRAIN)
    s.view(np.float32, 100)[:] = np.linspace(0, 1, 100, dtype=np.float32)
    got = reader.attach(s.name, s.size).view(np.float32, 100)
    np.testing.assert_array_equal(got, np.linspace(0, 1, 100, dtype=np.float32))
    assert not got.flags.writeable
    writer.close()
    with pytest.raises(RuntimeError, match="is gone"):
        Pool(directory).attach(s.name, s.size)


def test_orphans_of_a_killed_process_are_reclaimed(directory):
    # a real process makes segments and dies by SIGKILL, without cleaning up
    code = f"""
        import os, sys, time
        from flowreduce.shm.pool import Pool
        p = Pool({directory!r}, limit=1 << 26)
        segs = [p.lease(1 << 20) for _ in range(3)]
        print("ready", flush=True)
        time.sleep(60)
    """
    with ready_child(code) as child:
        names = listing(directory)
        assert len(names) == 3 and all(f"-{child.pid}-" in n for n in names)
        assert Pool(directory).reclaim_orphans() == []  # the owner lives: not touched
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert listing(directory) == names  # SIGKILL left them behind
        Pool(directory)  # the next pool on the host reclaims them
        assert listing(directory) == []


def test_missing_directory_falls_back_with_one_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flowreduce"):
        pool = Pool(str(tmp_path / "nowhere"))
        for _ in range(3):
            with pytest.raises(Unavailable, match="missing"):
                pool.lease(100)
    assert not pool.available
    assert [r.message for r in caplog.records if "Dask's comm" in r.message] == [
        f"flowreduce: same-host transfers use Dask's comm (shared-memory directory {tmp_path / 'nowhere'} "
        "is missing)"]


def test_unwritable_directory_falls_back(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="flowreduce"):
        pool = Pool(str(blocker))
        with pytest.raises(Unavailable):
            pool.lease(100)
    assert sum("Dask's comm" in r.message for r in caplog.records) == 1


@pytest.fixture
def tmpfs(tmp_path):
    """A real tmpfs mount of 2 MiB (root only: mounting needs CAP_SYS_ADMIN)."""
    mounted = []

    def make(*opts):
        d = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=2m", *opts)), "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return str(d)

    yield make
    for d in mounted:
        subprocess.run(["umount", str(d)], check=False)


def test_tiny_tmpfs_falls_back_without_a_bus_error(tmpfs, caplog):
    directory = tmpfs()
    with caplog.at_level(logging.WARNING, logger="flowreduce"):
        pool = Pool(directory, limit=1 << 30)
        with pytest.raises(Unavailable, match="free"):
            pool.lease(8 << 20)
    assert pool.available  # a passing condition: smaller segments still work
    assert listing(directory) == []
    assert sum("Dask's comm" in r.message for r in caplog.records) == 1


def test_full_tmpfs_is_an_error_not_a_bus_error(tmpfs, monkeypatch):
    directory = tmpfs()
    monkeypatch.setattr(shm_pool, "HEADROOM", 0)  # pass the free-space check: fallocate must catch it
    pool = Pool(directory, limit=1 << 30)
    first = pool.lease(GRAIN)
    first.view(np.uint8, GRAIN - shm_pool.HEADER)[:] = 7  # every page is backed: no SIGBUS
    with pytest.raises(Unavailable):
        pool.lease(GRAIN + GRAIN // 2)  # 2 MiB on a 2 MiB tmpfs holding 1 MiB already
    assert listing(directory) == [first.name]
    pool.close()


def test_read_only_tmpfs_falls_back(tmpfs):
    pool = Pool(tmpfs("ro"))
    assert not pool.available and "read-only" in pool.reason
    with pytest.raises(Unavailable, match="read-only"):
        pool.lease(100)


def test_process_pool_follows_the_dask_config(directory):
    import dask

    shm_pool.close()
    try:
        with dask.config.set({"flowreduce.shm.enabled": False, "flowreduce.shm.directory": directory}):
            pool = shm_pool.pool()
        assert pool.directory == directory
        with pytest.raises(Unavailable, match="disabled"):
            pool.lease(100)
        with dask.config.set({"flowreduce.shm.directory": directory, "flowreduce.shm.pool-bytes": "3MiB"}):
            shm_pool.close()
            pool = shm_pool.pool()
        assert pool.limit == 3 << 20 and pool.available
        pool.lease(GRAIN)
        assert len(listing(directory)) == 1
    finally:
        shm_pool.close()
    assert listing(directory) == []


def test_a_call_never_reuses_a_segment_it_gave_back(directory):
    """A call run again after a worker loss keeps its keys, and a reader may
    still hold the first run's handle: the call's own segments are not
    leased to it again (so that handle's payload stays), other calls reuse them."""
    pool = Pool(directory, limit=16 * GRAIN)
    a = pool.lease(GRAIN, owner="call-1")
    a.view(np.int64, 4)[:] = 7
    pool.give_back(a, a.generation)
    again = pool.lease(GRAIN, owner="call-1")
    assert again.name != a.name and a.stamped() == 1
    assert a.view(np.int64, 4).tolist() == [7] * 4
    other = pool.lease(GRAIN, owner="call-2")
    assert other is a and other.stamped() == 2
    pool.close()
