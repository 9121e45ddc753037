"""The same-host data plane on real worker processes: graph shape, handles
on the wire (read off distributed's transfer log), numbers against numpy,
results that are ordinary arrays, and the segments' lifecycle (success,
error, cancellation, SIGKILL, 1,000 calls, fallback)."""

from __future__ import annotations

import functools
import gc
import os
import shutil
import signal
import uuid

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from utils import assert_clean, graph_depth, wait_until, workers_of

import flowreduce
from flowreduce import config as flowreduce_config
from flowreduce import describe
from flowreduce.algorithms import plan as make_plan
from flowreduce.lower.shm_direct import build_direct
from flowreduce.ops import resolve_op
from flowreduce.schedule.shm_plugin import usage
from flowreduce.shm import pool as shm_pool

# These tests are about the task graph's same-host routes: method='tasks' (tests/test_p2p.py covers the engine)
pytestmark = pytest.mark.usefixtures("method_tasks")


IDLE = 0.5  # seconds before free segments are unlinked in these clusters


def shm_cluster(directory, n_workers=4, **config):
    settings = {"flowreduce.shm.directory": directory, "flowreduce.shm.idle-seconds": IDLE, **config}
    with dask.config.set(settings):  # the nannies hand the config to their worker processes
        return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=None)


@pytest.fixture(scope="module")
def client(shm_dir):
    with shm_cluster(shm_dir) as cluster, Client(cluster) as c:
        yield c


def scatter(client, arrays):
    ws = workers_of(client)
    return [client.scatter(a, workers=[ws[r % len(ws)]], hash=False) for r, a in enumerate(arrays)]


def leased(client) -> int:
    return sum(s.get("leased", 0) for s in usage(client).values())


def settled(client, directory) -> None:
    """No segment leased once the call's keys are gone, and none left once idle."""
    assert_clean(client)
    assert wait_until(lambda: leased(client) == 0, 30), usage(client)
    assert wait_until(lambda: not shm_pool.segments(directory), 30 + 4 * IDLE), shm_pool.segments(directory)


@pytest.mark.parametrize("ranks,workers", [(4, 4), (8, 4), (64, 4), (3, 1)])
def test_direct_graph_is_three_levels(ranks, workers):
    ws = [f"tcp://10.0.0.1:{9000 + r % workers}" for r in range(ranks)]
    groups = [list(range(w, ranks, workers)) for w in range(workers)]
    plan = make_plan("shm-direct", ranks, **({"groups": groups} if workers < ranks else {}))
    inputs = [(f"x-{r}",) for r in range(ranks)]
    graph = build_direct(plan, inputs, ws, size=1000, shape=(1000,), dtype=np.dtype("f8"), op=resolve_op("sum"))
    assert graph_depth(graph) == 3
    assert len(graph.tasks) == 2 * workers + ranks <= 3 * ranks + 2 * workers
    assert {graph.placement[k] for k in graph.outputs} == set(ws)
    assert all(graph.placement[o] == ws[r] for r, o in enumerate(graph.outputs))


def _clear_logs(dask_worker=None):
    dask_worker.transfer_outgoing_log.clear()


def _flowreduce_wire_bytes(peers, dask_worker=None) -> list[int]:
    """Bytes written on the wire per transfer of flowreduce keys to another
    worker (the client's gather of the results is not an edge)."""
    return [e["compressed"] for e in dask_worker.transfer_outgoing_log
            if e["who"] in peers and any("flowreduce-" in str(k) for k in e["keys"])]


