"""The all-reduce as a graph operation inside Dask workflows (issue #26,
docs/workflows.md): a call on inputs still computing returns at once and is
placed where its inputs arrive; Dask collections in give collections out;
input errors arrive on the results, naming the ranks; a chained loop
submitted without waiting gives the naive loop's weights; a worker lost
mid-call re-runs it. Each test checks values against numpy, and that no
key, kept input or run is left behind."""

from __future__ import annotations

import gc
import os
import signal
import uuid

import dask
import dask.array as da
import numpy as np
import pytest
from dask.delayed import Delayed
from distributed import Client, Event, LocalCluster, wait
from utils import assert_clean, flowreduce_keys, wait_until

import flowreduce
from flowreduce.errors import AllreduceTimeoutError, InputError, InputStateError, InputTypeError, OptionError
from flowreduce.schedule import p2p as engine

HANG = 60  # s: past this a wait counts as a hang; nothing here is timed


def rank_input(r: int, n: int = 1000) -> np.ndarray:
    return np.arange(n, dtype=np.int64) * (r + 1) - 3 * r


def held_back(name: str, r: int, n: int = 1000) -> np.ndarray:
    """Rank r's input once the test sets Event ``name`` (a call that waited for it fails, not hangs)."""
    if not Event(name).wait(HANG):
        raise TimeoutError(f"event {name} was not set")
    return rank_input(r, n)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        yield c


@pytest.fixture
def client(cluster):
    with Client(cluster) as c:
        c.wait_for_workers(4, timeout=HANG)
        yield c
        gc.collect()
        assert_clean(c)
        assert wait_until(lambda: not any(c.run(engine.arrivals_held).values()), 10), c.run(engine.arrivals_held)
        assert wait_until(lambda: not any(c.run(engine.runs_held).values()), 10), c.run(engine.runs_held)
        assert wait_until(lambda: not any(c.run(engine.awaited_held).values()), 10), c.run(engine.awaited_held)


def _expected(p: int, n: int = 1000) -> np.ndarray:
    return sum(rank_input(r, n) for r in range(p))


@pytest.mark.parametrize("p", [1, 4, 8])
def test_a_call_on_inputs_still_computing_returns_before_they_finish(client, p):
    """The inputs wait on an Event the test sets only after the call
    returned: a call that waited for them would never return (bounded by
    the Event's timeout below). The results are right, each rank's is on the
    worker that computed its input, and describe() tells what ran."""
    name = f"go-{uuid.uuid4().hex}"
    go = Event(name, client=client)
    inputs = [client.submit(held_back, name, r, pure=False) for r in range(p)]
    out = flowreduce.allreduce(client, inputs)
    assert all(f.status == "pending" for f in inputs), "the call waited for its inputs"
    go.set()
    for x in client.gather(out):
        np.testing.assert_array_equal(x, _expected(p))
    where = client.who_has(inputs + out)
    for r in range(p):
        assert where[out[r].key] == where[inputs[r].key], f"rank {r}'s result is not where its input was computed"
    record = flowreduce.describe(out)
    assert record.method == "p2p" and record.workers == tuple(where[f.key][0] for f in inputs)
    assert record.input_keys == tuple(f.key for f in inputs)
    del out, inputs


def test_the_graph_on_futures_is_an_output_per_rank_on_its_input_alone(client):
    """A call on futures still computing submits ``ranks`` tasks: per rank
    an output depending on that rank's input alone, carrying the call's
    decision (no barrier, no task between an input and its result)."""
    name = f"go-{uuid.uuid4().hex}"
    inputs = [client.submit(held_back, name, r, pure=False) for r in range(5)]
    out = flowreduce.allreduce(client, inputs, algorithm="ring")
    token = out[0].key[0].rpartition("-")[2]

    def ours(dask_scheduler=None):  # every key of the call the scheduler saw
        seen = {key for key, *_ in dask_scheduler.transition_log if token in str(key)}
        return {str(k): sorted(str(d.key) for d in dask_scheduler.tasks[k].dependencies)
                if k in dask_scheduler.tasks else None for k in seen}

    ranks = len(out)
    assert wait_until(lambda: len(client.run_on_scheduler(ours)) >= ranks, HANG)
    Event(name, client=client).set()
    assert flowreduce.describe(out).algorithm == "ring"
    for x in client.gather(out):
        np.testing.assert_array_equal(x, _expected(5))
    got = client.run_on_scheduler(ours)  # after the run: a barrier would have come and gone by now
    assert set(got) == {str(f.key) for f in out}, got
    for r, f in enumerate(out):
        assert got[str(f.key)] == [str(inputs[r].key)], f"rank {r}'s result depends on {got[str(f.key)]}"
    del out, inputs


