"""Failures as HPC clusters cause them (issue #15), each injected at a
chosen rank and plan step (tests/faults.py), on a
4-worker LocalCluster with nannies: the call recovers, or fails with an
error naming what was lost, or times out saying where it is stuck. It never
hangs, and no flowreduce key outlives the results (docs/failures.md).

Waits for results are bounded (``wait(..., timeout=HANG)``) only so that a
regression fails instead of hanging the suite; nothing here is timed."""

from __future__ import annotations

import gc
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor

import dask
import faults
import numpy as np
import pytest
from distributed import Client, Event, LocalCluster, wait
from utils import assert_clean, flowreduce_keys, flush, wait_until

import flowreduce
from flowreduce.errors import AllreduceTimeoutError, WorkerLostError
from flowreduce.keys import parse
from flowreduce.schedule.extension import ensure_extension
from flowreduce.schedule.guard import PinGuard, guard_of

# These tests are about faults at a step of the task graph and its recovery: method='tasks' (tests/test_p2p.py covers the engine)
pytestmark = pytest.mark.usefixtures("method_tasks")


N = 10**5  # elements per rank
HANG = 60  # s: past this a wait counts as a hang


def rank_input(r: int, n: int = N) -> np.ndarray:
    """Deterministic, so a recomputed input equals the lost one."""
    return np.arange(n, dtype=np.int64) * (r + 1) + r


def expected(p: int = 4, n: int = N) -> np.ndarray:
    return sum(rank_input(r, n) for r in range(p))


def _wait_for_event(name, r):
    Event(name).wait()
    return rank_input(r)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        yield c


@pytest.fixture
def client(cluster):
    """Four running workers before each test, whatever the last one killed or retired."""
    with Client(cluster) as c:
        _refill(cluster, c)
        yield c
        faults.disarm(c)
        gc.collect()
        assert_clean(c)


def _refill(cluster, client, n: int = 4) -> None:
    """A killed worker's nanny restarts it; a retired one is gone for good,
    and (rarely, on a loaded machine) a nanny never brings its worker back:
    replace those."""
    wait_until(lambda: all(w.status.name in ("running", "closed") for w in cluster.workers.values()), HANG)
    closed = sum(w.status.name == "closed" for w in cluster.workers.values())  # retired: they never come back
    # a nanny whose worker was retired but that is not closed yet waited out the whole 20 s here
    # (21 s of the suite); slow or gone, it is closed after 5 s and replaced by scale() below
    if not wait_until(lambda: len(client.nthreads()) >= n - closed, 5):
        alive = set(client.nthreads())
        for w in cluster.workers.values():
            if w.status.name == "running" and w.worker_address not in alive:
                cluster.sync(w.close)
    for name, w in list(cluster.workers.items()):
        if w.status.name == "closed":
            cluster.workers.pop(name)
            cluster.worker_spec.pop(name, None)
    cluster.scale(n)
    client.wait_for_workers(n, timeout=HANG)
    assert wait_until(lambda: len(client.nthreads()) == n, HANG)


def _inputs(client, p: int = 4):
    """Rank r's input computed (with lineage) on worker r."""
    ws = sorted(client.nthreads())
    parts = [client.submit(rank_input, r, workers=[ws[r % len(ws)]], allow_other_workers=True, pure=False)
             for r in range(p)]
    wait(parts)
    return parts


def _results(client, futures):
    done, pending = wait(futures, timeout=HANG, return_when="ALL_COMPLETED")
    return client.gather(futures)


def _last_step(algorithm: str) -> int:
    return flowreduce.plan(algorithm, 4).depth - 1


# -- 1. the fault injector ---------------------------------------------------------------------------


def test_fail_at_kills_the_worker_of_rank_r_when_step_s_starts(client):
    parts = _inputs(client)
    faults.fail_at(client, rank=2, step=1, action="kill")
    out = flowreduce.allreduce(client, parts, algorithm="butterfly")
    rank_worker = flowreduce.describe(out).workers[2]
    assert wait_until(lambda: faults.fired(client), HANG)
    (key, worker), = faults.fired(client)
    info = parse(key)
    assert (info["rank"], info["step"], worker) == (2, 1, rank_worker)
    assert wait_until(lambda: rank_worker not in client.nthreads(), HANG), "the worker was not killed"
    _results(client, out)
    del out, parts


# -- 2. recovery: the same futures resolve to the right result -------------------------------------------


