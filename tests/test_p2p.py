"""method="p2p": the plan run by the workers' engine (flowreduce.schedule.p2p).

Conformance against numpy through the front door (every dense algorithm,
ranks 1..8 and 64 sharing the fixtures' four workers, lengths 0, 1, p-1,
1000, 1001, chunks 1 and 3, ops sum / max / mean); the graph's size
(2 tasks per rank and a barrier whatever the plan); the handler's refusals;
failures (an input the engine refuses, a worker killed mid-run) failing
every rank in bounded time; and no run left in any engine afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import os
import uuid

import dask
import faults
import numpy as np
import pytest
from distributed import Client, Event, LocalCluster, SchedulerPlugin, wait
from utils import asleep_until_woken, assert_clean, scatter_ranks, wait_until, workers_of

import flowreduce
from flowreduce.algorithms import plan as make_plan
from flowreduce.errors import InputError, OptionError, WorkerLostError
from flowreduce.keys import hand_in_key
from flowreduce.lower.p2p import Spec, lower_p2p
from flowreduce.ops import resolve_op
from flowreduce.schedule import call
from flowreduce.schedule import p2p as engine
from flowreduce.schedule.extension import ensure_extension

DENSE = [a for a in flowreduce.ALGORITHMS if a != "auto"]


def _lengths(p):
    return sorted({0, 1, max(p - 1, 0), 1000, 1001})


def _inputs(p, n, op):
    """int64 inputs (exact sums) that differ per rank and element."""
    rng = np.random.default_rng(1000 * p + n)
    return [rng.integers(-1000, 1000, size=n, dtype=np.int64) for _ in range(p)]


def _expected(arrays, op):
    stack = np.stack(arrays)
    return {"sum": stack.sum(0), "max": stack.max(0), "mean": stack.mean(0)}[op]


def _check_calls(client, algorithm, p, op, cases):
    """Submit every (length, chunks) case at once, then compare each rank's result with numpy."""
    calls = []
    for n, chunks in cases:
        arrays = _inputs(p, n, op)
        futures = scatter_ranks(client, arrays)
        calls.append((n, chunks, arrays, flowreduce.allreduce(client, futures, op=op, algorithm=algorithm,
                                                              chunks=chunks, method="p2p")))
    for n, chunks, arrays, out in calls:
        want = _expected(arrays, op)
        got = [f.result(timeout=60) for f in out]  # a lost message would wait forever
        for r, x in enumerate(got):
            what = f"{algorithm} p={p} n={n} chunks={chunks} op={op} rank {r}"
            assert x.shape == want.shape and x.dtype == want.dtype, what
            if op == "mean":
                np.testing.assert_allclose(x, want, err_msg=what)
            else:
                np.testing.assert_array_equal(x, want, err_msg=what)
        assert flowreduce.describe(out).method == "p2p"


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("algorithm", DENSE)
def test_every_dense_algorithm_agrees_with_numpy(inproc_client, algorithm, p):
    """Sums at every length and chunking; max and mean (integer inputs: summed in int64, then divided) at a
    short and a long one (their code paths do not depend on the length)."""
    _check_calls(inproc_client, algorithm, p, "sum", [(n, c) for n in _lengths(p) for c in (1, 3)])
    for op in ("max", "mean"):
        _check_calls(inproc_client, algorithm, p, op, [(max(p - 1, 0), 1), (1001, 3)])


@pytest.mark.parametrize("algorithm", DENSE)
def test_64_ranks_on_four_workers(inproc_client, algorithm):
    _check_calls(inproc_client, algorithm, 64, "sum", [(0, 3), (1, 1), (63, 3), (1000, 1), (1001, 3)])
    _check_calls(inproc_client, algorithm, 64, "mean", [(1001, 3)])


@pytest.mark.parametrize("algorithm", DENSE)
def test_between_processes(proc_client, algorithm):
    """Values cross real comms (copies, reduced into where owned), big enough to run off the event loop."""
    _check_calls(proc_client, algorithm, 6, "sum", [(1001, 3), (engine.OFFLOAD_BYTES // 2, 1)])
    _check_calls(proc_client, algorithm, 5, "mean", [(1000, 1)])


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
def test_float64_sums_are_close_to_numpy(inproc_client, algorithm):
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(1001) for _ in range(7)]
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, arrays), algorithm=algorithm, chunks=3,
                               method="p2p")
    for x in inproc_client.gather(out):
        np.testing.assert_allclose(x, np.sum(arrays, axis=0))


# -- structure: O(ranks) tasks, whatever the plan ------------------------------------------------

@pytest.mark.parametrize("algorithm", DENSE)
@pytest.mark.parametrize("p", [1, 7, 64, 256])
@pytest.mark.parametrize("chunks", [1, 5])
def test_tasks_per_call_are_a_hand_in_per_worker_a_barrier_and_an_output_per_rank(algorithm, p, chunks):
    workers = [f"tcp://w{r % 4}:1" for r in range(p)]
    w = len(set(workers))
    plan = make_plan(algorithm, w, chunks=chunks)  # the plan runs over the workers: a worker's ranks combine there
    spec = Spec.of(plan, resolve_op("sum"), np.dtype("f8"), (1000,), workers, True)
    graph = engine.lower(spec, [("input", r) for r in range(p)])
    assert len(graph.tasks) == w + 1 + p <= 2 * p + 1
    assert all(graph.placement[k] == workers[r] for r, k in enumerate(graph.outputs))
    with pytest.raises(ValueError, match="workers of the ranks"):
        Spec.of(make_plan(algorithm, p + 1), resolve_op("sum"), np.dtype("f8"), (1000,), workers, True)


def test_the_front_door_submits_that_graph(inproc_client, monkeypatch):
    sizes = []
    real = call.submit
    monkeypatch.setattr(call, "submit", lambda client, job, *a, **k: sizes.append(len(job.tasks)) or real(
        client, job, *a, **k))
    p = 40
    arrays = _inputs(p, 100, "sum")
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, arrays), algorithm="butterfly",
                               chunks=4, method="p2p")
    np.testing.assert_array_equal(out[-1].result(), _expected(arrays, "sum"))
    assert sizes == [len(inproc_client.scheduler_info()["workers"]) + 1 + p]  # hand-ins per worker, outputs per rank


class GraphSizes(SchedulerPlugin):
    """Counts the new tasks of every graph the scheduler is sent (distributed's public plugin hook), not
    the inputs in memory it depends on (``tasks`` lists them too)."""

    name = "test-graph-sizes"

    def __init__(self):
        self.sizes = []

    def update_graph(self, scheduler, *, tasks, **kwargs):
        self.sizes.append(sum(scheduler.tasks[k].state != "memory" for k in tasks))