def _after(gate: int, r: int) -> np.ndarray:
    return rank_input(r)


def test_a_result_waits_where_its_rank_arrived_without_holding_the_thread(client):
    """A rank's result depends on its own input alone: it is sent where
    the input was computed (where the rank arrived) as soon as it is, and
    waits for the others without holding the worker's only thread, which the
    next rank's input on that worker needs."""
    w, other = sorted(client.nthreads())[:2]
    name = f"go-{uuid.uuid4().hex}"
    gate = client.submit(held_back, name, 0, 1, workers=[other], pure=False)  # holds the other worker's thread
    first = client.submit(rank_input, 0, workers=[w], pure=False)
    later = client.submit(_after, gate, 1, workers=[w], pure=False)
    out = flowreduce.allreduce(client, [first, later])

    def tasks(dask_scheduler=None):
        return {str(ts.key): (ts.state, sorted(str(d.key) for d in ts.dependencies))
                for ts in dask_scheduler.tasks.values() if "flowreduce" in str(ts.key)}

    first_key = str(out[0].key)
    assert wait_until(lambda: client.run_on_scheduler(tasks).get(first_key, ("",))[0] == "processing", HANG)
    got = client.run_on_scheduler(tasks)
    for r, x in enumerate([first, later]):
        assert got[str(out[r].key)][1] == [str(x.key)]
    Event(name, client=client).set()
    wait(out, timeout=HANG)
    for x in client.gather(out):
        np.testing.assert_array_equal(x, _expected(2))
    del out, first, later, gate


def test_one_result_kept_alone_still_gets_every_rank(client):
    """Only rank 0's result is kept (the others are let go before the
    inputs are computed): the scheduler keeps every rank's arrival wanted,
    so the call still runs, and rank 0's result is right."""
    name = f"go-{uuid.uuid4().hex}"
    inputs = [client.submit(held_back, name, r, pure=False) for r in range(3)]
    first = flowreduce.allreduce(client, inputs)[0]
    gc.collect()
    Event(name, client=client).set()
    np.testing.assert_array_equal(first.result(timeout=HANG), _expected(3))
    del first, inputs


def test_one_result_kept_alone_with_every_input_let_go_still_gets_every_rank(client):
    """As above, and the caller lets go of the inputs too before they are
    computed: the scheduler keeps each input wanted until it is computed (no
    task depends on them but their results), so every rank still arrives."""
    name = f"go-{uuid.uuid4().hex}"
    inputs = [client.submit(held_back, name, r, pure=False) for r in range(3)]
    keys = [f.key for f in inputs]
    out = flowreduce.allreduce(client, inputs)
    let_go = [f.key for f in out[1:]]
    first = out[0]

    def known(dask_scheduler=None):
        return [str(k) for k in keys + let_go if k in dask_scheduler.tasks]

    # the call's graph reached the scheduler (a question to it may overtake the graph, handled concurrently)
    assert wait_until(lambda: len(client.run_on_scheduler(known)) == len(keys + let_go), HANG)
    del inputs, out
    gc.collect()

    # the scheduler let go of the other results (and of the inputs, but for the call) before they are computed
    assert wait_until(lambda: not set(map(str, let_go)) & set(client.run_on_scheduler(known)), HANG)
    assert client.run_on_scheduler(known) == [str(k) for k in keys]
    Event(name, client=client).set()
    np.testing.assert_array_equal(first.result(timeout=HANG), _expected(3))
    del first