def _replicas(keys, dask_worker=None):
    return {k: dask_worker.data[k] for k in keys if k in dask_worker.data}


def _flat(value) -> np.ndarray:
    """A key's value (an array, or a node's tuple of pieces) as one array."""
    return np.concatenate([np.ravel(a) for a in value]) if isinstance(value, tuple) else value


@pytest.mark.parametrize("algorithm", ["butterfly", "ring", "tree"])
def test_every_replica_of_a_tasks_key_holds_the_same_value(client, algorithm):
    """Dask takes any replica of a key for its value: after a worker loss, the
    next attempt of a call (or a peer) may read the copy a rank received
    instead of its producer's. So no task may change a value it received: the
    task graph reduces into buffers of its own (``TASKS_REDUCE_INTO_RECEIVED``).
    Reducing into received copies counted a rank twice after recoveries.
    Every value of the call is kept here, and every replica compared."""
    from flowreduce.lower.graph import build_graph
    from flowreduce.ops import resolve_op
    from flowreduce.schedule.call import TASKS_REDUCE_INTO_RECEIVED

    parts = _inputs(client)
    holders = client.who_has(parts)
    placed = [holders[f.key][0] for f in parts]
    plan = flowreduce.plan(algorithm, 4, chunks=2)
    graph = build_graph(plan, parts, placed, size=N, shape=(N,), op=resolve_op("sum"),
                        in_place=TASKS_REDUCE_INTO_RECEIVED)
    client.amm.stop()  # it would drop the extra replicas this test compares
    try:
        keys = list(graph.tasks)
        with dask.annotate(workers=graph.placement.get, allow_other_workers=False):
            everything = dict(zip(keys, client.get(graph.tasks, keys, sync=False)))
        wait(list(everything.values()), timeout=HANG)
        for r, key in enumerate(graph.outputs):
            np.testing.assert_array_equal(everything[key].result(), expected(), err_msg=f"rank {r}")
        copies = client.run(_replicas, keys)
        shared = 0
        for key in keys:
            held = [(w, v[key]) for w, v in copies.items() if key in v]
            shared += len(held) > 1
            for w, value in held[1:]:
                np.testing.assert_array_equal(_flat(held[0][1]), _flat(value),
                                              err_msg=f"{key!r}: the replica on {w} differs")
        assert shared, "no key had two replicas: nothing was compared"
    finally:
        client.amm.start()
    del everything, parts


@pytest.mark.parametrize("algorithm,step,action", [
    ("butterfly", 0, "kill"),
    ("ring", 3, "kill"),
    ("reduce-broadcast", "last", "kill"),
    ("butterfly", "last", "kill"),
    ("ring", None, "kill"),  # when a rank's result task starts
    ("ring", 2, "retire"),
    ("tree", 1, "kill"),
    ("hierarchical", 1, "kill"),
    ("shm-direct", 2, "kill"),  # its reduce-scatter over shared memory (step 1 has no task of rank 1)
])
def test_worker_lost_mid_call_recovers(client, algorithm, step, action):
    step = _last_step(algorithm) if step == "last" else step
    parts = _inputs(client)
    faults.fail_at(client, rank=1, step=step, action=action)
    out = flowreduce.allreduce(client, parts, algorithm=algorithm, chunks=2)
    held = list(out)
    results = _results(client, out)
    assert faults.fired(client), "the fault was not injected"
    assert all(f is g for f, g in zip(out, held))
    for r, x in enumerate(results):
        np.testing.assert_array_equal(x, expected(), err_msg=f"rank {r}")
    for r, x in enumerate(client.gather(parts)):  # no re-run task wrote into an input
        np.testing.assert_array_equal(x, rank_input(r), err_msg=f"input of rank {r}")
    del out, held, results, parts


def test_pytree_call_recovers(client):
    ws = sorted(client.nthreads())
    parts = [{"w": client.submit(rank_input, r, workers=[ws[r]], allow_other_workers=True, pure=False),
              "b": client.submit(rank_input, r, 10, workers=[ws[r]], allow_other_workers=True, pure=False)}
             for r in range(4)]
    wait([f for d in parts for f in d.values()])
    faults.fail_at(client, rank=3, step=1, action="kill")
    out = flowreduce.allreduce(client, parts, algorithm="ring", bucket_bytes=0)
    results = [_results(client, [d["w"], d["b"]]) for d in out]
    assert faults.fired(client)
    for w, b in results:
        np.testing.assert_array_equal(w, expected())
        np.testing.assert_array_equal(b, expected(n=10))
    del out, results, parts