def _graph_sizes(dask_scheduler=None, clear=False):
    plugin = dask_scheduler.plugins[GraphSizes.name]
    sizes = list(plugin.sizes)
    if clear:
        plugin.sizes.clear()
    return sizes


@pytest.mark.parametrize("algorithm", DENSE)
def test_tasks_per_call_through_the_front_door_at_64_ranks(inproc_client, algorithm):
    """issue #25's bound, counted where the scheduler receives the graphs: every dense algorithm with
    method='p2p' sends at most 2 tasks per rank plus O(workers) per call (today a hand-in per worker,
    a barrier and an output per rank), whatever its steps: a named butterfly over these 64 ranks is
    1,216 tasks as method='tasks', a ring 12,160."""
    p, n = 64, 1000
    w = len(workers_of(inproc_client))
    futures = scatter_ranks(inproc_client, _inputs(p, n, "sum"))
    inproc_client.register_plugin(GraphSizes())
    inproc_client.run_on_scheduler(_graph_sizes, clear=True)
    out = flowreduce.allreduce(inproc_client, futures, algorithm=algorithm, method="p2p")
    wait(out)
    sizes = inproc_client.run_on_scheduler(_graph_sizes, clear=True)
    assert flowreduce.describe(out).method == "p2p"
    assert sizes and sum(sizes) <= 2 * p + 2 * w + 1, f"{algorithm}: graphs of {sizes} tasks for {p} ranks on {w} workers"
    np.testing.assert_array_equal(out[-1].result(), _expected(_inputs(p, n, "sum"), "sum"))


def test_method_from_the_dask_config_and_auto_by_default(inproc_client):
    arrays = _inputs(8, 10, "sum")
    futures = scatter_ranks(inproc_client, arrays)
    with dask.config.set({"flowreduce.method": "tasks"}):
        assert flowreduce.describe(flowreduce.allreduce(inproc_client, futures, algorithm="ring")).method == "tasks"
    with dask.config.set({"flowreduce.method": "p2p"}):
        out = flowreduce.allreduce(inproc_client, futures, algorithm="ring")
    record = flowreduce.describe(out)
    assert record.method == "p2p" and record.plan.algorithm == "ring"
    assert flowreduce.config.get("method") == "auto"
    with pytest.raises(OptionError, match="unknown method 'fast'.*'auto', 'tasks', 'p2p'"):
        flowreduce.allreduce(inproc_client, futures, method="fast")


def test_auto_runs_the_route_the_model_prices_lower(inproc_client):
    """A named ring over 8 ranks on 4 workers: 8 task levels of ~100 tasks as a graph, a few engine messages as
    p2p -- auto runs p2p, and says so; what p2p does not take (like=, deterministic=True, options naming ranks
    that share workers) runs as tasks under auto and is refused by method='p2p'."""
    arrays = _inputs(8, 1000, "sum")
    futures = scatter_ranks(inproc_client, arrays)
    out = flowreduce.allreduce(inproc_client, futures, algorithm="ring")
    record = flowreduce.describe(out)
    assert record.method == "p2p" and record.plan.ranks == 4
    model = flowreduce.CostModel()
    assert record.predicted == pytest.approx(model.p2p_time(record.plan, record.nbytes, 8), rel=0.01)  # cores shared
    assert record.predicted < model.predict(flowreduce.plan("ring", 8), record.nbytes)
    np.testing.assert_array_equal(out[5].result(), _expected(arrays, "sum"))
    floats = scatter_ranks(inproc_client, [a.astype("f8") for a in arrays])
    held_back = [(floats, {"deterministic": True}, "tree order"),
                 (futures, {"groups": [[0, 1, 2, 3], [4, 5, 6, 7]]}, "name ranks")]
    for parts, kwargs, why in held_back:
        algorithm = "hierarchical" if "groups" in kwargs else "ring"
        assert flowreduce.describe(flowreduce.allreduce(inproc_client, parts, algorithm=algorithm,
                                                        **kwargs)).method == "tasks"
        with pytest.raises(OptionError, match=why):
            flowreduce.allreduce(inproc_client, parts, algorithm=algorithm, method="p2p", **kwargs)
    # integer sums are exact in any order: deterministic=True keeps them on the engine
    assert flowreduce.describe(flowreduce.allreduce(inproc_client, futures, algorithm="ring",
                                                    deterministic=True)).method == "p2p"
    # one rank per worker: options naming ranks are the workers' own
    four = scatter_ranks(inproc_client, arrays[:4])
    out = flowreduce.allreduce(inproc_client, four, algorithm="reduce-broadcast", root=2, method="p2p")
    np.testing.assert_array_equal(out[0].result(), _expected(arrays[:4], "sum"))


def test_what_p2p_does_not_take_yet_is_refused(inproc_client):
    futures = scatter_ranks(inproc_client, _inputs(3, 10, "sum"))
    with pytest.raises(OptionError, match="unknown method"):
        flowreduce.allreduce(inproc_client, futures, method="mpi")
    with pytest.raises(OptionError, match="callable"):
        flowreduce.allreduce(inproc_client, futures, op=lambda a, b: a + b, method="p2p")
    with pytest.raises(OptionError, match="like="):
        flowreduce.allreduce(inproc_client, futures, like=np.zeros(10, np.int64), method="p2p")
    trees = [inproc_client.scatter({"a": np.ones(3)}) for _ in range(3)]
    with pytest.raises(OptionError, match="pytree"):
        flowreduce.allreduce(inproc_client, trees, method="p2p")


def test_torch_pytrees_and_sparse_in_memory_run_on_the_engine_as_calls_placed_on_arrival(inproc_client):
    """What the engine takes only on arrival (torch tensors converted there, a pytree or a scipy.sparse
    matrix per future gathered and reduced on one worker) runs with method='p2p' on inputs already in
    memory too, instead of being refused, and equals the reference."""
    import scipy.sparse as sp
    import torch

    c = inproc_client
    ws = workers_of(c)
    rng = np.random.default_rng(5)
    trees = [{"w": rng.integers(-50, 50, (3, 4)), "b": (rng.integers(-50, 50, 5),)} for _ in range(5)]
    futures = [c.submit(lambda t: t, t, workers=[ws[r % len(ws)]], pure=False) for r, t in enumerate(trees)]
    wait(futures)
    out = flowreduce.allreduce(c, futures, method="p2p")
    assert flowreduce.describe(out).method == "p2p"
    for f in out:
        got = f.result()
        np.testing.assert_array_equal(got["w"], sum(t["w"] for t in trees))
        np.testing.assert_array_equal(got["b"][0], sum(t["b"][0] for t in trees))
    mats = [sp.random(20, 30, density=0.1, random_state=r, format="csr", dtype=np.float64) for r in range(4)]
    mats = [sp.csr_matrix(np.round(m.toarray() * 100)) for m in mats]  # integers: exact in any order
    held = [c.scatter(m, workers=[ws[r % len(ws)]]) for r, m in enumerate(mats)]
    out = flowreduce.allreduce(c, held, method="p2p")
    assert flowreduce.describe(out).method == "p2p"
    for f in out:
        got = f.result()
        assert sp.issparse(got)
        np.testing.assert_array_equal(got.toarray(), sum(m.toarray() for m in mats))
    tensors = [torch.tensor(rng.integers(-50, 50, 7)) for _ in range(4)]
    held = [c.scatter(t, workers=[ws[r % len(ws)]]) for r, t in enumerate(tensors)]
    out = flowreduce.allreduce(c, held, op="max", method="p2p")
    assert flowreduce.describe(out).method == "p2p"
    for f in out:
        got = f.result()
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, torch.stack(tensors).amax(0), rtol=0, atol=0)