@pytest.mark.parametrize("algorithm,transport,small", [
    ("shm-direct", "auto", True), ("ring", "auto", True), ("butterfly", "auto", True), ("ring", "dask", False),
])
def test_same_host_edges_carry_a_handle(client, algorithm, transport, small):
    arrays = [np.random.default_rng(r).random(200_000) for r in range(4)]  # 1.6 MB each, past min-bytes
    parts = scatter(client, arrays)
    client.run(_clear_logs)
    futures = flowreduce.allreduce(client, parts, algorithm=algorithm, transport=transport)
    np.testing.assert_allclose(client.gather(futures)[2], sum(arrays))
    sent = [b for bs in client.run(_flowreduce_wire_bytes, workers_of(client)).values() for b in bs]
    assert sent, "no transfer between workers at all"
    if small:
        assert max(sent) < 1024, sorted(sent)[-5:]
        assert "shared memory" in describe(futures).transport
    else:
        assert min(sent) > 100_000
        assert describe(futures).transport == "dask"


def _input_transfers(input_keys, dask_worker=None) -> list[int]:
    """Bytes of the given (input) keys this worker sent another worker over Dask's comm."""
    return [e["compressed"] for e in dask_worker.transfer_outgoing_log if set(map(str, e["keys"])) & set(input_keys)]


def _post_copies(token, dask_worker=None) -> list[tuple[str, int, int]]:
    """(direction, bytes, segment owner's pid) of each shared-memory copy of the call ``token`` on this worker."""
    from flowreduce.kernels.shm import COPIES

    return [(direction, nbytes, owner) for _, _, _, nbytes, direction, owner, key in COPIES if token in key]


@pytest.mark.parametrize("ranks,dtype,op,n", [(4, "int64", "sum", 100_000), (4, "float64", "sum", 1000),
                                              (10, "int64", "sum", 100_000), (10, "int32", "mean", 1000)])
def test_direct_peers_on_the_host_read_each_others_posts(client, ranks, dtype, op, n):
    """``direct``: each worker posts its input (or the sum of the ranks it
    holds, in the op's accumulating dtype: int64 for an int32 mean) in
    shared memory once, and reads every other worker's post in place:
    nothing of the inputs crosses Dask's comm, whatever the size. With
    ``transport="dask"`` the same reads go through Dask's comm."""
    ws = workers_of(client)
    arrays = [np.random.default_rng(r).integers(0, 1000, n).astype(dtype) for r in range(ranks)]
    total = sum(a.astype(np.int64) for a in arrays)
    expected = total / ranks if op == "mean" else total
    acc = np.dtype(resolve_op(op).accumulator(np.dtype(dtype)) or dtype)
    # what a worker posts: its one input, or its ranks' sum (every worker holds several of 10 ranks)
    posted = n * (acc.itemsize if ranks > len(ws) else np.dtype(dtype).itemsize)
    pids = client.run(_pid)
    for transport in ("auto", "dask"):
        parts = scatter(client, arrays)
        names = [str(f.key) for f in parts]
        client.run(_clear_logs)
        futures = flowreduce.allreduce(client, parts, algorithm="direct", op=op, transport=transport)
        for o in client.gather(futures):
            np.testing.assert_array_equal(o, expected)
        token = str(futures[0].key[0]).rpartition("-")[2]
        sent = {w: b for w, b in client.run(_input_transfers, names).items()}
        copies = client.run(_post_copies, token)
        if transport == "auto":
            assert describe(futures).transport == "shared memory"
            assert {k for _, _, k in describe(futures).links} <= {"shared memory", "same worker"}
            assert not any(sent.values()), sent
            for w in ws:  # one post of its own, one read of every other worker's
                assert [c for c in copies[w] if c[0] == "write"] == [("write", posted, pids[w])], copies[w]
                reads = [c for c in copies[w] if c[0] == "read"]
                assert sorted(owner for _, _, owner in reads) == sorted(pids[v] for v in ws if v != w), reads
                assert all(nbytes == posted for _, nbytes, _ in reads), reads
        else:
            assert describe(futures).transport == "dask"
            assert not any(copies.values()), copies
            if ranks == 4:  # values, read by Dask's get_data (a worker holding several sends their sum by RPC)
                assert all(len(sent[w]) == 3 and min(sent[w]) >= n * 8 for w in ws), sent
        del futures, parts
    settled(client, client.run(lambda: shm_pool.current().directory).popitem()[1])


