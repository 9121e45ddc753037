"""Where things run and what is left: pinning checked in the task stream,
user keys never transferred, unique keys per call, nothing leaked."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest
from distributed import get_task_stream, wait
from utils import assert_clean, scatter_ranks, workers_of

import flowreduce
from flowreduce.keys import parse

# These tests are about where each task of the task graph runs: method='tasks' (tests/test_p2p.py covers the engine)
pytestmark = pytest.mark.usefixtures("method_tasks")


@pytest.mark.parametrize("algorithm", ["butterfly", "ring", "tree", "recursive-doubling", "reduce-broadcast"])
def test_every_task_runs_where_its_plan_says(proc_client, algorithm):
    ws = workers_of(proc_client)
    arrays = [np.full(5000, r, dtype=np.int64) for r in range(6)]  # 6 ranks on 4 workers
    parts = scatter_ranks(proc_client, arrays)
    with get_task_stream(proc_client) as ts:
        futures = flowreduce.allreduce(proc_client, parts, algorithm=algorithm, chunks=2)
        wait(futures)
    token = parse(futures[0].key)["token"]
    ran = [(parse(d["key"]), d["worker"]) for d in ts.data]
    mine = [(k, w) for k, w in ran if k and k["token"] == token]
    info = flowreduce.describe(futures)
    assert len(mine) == info.plan.cost().tasks  # every task of the graph ran exactly once
    for k, w in mine:
        assert w == ws[k["rank"] % len(ws)], f"{k} ran on {w}"
    who = proc_client.who_has(futures)
    for r, f in enumerate(futures):
        assert list(who[f.key]) == [ws[r % len(ws)]], f"result of rank {r} is on {who[f.key]}"


def _fetched_keys(dask_worker):
    return [str(k) for entry in dask_worker.transfer_incoming_log for k in entry["keys"]]


def test_user_keys_never_cross_workers(proc_client):
    proc_client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
    arrays = [np.arange(20_000) * r for r in range(4)]
    parts = scatter_ranks(proc_client, arrays)
    futures = flowreduce.allreduce(proc_client, parts, algorithm="butterfly", chunks=3)
    wait(futures)
    fetched = {k for keys in proc_client.run(_fetched_keys).values() for k in keys}
    assert fetched, "the all-reduce moved nothing between workers?"
    user = {str(f.key) for f in parts} | {str(f.key) for f in futures}
    assert not fetched & user, f"user keys were transferred: {fetched & user}"
    assert all("flowreduce-" in k for k in fetched)


def test_concurrent_calls_do_not_share_keys(proc_client):
    a = scatter_ranks(proc_client, [np.arange(1000) + r for r in range(4)])
    b = scatter_ranks(proc_client, [np.arange(1000) * r for r in range(4)])
    fa = flowreduce.allreduce(proc_client, a, algorithm="ring")
    fb = flowreduce.allreduce(proc_client, b, algorithm="ring")
    assert not {f.key for f in fa} & {f.key for f in fb}
    ra, rb = proc_client.gather(fa), proc_client.gather(fb)
    for x in ra:
        np.testing.assert_array_equal(x, sum(np.arange(1000) + r for r in range(4)))
    for x in rb:
        np.testing.assert_array_equal(x, sum(np.arange(1000) * r for r in range(4)))


def test_nothing_left_after_results_dropped(proc_client):
    parts = scatter_ranks(proc_client, [np.ones(30_000) for _ in range(5)])
    futures = flowreduce.allreduce(proc_client, parts, algorithm="butterfly", chunks=4)
    wait(futures)
    del futures
    assert_clean(proc_client)


def test_graph_carries_no_data():
    """The graph sent through the client holds references, not arrays."""
    from dask.task_spec import TaskRef

    from flowreduce.lower.graph import build_graph
    from flowreduce.ops import resolve_op

    p = flowreduce.plan("butterfly", 8, chunks=4)
    g = build_graph(p, [TaskRef(("in", r)) for r in range(8)], [f"w{r}" for r in range(8)],
                    size=10**7, shape=(10**7,), op=resolve_op("sum"))
    assert len(pickle.dumps(g.tasks)) < 200_000  # an 80 MB vector per rank
    assert set(g.placement) == set(g.tasks)


def test_auto_says_what_it_picked(proc_client, caplog):
    parts = scatter_ranks(proc_client, [np.ones(100) for _ in range(4)])
    with caplog.at_level("INFO", logger="flowreduce"):
        futures = flowreduce.allreduce(proc_client, parts)
    info = flowreduce.describe(futures)
    assert info.algorithm in flowreduce.ALGORITHMS and info.algorithm != "auto"
    assert "auto chose" in caplog.text and info.algorithm in caplog.text
    assert info.predicted > 0


@pytest.mark.parametrize("make", [lambda: np.arange(1000.0), lambda: np.arange(2000.0)[::2],
                                  lambda: np.arange(1000.0).reshape(10, 100)])
def test_input_views_count_small_until_they_travel(make):
    """Dask sizes values by nbytes; a zero-copy view of the input must not count
    again (it would trigger spilling that frees nothing), but once pickled it
    is a real copy and counts in full."""
    from dask.sizeof import sizeof

    from flowreduce.kernels.dense import split

    x = make()
    v = split(x, 100, 600)
    assert np.shares_memory(v[0], x) and sizeof(v) < 1000
    moved = pickle.loads(pickle.dumps(v, protocol=5))
    assert type(moved) is tuple and not np.shares_memory(moved[0], x)
    assert sizeof(moved) >= 500 * 8
    np.testing.assert_array_equal(moved[0], x.reshape(-1)[100:600])
    cast = split(x, 100, 600, np.dtype("int64"))  # a widening cast is a copy: full size
    assert sizeof(cast) >= 500 * 8


def test_replicated_input_stays_where_it_was_pinned(proc_client):
    """A task elsewhere fetched rank 0's input (as the hand-written baseline
    does); rank 0's result must still live on the worker it was pinned to,
    although the other holder is idle and the pinned one holds every rank."""
    ws = workers_of(proc_client)
    xs = [proc_client.submit(np.full, 5, r, workers=[ws[0]], pure=False) for r in range(3)]
    wait(xs)
    proc_client.submit(len, xs[0], workers=[ws[1]], pure=False).result()  # a replica on ws[1]
    assert sorted(proc_client.who_has([xs[0]])[xs[0].key]) == sorted(ws[:2])
    out = flowreduce.allreduce(proc_client, xs, algorithm="ring")
    wait(out)
    assert [proc_client.who_has([f])[f.key] for f in out] == [(ws[0],)] * 3
    np.testing.assert_array_equal(out[0].result(), np.full(5, 3))


def test_cores_and_groups_come_from_where_workers_run():
    from flowreduce.schedule.hosts import Place, host_groups, shared_cores

    # (node, cpus, job, machine): two SLURM virtual nodes on one 2-CPU machine, two jobs
    places = {"a": Place("n1", 2, "7", "box"), "b": Place("n1", 2, "7", "box"),
              "c": Place("n2", 2, "8", "box"), "d": Place("n2", 2, "8", "box")}
    assert host_groups(["a", "c", "b", "d"], places) == [[0, 2], [1, 3]]
    assert shared_cores(list("abcd"), places) == 2  # the machine's CPUs, not the nodes'
    apart = {w: Place(f"n{i}", 8, "", f"box{i}") for i, w in enumerate("abcd")}
    assert shared_cores(list("abcd"), apart) is None  # a core each: nothing shared
    assert host_groups(list("abcd"), apart) == [[0], [1], [2], [3]]


def _wait_for_event(name):
    from distributed import Event

    Event(name).wait()
    return 1


def test_amm_keeps_the_replica_a_waiting_pinned_task_needs(proc_client):
    """A rank's value X was fetched by a peer (two replicas) while a task of
    X's own worker still waits for it. Dask's ReduceReplicas would drop the
    replica on the worker using the most memory — here the owner — and the
    owner would fetch its own data back; flowreduce's guard keeps it."""
    import time
    import uuid

    from distributed import Event

    from flowreduce.schedule.extension import ensure_extension

    ensure_extension(proc_client)
    proc_client.amm.stop()  # run it once, below, when the stage is set
    a, b, c = workers_of(proc_client)[:3]
    token, event = uuid.uuid4().hex, f"flowreduce-test-{uuid.uuid4().hex}"
    x = proc_client.submit(np.arange, 1000, key=(f"flowreduce-test-split-{token}", 0, 0, 0, 0), workers=[a])
    later = proc_client.submit(_wait_for_event, event, workers=[c], pure=False)  # not ready yet
    waiting = proc_client.submit(lambda v, _: v, x, later, key=(f"flowreduce-test-reduce-{token}", 1, 0, 0, 1),
                                 workers=[a], allow_other_workers=False)
    peer = proc_client.submit(np.sum, x, workers=[b], pure=False)  # makes the replica on b
    heavy = proc_client.scatter(np.ones(20_000_000), workers=[a])  # a is the worker AMM would pick
    wait([peer, heavy])
    assert set(proc_client.who_has([x])[x.key]) == {a, b}
    try:
        proc_client.amm.run_once()
        deadline = time.monotonic() + 10
        while len(proc_client.who_has([x])[x.key]) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_client.who_has([x])[x.key] == (a,), "the owner's replica was dropped"
    finally:
        Event(event, client=proc_client).set()
        proc_client.amm.start()
    np.testing.assert_array_equal(waiting.result(), np.arange(1000))
    del x, later, waiting, peer, heavy
    assert_clean(proc_client)