def test_inputs_that_disagree_are_refused_naming_the_ranks(inproc_client):
    arrays = _inputs(4, 10, "sum")
    arrays[2] = np.zeros(11, np.int64)
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, arrays), method="p2p")
    for f in out:  # input errors come on the results, every rank's
        e = f.exception(timeout=60)
        assert isinstance(e, InputError) and "ranks [2]" in str(e), repr(e)
    del out, f, e
    assert_clean(inproc_client)


# -- the handler's refusals -----------------------------------------------------------------------

def test_the_handler_refuses_what_no_run_sends(inproc_client):
    address = sorted(inproc_client.nthreads())[0]
    ensure_extension(inproc_client)

    async def ask(dask_worker, **message):
        return await dask_worker.handlers[engine.RECEIVE](**message)

    def reply(**message):
        message = {"index": [], "packed": np.empty(0, np.uint8), **message}
        return inproc_client.run(ask, workers=[address], **message)[address]

    assert "unknown arguments" in reply(run="x.0", items=[], bogus=1)["message"]
    assert "run id" in reply(run=7, items=[])["message"]
    assert "unknown run" in reply(run="nobody.0", items=[(0, 0, (np.zeros(1),))])["message"]
    spec = Spec.of(make_plan("ring", 2), resolve_op("sum"), np.dtype("i8"), (4,), [address, "tcp://other:1"], True)
    assert "no value" in reply(run="r.0", items=[(0, 0, (np.zeros(1),))], spec=spec)["message"]
    received = min(engine.program(spec, address).received)
    assert "elements" in reply(run="r.0", items=[(0, received, (np.zeros(99),))], spec=spec)["message"]
    packed = np.zeros(16, np.uint8)
    assert "overrun" in reply(run="r.0", index=[[0, received, [["<i8", 3]]]], packed=packed, items=[],
                              spec=spec)["message"]
    assert "longer" in reply(run="r.0", index=[[0, received, [["<i8", 1]]]], packed=packed, items=[],
                             spec=spec)["message"]
    assert "not a plain dtype" in reply(run="r.0", index=[[0, received, [["|O", 1]]]], packed=packed, items=[],
                                        spec=spec)["message"]
    assert "not numeric" in reply(run="r.0", index=[[0, received, [["<U2", 1]]]], packed=packed, items=[],
                                  spec=spec)["message"]
    assert "not a plain dtype" in reply(run="r.0", index=[[0, received, [["bogus", 1]]]], packed=packed, items=[],
                                        spec=spec)["message"]
    wrong = engine.program(spec, address).expected(0, received) + 1
    assert "elements" in reply(run="r.0", index=[[0, received, [["<i8", wrong]]]], packed=np.zeros(8 * wrong, np.uint8),
                               items=[], spec=spec)["message"]
    # a shared segment's handle: only a flowreduce segment of this user, of the generation sent, read within it
    assert "segment handle" in reply(run="r.0", items=[], spec=spec, shared={"name": "x"})["message"]
    outside = {"handle": ["../../etc/passwd", 4096, 1, []], "values": []}
    assert "not a flowreduce segment" in reply(run="r.0", items=[], spec=spec, shared=outside)["message"]
    assert "not [name, size, generation, pieces]" in reply(run="r.0", items=[], spec=spec,
                                                           shared={"handle": ["x"], "values": []})["message"]
    from flowreduce.shm import pool as shm_pool

    seg = shm_pool.pool().lease(64)
    try:
        stale = {"handle": [seg.name, seg.size, seg.generation + 1, []], "values": []}
        assert "another lease" in reply(run="r.0", items=[], spec=spec, shared=stale)["message"]
        for piece, why in ([["<i8", seg.size, 1], "does not lie inside"], [["|O", 0, 1], "not a plain dtype"],
                           [["<i8", 0, -1], "does not lie inside"], [["<U4", 0, 1], "not numeric"]):
            shared = {"handle": [seg.name, seg.size, seg.generation, [piece]], "values": [[0, received, 1]]}
            assert why in reply(run="r.0", items=[], spec=spec, shared=shared)["message"], why
        for count, why in ((2, "name more than its 1 pieces"), (0, "do not name its 1 pieces")):
            counted = {"handle": [seg.name, seg.size, seg.generation, [["<i8", 0, 1]]], "values": [[0, received, count]]}
            assert why in reply(run="r.0", items=[], spec=spec, shared=counted)["message"], why
    finally:
        shm_pool.pool().discard(seg)  # unlinked: this process's pool is never closed
    assert inproc_client.run(engine.runs_held) == {w: [] for w in inproc_client.nthreads()}


def _early_ready(dask_worker=None):
    return len(engine.engine_of(dask_worker).early_ready)


def test_the_ready_handler_refuses_what_no_peer_sends(inproc_client):
    """READY (a peer ready for a step of a run's paced values): bad arguments refused with the
    reason; a word for a run not started here kept for it, the newest FAILED_KEPT runs' only."""
    address = sorted(inproc_client.nthreads())[0]
    ensure_extension(inproc_client)

    async def ask(dask_worker, **message):
        return dask_worker.handlers[engine.READY](**message)

    def reply(**message):
        return inproc_client.run(ask, workers=[address], **message)[address]

    for bad in ({"run": 7, "step": 1, "peer": "tcp://a:1"}, {"run": "r.0", "step": -1, "peer": "tcp://a:1"},
                {"run": "r.0", "step": "1", "peer": "tcp://a:1"}, {"run": "r.0", "step": 1, "peer": 3},
                {"run": "r.0", "step": 1, "peer": "tcp://a:1", "bogus": 1}, {"run": "x" * 101, "step": 1, "peer": "p"}):
        answer = reply(**bad)
        assert answer["status"] == "error" and "bad arguments" in answer["message"], (bad, answer)
    before = inproc_client.run(_early_ready, workers=[address])[address]
    for _ in range(engine.FAILED_KEPT + 10):
        assert reply(run=f"early-{uuid.uuid4().hex}.0", step=2, peer="tcp://a:1") == {"status": "OK"}
    assert before <= inproc_client.run(_early_ready, workers=[address])[address] == engine.FAILED_KEPT