def test_direct_calls_started_in_opposite_orders_do_not_wait_for_each_other(client, shm_dir):
    """Several ``direct`` calls at once, whose tasks each worker may run in
    any order: a task waiting for a peer's post leaves its worker's slot, so
    another call's task runs and posts; all finish with the right sums."""
    data = [[np.arange(5_000) * (c + 1) + r for r in range(4)] for c in range(6)]
    launched = [flowreduce.allreduce(client, scatter(client, arrays), algorithm="direct") for arrays in data]
    for arrays, out in zip(data, client.gather(launched)):
        for o in out:
            np.testing.assert_array_equal(o, sum(arrays))
    del launched
    settled(client, shm_dir)


OPS = [("sum", "int64"), ("prod", "int32"), ("max", "uint8"), ("mean", "int16"), ("mean", "float32"),
       ("sum", "bool"), ("logaddexp", "float64"), ("sum", "complex64")]


@pytest.mark.parametrize("op,dtype", OPS, ids=[f"{o}-{d}" for o, d in OPS])
@pytest.mark.parametrize("algorithm", ["shm-direct", "ring", "direct"])
def test_numbers_match_numpy(client, algorithm, op, dtype):
    """Ranks 1..8 on 4 workers (ranks sharing workers from 5 on), lengths
    from empty to past the publishing threshold."""
    calls, expected = [], []
    for p in (1, 2, 5, 8):
        for n in (0, 1, 1001, 20_000):
            rng = np.random.default_rng(p * 100 + n)
            arrays = [(rng.integers(0, 3, size=n) if dtype != "bool" else rng.integers(0, 2, size=n)).astype(dtype)
                      for _ in range(p)]
            ufunc = {"sum": np.add, "prod": np.multiply, "mean": np.add, "max": np.maximum, "min": np.minimum}.get(op) or getattr(np, op)
            counted = dtype == "bool" and op in ("sum", "prod")  # booleans count in int64, as np.sum does
            exp = functools.reduce(ufunc, [a.astype(np.int64) for a in arrays] if counted else arrays)
            expected.append(exp / p if op == "mean" else exp)
            calls.append(flowreduce.allreduce(client, scatter(client, arrays), op=op, algorithm=algorithm))
    for futures, exp in zip(calls, expected):
        for r, o in enumerate(client.gather(futures)):
            assert o.dtype == exp.dtype and o.shape == exp.shape, (r, o.dtype, exp.dtype)
            np.testing.assert_allclose(o, exp, rtol=1e-5, err_msg=f"rank {r}")
    del calls, futures
    settled(client, client.run(lambda: shm_pool.current().directory).popitem()[1])


def test_concurrent_calls_on_one_host(client, shm_dir):
    data = [[np.arange(30_000) * (c + 1) + r for r in range(6)] for c in range(8)]
    launched = [flowreduce.allreduce(client, scatter(client, arrays), algorithm=alg)
                for arrays, alg in zip(data, ["shm-direct", "ring"] * 4)]
    for arrays, out in zip(data, client.gather(launched)):
        for o in out:
            np.testing.assert_array_equal(o, sum(arrays))
    del launched
    settled(client, shm_dir)


def _owns_its_memory(key, dask_worker=None):
    x = dask_worker.data[key]
    return x.flags.writeable and not shm_pool.current().shares_memory(x)


def test_results_are_ordinary_arrays(client, shm_dir):
    """The next call reuses the segments: earlier results must not change."""
    first = [np.full(100_000, r, dtype=np.int64) for r in range(4)]
    kept = flowreduce.allreduce(client, scatter(client, first), algorithm="shm-direct")
    client.gather(kept)
    again = flowreduce.allreduce(client, scatter(client, [a * 7 for a in first]), algorithm="shm-direct")
    np.testing.assert_array_equal(client.gather(again)[0], np.full(100_000, 42))
    for r, f in enumerate(kept):
        np.testing.assert_array_equal(f.result(), np.full(100_000, 6), err_msg=f"rank {r}")
        owner = client.who_has([f])[f.key][0]
        assert client.run(_owns_its_memory, f.key, workers=[owner])[owner]
    del kept, again, f
    settled(client, shm_dir)