def sparse_input(r: int, n: int = N):
    """A deterministic CSR vector: every 50th element, offset by rank."""
    import scipy.sparse as sp

    x = np.zeros(n, dtype=np.float64)
    x[r::50] = r + 1
    return sp.csr_matrix(x.reshape(1, -1))


def block_input(r: int, n: int = N) -> np.ndarray:
    x = np.zeros(n, dtype=np.int64)
    x[r * 1000:(r + 1) * 1000] = np.arange(1000) + r
    return x


@pytest.mark.parametrize("algorithm,make", [("sparse-recursive-doubling", sparse_input),
                                            ("block-sparse", block_input)])
def test_sparse_and_block_sparse_calls_recover(client, algorithm, make):
    ws = sorted(client.nthreads())
    parts = [client.submit(make, r, workers=[ws[r]], allow_other_workers=True, pure=False) for r in range(4)]
    wait(parts)
    faults.fail_at(client, rank=2, step=1, action="kill")
    out = flowreduce.allreduce(client, parts, algorithm=algorithm)
    results = _results(client, out)
    assert faults.fired(client)
    want = sum(np.asarray(make(r).todense() if hasattr(make(r), "todense") else make(r)) for r in range(4))
    for x in results:
        np.testing.assert_array_equal(np.asarray(x.todense() if hasattr(x, "todense") else x), want)
    del out, results, parts


def test_bounded_attempts_turn_repeated_losses_into_an_error(client):
    flowreduce.allreduce(client, _inputs(client, 2))  # the guard is installed
    client.run_on_scheduler(_set_attempts, 0)  # no recovery allowed
    try:
        parts = _inputs(client)
        faults.fail_at(client, rank=1, step=1, action="kill")
        out = flowreduce.allreduce(client, parts, algorithm="butterfly")
        wait(out, timeout=HANG)
        with pytest.raises(WorkerLostError, match=r"cannot recover: it already recovered 0 times") as caught:
            client.gather(out)
        caught.value.__traceback__ = None
        del out, parts, caught
    finally:
        client.run_on_scheduler(_set_attempts, PinGuard().attempts)


def _set_attempts(n, dask_scheduler=None):
    guard_of(dask_scheduler).attempts = n


def test_scattered_input_lost_names_rank_and_key_and_survivors_work(client):
    ws = sorted(client.nthreads())
    parts = [client.scatter(rank_input(r), workers=[ws[r]], hash=False) for r in range(4)]
    faults.fail_at(client, rank=1, step=1, action="kill")
    out = flowreduce.allreduce(client, parts, algorithm="butterfly")
    wait(out, timeout=HANG)
    with pytest.raises(WorkerLostError, match=rf"input of rank 1 \(key {parts[1].key!r}\) was lost") as caught:
        client.gather(out)
    caught.value.__traceback__ = None
    del out, caught
    survivors = [parts[0], parts[2], parts[3]]
    for r, f in zip((0, 2, 3), survivors):
        np.testing.assert_array_equal(f.result(), rank_input(r))
    again = flowreduce.allreduce(client, survivors, algorithm="ring")
    want = rank_input(0) + rank_input(2) + rank_input(3)
    for x in _results(client, again):
        np.testing.assert_array_equal(x, want)
    del again, survivors, parts


# -- 3. hangs of the old guard ------------------------------------------------------------------------


def _pause(dask_worker=None):
    from distributed.core import Status

    dask_worker.status = Status.paused


def test_worker_retired_while_paused_as_the_call_reaches_it(client):
    """The tasks pinned to a paused worker wait in no-worker; the worker is
    then retired (removed without losing data): they must move, not wait forever."""
    parts = _inputs(client)
    w1 = sorted(client.nthreads())[1]
    client.run(_pause, workers=[w1])
    faults.fail_at(client, rank=1, step=1, action="retire")  # fires when step 1 finds no running worker
    out = flowreduce.allreduce(client, parts, algorithm="butterfly")
    for x in _results(client, out):
        np.testing.assert_array_equal(x, expected())
    assert faults.fired(client)[0][1] == w1
    del out, parts