def _send_awaits(dask_worker=None):
    """Hostile await messages (the scheduler's stream): none may raise (that would drop the worker's
    stream) or leave anything awaited."""
    handle = dask_worker.stream_handlers[engine.AWAIT]
    for keys in (None, "x", [["k", "t"]], [[{}, "t", 0]], [[["a", {}], "t", 0]], [["k", 3, 0]], [["k", "t", "0"]]):
        handle(keys=keys)
    handle(keys=[], other=1)
    return engine.awaited_held(dask_worker)


def test_an_engine_refuses_await_messages_it_cannot_read(inproc_client):
    ensure_extension(inproc_client)
    assert inproc_client.run(_send_awaits) == {w: [] for w in inproc_client.nthreads()}


# -- failures and cleanup -------------------------------------------------------------------------

def _held(client):
    return {w: runs for w, runs in client.run(engine.runs_held).items() if runs}


def test_no_run_is_left_after_ten_calls(proc_client):
    for i in range(10):
        arrays = _inputs(6, 1000 + i, "sum")
        out = flowreduce.allreduce(proc_client, scatter_ranks(proc_client, arrays), algorithm=DENSE[i % len(DENSE)],
                                   chunks=1 + i % 3, method="p2p")
        np.testing.assert_array_equal(proc_client.gather(out)[i % 6], _expected(arrays, "sum"))
        del out
    assert wait_until(lambda: not _held(proc_client), 10), _held(proc_client)
    assert_clean(proc_client)


def test_an_input_the_engine_refuses_fails_every_rank_and_leaves_nothing(proc_client):
    """The engine checks each input against the run's spec (here a spec that lies about the shape)."""
    p = 6
    workers = [sorted(proc_client.nthreads())[r % 4] for r in range(p)]
    arrays = _inputs(p, 10, "sum")
    futures = [proc_client.scatter(x, workers=[w], hash=False) for x, w in zip(arrays, workers)]
    spec = Spec.of(make_plan("butterfly", 4), resolve_op("sum"), np.dtype("i8"), (11,), workers, True)
    ensure_extension(proc_client)
    graph = engine.lower(spec, futures)
    job = call.Job(graph.tasks, graph.placement, graph.outputs, graph.token, list, (), summary=("test",))
    out = call.submit(proc_client, job)
    for f in out:
        with pytest.raises(InputError, match="rank") as caught:
            f.result(timeout=60)
        caught.value.__traceback__ = None  # its frames hold the future (and so its key)
    assert wait_until(lambda: not _held(proc_client), 10), _held(proc_client)
    del out, futures, f, caught
    gc.collect()
    assert_clean(proc_client)


@pytest.fixture
def killable():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client
            faults.disarm(client)
            gc.collect()


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
@pytest.mark.parametrize("rank, step, action", [(1, 0, "kill"), (2, None, "kill"), (1, 0, "retire")],
                         ids=["killed-at-hand-in", "killed-at-output", "retired-at-hand-in"])
def test_a_worker_lost_mid_run_restarts_it_on_the_survivors(killable, algorithm, rank, step, action):
    """Rank ``rank``'s worker is killed (or retired) as its hand-in (step 0) or its output starts: the others
    have started the run and wait for its values. The run restarts as attempt 1 over the two survivors (one
    of them now holds two of the plan's ranks), the lost inputs are recomputed by Dask, and every rank's
    result is right; no run, key or segment is left."""
    p = 6
    workers = sorted(killable.nthreads())
    futures = [killable.submit(np.arange, 1000 * r, 1000 * (r + 1), workers=[workers[r % 3]],
                               allow_other_workers=True, pure=False) for r in range(p)]
    faults.fail_at(killable, rank=rank, step=step, action=action, algorithm=algorithm)
    wait(futures)  # computed: the hand-in route these faults are placed in (on arrival: test_workflows)
    out = flowreduce.allreduce(killable, futures, algorithm=algorithm, chunks=2, method="p2p")
    want = np.arange(1000 * p).reshape(p, 1000).sum(0)
    for f in out:
        np.testing.assert_array_equal(f.result(timeout=60), want)
    assert faults.fired(killable), "the fault did not fire: nothing was tested"
    assert len(killable.nthreads()) == 2
    assert wait_until(lambda: not _held(killable), 10), _held(killable)
    del out, futures, f
    gc.collect()
    assert_clean(killable)


def _old_run_value(run, x):
    return run


def _hand_in_is(key, task, dask_scheduler=None):
    dask_scheduler.tasks[key].run_spec = task