def _buffer_of(key, dask_worker=None):
    """id of the result buffer under a key's value on this worker (None: not in one)."""
    import mmap

    x = dask_worker.data[key]
    while isinstance(x, np.ndarray):
        x = x.base
    x = x.obj if isinstance(x, memoryview) else x
    return id(x) if isinstance(x, mmap.mmap) else None


def test_results_are_made_in_warm_buffers_given_back_with_their_keys(shm_dir):
    """A large result is written into a buffer of the worker's result pool
    (pages touched by an earlier result, not fresh ones): the buffer is not
    lent again while the result's key is held (a later call leaves it
    unchanged), and once the key is released the next result on that
    worker is made in it."""
    from distributed import wait

    n = 10**6  # 8 MB of int64 per rank
    first = [np.full(n, r, dtype=np.int64) for r in range(4)]
    with shm_cluster(shm_dir, **{"flowreduce.shm.idle-seconds": 600}) as cluster, Client(cluster) as client:
        def buffers(futures):
            where = {f.key: client.who_has([f])[f.key][0] for f in futures}
            return {k: (w, client.run(_buffer_of, k, workers=[w])[w]) for k, w in where.items()}

        kept = flowreduce.allreduce(client, scatter(client, first), algorithm="shm-direct")
        wait(kept)
        lent = buffers(kept)
        assert all(b is not None for _, b in lent.values()), lent
        second = flowreduce.allreduce(client, scatter(client, [a * 7 for a in first]), algorithm="shm-direct")
        wait(second)
        assert not {b for _, b in buffers(second).values()} & {b for _, b in lent.values()}
        for r, f in enumerate(kept):
            np.testing.assert_array_equal(f.result(), np.full(n, 6), err_msg=f"rank {r}")
        keys = [f.key for f in kept]
        del kept, f
        assert wait_until(lambda: not any(client.run(lambda dask_worker: [k for k in keys if k in dask_worker.data])
                                          .values()), 30)
        third = flowreduce.allreduce(client, scatter(client, [a * 2 for a in first]), algorithm="shm-direct")
        for r, x in enumerate(client.gather(third)):
            np.testing.assert_array_equal(x, np.full(n, 12), err_msg=f"rank {r}")
        again = sorted(buffers(third).values())
        assert again == sorted(lent.values())  # each worker's given-back buffer, lent again
        del second, third
        assert_clean(client)
    assert not shm_pool.segments(shm_dir)


def _boom(a, b):
    raise ArithmeticError("no")


@pytest.mark.parametrize("algorithm", ["shm-direct", "direct", "direct@dask"])
def test_no_segment_left_after_an_error(client, shm_dir, algorithm):
    parts = scatter(client, [np.ones(100_000) for _ in range(4)])
    algorithm, _, transport = algorithm.partition("@")
    futures = flowreduce.allreduce(client, parts, algorithm=algorithm, op=_boom, transport=transport or "auto")
    with pytest.raises(ArithmeticError) as caught:
        client.gather(futures)
    for e in {id(x): x for x in [caught.value, *(f.exception() for f in futures)]}.values():
        e.__traceback__ = e.__context__ = None  # frames holding `futures` (see test_errors.py)
    del futures, caught, e
    gc.collect()
    settled(client, shm_dir)


def test_no_segment_left_after_cancellation(client, shm_dir):
    parts = scatter(client, [np.ones(2_000_000) for _ in range(4)])
    for alg in ("shm-direct", "ring", "direct"):
        futures = flowreduce.allreduce(client, parts, algorithm=alg)
        client.cancel(futures)
        del futures
    settled(client, shm_dir)