def test_a_result_that_runs_elsewhere_than_its_rank_arrived_begins_there(client):
    """Ranks 0-2's inputs are computed on one worker and copied each to
    another one; that worker's only thread is then busy, so Dask runs
    results where their copies are. Both workers holding an input keep it (the
    scheduler tells every holder), but the rank is where its result runs:
    the call begins with ranks 0-2 there, whichever arrival came first."""
    w = sorted(client.nthreads())
    name = f"go-{uuid.uuid4().hex}"
    client.amm.stop()  # its ReduceReplicas would drop the copies this test makes
    try:
        computed = [client.submit(rank_input, r, workers=[w[0]], pure=False) for r in range(3)]
        wait(computed, timeout=HANG)
        for r, f in enumerate(computed):
            client.replicate([f], workers=[w[0], w[r + 1]])
        busy = client.submit(held_back, name, 0, 1, workers=[w[0]], pure=False)
        later = client.submit(held_back, name, 3, workers=[w[1]], pure=False)
        key = busy.key
        assert wait_until(lambda: set(client.processing()[w[0]]) == {key}, HANG)
        keys = [f.key for f in computed]
        assert wait_until(lambda: [set(client.who_has().get(k, ())) for k in keys] ==
                          [{w[0], w[r + 1]} for r in range(3)], HANG), client.who_has(computed)
        out = flowreduce.allreduce(client, [*computed, later])
        Event(name, client=client).set()
        for x in client.gather(out):
            np.testing.assert_array_equal(x, _expected(4))
        record = flowreduce.describe(out)
        where = client.who_has(out)
        assert record.workers == tuple(where[f.key][0] for f in out)
        assert any(record.workers[r] == w[r + 1] for r in range(3)), "Dask ran every result on the busy worker"
        del out, computed, later, busy
    finally:
        Event(name, client=client).set()
        client.amm.start()


def test_ranks_sharing_workers_and_every_algorithm(client):
    """16 ranks on 4 workers (inputs submitted round robin), each dense algorithm, sums and max."""
    ws = sorted(client.nthreads())
    for algorithm in [a for a in flowreduce.ALGORITHMS if a != "auto"]:
        name = f"go-{uuid.uuid4().hex}"
        inputs = [client.submit(held_back, name, r, 1001, pure=False, workers=[ws[r % 4]]) for r in range(16)]
        outs = {op: flowreduce.allreduce(client, inputs, algorithm=algorithm, op=op) for op in ("sum", "max")}
        Event(name, client=client).set()
        stack = np.stack([rank_input(r, 1001) for r in range(16)])
        for op, want in (("sum", stack.sum(0)), ("max", stack.max(0))):
            for r, x in enumerate(client.gather(outs[op])):
                np.testing.assert_array_equal(x, want, err_msg=f"{algorithm} {op} rank {r}")
        del outs, inputs


def _step(w: np.ndarray, g: np.ndarray, lr: float) -> np.ndarray:
    return w - lr * g


def _gradient(w: np.ndarray, shard: np.ndarray) -> np.ndarray:
    return shard * np.tanh(shard @ w)  # any function of the weights and the shard