def test_retire_returns_while_a_user_task_holds_the_worker(client):
    """Retiring a worker whose only thread runs a user's task while a rank's
    tasks wait there: retire_workers must return (the replica guard used to
    fight Dask's replication off the retiring worker forever)."""
    ws = sorted(client.nthreads())
    parts = _inputs(client)
    name = f"flowreduce-test-{uuid.uuid4().hex}"
    event = Event(name, client=client)
    holder = client.submit(_wait_for_event, name, 0, workers=[ws[1]], pure=False)
    assert wait_until(lambda: client.processing(workers=[ws[1]])[ws[1]], HANG)
    out = flowreduce.allreduce(client, parts, algorithm="ring")
    pool = ThreadPoolExecutor(1)
    try:
        retiring = pool.submit(client.retire_workers, workers=[ws[1]], close_workers=True)
        retiring.result(timeout=HANG)  # a regression fails here instead of hanging
    finally:
        event.set()
        pool.shutdown(wait=False)
    for x in _results(client, out):
        np.testing.assert_array_equal(x, expected())
    del out, parts, holder


def _pids(client) -> dict[str, int]:
    return client.run(os.getpid)


def _set_status(name, dask_worker=None):
    from distributed.core import Status

    dask_worker.status = Status[name]  # the worker tells the scheduler, as retire_workers' own change does


def test_replica_guard_lets_a_retiring_worker_give_its_data_away(client):
    """The replica guard keeps a rank's value on the worker where a waiting
    flowreduce task is pinned, except when that worker is retiring: there
    Dask replicates the value away and drops the retiring copy, and keeping
    it made retire_workers replicate and drop forever (issue #15)."""
    ensure_extension(client)
    client.amm.stop()  # run it once, below, when the stage is set
    a, b, c = sorted(client.nthreads())[:3]
    token, name = uuid.uuid4().hex, f"flowreduce-test-{uuid.uuid4().hex}"
    event = Event(name, client=client)
    x = client.submit(np.arange, 1000, key=(f"flowreduce-test-split-{token}", 0, 0, 0, 0), workers=[a])
    later = client.submit(_wait_for_event, name, 0, workers=[c], pure=False)
    waiting = client.submit(lambda v, _: v, x, later, key=(f"flowreduce-test-reduce-{token}", 1, 0, 0, 1),
                            workers=[a], allow_other_workers=False)
    peer = client.submit(np.sum, x, workers=[b], pure=False)  # the replica Dask made on b
    heavy = client.scatter(np.ones(20_000_000), workers=[a])  # a is the worker AMM drops from
    wait([peer, heavy])
    assert set(client.who_has([x])[x.key]) == {a, b}
    try:
        client.run(_set_status, "closing_gracefully", workers=[a])
        assert wait_until(lambda: client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.workers[a].status.name) == "closing_gracefully", HANG)
        client.amm.run_once()
        assert wait_until(lambda f=x: client.who_has([f])[f.key] == (b,), HANG), "the retiring worker kept its copy"
    finally:
        client.run(_set_status, "running", workers=[a])
        event.set()
        client.amm.start()
    np.testing.assert_array_equal(waiting.result(), np.arange(1000))
    del x, later, waiting, peer, heavy


def _kill(client, worker: str) -> None:
    os.kill(_pids(client)[worker], signal.SIGKILL)
    assert wait_until(lambda: worker not in client.nthreads(), HANG)


def test_two_workers_lost_one_after_the_other_after_the_call(client):
    """Results lost after the call finished are recomputed, twice."""
    parts = _inputs(client)
    out = flowreduce.allreduce(client, parts, algorithm="butterfly", chunks=2)
    _results(client, out)
    workers = flowreduce.describe(out).workers
    _kill(client, workers[1])
    for x in _results(client, out):
        np.testing.assert_array_equal(x, expected())
    _kill(client, workers[2])
    for x in _results(client, out):
        np.testing.assert_array_equal(x, expected())
    del out, parts


# -- 4. timeouts say where the call is stuck --------------------------------------------------------------


