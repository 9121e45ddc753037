"""SPMD jobs (flowreduce.spmd): every collective against numpy, on every route
(shared memory in a host, shared memory per worker with a plan between
workers, every rank alone over Dask's comm) and every algorithm; the
scheduler hears nothing after the first collective; a rank that raises, a
worker SIGKILLed and a timeout each fail every rank fast, naming the rank;
``restarts=`` completes a job whose worker was killed; nothing is left in
/dev/shm. Real multi-process LocalClusters: 2 single-threaded workers, so up
to 8 ranks share workers."""

from __future__ import annotations

import dataclasses
import functools
import glob
import inspect
import os
import re
import signal
import time
from collections import Counter

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait
from utils import asleep_until_woken, wait_until

import flowreduce
from flowreduce.errors import AllreduceTimeoutError, FlowreduceError, InputError, OptionError, WorkerLostError
from flowreduce.shm.host_group import SPLIT_BYTES

ALGORITHMS = [a for a in flowreduce.ALGORITHMS if a != "auto"] + ["auto"]
LENGTHS = (0, 1, 1000, 1001)
OPS = ("sum", "prod", "min", "max", "mean", "bitwise_xor")
#: route -> the dask config value of flowreduce.spmd.transport
ROUTES = {"shm": "auto", "shm-per-worker+dask": "worker", "dask": "dask"}


def _segments(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "frspmd-*")))


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            yield c