def test_thirty_chained_iterations_submitted_without_waiting_equal_the_naive_loop(client):
    """A solver loop (gradient per worker -> all-reduce -> update per
    worker), all 30 iterations submitted before any finishes: the weights
    equal those of the same loop with the naive reduction (a sum task on one
    worker), and the loop was submitted in a fraction of its run (not timed
    here: it must not wait for any iteration, which the Event checks)."""
    ws = sorted(client.nthreads())
    rng = np.random.default_rng(0)
    shards = [client.scatter(rng.standard_normal(64), workers=[w]) for w in ws]
    name = f"go-{uuid.uuid4().hex}"
    start = client.submit(held_back, name, 0, 64, pure=False)  # holds the first iteration back

    def loop(reduce):
        w = [client.submit(lambda x: np.zeros(64) + 0 * x[:64], start, workers=[ws[r]], pure=False) for r in range(4)]
        for _ in range(30):
            g = [client.submit(_gradient, w[r], shards[r], workers=[ws[r]], pure=False) for r in range(4)]
            total = reduce(g)
            w = [client.submit(_step, w[r], total[r], 0.01, workers=[ws[r]], pure=False) for r in range(4)]
        return w

    def naive(g):
        s = client.submit(lambda *gs: np.sum(gs, axis=0), *g, workers=[ws[0]], pure=False)
        return [s] * 4

    ours = loop(lambda g: flowreduce.allreduce(client, g))
    theirs = loop(naive)
    assert all(f.status == "pending" for f in ours), "an iteration finished before the loop was submitted"
    Event(name, client=client).set()
    got, want = client.gather(ours), client.gather(theirs)
    for r in range(4):
        np.testing.assert_allclose(got[r], want[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(got[r], got[0])  # every rank holds the same bits
    ours = theirs = start = shards = None


def test_input_errors_arrive_on_the_results_naming_the_ranks(client):
    name = f"go-{uuid.uuid4().hex}"
    cases = {
        "shape": ([held_back] * 3 + [lambda n, r: np.zeros(7, np.int64)], InputError, "ranks [3]"),
        "dtype": ([held_back, lambda n, r: np.zeros(1000, np.float32), held_back], InputError, "ranks [1]"),
        "type": ([held_back, held_back, lambda n, r: "not an array"], InputTypeError, "ranks [2]"),
        "error": ([held_back, lambda n, r: 1 / 0], ZeroDivisionError, ""),
    }
    outs = {}
    for what, (fs, _, _) in cases.items():
        inputs = [client.submit(f, name, r, pure=False) for r, f in enumerate(fs)]
        outs[what] = flowreduce.allreduce(client, inputs)  # returns: the errors come on the results
    Event(name, client=client).set()
    for what, (_, kind, says) in cases.items():
        wait(outs[what], timeout=HANG)
        for r, f in enumerate(outs[what]):
            e = f.exception()
            assert isinstance(e, kind) and says in str(e), f"{what}, rank {r}: {e!r}"
    assert "shapes" in str(outs["shape"][0].exception()) and "(7,)" in str(outs["shape"][0].exception())
    del outs


def test_options_the_engine_does_not_take_wait_for_the_inputs_as_before(client):
    """like=, pytrees, deterministic=True, topology= and callable ops keep the call that waits (or, for
    Dask collections, are refused saying what collections take)."""
    x = [client.submit(rank_input, r, pure=False) for r in range(3)]
    out = flowreduce.allreduce(client, x, op=lambda a, b: a + b)
    assert flowreduce.describe(out).method == "tasks"
    np.testing.assert_array_equal(out[1].result(), _expected(3))
    with pytest.raises(OptionError, match="Dask collections"):
        flowreduce.allreduce(client, [dask.delayed(rank_input)(r) for r in range(3)], deterministic=True)
    del out, x


def test_delayed_in_delayed_out_composes_with_the_users_graph(client):
    parts = [dask.delayed(rank_input)(r, 1001) for r in range(5)]
    out = flowreduce.allreduce(client, parts)
    assert all(isinstance(o, Delayed) for o in out)
    further = [dask.delayed(np.sum)(o) for o in out]  # the user's next step on each rank's result
    got = dask.compute(*out, *further)
    for x in got[:5]:
        np.testing.assert_array_equal(x, _expected(5, 1001))
    assert list(got[5:]) == [_expected(5, 1001).sum()] * 5
    persisted = dask.persist(*out)
    np.testing.assert_array_equal(persisted[2].compute(), _expected(5, 1001))
    assert flowreduce.describe(out).workers  # what ran, once it ran
    del persisted, out


@pytest.mark.parametrize("again", ["persist", "compute"])
def test_a_collection_computed_again_while_one_rank_result_is_still_held(client, again):
    """A future of an earlier compute still holds rank 3's result; the
    others and every input were let go. Computing every rank's result again
    needs rank 3's input too (the others' sums include it): it is computed
    again, every rank's result is the sum, and nothing is left behind."""
    parts = [dask.delayed(rank_input)(r, 1001) for r in range(5)]
    out = flowreduce.allreduce(client, parts)
    first = client.compute(out)
    wait(first, timeout=HANG)
    held, kept = first[3], [first[3].key]
    del first
    assert wait_until(lambda: flowreduce_keys(client) == kept, 10), flowreduce_keys(client)
    if again == "persist":
        got = [f.compute() for f in dask.persist(*out)]
    else:
        got = list(dask.compute(*out))
    for r, x in enumerate(got):
        np.testing.assert_array_equal(x, _expected(5, 1001), err_msg=f"rank {r}")
    np.testing.assert_array_equal(held.result(), _expected(5, 1001))
    del held, out, got


@pytest.mark.parametrize("kind", ["delayed", "array"])
def test_one_result_of_a_collection_kept_alone_still_gets_every_rank(client, kind):
    """``client.compute(out)[0]``: every rank's result computed together, all
    but rank 0's let go before the inputs are computed (they wait on an
    Event). Every rank still arrives (the scheduler keeps each result's input
    wanted until it is computed), and rank 0's result is the sum."""
    name = f"go-{uuid.uuid4().hex}"
    if kind == "delayed":
        out = flowreduce.allreduce(client, [dask.delayed(held_back, pure=False)(name, r) for r in range(3)])
    else:
        import dask.array as da

        blocks = [da.from_delayed(dask.delayed(held_back, pure=False)(name, r), (1000,), np.int64) for r in range(3)]
        out = flowreduce.allreduce(client, blocks)
    first = client.compute(out)[0]  # the other results' futures are let go at once
    del out
    gc.collect()
    token = first.key[0].rpartition("-")[2] if kind == "delayed" else None
    if token is not None:  # the scheduler let go of the other results before any input was computed
        def results(dask_scheduler=None):
            return sorted(str(k) for k in dask_scheduler.tasks if f"output-{token}" in str(k))

        kept = [str(first.key)]
        assert wait_until(lambda: client.run_on_scheduler(results) == kept, HANG)
    Event(name, client=client).set()
    np.testing.assert_array_equal(first.result(timeout=HANG), _expected(3))
    del first


def _held_rank_1(name: str, r: int) -> np.ndarray:
    return held_back(name, r) if r == 1 else rank_input(r)


@pytest.mark.parametrize("kind", ["futures", "delayed"])
def test_a_call_placed_on_arrival_times_out_naming_the_ranks_not_arrived(client, kind):
    """``timeout=``: rank 1's input is never computed (until the test lets it go); the results fail
    with AllreduceTimeoutError naming rank 1 as not arrived, on futures and on a list of ``Delayed``
    (whose graph the user's compute sends: the scheduler watches it)."""
    name = f"go-{uuid.uuid4().hex}"
    if kind == "futures":
        out = flowreduce.allreduce(client, [client.submit(_held_rank_1, name, r, pure=False) for r in range(3)],
                                   timeout=2)
    else:
        out = client.compute(flowreduce.allreduce(
            client, [dask.delayed(_held_rank_1, pure=False)(name, r) for r in range(3)], timeout=2))
    try:
        errors = [f.exception(timeout=HANG) for f in out]
    finally:
        Event(name, client=client).set()
    del out
    for e in errors:
        assert isinstance(e, AllreduceTimeoutError) and "rank(s) [1] had not arrived" in str(e), e


def _ran(client, token: str) -> set[str]:
    """Every key of call ``token`` the scheduler saw."""
    def seen(dask_scheduler=None):
        return sorted({str(key) for key, *_ in dask_scheduler.transition_log if token in str(key)})

    return set(client.run_on_scheduler(seen))


def test_collections_computed_together_get_the_graph_of_a_call_on_futures(client):
    """A list of ``Delayed`` and a dask array whose every result is computed
    together: per rank one task, depending on that rank's input alone (no
    arrive task, no barrier: the inputs are kept as they reach memory and the
    scheduler begins the call), and nothing else of the call runs."""
    parts = [dask.delayed(rank_input)(r) for r in range(4)]
    out = flowreduce.allreduce(client, parts)
    token = out[0].key[0].rpartition("-")[2]
    graph = dict(out[0].__dask_graph__())
    ours = {k: v for k, v in graph.items() if token in str(k)}
    assert set(ours) == {o.key for o in out}, sorted(map(str, ours))
    for r, o in enumerate(out):
        assert set(ours[o.key].dependencies) == {parts[r].key}, f"rank {r}'s result depends on {ours[o.key].dependencies}"
    for x in dask.compute(*out):
        np.testing.assert_array_equal(x, _expected(4))
    assert _ran(client, token) == {str(o.key) for o in out}
    x = da.from_array(np.arange(4 * 6, dtype=np.int64).reshape(4, 6), chunks=(1, 6))
    summed = flowreduce.allreduce(client, x, axis=0)
    np.testing.assert_array_equal(summed.compute(), np.tile(np.arange(24).reshape(4, 6).sum(0), (4, 1)))
    assert _ran(client, summed.name.rpartition("-")[2]) == {str(k) for k in flatten_keys(summed)}
    del out, summed


def flatten_keys(x: da.Array) -> list:
    return [k for row in x.__dask_keys__() for k in row]


def test_some_results_alone_compute_every_rank_or_say_which_are_missing(client):
    """Dask's optimisation culls the others' results: the culled graph still
    computes every rank's input (an arrive task per rank). With it off, the
    results left out fail the ones asked for, naming their ranks."""
    parts = [dask.delayed(rank_input)(r) for r in range(3)]
    out = flowreduce.allreduce(client, parts)
    np.testing.assert_array_equal(client.compute(out[1]).result(timeout=HANG), _expected(3))
    alone = client.compute(flowreduce.allreduce(client, parts)[1], optimize_graph=False)
    wait(alone, timeout=HANG)
    e = alone.exception()
    assert isinstance(e, InputStateError) and "ranks [0, 2]" in str(e), repr(e)
    del out, alone, e


def test_a_dask_array_with_a_block_per_rank(client):
    x = da.from_array(np.arange(4 * 6 * 3, dtype=np.int64).reshape(4 * 6, 3), chunks=(6, 3))
    out = flowreduce.allreduce(client, x, axis=0)
    assert isinstance(out, da.Array) and out.chunks == x.chunks
    blocks = np.arange(4 * 6 * 3, dtype=np.int64).reshape(4, 6, 3)
    np.testing.assert_array_equal(out.compute(), np.tile(blocks.sum(0), (4, 1)))
    y = da.ones((5, 8), chunks=(5, 2), dtype=np.float64) * np.arange(8)  # 4 blocks along axis 1
    got = flowreduce.allreduce(client, y, axis=1, op="max")
    np.testing.assert_array_equal((got + 1).compute(), np.tile(np.array([6.0, 7.0]), (5, 4)) + 1)
    with pytest.raises(InputError, match="axis 2"):
        flowreduce.allreduce(client, x, axis=2)
    del out, got


def test_a_list_of_dask_arrays(client):
    xs = [da.from_array(rank_input(r, 100), chunks=30) for r in range(3)]  # several blocks each: one per rank
    out = flowreduce.allreduce(client, xs, op="mean")
    assert all(isinstance(o, da.Array) and o.shape == (100,) for o in out)
    want = np.mean(np.stack([rank_input(r, 100) for r in range(3)]), axis=0)
    for got in dask.compute(*out):
        np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(out[1].compute(), want)  # one rank's result alone
    del out


def test_a_worker_killed_mid_call_runs_it_again(client, cluster):
    """The worker of rank 2 is SIGKILLed once the ranks arrived and before
    the plan ran (its arrival task waits on an Event past the barrier: the
    engine's run cannot finish without it): inputs with lineage are
    recomputed, the call runs again where they are, every rank right."""
    ws = sorted(client.nthreads())
    name = f"go-{uuid.uuid4().hex}"
    inputs = [client.submit(held_back, name, r, 10**5, pure=False, workers=[ws[r]], allow_other_workers=True)
              for r in range(4)]
    out = flowreduce.allreduce(client, inputs, algorithm="ring")
    Event(name, client=client).set()
    wait(out, timeout=HANG)
    victim = client.who_has(out[2])[out[2].key][0]
    os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    assert wait_until(lambda: victim not in client.nthreads(), HANG)
    # rank 2's result is lost with it: Dask asks for it again, and the call runs again for it
    np.testing.assert_array_equal(out[2].result(timeout=HANG), _expected(4, 10**5))
    for r, f in enumerate(out):
        np.testing.assert_array_equal(f.result(timeout=HANG), _expected(4, 10**5), err_msg=f"rank {r}")
    del out, inputs
    client.cluster.scale(4) if hasattr(client, "cluster") and client.cluster else None
    cluster.scale(4)
    client.wait_for_workers(4, timeout=HANG)


def test_a_delayed_result_lost_with_its_worker_is_computed_again(client, cluster):
    """Dask collections computed together (their inputs kept too): the
    worker holding rank 2's result is SIGKILLed after the call; Dask asks
    for the result again, and the call runs again for it."""
    ws = sorted(client.nthreads())
    parts = []
    for r in range(4):
        with dask.annotate(workers=[ws[r]], allow_other_workers=True):
            parts.append(dask.delayed(rank_input)(r, 10**5, dask_key_name=f"part-{uuid.uuid4().hex}"))
    out = flowreduce.allreduce(client, parts, algorithm="ring")
    held = client.compute([*parts, *out])
    wait(held, timeout=HANG)
    victim = client.who_has(held[4 + 2])[held[4 + 2].key][0]
    os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    assert wait_until(lambda: victim not in client.nthreads(), HANG)
    for r, f in enumerate(held[4:]):
        np.testing.assert_array_equal(f.result(timeout=HANG), _expected(4, 10**5), err_msg=f"rank {r}")
    del out, held
    cluster.scale(4)
    client.wait_for_workers(4, timeout=HANG)


def _tensor(name: str, r: int):
    import torch

    return torch.from_numpy(held_back(name, r, 100)).to(torch.float32)


def test_torch_tensors_still_computing_come_back_as_tensors(client):
    torch = pytest.importorskip("torch")
    name = f"go-{uuid.uuid4().hex}"
    inputs = [client.submit(_tensor, name, r, pure=False) for r in range(3)]
    out = flowreduce.allreduce(client, inputs, op="mean")
    assert all(f.status == "pending" for f in inputs)
    Event(name, client=client).set()
    want = torch.stack([torch.from_numpy(rank_input(r, 100)).to(torch.float32) for r in range(3)]).mean(0)
    for x in client.gather(out):
        assert isinstance(x, torch.Tensor) and x.dtype == torch.float32
        torch.testing.assert_close(x, want)
    del out, inputs


def _pair(name: str, r: int) -> dict:
    return {"w": held_back(name, r, 10), "b": rank_input(r, 2)}


def test_pytrees_in_one_future_still_computing_are_gathered_and_reduced(client):
    """The engine's plans move one array; a dict of arrays in one future is found only once computed: it is
    checked as any pytree (errors naming the ranks), gathered on the first rank's worker, reduced leaf by
    leaf (an integer mean is float64, as the task path's) and sent back, each rank its own copy."""
    ws = sorted(client.nthreads())
    name = f"go-{uuid.uuid4().hex}"
    inputs = [client.submit(_pair, name, r, pure=False, workers=[ws[r % 4]]) for r in range(6)]
    out = flowreduce.allreduce(client, inputs)
    mean = flowreduce.allreduce(client, inputs, op="mean")
    Event(name, client=client).set()
    want = {"w": sum(rank_input(r, 10) for r in range(6)), "b": sum(rank_input(r, 2) for r in range(6))}
    got = client.gather(out)
    for r, x in enumerate(got):
        assert set(x) == {"w", "b"} and x["w"].dtype == np.int64, r
        np.testing.assert_array_equal(x["w"], want["w"])
        np.testing.assert_array_equal(x["b"], want["b"])
    assert not np.shares_memory(got[0]["w"], got[4]["w"])  # ranks 0 and 4 share a worker
    for x in client.gather(mean):
        assert x["w"].dtype == np.float64
        np.testing.assert_allclose(x["w"], want["w"] / 6)
    assert flowreduce.describe(out).algorithm == "reduce-broadcast"
    bad = [client.submit(_pair, name, r, pure=False) for r in range(2)] + [client.submit(lambda: {"w": np.zeros(3)})]
    refused = flowreduce.allreduce(client, bad)
    wait(refused, timeout=HANG)
    e = refused[0].exception()
    assert isinstance(e, (InputError, InputTypeError)) and "rank" in str(e), repr(e)
    del out, mean, got, inputs, bad, refused, e


def _shown(token, dask_scheduler=None):
    from flowreduce.dashboard.store import store_of

    call = store_of(dask_scheduler).find(token)
    return None if call is None or call.record is None else (call.record.algorithm, call.record.ranks)


def test_the_dashboard_draws_a_call_placed_on_arrival_once_its_plan_is_chosen(client):
    name = f"go-{uuid.uuid4().hex}"
    inputs = [client.submit(held_back, name, r, pure=False) for r in range(3)]
    out = flowreduce.allreduce(client, inputs, algorithm="butterfly")
    token = out[0].key[0].rpartition("-")[2]
    Event(name, client=client).set()
    wait(out, timeout=HANG)
    assert wait_until(lambda: client.run_on_scheduler(_shown, token) is not None, HANG)
    assert client.run_on_scheduler(_shown, token) == ("butterfly", 3)
    del out, inputs