@contextlib.contextmanager
def _two_one_thread_workers():
    """A call's parts on two one-thread workers: the client, the workers, each rank's integer input and its
    future there, a butterfly spec over them and a fresh token."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ensure_extension(client)
        workers = sorted(client.nthreads())
        arrays = _inputs(2, 10, "sum")
        futures = [client.scatter(x, workers=[w], hash=False) for x, w in zip(arrays, workers)]
        spec = Spec.of(make_plan("butterfly", 2), resolve_op("sum"), np.dtype("i8"), (10,), workers, True)
        yield client, workers, arrays, futures, spec, uuid.uuid4().hex


def test_a_hand_in_holding_the_old_runs_value_runs_again():
    """A hand-in in memory with the old attempt's value while its task hands in to the new run: what a
    survivor left when a worker was retired at hand-in (it was fetching the retired worker's hand-in,
    Dask's copy of it, as the call restarted, and took the copy as the new run's result). The new run
    never had that rank's input: the barrier finds the value, the scheduler runs the hand-in again, and
    every result is right (before: the results waited for good)."""
    with _two_one_thread_workers() as (client, workers, arrays, futures, spec, token):
        graph = lower_p2p(spec, futures, token=token, run=engine.run_id(token, 1), hand_in=engine.hand_in,
                          barrier=engine.barrier, take_out=engine.take_out)
        stale = hand_in_key(spec.algorithm, token, 1)
        old = client.submit(_old_run_value, engine.run_id(token, 0), futures[1], key=stale, workers=[workers[1]])
        assert old.result(timeout=10) == engine.run_id(token, 0)
        client.run_on_scheduler(_hand_in_is, key=stale, task=graph.tasks[stale])  # the task, as restart left it
        job = call.Job(graph.tasks, graph.placement, graph.outputs, graph.token, list, (), summary=("test",))
        out = call.submit(client, job)
        for f in out:
            np.testing.assert_array_equal(f.result(timeout=20), arrays[0] + arrays[1])
        del old, out, f
        assert wait_until(lambda: not _held(client), 10), _held(client)


def _executing(key, dask_worker=None):
    ts = dask_worker.state.tasks.get(key)
    return ts is not None and ts.state == "executing"


def test_a_result_of_the_new_run_started_after_the_old_barrier_does_not_hold_the_worker():
    """A result task of the restarted run started against the old run's barrier (Dask does so when a
    restart releases a result before the old barrier, and cancels it next: the flake of
    retired-at-hand-in) fails at once: waiting on the new run, it would keep the only thread slot of a
    worker whose hand-in of that run then never runs (before: the call waited for good)."""
    with _two_one_thread_workers() as (client, workers, arrays, futures, spec, token):
        old, new = engine.run_id(token, 0), engine.run_id(token, 1)
        first = client.submit(engine.hand_in, new, 0, spec, futures[0], workers=[workers[0]], pure=False)
        assert first.result(timeout=10) == new
        assert wait_until(lambda: new in client.run(engine.runs_held, workers=[workers[1]])[workers[1]], 10)
        early = client.submit(engine.take_out, old, new, 1, workers=[workers[1]], pure=False)
        assert wait_until(lambda: early.done() or client.run(_executing, early.key, workers=[workers[1]])[workers[1]],
                          10)
        second = client.submit(engine.hand_in, new, 1, spec, futures[1], workers=[workers[1]], pure=False)
        assert second.result(timeout=10) == new  # the worker's only slot was free
        with pytest.raises(RuntimeError, match="another attempt"):
            early.result(timeout=10)
        got = [client.submit(engine.take_out, new, new, r, workers=[w], pure=False) for r, w in enumerate(workers)]
        for f in got:
            np.testing.assert_array_equal(f.result(timeout=10), arrays[0] + arrays[1])
        assert wait_until(lambda: not _held(client), 10), _held(client)


def test_two_workers_lost_in_one_call_leave_one_worker_to_finish_it(killable):
    """Two of three workers die during one call (at two ranks' hand-ins): it restarts each time and ends on the
    last worker, holding all three plan ranks."""
    p = 6
    workers = sorted(killable.nthreads())
    futures = [killable.submit(np.arange, 1000 * r, 1000 * (r + 1), workers=[workers[r % 3]],
                               allow_other_workers=True, pure=False) for r in range(p)]
    faults.fail_at(killable, rank=1, step=0, action="kill", algorithm="butterfly", more=((2, 0),))
    wait(futures)  # computed: the hand-in route these faults are placed in (on arrival: test_workflows)
    out = flowreduce.allreduce(killable, futures, algorithm="butterfly", method="p2p")
    want = np.arange(1000 * p).reshape(p, 1000).sum(0)
    for f in out:
        np.testing.assert_array_equal(f.result(timeout=90), want)
    assert len(faults.fired(killable)) == 2 and len(killable.nthreads()) == 1
    assert wait_until(lambda: not _held(killable), 10), _held(killable)


def test_a_lost_scattered_input_fails_every_rank_naming_it(killable):
    """Scattered data cannot be recomputed: the loss of its only copy fails the call, naming the rank."""
    p = 6
    workers = sorted(killable.nthreads())
    arrays = _inputs(p, 100, "sum")
    futures = [killable.scatter(x, workers=[workers[r % 3]], hash=False) for r, x in enumerate(arrays)]
    faults.fail_at(killable, rank=1, step=0, action="kill", algorithm="butterfly")
    wait(futures)  # computed: the hand-in route these faults are placed in (on arrival: test_workflows)
    out = flowreduce.allreduce(killable, futures, algorithm="butterfly", method="p2p")
    for f in out:
        with pytest.raises(WorkerLostError, match="rank") as caught:
            f.result(timeout=60)
        caught.value.__traceback__ = None  # its frames hold the future (and so its key)
    assert faults.fired(killable), "the fault did not fire: nothing was tested"
    assert wait_until(lambda: not _held(killable), 10), _held(killable)


def test_the_dashboard_draws_a_p2p_call(inproc_client):
    """Hand-ins, the barrier (rank 0, step 1), the engine's plan steps (as its workers report them, #25
    item 5) and outputs each have a cell on the ranks x steps grid; every engine cell ends all done."""
    from flowreduce.dashboard.record import ENGINE_COLUMN
    p = 5
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, _inputs(p, 20, "sum")),
                               algorithm="butterfly", method="p2p")
    [f.result(timeout=60) for f in out]
    token = flowreduce.describe(out).token

    def cells(dask_scheduler, token):
        from flowreduce.dashboard import views
        from flowreduce.dashboard.store import store_of

        call = store_of(dask_scheduler).find(token)
        return [(c.rank, c.column, c.state, c.done, c.tasks) for c in views.grid(call, dask_scheduler)]

    def engine_done(got):
        last = max((c for _, c, *_ in got), default=0)
        engine = [g for g in got if ENGINE_COLUMN <= g[1] < last]
        return bool(engine) and all(g[2] == "done" for g in got) and all(g[3] == g[4] for g in engine)

    assert wait_until(lambda: engine_done(inproc_client.run_on_scheduler(cells, token=token)), 10)
    got = inproc_client.run_on_scheduler(cells, token=token)
    # a hand-in per worker (named by its first rank: 5 ranks on 4 workers), the barrier on rank 0's
    assert {(r, c) for r, c, *_ in got} >= {(r, 0) for r in range(4)} | {(0, 1)}
    columns = sorted({c for _, c, *_ in got})
    assert columns[:2] == [0, 1] and len(columns) > 3  # hand-in, barrier, the engine's steps, output


def test_a_cancelled_call_leaves_no_run(proc_client):
    """Results cancelled as soon as submitted (before, during or after the run): the scheduler plugin tells
    the workers of a run that cannot finish, and nothing is left."""
    arrays = _inputs(8, 200_000, "sum")
    out = flowreduce.allreduce(proc_client, scatter_ranks(proc_client, arrays), algorithm="ring", chunks=4,
                               method="p2p")
    proc_client.cancel(out)
    del out
    assert wait_until(lambda: not _held(proc_client), 10), _held(proc_client)
    assert_clean(proc_client)


@pytest.mark.parametrize("dtype, op", [("float32", "mean"), ("int32", "mean"), ("bool", "sum"), ("float64", "prod"),
                                       ("uint8", "max"), ("float64", "logaddexp")])
def test_the_same_bits_as_method_tasks_with_a_rank_per_worker(inproc_client, dtype, op):
    """One rank per worker: the same plan, kernels and order of combining as the task graph, so the same
    result bit for bit (accumulating dtypes, mean's division, ufuncs by name)."""
    rng = np.random.default_rng(3)
    arrays = [(rng.standard_normal(1001) * 4).astype(dtype) for _ in range(4)]
    futures = scatter_ranks(inproc_client, arrays, workers_of(inproc_client))
    for algorithm in ("butterfly", "ring", "hierarchical"):
        tasks = flowreduce.allreduce(inproc_client, futures, op=op, algorithm=algorithm, chunks=3, method="tasks")
        p2p = flowreduce.allreduce(inproc_client, futures, op=op, algorithm=algorithm, chunks=3, method="p2p")
        for r, (a, b) in enumerate(zip(inproc_client.gather(tasks), [f.result(timeout=60) for f in p2p])):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{algorithm} rank {r}"


@pytest.mark.parametrize("dtype, op", [("float32", "sum"), ("float64", "prod"), ("float64", "logaddexp"),
                                       ("int16", "sum"), ("uint8", "max")])
def test_ranks_sharing_a_worker_are_combined_there_first(inproc_client, dtype, op):
    """Seven ranks on four workers: the engine combines each worker's ranks in rank order, then runs the plan
    over the four workers -- bit for bit the task graph of that plan over those partials."""
    rng = np.random.default_rng(4)
    arrays = [(rng.standard_normal(1001) * 4).astype(dtype) for _ in range(7)]
    workers = workers_of(inproc_client)
    placed = [workers[r % 4] for r in range(7)]
    futures = scatter_ranks(inproc_client, arrays, placed)
    the_op = resolve_op(op)
    partials = []
    for w in workers:  # each worker's ranks, in rank order, accumulated as the op does
        mine = [a for a, at in zip(arrays, placed) if at == w]
        acc = mine[0].astype(the_op.accumulator(mine[0].dtype) or mine[0].dtype)
        for a in mine[1:]:
            acc = the_op.combine(acc, a, out=acc)
        partials.append(acc)
    for algorithm in ("butterfly", "ring", "tree"):
        want = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, partials, workers), op=op,
                                    algorithm=algorithm, chunks=2, method="tasks")
        got = flowreduce.allreduce(inproc_client, futures, op=op, algorithm=algorithm, chunks=2, method="p2p")
        assert flowreduce.describe(got).plan.ranks == 4
        want = want[0].result(timeout=60)
        results = [f.result(timeout=60) for f in got]
        for r, b in enumerate(results):
            assert b.dtype == want.dtype and b.tobytes() == want.tobytes(), f"{algorithm} rank {r}"
        assert len({id(b) for b in results}) == 7  # every rank its own array