def test_timeout_names_a_held_back_upstream_task(client):
    ws = sorted(client.nthreads())
    parts = _inputs(client)[:3]
    name = f"flowreduce-test-{uuid.uuid4().hex}"
    event = Event(name, client=client)
    parts.append(client.submit(_wait_for_event, name, 3, workers=[ws[3]], pure=False))
    pool = ThreadPoolExecutor(1)  # a regression fails below instead of hanging
    try:
        call = pool.submit(flowreduce.allreduce, client, parts, algorithm="ring", timeout=1)
        with pytest.raises(AllreduceTimeoutError, match=rf"input of rank 3 \(key {parts[3].key!r}\), computed "
                                                        rf"by your own task: processing on worker {ws[3]}"):
            call.result(timeout=HANG)
        out = flowreduce.allreduce(client, parts, algorithm="ring", like=np.zeros(N, np.int64), timeout="1s")
        wait(out, timeout=HANG)
        with pytest.raises(AllreduceTimeoutError, match=r"did not finish within 1 s \(4 of 4 results pending\); "
                                                        rf"waiting for input of rank 3 \(key {parts[3].key!r}\), "
                                                        rf"computed by your own task: processing on worker {ws[3]} "
                                                        r"for \d+\.\d s") as caught:
            client.gather(out)
        caught.value.__traceback__ = None
        del out, caught
    finally:
        event.set()
        pool.shutdown()
    del parts


def test_timeout_names_a_worker_that_stopped_responding(client):
    parts = _inputs(client)
    pids = _pids(client)
    faults.fail_at(client, rank=1, step=1, action="stop")
    with dask.config.set({"flowreduce.timeout": "2s"}):
        out = flowreduce.allreduce(client, parts, algorithm="butterfly")
    w1 = flowreduce.describe(out).workers[1]
    try:
        wait(out, timeout=HANG)
        with pytest.raises(AllreduceTimeoutError, match=rf"rank 1, plan step 1 \(reduce-scatter\), key .*: processing "
                                                        rf"on worker {w1} for \d+\.\d s.*last heard from") as caught:
            client.gather(out)
        caught.value.__traceback__ = None
        del caught
    finally:
        os.kill(pids[w1], signal.SIGCONT)
    del out, parts


def test_timeout_must_be_positive(client):
    parts = _inputs(client, 2)
    with pytest.raises(ValueError, match="timeout must be positive"):
        flowreduce.allreduce(client, parts, timeout=0)
    del parts




# -- 5. two workers lost during one call -----------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
@pytest.mark.parametrize("steps", [(0, 2), (1, 1)], ids=["different-steps", "same-step"])
def test_two_workers_lost_during_one_call_recovers(client, algorithm, steps):
    """Ranks 1 and 2 lose their workers while one call runs, at different
    plan steps or both at one step: inputs with lineage are recomputed and
    every rank's result is right."""
    parts = _inputs(client)
    faults.fail_at(client, rank=1, step=steps[0], action="kill", more=((2, steps[1]),))
    out = flowreduce.allreduce(client, parts, algorithm=algorithm, chunks=2)
    workers = flowreduce.describe(out).workers
    results = _results(client, out)
    fired = faults.fired(client)
    assert sorted((parse(k)["rank"], parse(k)["step"], w) for k, w in fired) == \
        [(1, steps[0], workers[1]), (2, steps[1], workers[2])]
    for r, x in enumerate(results):
        np.testing.assert_array_equal(x, expected(), err_msg=f"rank {r}")
    for r, x in enumerate(client.gather(parts)):
        np.testing.assert_array_equal(x, rank_input(r), err_msg=f"input of rank {r}")
    del out, results, parts


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
def test_two_scattered_inputs_lost_during_one_call_name_the_lost_rank(client, algorithm):
    """Scattered inputs of ranks 1 and 2, their workers killed at plan step 1
    of one call: the first loss the scheduler handles fails the call (no
    lineage), so every result is a WorkerLostError naming a lost rank and
    its key; the survivors' inputs are intact."""
    ws = sorted(client.nthreads())
    parts = [client.scatter(rank_input(r), workers=[ws[r]], hash=False) for r in range(4)]
    faults.fail_at(client, rank=1, step=1, action="kill", more=((2, 1),))
    out = flowreduce.allreduce(client, parts, algorithm=algorithm)
    wait(out, timeout=HANG)
    assert {w for _, w in faults.fired(client)} <= {ws[1], ws[2]} and faults.fired(client)
    named = set()
    for r in range(4):
        with pytest.raises(WorkerLostError, match=r"input of rank [12] \(key .*\) was lost") as caught:
            out[r].result()
        named |= {q for q in (1, 2) if f"input of rank {q} (key {parts[q].key!r}) was lost" in str(caught.value)}
        caught.value.__traceback__ = None
        del caught
    assert named and named <= {1, 2}
    del out
    for r in (0, 3):
        np.testing.assert_array_equal(parts[r].result(), rank_input(r))
    del parts