def test_pool_stays_bounded_over_many_calls(client, shm_dir):
    """200 calls here (each call's locate round trip makes 1,000 slow on a
    shared CI machine; test_shm_pool runs 1,000 leases against the bound)."""
    parts = scatter(client, [np.arange(20_000.0) + r for r in range(4)])  # past min-bytes: shared memory
    for _ in range(10):
        batch = [flowreduce.allreduce(client, parts, algorithm="shm-direct") for _ in range(20)]
        for out in client.gather(batch):
            np.testing.assert_array_equal(out[0], 4 * np.arange(20_000.0) + 6)
    per_worker = usage(client)
    # reused, not grown: at most one segment per call running at once (a batch), within the bound
    assert all(s["leased"] + s["free"] <= 20 and s["bytes"] <= 4 << 30 for s in per_worker.values()), per_worker
    assert len(shm_pool.segments(shm_dir)) <= 20 * len(per_worker)
    del batch
    settled(client, shm_dir)


def test_transport_dask_uses_no_shared_memory(tmp_path):
    d = str(tmp_path)
    with shm_cluster(d, n_workers=2) as cluster, Client(cluster) as c:
        arrays = [np.arange(200_000.0) * r for r in range(4)]
        for alg in ("shm-direct", "ring"):
            futures = flowreduce.allreduce(c, scatter(c, arrays), algorithm=alg, transport="dask")
            np.testing.assert_array_equal(c.gather(futures)[3], sum(arrays))
            assert describe(futures).transport == "dask"
            assert shm_pool.segments(d) == []
        with pytest.raises(ValueError, match="unknown transport 'mpi'; valid: auto, shm, dask"):
            flowreduce.allreduce(c, scatter(c, arrays), transport="mpi")


def _record_logs(dask_worker=None):
    import logging.handlers

    handler = logging.handlers.BufferingHandler(10_000)
    logging.getLogger("flowreduce").addHandler(handler)
    dask_worker._flowreduce_test_log = handler


def _fallback_lines(dask_worker=None) -> list[str]:
    return [r.getMessage() for r in dask_worker._flowreduce_test_log.buffer
            if "same-host transfers use Dask's comm" in r.getMessage()]


@pytest.mark.parametrize("where", ["missing", "not-a-directory"])
def test_unusable_directory_falls_back_with_one_line(tmp_path, where):
    d = tmp_path / "gone"
    if where == "not-a-directory":
        d.write_text("a file")
    with shm_cluster(str(d), n_workers=2) as cluster, Client(cluster) as c:
        c.run(_record_logs)
        arrays = [np.arange(100_000.0) * (r + 1) for r in range(4)]
        for alg in ("shm-direct", "ring", "direct", "shm-direct"):
            out = c.gather(flowreduce.allreduce(c, scatter(c, arrays), algorithm=alg))
            for o in out:
                np.testing.assert_array_equal(o, sum(arrays))
        for w, said in c.run(_fallback_lines).items():
            assert len(said) == 1, (w, said)
            assert str(d) in said[0]
        assert all(s["reason"] for s in usage(c).values())
        assert_clean(c)