# -- one decision in one place --------------------------------------------------------


def test_chunk_bytes_give_the_same_chunks_on_every_path(inproc_client):
    """``chunk_bytes`` -> chunks is one rule for a dense call, each bucket of a
    pytree call (with a template or not) and block-sparse: ceil(bytes / chunk_bytes)."""
    client = inproc_client
    arrays = [np.arange(1000, dtype=np.float64) * (r + 1) for r in range(3)]  # 8000 bytes each
    parts = scatter_ranks(client, arrays)
    expected = -(-8000 // 3000)
    dense = flowreduce.allreduce(client, parts, algorithm="ring", chunk_bytes=3000)
    blocks = flowreduce.allreduce(client, parts, algorithm="block-sparse", chunk_bytes=3000, block_size=100)
    trees = [flowreduce.allreduce(client, [[p] for p in parts], algorithm="ring", chunk_bytes=3000, **kw)
             for kw in ({}, {"like": [np.zeros(1000)]})]
    for out in (dense, blocks, *trees):
        assert flowreduce.describe(out).plan.chunks == expected, flowreduce.describe(out).plan
        for got in client.gather(out):
            np.testing.assert_allclose(np.ravel(got), np.sum(arrays, axis=0))
    del dense, blocks, trees, out
    assert_clean(client)


def test_a_model_without_cores_learns_the_shared_cores():
    from dataclasses import replace

    from flowreduce.cost import CostModel, configured_model, model_for

    assert model_for(None, 2) == replace(configured_model(), cores=2)
    assert model_for(CostModel(cores=8), 2).cores == 8  # a model naming its cores keeps them
    assert model_for(CostModel(), None) == CostModel()


def test_one_bounded_record_per_call_read_by_describe_and_the_tracer(inproc_client, monkeypatch):
    """describe() and the tracer's lookup read the same records, and forget a
    call together once more than MAX_CALLS came after it."""
    from flowreduce.schedule import records
    from flowreduce.tracing import registry

    client = inproc_client
    parts = scatter_ranks(client, [np.full(8, r, dtype=np.int64) for r in range(3)])
    tree = flowreduce.allreduce(client, [{"a": p, "b": p} for p in parts], bucket_bytes=0)
    whole = flowreduce.describe(tree)
    assert len(whole.buckets) == 2 and whole.nbytes == 2 * 64
    for bucket in whole.buckets:
        assert registry.lookup(bucket.token).plan == bucket.plan
    dense = flowreduce.allreduce(client, parts, algorithm="ring")
    call = flowreduce.describe(dense)
    assert registry.lookup(call.token) == call.__class__(**{**call.__dict__, "input_keys": ()})
    assert call.input_keys == tuple(p.key for p in parts)
    monkeypatch.setattr(records, "MAX_CALLS", 2)  # the two buckets go, the dense calls stay
    flowreduce.allreduce(client, parts, algorithm="ring")
    assert registry.lookup(whole.buckets[0].token) is None  # forgotten by both at once
    with pytest.raises(KeyError):
        flowreduce.describe(tree)
    assert flowreduce.describe(dense) == call
    del tree, dense
    gc.collect()  # the KeyError's traceback held the futures in a cycle
    assert_clean(client)


def _slow(x):
    import time

    time.sleep(1.0)  # outlasts several of the waits below, so they time out
    return x


def _keys(dask_scheduler):
    return [k for k in dask_scheduler.tasks if str(k).startswith("pinned-slow-")]


@pytest.mark.parametrize("how", ["gather_pinned", "wait_for_a_while"])
def test_waits_that_time_out_let_go_of_the_futures(inproc_client, how):
    """A wait that timed out keeps no reference to the futures it waited on: distributed's timeout
    exception sits in a reference cycle with the waiting frames, and before these waits cleared it a
    closed trainer's replicas kept their keys on the scheduler until the garbage collector ran."""
    from utils import wait_until

    from flowreduce.schedule.placement import gather_pinned, wait_for_a_while

    client, w = inproc_client, workers_of(inproc_client)[0]
    gc.collect()
    gc.disable()  # the cycle would otherwise be collected at some moment: the test must see it deterministically
    try:
        f = client.submit(_slow, 7, workers=[w], key=f"pinned-slow-{how}")
        if how == "gather_pinned":
            assert gather_pinned(client, [f], [w], "a test", poll=0.05) == [7]
        else:
            assert wait_for_a_while(client, [f], 0.05) is None
        del f
        assert wait_until(lambda: not client.run_on_scheduler(_keys), 10)
    finally:
        gc.enable()