# -- 6. memory pressure --------------------------------------------------------------------------------


def _big_input(r: int, n: int) -> np.ndarray:
    return rank_input(r, n)


@pytest.mark.parametrize("algorithm, method", [("butterfly", "tasks"), ("ring", "tasks"), ("butterfly", "p2p"),
                                               ("ring", "p2p")])
def test_memory_pressure_gives_the_result_or_a_clean_error(algorithm, method):
    """Workers with a 250 MiB limit, 1e7 int64 elements (80 MB) per rank:
    Dask spills, pauses and its nanny may kill a worker past 95%. The call
    must end with the right result on every rank or a WorkerLostError naming
    what was lost; the call's timeout turns a hang into a failure here. With
    ``method="p2p"`` the inputs are still computing when the call is made, so
    it is placed on arrival, and its engines keep the ranks' values outside
    Dask's spilling: after a lost worker, workers paused by that memory may
    not recompute the lost input, and the call then fails at its timeout
    (docs/failures.md), a bounded failure; either way nothing is left."""
    n = 10**7
    with LocalCluster(n_workers=4, threads_per_worker=1, memory_limit="250MiB", dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ws = sorted(client.nthreads())
        parts = [client.submit(_big_input, r, n, workers=[ws[r]], allow_other_workers=True, pure=False)
                 for r in range(4)]
        like = {"like": np.zeros(n, np.int64)} if method == "tasks" else {}  # p2p takes no template
        # p2p's bounded failure is the timeout: a quarter of a HANG keeps the suite short (a timeout is a pass
        # here; at half a HANG it took 33 s of the suite in 2026-11-28's CI, at a whole one 120 s of 125)
        timeout = HANG * 2 if method == "tasks" else HANG // 4
        out = flowreduce.allreduce(client, parts, algorithm=algorithm, method=method, timeout=timeout, **like)
        wait(out, timeout=HANG * 3)
        want = expected(n=n)
        failed = []
        for r, f in enumerate(out):
            try:
                x = f.result()
            except WorkerLostError as e:
                assert "tcp://" in str(e) or "rank" in str(e), e
                e.__traceback__ = None
                failed.append(r)
                continue
            except AllreduceTimeoutError as e:
                assert method == "p2p" and "did not finish within" in str(e), e
                e.__traceback__ = None
                failed.append(r)
                continue
            np.testing.assert_array_equal(x, want, err_msg=f"rank {r}")
            del x
        # a failure is a clean one only where memory cost a worker: with every worker still there, every rank
        # must be right (a call that always failed would pass the loop above)
        lost = set(ws) - set(client.nthreads())
        assert not failed or lost, f"ranks {failed} failed although no worker was lost"
        del out, parts, f, want
        gc.collect()
        assert_clean(client)


# -- 7. keys after a failed call (README: what remains on the cluster) ------------------------------------


def _fail_after_event(name):
    Event(name).wait()
    raise ValueError("this input failed on purpose")


def test_an_exception_kept_from_gather_holds_the_calls_keys_until_dropped(client):
    """As documented (README, docs/failures.md): the exception ``client.gather``
    raised holds the result futures in its traceback (Dask's own behaviour,
    as for ``submit``), so the failed call's keys stay while it lives, even
    with the results dropped; they go once its traceback is cleared. The
    exception from ``future.exception()`` holds none of them."""
    ws = sorted(client.nthreads())
    parts = [client.submit(rank_input, r, workers=[ws[r]], pure=False) for r in range(3)]
    name = f"flowreduce-test-{uuid.uuid4().hex}"
    event = Event(name, client=client)
    parts.append(client.submit(_fail_after_event, name, workers=[ws[3]], pure=False))
    out = flowreduce.allreduce(client, parts, algorithm="butterfly", like=np.zeros(N, np.int64))
    event.set()
    wait(out, timeout=HANG)
    token = parse(out[0].key)["token"]
    with pytest.raises(ValueError, match="failed on purpose") as caught:
        client.gather(out)
    kept = caught.value
    from_future = out[0].exception()
    assert isinstance(from_future, ValueError)
    del out, parts, caught
    gc.collect()
    flush(client)
    assert {parse(k)["token"] for k in flowreduce_keys(client)} == {token}, "the kept traceback holds the results"
    kept.__traceback__ = None
    assert_clean(client)
    assert isinstance(from_future, ValueError)  # still held: it kept nothing