def _shared_sends(dask_worker=None):
    return engine.engine_of(dask_worker).shared_sends


def _leased(dask_worker=None):
    from flowreduce.shm import pool as shm_pool

    found = shm_pool.current()
    return found.stats()["leased"] if found is not None else 0


@pytest.mark.parametrize("algorithm", ["butterfly", "ring", "reduce-broadcast"])
def test_workers_of_one_host_exchange_big_values_through_shared_segments(proc_client, algorithm):
    """Values of at least flowreduce.shm.min-bytes between workers of one host go through a segment of the
    sender's pool (the receiver copies them out before answering): the same result as through Dask's comm,
    none when transport='dask', every segment given back after."""
    arrays = _inputs(4, 200_000, "sum")
    futures = scatter_ranks(proc_client, arrays)
    want = _expected(arrays, "sum")
    ensure_extension(proc_client)  # the counters live in the engines, there before any call
    for transport in ("dask", "auto"):
        before = sum(proc_client.run(_shared_sends).values())
        out = flowreduce.allreduce(proc_client, futures, algorithm=algorithm, chunks=2, method="p2p",
                                   transport=transport)
        for f in out:
            np.testing.assert_array_equal(f.result(timeout=60), want)
        sent = sum(proc_client.run(_shared_sends).values()) - before
        assert (sent > 0) == (transport == "auto"), (transport, sent)
        assert wait_until(lambda: not any(proc_client.run(_leased).values()), 10)
    assert wait_until(lambda: not _held(proc_client), 10), _held(proc_client)


def test_a_value_broadcast_to_workers_of_one_host_is_written_once(proc_client):
    """reduce-broadcast over 4 workers of one host: the three values sent to the root are three
    segments, and the root's result, sent to the three others, is one segment that each copies out
    (given back after the last): 4 writes, not 6. The same result as through Dask's comm."""
    arrays = _inputs(4, 200_000, "sum")
    futures = scatter_ranks(proc_client, arrays)
    ensure_extension(proc_client)
    before = sum(proc_client.run(_shared_sends).values())
    out = flowreduce.allreduce(proc_client, futures, algorithm="reduce-broadcast", method="p2p")
    for f in out:
        np.testing.assert_array_equal(f.result(timeout=60), _expected(arrays, "sum"))
    assert sum(proc_client.run(_shared_sends).values()) - before == 4
    assert wait_until(lambda: not any(proc_client.run(_leased).values()), 10)
    del out, futures


def _host_runs(dask_worker=None):
    return engine.engine_of(dask_worker).host_runs


@pytest.mark.parametrize("n", [0, 1, 1001, 100_000])
def test_workers_of_one_host_run_auto_as_one_collective_of_a_host_group(proc_client, n):
    """method="p2p" over workers of one host, algorithm auto: the plan is shm-direct, and the engines
    run it as one all-reduce of a host group (flowreduce.shm.host_group: every worker's values in shared
    memory, one step under SPLIT_BYTES (128 KiB) and two from it, no engine message). The same bits as the same plan
    through Dask's comm, ranks sharing workers combined there first; every segment given back after."""
    p = 6
    arrays = [np.random.default_rng(r).standard_normal(n) * 10.0 ** (r % 5) for r in range(p)]
    futures = scatter_ranks(proc_client, arrays)
    ensure_extension(proc_client)
    runs, sends = sum(proc_client.run(_host_runs).values()), sum(proc_client.run(_shared_sends).values())
    out = flowreduce.allreduce(proc_client, futures, method="p2p")
    got = proc_client.gather(out)
    assert flowreduce.describe(out).plan.algorithm == "shm-direct"
    assert sum(proc_client.run(_host_runs).values()) - runs == 4  # every worker, once
    assert sum(proc_client.run(_shared_sends).values()) == sends  # and no message
    through_dask = proc_client.gather(flowreduce.allreduce(proc_client, futures, algorithm="shm-direct",
                                                           method="p2p", transport="dask"))
    for g in got:
        assert g.tobytes() == through_dask[0].tobytes()
    np.testing.assert_allclose(got[0], np.sum(arrays, axis=0), rtol=1e-9)
    assert wait_until(lambda: not any(proc_client.run(_leased).values()), 10)
    assert wait_until(lambda: not _held(proc_client), 10), _held(proc_client)