@pytest.fixture
def fresh_client():
    """A cluster of its own: for the tests that kill workers or wrap the scheduler's handlers."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            yield c


@pytest.fixture(autouse=True)
def no_segment_left(shm_dir):
    """The jobs' segments in a directory of this module's (other sessions' jobs share /dev/shm), none left after."""
    with dask.config.set({"flowreduce.shm.directory": shm_dir}):
        yield
    deadline = time.monotonic() + 5
    while _segments(shm_dir) and time.monotonic() < deadline:  # a failed job's survivors sweep as they end
        time.sleep(0.05)
    assert _segments(shm_dir) == [], "an SPMD job left shared-memory segments behind"


def _input(rank: int, n: int) -> np.ndarray:
    """Small integers (sums, products and xors exact), different per rank and element."""
    return ((np.arange(n, dtype=np.int64) * (rank + 3) + rank) % 5) + 1


def _collectives(comm, lengths, ops, algorithm):
    out = {}
    for n in lengths:
        x = _input(comm.rank, n)
        for op in ops:
            out["allreduce", n, op] = comm.allreduce(x, op=op, algorithm=algorithm)
        out["broadcast", n] = comm.broadcast(x if comm.rank == comm.size - 1 else None, root=comm.size - 1)
        out["allgather", n] = comm.allgather(x[: n - comm.rank % 2] if n else x)  # shapes differ by rank
    comm.barrier()
    return out


def _expected(size, lengths, ops):
    out = {}
    for n in lengths:
        xs = np.stack([_input(r, n) for r in range(size)])
        for op in ops:
            out["allreduce", n, op] = np.mean(xs, axis=0) if op == "mean" else getattr(np, {
                "sum": "add", "prod": "multiply", "min": "minimum", "max": "maximum"}.get(op, op)).reduce(xs, axis=0)
        out["broadcast", n] = xs[-1]
        out["allgather", n] = [x[: n - r % 2] if n else x for r, x in enumerate(xs)]
    return out


def _check(results, expected):
    for rank, got in enumerate(results):
        assert got.keys() == expected.keys()
        for what, want in expected.items():
            if what[0] == "allgather":
                assert len(got[what]) == len(want)
                for a, b in zip(got[what], want):
                    np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {what}")
            else:
                assert got[what].dtype == want.dtype, (rank, what)
                np.testing.assert_array_equal(got[what], want, err_msg=f"rank {rank} {what}")


@pytest.mark.parametrize("ranks", range(1, 9))
@pytest.mark.parametrize("route", ROUTES)
def test_every_collective_matches_numpy(client, route, ranks):
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        futures = flowreduce.spmd(client, _collectives, ranks=ranks, lengths=LENGTHS, ops=OPS, algorithm="auto",
                                  timeout=30)
        _check(client.gather(futures), _expected(ranks, LENGTHS, OPS))


def _allreduces(comm, lengths, algorithm):
    return {n: comm.allreduce(_input(comm.rank, n), algorithm=algorithm) for n in lengths}


@pytest.mark.parametrize("ranks", range(1, 9))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_between_ranks(client, algorithm, ranks):
    """Every rank alone (over Dask's comm): the plan runs over all the ranks."""
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        futures = flowreduce.spmd(client, _allreduces, ranks=ranks, lengths=LENGTHS, algorithm=algorithm, timeout=30)
        for rank, got in enumerate(client.gather(futures)):
            for n in LENGTHS:
                want = np.sum([_input(r, n) for r in range(ranks)], axis=0)
                np.testing.assert_array_equal(got[n], want, err_msg=f"{algorithm} rank {rank} n={n}")


def _allreduces_on_the_thread(comm, lengths, algorithm):
    comm.plan_on_loop = False
    return _allreduces(comm, lengths, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_between_ranks_on_the_ranks_thread(client, algorithm):
    """The plan walked on each rank's thread (``plan_on_loop = False``), not its worker's event loop: the same sums."""
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        futures = flowreduce.spmd(client, _allreduces_on_the_thread, ranks=5, lengths=LENGTHS, algorithm=algorithm,
                                  timeout=30)
        for rank, got in enumerate(client.gather(futures)):
            for n in LENGTHS:
                want = np.sum([_input(r, n) for r in range(5)], axis=0)
                np.testing.assert_array_equal(got[n], want, err_msg=f"{algorithm} rank {rank} n={n}")


class _TakeSpy:
    """A rank's mailbox, counting the takes of its collectives: on the rank's thread (``take``) and on the
    worker's event loop (``take_async``); everything else is the worker's mailbox's."""

    def __init__(self, box):
        self.box, self.takes = box, Counter()

    def __getattr__(self, name):
        return getattr(self.box, name)

    def take(self, *args, **kwargs):
        self.takes["thread"] += 1
        return self.box.take(*args, **kwargs)

    async def take_async(self, *args, **kwargs):
        self.takes["loop"] += 1
        return await self.box.take_async(*args, **kwargs)


def _between_hosts_on_the_loop(comm, lengths):
    spy = comm.mailbox = _TakeSpy(comm.mailbox)
    out = {}
    for n in lengths:
        x = _input(comm.rank, n)
        for root in range(comm.size):
            out["broadcast", n, root] = comm.broadcast(x if comm.rank == root else None, root=root)
        out["allgather", n] = comm.allgather(x[: n - comm.rank % 2] if n else x)
        comm.barrier()
        out["tree", n] = comm.allreduce(x.astype(np.float64), deterministic=True)  # gathered between leaders
    out["auto"] = comm.allreduce(_input(comm.rank, 1000))  # the first auto between hosts: the link's probe too
    comm.barrier()
    return out, dict(spy.takes), comm.link is not None


@pytest.mark.parametrize("ranks", [2, 3, 5])
@pytest.mark.parametrize("route", ["shm-per-worker+dask", "dask"])
def test_broadcast_allgather_barrier_between_hosts_run_on_the_event_loop(client, route, ranks):
    """Between hosts (every worker a host, or every rank alone), broadcast from every root, all-gather,
    barrier, the deterministic all-reduce's gather and the link's probe take every value on the worker's
    event loop, none on the rank's thread; ranks share 2 single-threaded workers; the values are numpy's."""
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        results = client.gather(flowreduce.spmd(client, _between_hosts_on_the_loop, ranks=ranks, lengths=LENGTHS,
                                                timeout=30))
    leaders = {0, 1} if route == "shm-per-worker+dask" else set(range(ranks))
    for rank, (got, takes, measured) in enumerate(results):
        assert takes.get("thread", 0) == 0, f"rank {rank} took {takes['thread']} values on its thread"
        assert rank not in leaders or takes.get("loop", 0) > 0, (rank, takes)
        assert measured, f"rank {rank} did not learn the link"
        for n in LENGTHS:
            xs = [_input(r, n) for r in range(ranks)]
            for root in range(ranks):
                np.testing.assert_array_equal(got["broadcast", n, root], xs[root], err_msg=f"rank {rank} root {root}")
            for r, (a, b) in enumerate(zip(got["allgather", n], [x[: n - r % 2] if n else x for r, x in enumerate(xs)])):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} allgather {n} part {r}")
            np.testing.assert_array_equal(got["tree", n], flowreduce.reference_reduce(
                [x.astype(np.float64) for x in xs], "sum", order="tree"))
        np.testing.assert_array_equal(got["auto"], np.sum([_input(r, 1000) for r in range(ranks)], axis=0))


def _float_and_torch(comm):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(comm.rank).standard_normal(1001)
    t = torch.arange(7, dtype=torch.float32) * (comm.rank + 1)
    scalar = torch.tensor(comm.rank + 1, dtype=torch.int64)  # 0-d, as BatchNorm's num_batches_tracked
    return (comm.allreduce(x), comm.allreduce(x, op="mean"), comm.allreduce(t), comm.broadcast(t, root=0),
            comm.allgather(t), _bfloat16(comm.allreduce(torch.ones(3, dtype=torch.bfloat16))),
            (comm.allreduce(scalar), comm.broadcast(scalar, root=1), *comm.allgather(scalar)))


def _bfloat16(t):
    return str(t.dtype), t.float()  # Dask's serialisation of results does not take bfloat16 tensors


@pytest.mark.parametrize("route", ROUTES)
def test_floats_are_the_same_bits_on_every_rank_and_tensors_stay_tensors(client, route):
    torch = pytest.importorskip("torch")
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        results = client.gather(flowreduce.spmd(client, _float_and_torch, ranks=5, timeout=30))
    xs = [np.random.default_rng(r).standard_normal(1001) for r in range(5)]
    for total, mean, t, b, g, bf, scalars in results:
        assert [(tuple(s.shape), s.dtype, s.item()) for s in scalars] == \
            [((), torch.int64, v) for v in (15, 2, *range(1, 6))]
        np.testing.assert_allclose(total, np.sum(xs, axis=0), rtol=1e-12)
        np.testing.assert_array_equal(total, results[0][0])  # bitwise identical across ranks
        np.testing.assert_array_equal(mean, results[0][1])
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
        assert torch.equal(t, torch.arange(7, dtype=torch.float32) * 15)
        assert torch.equal(b, torch.arange(7, dtype=torch.float32))
        assert [x.tolist() for x in g] == [(torch.arange(7, dtype=torch.float32) * (r + 1)).tolist() for r in range(5)]
        assert bf[0] == "torch.bfloat16" and bf[1].tolist() == [5.0, 5.0, 5.0]


@pytest.mark.parametrize("algorithm", ["butterfly", "ring", "recursive-doubling", "reduce-broadcast", "tree"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_a_plan_between_leaders_runs_in_chunks(algorithm, chunks):
    """run_plan over 5 ranks on threads, a mailbox of queues between them: with chunks, each rank walks
    the plan node by node and chunk by chunk (sending a step's first chunk before computing the next),
    and the sums are numpy's at lengths that do and do not split evenly (7: chunks of no element)."""
    import queue
    import threading

    from flowreduce.ops import resolve_op
    from flowreduce.spmd.planrun import run_plan

    p = 5
    plan = flowreduce.plan(algorithm, p, chunks=chunks)
    for n in (7, 1000, 1001):
        xs = [_input(r, n) for r in range(p)]
        boxes: dict = {}
        lock = threading.Lock()

        def box(src, dest, key):
            with lock:
                return boxes.setdefault((src, dest, key), queue.Queue())

        results: dict = {}
        sent: list = []  # (value sent, its bytes then): run_plan sends values nobody changes afterwards

        def put(r, dest, key, v):
            with lock:
                sent.append((v, v.copy()))
            box(r, dest, key).put(v)

        def rank(r):
            results[r] = run_plan(plan, r, xs[r], resolve_op("sum"), lambda dest, key, v, r=r: put(r, dest, key, v),
                                  lambda src, key, r=r: box(src, r, key).get(timeout=30))

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        want = np.sum(xs, axis=0)
        for r in range(p):
            np.testing.assert_array_equal(results[r][0], want, err_msg=f"rank {r} n={n}")
        for r in range(p):
            results[r][0][...] = -1  # the callers change their inputs and results: no message changes
            xs[r][...] = -1
        for value, then in sent:
            np.testing.assert_array_equal(value, then)


def _big_between_leaders(comm, n):
    x = np.full(n, comm.rank + 1, dtype=np.int64)
    return comm.plan_for("auto", x.nbytes).chunks, comm.allreduce(x)


def test_a_big_vector_between_hosts_runs_in_chunks(client):
    """Every rank alone (transport dask): a vector of two PIPELINE_BYTES and more runs in chunks."""
    from flowreduce.spmd.comm import PIPELINE_BYTES

    n = 2 * PIPELINE_BYTES // 8 + 5
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        got = client.gather(flowreduce.spmd(client, _big_between_leaders, ranks=3, n=n, timeout=60))
    for chunks, y in got:
        assert chunks == 2
        assert y.shape == (n,) and bool(np.all(y == 6))


def _named_big(comm, n):
    return comm.allreduce(np.full(n, comm.rank + 1, dtype=np.int64), algorithm="ring")


def test_a_named_plan_over_big_values_between_hosts(client):
    """Every rank alone (transport dask), a named ring (never cut in chunks) of values past the event
    loop's limit (LOOP_BYTES): the walk's stretches after them run on a thread, sending from there."""
    from flowreduce.spmd.planrun import LOOP_BYTES

    n = 3 * (LOOP_BYTES // 8) + 7  # a ring of 3 moves thirds: each past the limit
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        got = client.gather(flowreduce.spmd(client, _named_big, ranks=3, n=n, timeout=60))
    for y in got:
        assert y.shape == (n,) and bool(np.all(y == 6))


def test_a_walk_on_the_event_loop_hands_big_values_to_a_thread():
    """Two ranks' butterfly walked on one event loop (run_plan_async), messages through futures: values
    past LOOP_BYTES are reduced and sent on from another thread, smaller ones on the loop; the sums are
    numpy's."""
    import asyncio
    import threading

    from flowreduce.ops import resolve_op
    from flowreduce.spmd.planrun import LOOP_BYTES, run_plan_async

    plan = flowreduce.plan("butterfly", 2)

    async def run(n):
        loop = asyncio.get_running_loop()
        boxes: dict = {}
        on_loop: list[bool] = []

        def box(key):
            return boxes.setdefault(key, loop.create_future())

        def sender(me):
            def send(dest, node, value):
                on_loop.append(threading.current_thread() is threading.main_thread())
                loop.call_soon_threadsafe(lambda: box((dest, me, node)).set_result(value))
            return send

        def receiver(me):
            async def receive(src, node):
                return await box((me, src, node))
            return receive

        xs = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(2)]
        got = await asyncio.gather(*(run_plan_async(plan, r, xs[r], resolve_op("sum"), sender(r), receiver(r))
                                     for r in range(2)))
        for value, _, _ in got:
            np.testing.assert_array_equal(value, xs[0] + xs[1])
        return on_loop

    assert all(asyncio.run(run(1001)))
    on_loop = asyncio.run(run(2 * (LOOP_BYTES // 8) + 1002))  # halves past the limit
    assert True in on_loop and False in on_loop, on_loop


def _wide_floats(rank: int, n: int) -> np.ndarray:
    """float32s of magnitudes 1e-6..1e6, so that another order of the sum gives other bits."""
    rng = np.random.default_rng(rank)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(np.float32)


def _sums_of_wide_floats(comm, lengths):
    return [comm.allreduce(_wide_floats(comm.rank, n)) for n in lengths]


def test_one_host_sums_floats_left_to_right_in_rank_order(client):
    """deterministic=False on one host: ((x0 + x1) + x2) + ..., the documented order, at every length (the
    small slots' one-step path, its one-element case, and the reduce-scatter from SPLIT_BYTES)."""
    lengths = [1, 2, 3, 1001, 40_000]
    results = client.gather(flowreduce.spmd(client, _sums_of_wide_floats, ranks=5, lengths=lengths, timeout=30))
    for i, n in enumerate(lengths):
        want = _wide_floats(0, n)
        for r in range(1, 5):
            want = want + _wide_floats(r, n)
        for rank, got in enumerate(results):
            assert got[i].dtype == np.float32
            assert got[i].tobytes() == want.tobytes(), (n, rank)


def _sums_across_the_split(comm, lengths):
    ints = [comm.allreduce(np.arange(n, dtype=np.int64) * (comm.rank + 1) + comm.rank) for n in lengths]
    return ints, [comm.allreduce(_wide_floats(comm.rank, n).astype(np.float64)) for n in lengths]


def test_one_host_sums_on_either_side_of_the_split(client):
    """Just under SPLIT_BYTES (one step through the small slots, every rank folding every slot) and
    from it (reduce-scatter and all-gather, each rank folding a slice), and sizes the split once put
    on the other side: integers equal numpy's sum, floats the left fold in rank order, the same bits
    on every rank."""
    step = SPLIT_BYTES // 8
    lengths = [8191, 8192, 10_000, step - 1, step, step + 1, 2 * step + 3]
    results = client.gather(flowreduce.spmd(client, _sums_across_the_split, ranks=4, lengths=lengths, timeout=30))
    for i, n in enumerate(lengths):
        ints = [np.arange(n, dtype=np.int64) * (r + 1) + r for r in range(4)]
        want = _wide_floats(0, n).astype(np.float64)
        for r in range(1, 4):
            want = want + _wide_floats(r, n).astype(np.float64)
        for rank, (got_ints, got_floats) in enumerate(results):
            assert got_ints[i].dtype == np.int64 and np.array_equal(got_ints[i], np.sum(ints, axis=0)), (n, rank)
            assert got_floats[i].tobytes() == want.tobytes(), (n, rank)


def _layouts(n):
    """Inputs of every memory layout a caller may hand in: strided, 2-d in C and Fortran order,
    transposed, 0-d (rank ``r`` adds ``r * 7``)."""
    def of(rank):
        full = np.arange(4 * n, dtype=np.int64) + rank * 7
        return {"strided": full[::4], "c": full.reshape(4, n), "fortran": np.asfortranarray(full.reshape(4, n)),
                "transposed": full.reshape(n, 4).T, "0-d": np.array(rank * 7, dtype=np.int64)}
    return of


def _sum_layouts(comm, lengths):
    return {(n, k): comm.allreduce(x) for n in lengths for k, x in _layouts(n)(comm.rank).items()}


@pytest.mark.parametrize("route", ROUTES)
def test_inputs_of_any_memory_layout_sum_as_numpy(client, route):
    """Strided, Fortran-ordered, transposed and 0-d inputs, under and over SPLIT_BYTES: numpy's sum
    over the ranks, of the input's shape."""
    lengths = [1000, SPLIT_BYTES // 8]  # the strided input alone is over the split at the second
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        results = client.gather(flowreduce.spmd(client, _sum_layouts, ranks=3, lengths=lengths, timeout=30))
    for n in lengths:
        for k in _layouts(n)(0):
            want = np.sum([_layouts(n)(r)[k] for r in range(3)], axis=0)
            for rank, got in enumerate(results):
                assert got[n, k].shape == want.shape, (n, k, rank)
                np.testing.assert_array_equal(got[n, k], want, err_msg=f"{k} n={n} rank {rank}")


def _subgroups(comm):
    evens = comm.subgroup(range(0, comm.size, 2))
    x = np.array([comm.rank])
    within = evens.allreduce(x) if evens is not None else None
    return comm.allreduce(x), within, evens.rank if evens is not None else None


@pytest.mark.parametrize("route", ROUTES)
def test_subgroup(client, route):
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        results = client.gather(flowreduce.spmd(client, _subgroups, ranks=5, timeout=30))
    for rank, (everyone, within, sub_rank) in enumerate(results):
        assert everyone.tolist() == [10]
        if rank % 2:
            assert within is None and sub_rank is None
        else:
            assert within.tolist() == [0 + 2 + 4] and sub_rank == rank // 2


def test_per_rank_arguments_place_ranks_where_their_futures_live(client):
    workers = sorted(client.scheduler_info()["workers"])
    parts = [client.submit(np.full, 3, i, workers=[workers[i % 2]], pure=False) for i in range(4)]

    def fn(comm, part, scale=1):
        from distributed import get_worker

        return get_worker().address, comm.allreduce(part * scale)

    results = client.gather(flowreduce.spmd(client, fn, parts, scale=2))
    assert [w for w, _ in results] == [workers[i % 2] for i in range(4)]
    assert all(r.tolist() == [12, 12, 12] for _, r in results)


def _mutating(comm, algorithm):
    x = np.arange(1001, dtype=np.int64) + comm.rank
    y = comm.allreduce(x, algorithm=algorithm)
    x += 10**6  # the caller reuses its input and its result at once, as a training loop does
    y += 10**6 * (comm.rank + 1)
    g = comm.allgather(x[:3])
    g[0] += 7
    comm.barrier()
    return y, g


@pytest.mark.parametrize("algorithm", ["reduce-broadcast", "butterfly", "recursive-doubling"])
def test_results_are_the_callers_own(client, algorithm):
    """Nothing a rank returns is shared with a peer or still read after the call (3 ranks on 2 workers,
    all over Dask's comm: ranks 0 and 2 share a worker, so a value sent between them is not serialised)."""
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        results = client.gather(flowreduce.spmd(client, _mutating, ranks=3, algorithm=algorithm, timeout=30))
    total = np.sum([np.arange(1001) + r for r in range(3)], axis=0)
    for rank, (y, g) in enumerate(results):
        np.testing.assert_array_equal(y, total + 10**6 * (rank + 1), err_msg=f"rank {rank}")
        assert [a.tolist() for a in g] == [[10**6 + r + i + (7 if r == 0 else 0) for i in range(3)] for r in range(3)]


# -- the scheduler hears nothing per collective ---------------------------------------------------------------------

_COUNTS: Counter = Counter()
#: What the scheduler hears on a clock, whatever runs (a longer job hears more of it): the workers' and the
#: client's heartbeats, batched streams' keepalives, the LocalCluster's polls of the scheduler (identity) and
#: its cluster-manager info (set_metadata).
PERIODIC = {"heartbeat_worker", "heartbeat-client", "keep-alive", "identity", "set_metadata",
            "client-releases-keys", "release-worker-data"}  # a task's release, not a collective's message


def _count_messages(dask_scheduler=None):
    """Wrap every handler of the scheduler, rpc and stream, to count what it receives."""
    for table in (dask_scheduler.handlers, dask_scheduler.stream_handlers):
        for op, handler in list(table.items()):
            if getattr(handler, "_counted", False):
                continue

            if inspect.iscoroutinefunction(handler):
                @functools.wraps(handler)  # distributed reads the signature (does it take comm?)
                async def counted(*args, _op=op, _handler=handler, **kwargs):
                    _COUNTS[_op] += 1
                    return await _handler(*args, **kwargs)
            else:
                @functools.wraps(handler)
                def counted(*args, _op=op, _handler=handler, **kwargs):
                    _COUNTS[_op] += 1
                    return _handler(*args, **kwargs)

            counted._counted = True
            table[op] = counted


def _counts(dask_scheduler=None):
    return {k: v for k, v in _COUNTS.items() if k not in PERIODIC}


def _many(comm, calls):
    x = np.arange(10, dtype=np.int64) + comm.rank
    for _ in range(calls):
        y = comm.allreduce(x)
    comm.barrier()
    return y


def _known(keys, dask_scheduler=None):
    return [k for k in keys if k in dask_scheduler.tasks]


def _messages_of_a_job(client, calls):
    before = Counter(client.run_on_scheduler(_counts))
    with dask.config.set({"flowreduce.spmd.transport": "worker"}):  # shared memory and Dask's comm both
        futures = flowreduce.spmd(client, _many, ranks=4, calls=calls, timeout=30)
        results = client.gather(futures)
    keys = [f.key for f in futures]
    del futures
    # the job's own tasks are released the same way whatever the collectives did, but when their release
    # messages arrive is up to Dask: count once the scheduler forgot them, and leave the release out
    assert wait_until(lambda: not client.run_on_scheduler(_known, keys), 10), "the job's tasks were never released"
    after = Counter(client.run_on_scheduler(_counts))
    return results, after - before


def test_no_scheduler_message_after_the_first_collective(fresh_client):
    client = fresh_client
    client.run_on_scheduler(_count_messages)
    _messages_of_a_job(client, 1)  # warm: plugins installed, places known
    _, one = _messages_of_a_job(client, 1)
    results, many = _messages_of_a_job(client, 2000)
    assert all(r.tolist() == (np.arange(10) * 4 + 6).tolist() for r in results)
    assert sum(one.values()) > 0, "the counter counts nothing"
    extra = many - one
    assert sum(extra.values()) <= 4, f"2,000 collectives sent the scheduler more than 1 did: {dict(extra)}"


def _many_small(comm, rounds):
    return [comm.allreduce(_input(comm.rank, 10 + i % 7), algorithm="butterfly") for i in range(rounds)]


def _streams(dask_worker):
    from flowreduce.schedule.spmd_mailbox import mailbox_of

    box = mailbox_of(dask_worker)
    return {peer: (id(out.comm), out.dead) for peer, out in box.outboxes.items()}


def test_messages_between_workers_go_over_one_stream_per_peer(client):
    """Every rank alone (over Dask's comm), 4 ranks on 2 workers: hundreds of small all-reduces, the values
    numpy's, and every message from a worker to the other on one connection kept open for the next job."""
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        got = client.gather(flowreduce.spmd(client, _many_small, ranks=4, rounds=300, timeout=60))
        before = client.run(_streams)
        again = client.gather(flowreduce.spmd(client, _many_small, ranks=4, rounds=100, timeout=60))
        after = client.run(_streams)
    for i in range(300):
        want = np.sum([_input(r, 10 + i % 7) for r in range(4)], axis=0)
        for rank in range(4):
            np.testing.assert_array_equal(got[rank][i], want, err_msg=f"rank {rank} round {i}")
            if i < 100:
                np.testing.assert_array_equal(again[rank][i], want, err_msg=f"rank {rank} round {i}, job 2")
    workers = sorted(before)
    for w in workers:
        others = set(workers) - {w}
        assert set(before[w]) == others, f"{w} streams to {sorted(before[w])}, not one per other worker"
        assert after[w] == before[w], f"{w}: a stream was replaced or died between two jobs: {before[w]} {after[w]}"
        assert not any(dead for _, dead in after[w].values())


def test_a_malformed_inline_value_is_refused_not_raised():
    """A message whose inline value is not one of a mailbox's (a peer of another version, garbage) is logged
    and dropped by the stream handler (raising there would close the peer's stream); a well-formed one is put."""
    from flowreduce.schedule.spmd_mailbox import Mailbox

    box = Mailbox(object())
    for bad in ([], ["z", 1], ["a", "O", [1], b"x"], ["a", "<f8", [3], b"12"], ["l", 5], "text", 7, None):
        box.delivered(run="r", key=f"k{bad!r}", inline=bad)
    with pytest.raises(AllreduceTimeoutError):
        box.take("r", "k[]", deadline=time.monotonic(), what="test", rank=0, source=1)
    box.delivered(run="r", key="good", inline=["a", "<f8", [2], np.arange(2.0).tobytes()])
    got = box.take("r", "good", deadline=time.monotonic() + 5, what="test", rank=0, source=1)
    np.testing.assert_array_equal(got, [0.0, 1.0])
    assert got.flags.writeable


def _reduces_over_received(comm, algorithms, lengths):
    out = {}
    for algorithm in algorithms:
        for n in lengths:
            x = _input(comm.rank, n)
            keep = x.copy()
            out[algorithm, n] = [comm.allreduce(x, algorithm=algorithm) for _ in range(2)]
            assert np.array_equal(x, keep), "an all-reduce changed its input"
    return out


@pytest.mark.parametrize("ranks", [3, 8])
def test_a_reduce_writes_over_what_it_received_never_over_a_value_shared_in_the_worker(client, ranks):
    """Every rank alone (over Dask's comm), ranks sharing 2 workers: a plan's reduce may write its sum over a
    value it received (its own copy), but a value another rank of the same worker hands over is the sender's
    too and stays as it was: every rank's sums are numpy's, for plans whose reduces read received values first
    (butterfly, recursive doubling) and second (ring)."""
    algorithms = ("ring", "butterfly", "recursive-doubling")
    lengths = (1000, 40_000)
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        results = client.gather(flowreduce.spmd(client, _reduces_over_received, ranks=ranks, algorithms=algorithms,
                                                lengths=lengths, timeout=60))
    for n in lengths:
        want = np.sum([_input(r, n) for r in range(ranks)], axis=0)
        for rank, got in enumerate(results):
            for algorithm in algorithms:
                for i, y in enumerate(got[algorithm, n]):
                    np.testing.assert_array_equal(y, want, err_msg=f"rank {rank} {algorithm} n={n} call {i}")


def _spy_deliveries(dask_worker):
    """Record, per message of :data:`~flowreduce.schedule.spmd_mailbox.DELIVER` this worker is handed on a stream,
    whether its value came inside the message (``inline``) or as Dask-serialised frames (``value``)."""
    from flowreduce.schedule.spmd_mailbox import DELIVER

    handlers = dask_worker.stream_handlers
    seen = dask_worker.flowreduce_test_deliveries = []
    handler = dask_worker.flowreduce_test_handler = handlers[DELIVER]

    def spy(**msg):
        seen.append("inline" if msg.get("inline") is not None else "value")
        return handler(**msg)

    handlers[DELIVER] = spy
    return DELIVER


def _unspy_deliveries(dask_worker):
    from flowreduce.schedule.spmd_mailbox import DELIVER

    dask_worker.stream_handlers[DELIVER] = dask_worker.__dict__.pop("flowreduce_test_handler")
    return dask_worker.__dict__.pop("flowreduce_test_deliveries")


def _mixed_values(comm, n, dtypes):
    out = {}
    for dtype in dtypes:
        x = (np.arange(n) % 7 + comm.rank).astype(dtype)
        out["allreduce", dtype] = comm.allreduce(x, algorithm="butterfly")
        out["allgather", dtype] = comm.allgather(x.reshape(-1, 1) if n else x)
        out["broadcast", dtype] = comm.broadcast(x if comm.rank == 1 else None, root=1)
        for got in (out["allgather", dtype][0], out["broadcast", dtype]):
            got[...] = got  # a received value is the rank's own to change, as Dask's deserialisation gives it
    comm.barrier()
    return out


@pytest.mark.parametrize("n", [0, 1, 1000, 200_000])
def test_small_values_travel_inside_the_message_and_large_ones_as_frames(client, n):
    """Every rank alone (over Dask's comm): a value of a few kB (numpy arrays of every kind of number, 0-d to
    2-d, a list of them for the all-gather, the barrier's int) goes inside the message, one of 1.6 MB as
    Dask-serialised frames; either way the results are numpy's, of the input's dtype and shape, writable."""
    dtypes = ("float64", "float32", "int8", "uint16", "bool", "complex64") if n <= 1000 else ("float64",)
    client.gather(flowreduce.spmd(client, _many_small, ranks=2, rounds=1))  # flowreduce's extension on every worker
    client.run(_spy_deliveries)
    try:
        with dask.config.set({"flowreduce.spmd.transport": "dask"}):
            results = client.gather(flowreduce.spmd(client, _mixed_values, ranks=4, n=n, dtypes=dtypes, timeout=60))
    finally:
        seen = client.run(_unspy_deliveries)
    xs = {d: [(np.arange(n) % 7 + r).astype(d) for r in range(4)] for d in dtypes}
    for rank, got in enumerate(results):
        for d in dtypes:
            want = np.sum(xs[d], axis=0, dtype=np.result_type(d, np.int64) if d == "bool" else None)
            np.testing.assert_array_equal(got["allreduce", d], want.astype(got["allreduce", d].dtype))
            for r, part in enumerate(got["allgather", d]):
                assert part.dtype == np.dtype(d) and part.shape == ((n, 1) if n else (0,)), (rank, d, r, part.shape)
                np.testing.assert_array_equal(part.ravel(), xs[d][r])
            assert got["broadcast", d].dtype == np.dtype(d)
            np.testing.assert_array_equal(got["broadcast", d], xs[d][1])
    kinds = Counter(k for per_worker in seen.values() for k in per_worker)
    assert kinds, "no message between the workers was seen"
    if n <= 1000:
        assert kinds == Counter(inline=kinds["inline"]), f"small values went as frames: {dict(kinds)}"
    else:
        assert kinds["value"] > 0, f"1.6 MB values went inline: {dict(kinds)}"


# -- deterministic all-reduces ---------------------------------------------------------------------------------------

#: route -> the algorithm between hosts it asks for (the bits must not depend on either)
DETERMINISTIC_ROUTES = {"shm": "auto", "shm-per-worker+dask": "ring", "dask": "butterfly"}
DTYPES = ("float32", "float64")
#: and one above the shared-memory exchange's split (64 kB: each rank folds a slice)
DETERMINISTIC_LENGTHS = (*LENGTHS, 20_000)


def _floats(rank: int, n: int, dtype: str) -> np.ndarray:
    """Values of many magnitudes and both signs: the order of additions shows in the last bits."""
    rng = np.random.default_rng(rank + 1000 * n)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(dtype)


def _deterministic(comm, mode, algorithm):
    return {(n, dtype, op): comm.allreduce(_floats(comm.rank, n, dtype), op=op, algorithm=algorithm,
                                           deterministic=mode)
            for n in DETERMINISTIC_LENGTHS for dtype in DTYPES for op in ("sum", "mean")}


@pytest.mark.parametrize("ranks", range(1, 9))
@pytest.mark.parametrize("mode", [True, "exact"])
def test_deterministic_allreduce_is_the_reference_on_every_route(client, mode, ranks):
    """``deterministic=True``: ``flowreduce.reference_reduce(..., order="tree")``'s bits; ``"exact"``: its
    exact sum's; on every rank, whatever the host grouping (ranks sharing the 2 workers) and algorithm."""
    want = {(n, dtype, op): flowreduce.reference_reduce([_floats(r, n, dtype) for r in range(ranks)], op,
                                                        order="tree" if mode is True else "exact")
            for n in DETERMINISTIC_LENGTHS for dtype in DTYPES for op in ("sum", "mean")}
    for route, algorithm in DETERMINISTIC_ROUTES.items():
        with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
            results = client.gather(flowreduce.spmd(client, _deterministic, ranks=ranks, mode=mode,
                                                    algorithm=algorithm, timeout=30))
        for rank, got in enumerate(results):
            for what, expected in want.items():
                assert got[what].dtype == expected.dtype and got[what].shape == expected.shape, (route, rank, what)
                assert got[what].tobytes() == expected.tobytes(), (route, rank, what)


def test_the_data_tells_the_orders_apart():
    """The inputs above make the reference tree's sum, the exact sum and left-to-right sums differ."""
    xs = [_floats(r, 1001, "float32") for r in range(7)]
    in_order = functools.reduce(np.add, xs)
    tree = flowreduce.reference_reduce(xs, "sum", order="tree")
    exact = flowreduce.reference_reduce(xs, "sum")
    assert len({in_order.tobytes(), tree.tobytes(), exact.tobytes()}) == 3


class _Unused:
    """A mailbox the test never sends through."""

    def open(self, *args, **kwargs):
        pass


def test_auto_between_hosts_prices_the_hosts_links():
    """The host groups' leaders are on different hosts: ``auto`` prices their plan on the hosts' links,
    as the communicator runs it (messages, no tasks), so an 8 MB all-reduce between 4 hosts does not
    send every peer the whole vector (recursive doubling of radix 4: 3 vectors out, 3 in per leader,
    1.7x butterfly on the emulated 1 Gbit/s network, benchmarks/results/spmd_netem-2026-11-28.txt)."""
    from flowreduce.spmd.comm import Communicator
    from flowreduce.spmd.layout import Layout

    hosts, nbytes = 4, 8_000_000
    layout = Layout("auto-test", 0, tuple(f"tcp://10.0.0.{i}:1234" for i in range(hosts)), tuple(range(hosts)))
    comm = Communicator(layout, 0, _Unused())
    plan = comm.plan_for("auto", nbytes)
    optimal = 2 * (hosts - 1) / hosts * nbytes  # a bandwidth-optimal plan's bytes out (and in) per leader
    assert plan.cost(nbytes).max_rank_bytes <= 2 * optimal * 1.001, plan.algorithm
    assert comm.plan_for("auto", 8000).ranks == hosts and comm.plan_for("auto", 8000).chunks == 1
    # in chunks, a ring: one flow into each host per step (faster than butterfly's three, 2026-11-28)
    big = comm.plan_for("auto", 80_000_000)
    assert big.chunks > 1 and big.algorithm == "ring"


def test_auto_keeps_the_ring_in_chunks_between_4_hosts_on_a_slow_link(tmp_path):
    """Between 4 hosts, ``auto`` cuts 8 MB into chunks and runs them as a ring even on a link whose latency a
    loaded machine's probe measures at 6 ms a step (where the model prices the ring 1.2x radix-4 butterfly, which
    was 12-15% slower in every comparison on the emulated network, 2026-11-28); between 16 hosts it does not."""
    from flowreduce.spmd.comm import Communicator
    from flowreduce.spmd.layout import Layout

    path = str(tmp_path / "model.json")
    dataclasses.replace(flowreduce.cost.CostModel(), inter=flowreduce.cost.Link(alpha=6e-3, beta=1 / 120e6)).to_file(path)
    with dask.config.set({"flowreduce.cost-model": path}):
        plans = {}
        for hosts in (4, 16):
            layout = Layout("auto-test", 0, tuple(f"tcp://10.0.0.{i}:1234" for i in range(hosts)), tuple(range(hosts)))
            plans[hosts] = Communicator(layout, 0, _Unused()).plan_for("auto", 8_000_000)
    assert plans[4].chunks > 1 and plans[4].algorithm == "ring", plans[4]
    assert plans[16].algorithm != "ring", plans[16]


def _learns_the_link(comm, n):
    before = comm.link
    explicit = comm.allreduce(np.ones(n), algorithm="ring")  # an explicit plan measures nothing
    after_explicit = comm.link
    y = comm.allreduce(np.full(n, comm.rank + 1.0))
    link = comm.link
    return (before, after_explicit, None if link is None else (link.alpha, link.beta),
            repr(comm.plan_for("auto", 800_000)), float(explicit[0]), float(y[0]))


@pytest.mark.parametrize(("route", "ranks"), [("shm-per-worker+dask", 4), ("dask", 4), ("dask", 6)])
def test_the_first_auto_allreduce_between_hosts_measures_the_link(client, route, ranks):
    """``auto`` between hosts prices plans on the link the communicator measured at its first ``auto``
    all-reduce there (no calibrated model configured): the same numbers on every rank, so every rank
    picks the same plan, and the plan is the one the cost model picks on that link."""
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        got = client.gather(flowreduce.spmd(client, _learns_the_link, ranks=ranks, n=1000, timeout=60))
    befores, explicits, links, plans, ones, sums = zip(*got)
    assert set(befores) == {None} and set(explicits) == {None}
    assert len(set(links)) == 1 and links[0] is not None, links
    alpha, beta = links[0]
    assert alpha > 0 and beta > 0
    assert len(set(plans)) == 1
    hosts = 2 if route == "shm-per-worker+dask" else ranks
    groups = [[g] for g in range(hosts)]
    model = dataclasses.replace(flowreduce.cost.configured_model(), inter=flowreduce.cost.Link(alpha, beta))
    engine = dataclasses.replace(model, call=0.0, task=0.0, level=model.message)
    assert plans[0] == repr(flowreduce.choose(hosts, 800_000, chunks=1, groups=groups, model=engine))
    assert set(ones) == {float(ranks)} and set(sums) == {ranks * (ranks + 1) / 2}


def _configure(key, value):
    dask.config.set({key: value})


def test_a_calibrated_inter_host_link_is_not_measured(client, tmp_path):
    """A cost model that names the link between hosts (``flowreduce calibrate``) is the one ``auto`` uses."""
    path = str(tmp_path / "model.json")
    link = flowreduce.cost.Link(alpha=2e-3, beta=8 / 1e9)
    dataclasses.replace(flowreduce.cost.CostModel(), inter=link).to_file(path)
    client.run(_configure, "flowreduce.cost-model", path)  # where the ranks read it
    try:
        with dask.config.set({"flowreduce.spmd.transport": "dask"}):
            got = client.gather(flowreduce.spmd(client, _learns_the_link, ranks=3, n=10, timeout=60))
    finally:
        client.run(_configure, "flowreduce.cost-model", None)
    assert all(g[2] is None for g in got)
    groups = [[g] for g in range(3)]
    engine = dataclasses.replace(flowreduce.cost.CostModel(), inter=link, call=0.0, task=0.0, level=2e-3)
    engine = dataclasses.replace(engine, level=engine.message)
    assert {g[3] for g in got} == {repr(flowreduce.choose(3, 800_000, chunks=1, groups=groups, model=engine))}


def test_deterministic_options_are_checked(client):
    def asks(comm, **options):
        return comm.allreduce(np.ones(3), **options)

    with pytest.raises(OptionError, match="deterministic must be False, True or 'exact', got 'bogus'"):
        client.gather(flowreduce.spmd(client, asks, ranks=2, deterministic="bogus"))
    with pytest.raises(OptionError, match="op 'prod' on float64 has no exact form"):
        client.gather(flowreduce.spmd(client, asks, ranks=2, op="prod", deterministic="exact"))
    ints = client.gather(flowreduce.spmd(client, lambda comm: comm.allreduce(np.arange(3), deterministic="exact"),
                                         ranks=3))
    assert [x.tolist() for x in ints] == [[0, 3, 6]] * 3  # integers are exact already


# -- failures never hang ---------------------------------------------------------------------------------------------

def _forever(comm, fault, at, size=100):
    x = np.ones(size)
    for i in range(10**9):
        if i == at and comm.rank == 2 and comm.attempt == 0:
            if fault == "raise":
                raise ValueError("rank two gives up")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "late":
                time.sleep(4)
        comm.allreduce(x)
        if fault == "kill" and comm.attempt > 0 and i == at + 5:
            return comm.attempt, comm.allreduce(np.array([comm.rank]))
    return None


def _errors(client, futures, bound):
    start = time.monotonic()
    wait(futures, timeout=bound)
    took = time.monotonic() - start
    errors = [f.exception() if f.status == "error" else f.status for f in futures]
    return errors, took


@pytest.mark.parametrize("route", ["shm", "dask"])
def test_a_rank_that_raises_fails_every_rank(client, route):
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        futures = flowreduce.spmd(client, _forever, ranks=4, fault="raise", at=50)
        errors, took = _errors(client, futures, 15)
    assert isinstance(errors[2], ValueError)
    for rank, e in enumerate(errors):
        assert isinstance(e, FlowreduceError if rank != 2 else ValueError), (rank, e)
        assert "rank 2 raised ValueError: rank two gives up" in str(e) or rank == 2, str(e)
        assert rank == 2 or "allreduce #" in str(e)
    assert took < 10


def _stops_in(comm, collective, fault):
    x = np.ones(100)
    for i in range(10**9):
        if i == 20 and comm.rank == 2:
            if fault == "raise":
                raise ValueError("rank two gives up")
            time.sleep(4)
        if collective == "broadcast":
            comm.broadcast(x, root=i % comm.size)
        elif collective == "allgather":
            comm.allgather(x)
        elif collective == "allreduce":
            comm.allreduce(x, algorithm="butterfly")
        else:
            comm.barrier()


@pytest.mark.parametrize("fault", ["raise", "late"])
@pytest.mark.parametrize("collective", ["broadcast", "allgather", "barrier", "allreduce"])
def test_a_failure_between_hosts_fails_every_rank_in_any_collective(client, collective, fault):
    """Every rank alone (their collectives walked on the workers' event loops): a rank that raises, or is
    late past the timeout, fails every other rank's collective, naming it (a timeout on the loop once
    looped for good in ``Mailbox.call``: AllreduceTimeoutError is a TimeoutError, as the wait's own)."""
    with dask.config.set({"flowreduce.spmd.transport": "dask"}):
        futures = flowreduce.spmd(client, _stops_in, ranks=4, collective=collective, fault=fault,
                                  timeout=1 if fault == "late" else 30)
        errors, took = _errors(client, futures, 15)
    assert took < 10
    for rank, e in enumerate(errors):
        if rank == 2 and fault == "raise":
            assert isinstance(e, ValueError), e
            continue
        assert isinstance(e, FlowreduceError), (rank, e)
        assert str(e).startswith(f"{collective} #"), (rank, str(e))
        if fault == "raise":
            assert "rank 2 raised ValueError: rank two gives up" in str(e), str(e)
        else:
            assert "timed out" in str(e), str(e)
    if fault == "late":
        # The first timer to fire names whom that rank waits for: rank 2 (late), or for rank 1 in a
        # butterfly's second step rank 3, itself still waiting for rank 2; which fires first is a race.
        timeouts = [e for e in errors if isinstance(e, AllreduceTimeoutError)]
        assert timeouts, errors
        named = {int(m) for e in timeouts for m in re.findall(r"waiting for rank (\d+)", str(e))}
        assert named and named <= ({2, 3} if collective == "allreduce" else {2}), errors


def test_a_killed_worker_fails_every_rank(fresh_client):
    client = fresh_client
    client.run(asleep_until_woken)  # ranks 1 and 3, asleep in their step, wake as their worker is told
    futures = flowreduce.spmd(client, _forever, ranks=4, fault="kill", at=50)  # ranks 0, 2 share a worker
    errors, took = _errors(client, futures, 30)
    assert all(isinstance(e, Exception) for e in errors), errors
    assert isinstance(errors[2], WorkerLostError) and "rank 2 " in str(errors[2]), errors[2]
    for rank in (1, 3):
        assert "holding rank(s) [0, 2] left the cluster" in str(errors[rank]) and "allreduce #" in str(errors[rank])
    assert took < 20


def _kill_all(comm, at):
    x = np.ones(100)
    for i in range(10**9):
        if i == at:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank: both workers die, their nannies restart them
        comm.allreduce(x)


def test_every_worker_killed_fails_every_rank_and_leaves_no_segment(fresh_client):
    """With every worker of the job gone at once, the rank tasks Dask retries on the restarted workers
    (anywhere: not waiting in no-worker for workers that left) fail at once naming the lost worker,
    and sweep what the dead ranks left in shared memory (the autouse fixture checks)."""
    futures = flowreduce.spmd(fresh_client, _kill_all, ranks=4, at=20)
    errors, _ = _errors(fresh_client, futures, 120)
    assert all(isinstance(e, WorkerLostError) and "left the cluster" in str(e) for e in errors), errors


def test_a_timeout_fails_every_rank(client):
    futures = flowreduce.spmd(client, _forever, ranks=4, fault="late", at=20, timeout=1)
    start = time.monotonic()
    wait([futures[0], futures[1], futures[3]], timeout=15)
    took = time.monotonic() - start
    errors, _ = _errors(client, futures, 15)
    assert took < 4, f"the ranks waiting on rank 2 took {took:.1f} s to fail with timeout=1"
    assert any(isinstance(e, AllreduceTimeoutError) for e in errors), errors
    for rank, e in enumerate(errors):
        assert isinstance(e, FlowreduceError), (rank, e)
        assert "timed out" in str(e) and "allreduce #21" in str(e), (rank, str(e))


def test_restarts_complete_a_job_whose_worker_was_killed(fresh_client):
    client = fresh_client
    futures = flowreduce.spmd(client, _forever, ranks=4, fault="kill", at=20, restarts=1, timeout=30)
    results = client.gather(futures)
    assert [a for a, _ in results] == [1, 1, 1, 1]
    assert all(r.tolist() == [6] for _, r in results)


def _disagreeing(comm, what, deterministic):
    if what == "shape":
        x = np.ones(1001 if comm.rank == 2 else 1000)
    else:
        x = np.ones(1000, dtype=np.float32 if comm.rank == 2 else np.float64)
    return comm.allreduce(x, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("what", ["shape", "dtype"])
@pytest.mark.parametrize("route", ROUTES)
def test_ranks_disagreeing_on_shape_or_dtype_fail_naming_the_ranks(client, route, what, deterministic):
    """Every route (shared memory, Dask's comm between leaders, both), in either order, checks what
    it received: an InputError naming rank 2 and one that disagrees with it, never numpy's error."""
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        futures = flowreduce.spmd(client, _disagreeing, ranks=4, what=what, deterministic=deterministic, timeout=30)
        errors, _ = _errors(client, futures, 60)
    assert all(isinstance(e, FlowreduceError) for e in errors), [f"{type(e).__name__}: {e}" for e in errors]
    origins = [e for e in errors if isinstance(e, InputError)]
    assert origins, errors
    for e in origins:
        assert "every rank must give the same shape and dtype" in str(e) and "rank 2" in str(e), str(e)


def _paths(comm):
    total = comm.allreduce(np.ones(1000))
    return float(total[0]), [e.path for e in comm.events]


def test_no_shared_memory_where_stores_may_be_reordered(client, monkeypatch):
    """The shared-memory protocol counts on stores seen in program order (x86): on another machine
    (as the client sees it: it makes the peer table) every rank is a group of its own, over Dask's comm."""
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    results = client.gather(flowreduce.spmd(client, _paths, ranks=4, timeout=30))
    assert results == [(4.0, ["dask"])] * 4
    monkeypatch.undo()
    assert {p for _, paths in client.gather(flowreduce.spmd(client, _paths, ranks=4, timeout=30)) for p in paths} \
        <= {"shm", "shm+dask"}, "on this x86 machine the ranks of a host share memory"


def _fails_in_subgroup(comm):
    evens, odds = comm.subgroup([0, 2]), comm.subgroup([1, 3])
    mine, x = evens or odds, np.ones(10)
    for i in range(10**9):
        if comm.rank == 2 and i == 30:
            raise ValueError("rank two gives up")
        mine.allreduce(x)  # ranks 1 and 3 never exchange with rank 2: the job's failure reaches them


@pytest.mark.parametrize("route", ["shm", "dask"])
def test_a_failure_in_a_subgroup_fails_the_job(client, route):
    with dask.config.set({"flowreduce.spmd.transport": ROUTES[route]}):
        futures = flowreduce.spmd(client, _fails_in_subgroup, ranks=4)
        errors, took = _errors(client, futures, 15)
    assert isinstance(errors[2], ValueError)
    for rank in (0, 1, 3):
        assert isinstance(errors[rank], FlowreduceError), (rank, errors[rank])
        assert "rank 2 raised ValueError: rank two gives up" in str(errors[rank]), str(errors[rank])
    assert took < 10


def test_closing_the_cluster_under_a_running_job_leaves_no_segment(shm_dir):
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            # past the small slots (SPLIT_BYTES), so that every rank has a data segment
            futures = flowreduce.spmd(c, _forever, ranks=4, fault=None, at=-1, size=SPLIT_BYTES // 8 + 1000)
            def data_segments():  # one per rank ("<group>-r<rank>-g<generation>"), beside the group's "-ctl"
                return [n for n in _segments(shm_dir) if re.search(r"-r\d+-g\d+$", n)]

            wait_until(lambda: len(data_segments()) >= 4, 30, step=0.05)
            assert len(data_segments()) == 4, _segments(shm_dir)
    assert _segments(shm_dir) == []  # the workers swept them as they closed
    del futures


def test_options_are_checked(client):
    with pytest.raises(ValueError, match="ranks="):
        flowreduce.spmd(client, _many)
    with pytest.raises(ValueError, match="one entry per rank"):
        flowreduce.spmd(client, _many, [1, 2], [1])
    with pytest.raises(ValueError, match="restarts"):
        flowreduce.spmd(client, _many, ranks=2, restarts=-1)

    def bad(comm):
        return comm.allreduce(np.ones(3), algorithm="nope")

    with pytest.raises(ValueError, match="unknown algorithm 'nope'; valid: reduce-broadcast"):
        client.gather(flowreduce.spmd(client, bad, ranks=2))


def test_events_record_each_collective(client):
    def fn(comm):
        comm.allreduce(np.ones(1000))
        comm.barrier()
        return list(comm.events), comm.run

    with dask.config.set({"flowreduce.spmd.transport": "worker"}):
        results = client.gather(flowreduce.spmd(client, fn, ranks=4))
    events = [evs for evs, _ in results]
    rows = flowreduce.spmd.collect(client, results[0][1])
    assert sorted((r["rank"], r["phase"], r["seq"]) for r in rows) == sorted(
        (rank, phase, seq) for rank in range(4) for phase, seq in (("allreduce", 1), ("barrier", 2)))
    for rank, evs in enumerate(events):
        assert [(e.collective, e.seq) for e in evs] == [("allreduce", 1), ("barrier", 2)]
        ar = evs[0]
        assert ar.nbytes == 8000 and ar.stop >= ar.start and ar.path == "shm+dask"
        assert rank in (0, 1) or ar.sent == 0  # only the leaders (ranks 0, 1) talk between workers
        assert set(ar.peers) <= set(range(4)) - {rank} and ar.peers