def test_tiny_tmpfs_falls_back(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    r = os.system(f"mount -t tmpfs -o size=4m tmpfs {d} 2>/dev/null")
    if r:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with shm_cluster(str(d), n_workers=2) as cluster, Client(cluster) as c:
            c.run(_record_logs)
            arrays = [np.arange(1_000_000.0) * (r + 1) for r in range(4)]  # 8 MB: no room
            for alg in ("shm-direct", "direct", "shm-direct", "direct"):
                out = c.gather(flowreduce.allreduce(c, scatter(c, arrays), algorithm=alg))
                np.testing.assert_array_equal(out[1], sum(arrays))
            assert [len(said) for said in c.run(_fallback_lines).values()] == [1, 1]
            # direct's posts that could not be had are posted "unfit", taken down shortly after
            assert wait_until(lambda: shm_pool.segments(str(d)) == [], 10), shm_pool.segments(str(d))
    finally:
        os.system(f"umount {d}")


def _pid(dask_worker=None):
    return os.getpid()


def test_segments_of_a_killed_worker_are_reclaimed(tmp_path, caplog):
    # flowreduce's defaults loaded (as in a full run), so shm_cluster's dask.config.set changes them in
    # place and undoes that in the nanny's shallow config snapshot: the restarted worker must still use d
    dask.config.update_defaults({"flowreduce": {"shm": {k: flowreduce_config.get(f"shm.{k}") for k in shm_pool.KEYS}}})
    d = f"/dev/shm/flowreduce-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(d)
    try:
        with shm_cluster(d, n_workers=2, **{"flowreduce.shm.idle-seconds": 600}) as cluster, Client(cluster) as c:
            arrays = [np.arange(100_000.0) for _ in range(2)]
            c.gather(flowreduce.allreduce(c, scatter(c, arrays), algorithm="shm-direct"))
            pids = c.run(_pid)
            victim_addr, victim = sorted(pids.items())[0]
            assert any(f"-{victim}-" in n for n in shm_pool.segments(d))  # free, kept for reuse
            os.kill(victim, signal.SIGKILL)
            assert wait_until(lambda: len(c.nthreads()) == 2 and victim_addr not in c.nthreads(), 60)
            out = c.gather(flowreduce.allreduce(c, scatter(c, arrays), algorithm="shm-direct"))
            np.testing.assert_array_equal(out[0], 2 * arrays[0])
            # the restarted worker's pool (made at its plugin's setup, or by this call) reclaimed them
            assert wait_until(lambda: not any(f"-{victim}-" in n for n in shm_pool.segments(d)), 60)
        assert shm_pool.segments(d) == []  # closing workers unlink their own
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_pool_usage_is_visible(client):
    parts = scatter(client, [np.ones(300_000) for _ in range(4)])
    client.gather(flowreduce.allreduce(client, parts, algorithm="shm-direct"))
    stats = usage(client)
    assert set(stats) == set(workers_of(client))
    assert all(s["bytes"] >= 300_000 * 8 and s["reason"] is None for s in stats.values()), stats


def test_traces_show_shared_memory_copies_per_link(client):
    from flowreduce.tracing import summarize

    n, ws = 100_000, workers_of(client)
    parts = scatter(client, [np.full(n, float(r)) for r in range(4)])
    with flowreduce.trace(client) as tr:
        futures = flowreduce.allreduce(client, parts, algorithm="shm-direct")
        client.gather(futures)
    copies = [e for e in tr.events if e.phase == "shm-copy"]
    assert {e.detail for e in copies} == {"shm-write", "shm-read"}
    assert all(e.token == futures[0].key[0].rpartition("-")[2] for e in copies)
    # every worker reads its slice of every peer (reduce-scatter) and every peer's slice (all-gather)
    expected = {(a, b): 2 * n * 8 // 4 for a in ws for b in ws if a != b}
    assert summarize(tr).shm_links == expected


def test_sixty_four_ranks_on_four_workers(client, shm_dir):
    """Ranks sharing workers are summed in one task per worker (the graph's
    size: test_direct_graph_is_three_levels); here the numbers."""
    arrays = [np.arange(1000, dtype=np.int64) * r for r in range(64)]
    futures = flowreduce.allreduce(client, scatter(client, arrays), algorithm="shm-direct")
    assert describe(futures).plan.options["groups"] == [list(range(w, 64, 4)) for w in range(4)]
    for r, o in enumerate(client.gather(futures)):
        np.testing.assert_array_equal(o, np.arange(1000) * (63 * 64 // 2), err_msg=f"rank {r}")
    del futures
    settled(client, shm_dir)


def _process_memory(dask_worker=None) -> int:
    """What Dask's memory manager reads (pause, spill, terminate): the process's RSS."""
    return dask_worker.monitor.get_process_memory()


def _keep_idle(seconds: float, dask_worker=None) -> float:
    pool = shm_pool.pool()
    before, pool.idle = pool.idle, seconds
    return before


def _drop_pool(dask_worker=None) -> int:
    """Unlink every free segment and unmap every peer's now (as idle expiry does)."""
    import time

    dropped = shm_pool.current().release_idle(now=time.monotonic() + 1e9)
    gc.collect()  # the segments' last views
    return dropped


def _pooled_segment_in_rss(nbytes: int, dask_worker=None) -> tuple[int, int, int]:
    """A segment written and given back to this worker's pool (free, still
    mapped), then dropped: (pool bytes, RSS held, RSS after the drop)."""
    pool = shm_pool.pool()
    seg = pool.lease(nbytes)
    seg.view(np.uint8, nbytes)[:] = 1  # the pages a call's write touches
    pool.give_back(seg)
    del seg
    held = (pool.nbytes, _process_memory(dask_worker))
    _drop_pool()
    return (*held, _process_memory(dask_worker))


def test_pool_counts_in_the_workers_process_memory(client, shm_dir):
    """Dask's memory manager watches each worker's RSS, which on Linux
    includes the shared pages a process touched (RssShmem): its pool's
    segments, and the pages of peers' segments it read. After a large call
    every worker's RSS has grown by at least its pool's bytes (usage()),
    and dropping a pooled segment gives its bytes back."""
    n = 4_000_000  # 32 MB per rank
    parts = scatter(client, [np.full(n, float(r)) for r in range(4)])
    client.run(_keep_idle, 3600)  # this cluster drops idle segments after IDLE seconds
    try:
        client.run(_drop_pool)
        before = client.run(_process_memory)
        futures = flowreduce.allreduce(client, parts, algorithm="shm-direct")
        client.gather(futures)
        del futures  # the results are fresh arrays: gone with their keys
        assert wait_until(lambda: leased(client) == 0, 30), usage(client)
        pool = usage(client)
        grown = {w: m - before[w] for w, m in client.run(_process_memory).items()}
        client.run(_drop_pool)
        own = client.run(_pooled_segment_in_rss, 8 * n)
    finally:
        client.run(_keep_idle, IDLE)
    for w, s in pool.items():
        assert s["bytes"] >= n * 8, s
        assert grown[w] >= 0.9 * s["bytes"], (w, grown[w], s)
    for w, (nbytes, held, dropped) in own.items():
        assert nbytes >= 8 * n and held - dropped >= 0.9 * nbytes, (w, nbytes, held, dropped)
    del parts
    settled(client, shm_dir)


def test_pool_stays_within_a_share_of_the_workers_memory_limit(tmp_path):
    """The pool's pages count in the worker's RSS, by which Dask's memory
    manager pauses and kills workers: the bound is at most
    ``memory-fraction`` of the memory limit, and a value past it goes
    through Dask's comm (the result stays right)."""
    d = str(tmp_path)
    settings = {"flowreduce.shm.directory": d, "flowreduce.shm.idle-seconds": IDLE,
                "flowreduce.shm.memory-fraction": 0.25}
    with dask.config.set(settings):
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                               memory_limit="400MiB")
    with cluster, Client(cluster) as c:
        small = [np.arange(100_000, dtype=np.int64) * (r + 1) for r in range(2)]  # 0.8 MB: through the pool
        out = flowreduce.allreduce(c, scatter(c, small), algorithm="shm-direct")
        np.testing.assert_array_equal(c.gather(out)[1], small[0] + small[1])
        limits = {s["limit"] for s in usage(c).values()}
        assert limits == {int(0.25 * (400 << 20))}, usage(c)
        big = [np.arange(15_000_000, dtype=np.int64) + r for r in range(2)]  # 120 MB: past the 100 MiB bound
        out = flowreduce.allreduce(c, scatter(c, big), algorithm="shm-direct")
        np.testing.assert_array_equal(c.gather(out)[0], big[0] + big[1])
        assert all(s["bytes"] <= 100 << 20 for s in usage(c).values()), usage(c)
        del out