def _published_runs(dask_worker=None):
    return engine.engine_of(dask_worker).published_runs


def _held_back_floats(name: str, r: int, n: int) -> np.ndarray:
    Event(name).wait()
    return np.random.default_rng(r).standard_normal(n) * 10.0 ** (r % 5)


@pytest.mark.parametrize("n", [1, 1001, 100_000, 300_000])
def test_a_call_placed_on_arrival_on_one_host_folds_the_inputs_where_they_arrived(proc_client, n):
    """A call on inputs still computing, over workers of one host: each input, up to
    engine.PUBLISH_BYTES, is copied into a shared segment as it arrives, and when the call begins each
    worker folds every rank's input from there, in rank order, with no wait for its peers. Every rank
    gets the bits of the left fold over the ranks (ranks sharing workers too); a bigger input runs as
    the host group's all-reduce (the same bits on every rank); every segment is given back when the
    call ends."""
    p = 6
    workers = sorted(proc_client.nthreads())
    name = f"go-{uuid.uuid4().hex}"
    futures = [proc_client.submit(_held_back_floats, name, r, n, workers=[workers[r % 4]], pure=False)
               for r in range(p)]
    ensure_extension(proc_client)
    published, runs = sum(proc_client.run(_published_runs).values()), sum(proc_client.run(_host_runs).values())
    out = flowreduce.allreduce(proc_client, futures)
    Event(name, client=proc_client).set()
    got = proc_client.gather(out)
    arrays = [np.random.default_rng(r).standard_normal(n) * 10.0 ** (r % 5) for r in range(p)]
    want = arrays[0].copy()
    for a in arrays[1:]:
        want += a
    published_here = n * 8 <= engine.PUBLISH_BYTES
    for g in got:  # the host group combines a worker's ranks first (rank r with r + 4 here): other bits
        assert g.tobytes() == (want if published_here else got[0]).tobytes()
    np.testing.assert_allclose(got[0], want, rtol=1e-9)
    folded = sum(proc_client.run(_published_runs).values()) - published
    assert folded == (4 if published_here else 0)
    assert sum(proc_client.run(_host_runs).values()) - runs == 4  # every worker, once
    assert wait_until(lambda: not any(proc_client.run(_leased).values()), 10)
    assert wait_until(lambda: not _held(proc_client), 10), _held(proc_client)
    del out, futures


def test_no_host_group_where_shared_memory_is_off():
    """flowreduce.shm.enabled false on the workers: shm-direct named on the engine runs as the plan
    through Dask's comm, never as a host group in /dev/shm (the client's config says the same)."""
    arrays = _inputs(6, 100_000, "sum")
    with dask.config.set({"flowreduce.shm.enabled": False}), \
            LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        futures = scatter_ranks(client, arrays)
        ensure_extension(client)
        out = flowreduce.allreduce(client, futures, algorithm="shm-direct", method="p2p")
        for f in out:
            np.testing.assert_array_equal(f.result(timeout=60), _expected(arrays, "sum"))
        assert sum(client.run(_host_runs).values()) == 0


def _die_in_host_group(dask_worker=None):
    """Arm this worker to SIGKILL itself as its engine enters a host group's all-reduce (its peers wait
    for it in shared memory)."""
    import os
    import signal

    from flowreduce.shm.host_group import HostGroup

    def dying(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    HostGroup.allreduce = dying


@pytest.mark.parametrize("n", [1000, 100_000])
def test_a_worker_killed_inside_a_host_group_run_restarts_it_on_the_survivors(killable, n):
    """A worker dies as its engine enters the host group while the other two wait for it there: their
    wait ends (the run failed), the run restarts over the two survivors, and every rank's result is
    right; no run, key or segment is left."""
    p = 6
    workers = sorted(killable.nthreads())
    futures = [killable.submit(np.arange, n * r, n * (r + 1), workers=[workers[r % 3]],
                               allow_other_workers=True, pure=False) for r in range(p)]
    ensure_extension(killable)
    killable.run(_die_in_host_group, workers=[workers[1]])
    killable.run(asleep_until_woken, workers=[workers[0], workers[2]])  # their wait ends as the run fails there
    wait(futures)
    out = flowreduce.allreduce(killable, futures, method="p2p")
    want = np.arange(n * p).reshape(p, n).sum(0)
    for f in out:
        np.testing.assert_array_equal(f.result(timeout=60), want)
    assert flowreduce.describe(out).plan.algorithm == "shm-direct"
    assert workers[1] not in killable.nthreads()  # it did die mid-run
    assert wait_until(lambda: not _held(killable), 10), _held(killable)
    del out, futures, f
    gc.collect()
    assert_clean(killable)


def _die_at_first_message(dask_worker=None):
    """Arm this worker to SIGKILL itself when its engine receives a run's first values (mid-run: the
    peers have computed and sent a step, this worker has handed in)."""
    import os
    import signal

    real = dask_worker.handlers[engine.RECEIVE]

    async def dying(**message):
        os.kill(os.getpid(), signal.SIGKILL)
        return await real(**message)

    dask_worker.handlers[engine.RECEIVE] = dying


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
def test_a_worker_killed_between_engine_steps_restarts_the_run(killable, algorithm):
    """The kill lands inside the engine's run, when a step's values reach a worker (no task starts then):
    the run restarts over the survivors and every rank's result is right."""
    p = 6
    workers = sorted(killable.nthreads())
    futures = [killable.submit(np.arange, 1000 * r, 1000 * (r + 1), workers=[workers[r % 3]],
                               allow_other_workers=True, pure=False) for r in range(p)]
    ensure_extension(killable)
    killable.run(_die_at_first_message, workers=[workers[1]])
    wait(futures)  # computed: the hand-in route these faults are placed in (on arrival: test_workflows)
    out = flowreduce.allreduce(killable, futures, algorithm=algorithm, chunks=2, method="p2p")
    want = np.arange(1000 * p).reshape(p, 1000).sum(0)
    for f in out:
        np.testing.assert_array_equal(f.result(timeout=60), want)
    assert workers[1] not in killable.nthreads()  # it did die mid-run
    assert wait_until(lambda: not _held(killable), 10), _held(killable)


def _held_back(name: str, lo: int, hi: int) -> np.ndarray:
    Event(name).wait()
    return np.arange(lo, hi)


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
def test_a_worker_killed_inside_a_run_placed_on_arrival_runs_it_again(killable, algorithm):
    """The call is placed on arrival (its inputs still computing) and a worker dies inside its run, when a
    step's values reach it. Its ranks arrive again where their inputs are recomputed (the workers are told
    to await them again; a result that runs where its input is arrives it there), and the next attempt
    begins when the last has (else the call waited for good). No engine keeps or awaits anything after."""
    p = 6
    workers = sorted(killable.nthreads())
    name = f"go-{uuid.uuid4().hex}"
    futures = [killable.submit(_held_back, name, 1000 * r, 1000 * (r + 1), workers=[workers[r % 3]],
                               allow_other_workers=True, pure=False) for r in range(p)]
    ensure_extension(killable)
    killable.run(_die_at_first_message, workers=[workers[1]])
    out = flowreduce.allreduce(killable, futures, algorithm=algorithm, chunks=2, method="p2p")
    Event(name, client=killable).set()
    want = np.arange(1000 * p).reshape(p, 1000).sum(0)
    for f in out:
        np.testing.assert_array_equal(f.result(timeout=60), want)
    assert workers[1] not in killable.nthreads()  # it did die mid-run
    assert wait_until(lambda: not _held(killable), 10), _held(killable)
    del out, futures, f
    gc.collect()
    assert_clean(killable)


def _once(path: str, name: str, lo: int, hi: int) -> np.ndarray:
    """An input that cannot be computed again (no lineage to recover it from)."""
    if os.path.exists(path):
        raise RuntimeError(f"input {path} computed twice")
    open(path, "w").close()
    Event(name).wait()
    return np.arange(lo, hi)


def test_an_input_that_fails_while_a_call_placed_on_arrival_runs_again_fails_every_rank(killable, tmp_path):
    """A worker dies inside the run of a call placed on arrival, and its ranks' inputs fail when Dask
    computes them again: the call ends there. Every rank's result raises (none waits for the call's
    timeout), and every engine lets go of the inputs it kept since they arrived."""
    p = 6
    workers = sorted(killable.nthreads())
    name = f"go-{uuid.uuid4().hex}"
    futures = [killable.submit(_once, str(tmp_path / f"rank{r}"), name, 1000 * r, 1000 * (r + 1),
                               workers=[workers[r % 3]], allow_other_workers=True, pure=False) for r in range(p)]
    ensure_extension(killable)
    killable.run(_die_at_first_message, workers=[workers[1]])
    out = flowreduce.allreduce(killable, futures, algorithm="ring", chunks=2, method="p2p", timeout=120)
    Event(name, client=killable).set()
    wait(out, timeout=60)  # well before the call's timeout
    assert workers[1] not in killable.nthreads()  # it did die mid-run
    assert all(f.status == "error" for f in out), [f.status for f in out]
    assert any("computed twice" in str(f.exception()) for f in out)
    assert wait_until(lambda: not _held(killable), 10), _held(killable)
    del out, futures
    gc.collect()
    assert_clean(killable)


def test_a_new_scheduler_on_a_port_used_before_gets_the_engine():
    """The engine is installed per client, not per scheduler address: a
    scheduler started on the port of one that closed (as happens between
    test modules, and when a user restarts a cluster on a fixed port) has
    none of its plugins. Keyed by address, its hand-ins failed "the engine
    is not installed" on every worker (a CI run, 2026-11-26)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arrays = _inputs(3, 100, "sum")
    for _ in range(2):
        with LocalCluster(n_workers=3, threads_per_worker=1, processes=False, scheduler_port=port,
                          dashboard_address=None, host="127.0.0.1") as cluster, Client(cluster) as client:
            assert client.scheduler.address == f"tcp://127.0.0.1:{port}"
            out = flowreduce.allreduce(client, scatter_ranks(client, arrays), algorithm="ring", method="p2p")
            for x in client.gather(out):
                np.testing.assert_array_equal(x, _expected(arrays, "sum"))
            del out
            gc.collect()
            assert_clean(client)


@pytest.fixture
def four_hosts():
    """Four in-process workers listening on four loopback addresses: four hosts, as their addresses say."""
    from distributed import Scheduler, SpecCluster, Worker

    workers = {f"h{i}": {"cls": Worker, "options": {"host": f"127.0.0.{i + 1}", "nthreads": 1}} for i in range(4)}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(4, timeout=60)
        yield cluster, client


def test_a_step_between_hosts_goes_once_its_receiver_has_the_steps_before(four_hosts):
    """Paced values (engine.PACED_BYTES): a radix-2 butterfly over 4 hosts with 2-4 MB values and no
    shared memory. The first host's step-0 value is held up 0.5 s as it arrives there; its partner
    of step 1, done with step 0 at once, sends its step-1 value only once the first host has its
    step-0 value (pushed at once, it would come meanwhile and share the link with it). Every rank's
    result is right."""
    cluster, client = four_hosts
    ensure_extension(client)
    workers = sorted(client.nthreads())
    plan = make_plan("butterfly", 4, radix=2)
    first = next(w for w in cluster.workers.values() if w.address == workers[0])
    calls: list[tuple[float, float, list[int]]] = []
    real = first.handlers[engine.RECEIVE]

    async def slow_step_0(**message):
        import asyncio
        import time

        items = message.get("items")
        steps = sorted({plan.nodes[n].step for _, n, _ in (items.data if hasattr(items, "data") else items or [])})
        t0 = time.monotonic()
        if steps == [0]:
            await asyncio.sleep(0.5)
        try:
            return await real(**message)
        finally:
            calls.append((t0, time.monotonic(), steps))

    first.handlers[engine.RECEIVE] = slow_step_0
    n = 1 << 19  # float64: 4 MiB a rank; a radix-2 butterfly's values between hosts are 2 and 1 MiB
    xs = [client.submit(np.arange, r * n, (r + 1) * n, dtype=np.float64, workers=[w], pure=False)
          for r, w in enumerate(workers)]
    out = flowreduce.allreduce(client, xs, algorithm="butterfly", method="p2p", transport="dask", chunks=1)
    want = np.arange(4 * n, dtype=np.float64).reshape(4, n).sum(0)
    for f in out:
        np.testing.assert_array_equal(f.result(timeout=60), want)
    assert flowreduce.describe(out).plan.algorithm == "butterfly"
    first.handlers[engine.RECEIVE] = real
    step0 = [c for c in calls if c[2] == [0]]
    step1 = [c for c in calls if c[2] and c[2][0] == 1]
    assert step0 and step1, calls
    assert min(c[0] for c in step1) >= max(c[1] for c in step0), calls  # step 1 came after step 0 was in
    assert sum(engine.engine_of(w).ready_heard for w in cluster.workers.values()) > 0  # the receivers said so
