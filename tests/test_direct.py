"""The one-level ``direct`` all-reduce for small vectors: its plan and cost
card, the graph it lowers to (one task per worker, depending only on its
own ranks' inputs; ranks sharing a worker share its result), and, on real
worker processes,
the front door's path that asks the scheduler, not the workers, before
submitting: numbers against numpy, the same bits on every rank, the input
check run in the tasks (errors naming the ranks), inputs kept while they
are read, no replica and no key left behind."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from dask.task_spec import TaskRef
from distributed import Client, LocalCluster, wait
from utils import assert_clean, graph_depth, workers_of

import flowreduce
from flowreduce import describe
from flowreduce.algorithms import plan as make_plan
from flowreduce.cost import choose
from flowreduce.errors import InputError, InputTypeError, WorkerLostError
from flowreduce.lower.direct import build_direct
from flowreduce.ops import resolve_op
from flowreduce.schedule import peer_reads, placement

# -- plan and cost card ------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 4, 7, 64])
def test_plan_is_complete_and_one_level(p):
    plan = make_plan("direct", p)
    plan.check()
    card = plan.cost(1000.0)
    assert (card.steps, card.tasks, card.messages) == (1, p, p * (p - 1))
    assert card.max_rank_bytes == pytest.approx(2 * (p - 1) * 1000.0)  # p-1 reads of n in, as many served


def test_auto_picks_direct_for_small_vectors_only_when_it_can_lower_it():
    assert choose(4, 8e3, direct=True).algorithm == "direct"
    assert choose(4, 8e3).algorithm != "direct"  # e.g. a template call: nothing in memory to read
    assert choose(4, 8e8, direct=True).algorithm != "direct"  # p²·n bytes: the bandwidth plans win
    assert choose(4, 8e3, direct=True, chunks=3).algorithm != "direct"  # it reads whole inputs


# -- the lowered graph -------------------------------------------------------------------------------

def _graph(p, workers):
    refs = [TaskRef(("input", r)) for r in range(p)]
    return build_direct(make_plan("direct", p), refs, workers, input_keys=[r.key for r in refs],
                        op=resolve_op("sum"), read=peer_reads.reading)


def test_four_ranks_on_four_workers_are_four_tasks_in_one_level():
    workers = [f"w{r}" for r in range(4)]
    g = _graph(4, workers)
    assert len(g.tasks) == 4 and graph_depth(g) == 1
    for r, key in enumerate(g.outputs):
        assert g.tasks[key].dependencies == {("input", r)}  # its own input only: the peers are read
        assert g.placement[key] == workers[r]


def test_sixty_four_ranks_on_four_workers_sum_once_per_worker():
    """One task per worker, in one level: its key is the result of every rank on that worker."""
    p, w = 64, 4
    workers = [f"w{r % w}" for r in range(p)]
    g = _graph(p, workers)
    assert len(g.tasks) == w and graph_depth(g) == 1
    for r, key in enumerate(g.outputs):
        assert g.placement[key] == workers[r]
        mine = {("input", s) for s in range(p) if workers[s] == workers[r]}
        assert g.tasks[key].dependencies == mine  # that worker's inputs only: the others are read
    assert len(set(g.outputs)) == w


def _same_host_pick_over_choose(model, p):
    """A size (float64 elements) and the plan ``auto`` runs there on one
    host, where the same-host preference (``shm-direct``, or ``direct``
    reading its peers through shared memory) overrides the model's choice
    among the plans priced over Dask's comm; None if there is none."""
    from flowreduce.schedule import routes

    ws = tuple(f"tcp://10.0.0.1:{9000 + r}" for r in range(p))
    domains = (("node", "machine"),) * p
    for n in np.geomspace(1e4, 1e7, 31):
        nbytes = int(n) * 8
        first = choose(p, nbytes, model=model, direct=True)
        site = routes.Site(ws, domains, [[list(range(p))]], model, nbytes)
        final = routes.choose(site, [first, *routes.proposals(site)]).plan
        if final.algorithm != first.algorithm:
            return int(n), final.algorithm
    return None


# -- through the front door, on worker processes -----------------------------------------------------

def _submitted(client, arrays, workers=None):
    """Rank r's array computed by a task on worker r mod W (so the scheduler knows its type and size)."""
    ws = workers or workers_of(client)
    out = [client.submit(np.array, a, workers=[ws[r % len(ws)]], pure=False) for r, a in enumerate(arrays)]
    wait(out)
    return out


def _holders(client, keys):
    return client.run_on_scheduler(
        lambda dask_scheduler: {k: sorted(ws.address for ws in dask_scheduler.tasks[k].who_has) for k in keys})


@pytest.mark.parametrize("ranks", [2, 4, 6])
def test_small_vectors_take_one_level_without_asking_the_workers(proc_client, monkeypatch, ranks):
    """Integers exact, ranks sharing workers (6 on 4), and no broadcast to
    the workers before submitting (locating would fail here)."""

    def no_locate(*args, **kwargs):
        raise AssertionError("the small-vector path must not ask the workers")

    monkeypatch.setattr(placement, "locate", no_locate)
    rng = np.random.default_rng(ranks)
    arrays = [rng.integers(-10**6, 10**6, size=1000) for _ in range(ranks)]
    parts = _submitted(proc_client, arrays)
    futures = flowreduce.allreduce(proc_client, parts)
    assert describe(futures).plan.algorithm == "direct"
    for r, o in enumerate(proc_client.gather(futures)):
        np.testing.assert_array_equal(o, sum(arrays), err_msg=f"rank {r}")
    where = _holders(proc_client, [f.key for f in parts])
    assert all(len(ws) == 1 for ws in where.values()), f"inputs copied to other workers: {where}"
    # a result per worker: the ranks it holds share it, and it lives there only
    results = _holders(proc_client, {f.key for f in futures})
    for r, f in enumerate(futures):
        assert results[f.key] == where[parts[r].key], f"rank {r}'s result is not where its input is"
        for s in range(ranks):
            assert (f.key == futures[s].key) == (where[parts[r].key] == where[parts[s].key])
    del futures, parts, f
    assert_clean(proc_client)


def _in_worker_order(arrays, workers):
    """The sum ``direct`` promises, bit for bit: each worker's ranks in rank
    order, then the workers' sums in the order of their first ranks."""
    groups: dict[str, list[int]] = {}
    for r, w in enumerate(workers):
        groups.setdefault(w, []).append(r)
    total = None
    for ranks in groups.values():
        part = arrays[ranks[0]].copy()
        for r in ranks[1:]:
            part += arrays[r]
        total = part if total is None else total + part
    return total


@pytest.mark.parametrize("ranks", [4, 6, 64])
def test_every_rank_gets_the_same_bits(proc_client, ranks):
    """Float values spanning 16 orders of magnitude, where any other order of
    the sum gives other bits; 4 ranks on 4 workers is rank order; 6 and 64
    have workers holding several ranks, whose peers ask them for their sums."""
    rng = np.random.default_rng(ranks)
    arrays = [rng.standard_normal(777) * 10.0 ** rng.integers(-8, 8, size=777) for _ in range(ranks)]
    ws = workers_of(proc_client)
    out = proc_client.gather(flowreduce.allreduce(proc_client, _submitted(proc_client, arrays), algorithm="direct"))
    expected = _in_worker_order(arrays, [ws[r % len(ws)] for r in range(ranks)])
    if ranks == len(ws):
        assert expected.tobytes() == sum(arrays[1:], arrays[0].copy()).tobytes()  # rank order
    for r, o in enumerate(out):
        assert o.tobytes() == expected.tobytes(), f"rank {r} differs"


def _sent_by_get_data(client, keys):
    """The keys of ``keys`` some worker sent to another with Dask's get_data."""
    def sent(dask_worker):
        return [k for t in dask_worker.transfer_outgoing_log for k in t["keys"]]

    wanted = set(keys)
    return {k for ks in client.run(sent).values() for k in ks if k in wanted}


def test_a_worker_holding_several_ranks_sends_their_sum_not_their_values(proc_client):
    """64 integer ranks on 4 workers: exact, and no input travelled through
    get_data (each worker sent its peers one array, the sum of its ranks)."""
    rng = np.random.default_rng(64)
    arrays = [rng.integers(-10**9, 10**9, size=500) for _ in range(64)]
    parts = _submitted(proc_client, arrays)
    futures = flowreduce.allreduce(proc_client, parts, algorithm="direct")
    for r, o in enumerate(proc_client.gather(futures)):
        np.testing.assert_array_equal(o, np.sum(arrays, axis=0), err_msg=f"rank {r}")
    assert not _sent_by_get_data(proc_client, [f.key for f in parts])
    del futures, parts
    assert_clean(proc_client)


def test_a_peer_without_the_handler_is_read_value_by_value():
    """Readers fall back to get_data when a peer cannot sum its ranks (no
    plugin on this cluster): the same bits."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        a, b = workers_of(client)
        rng = np.random.default_rng(3)
        arrays = [rng.standard_normal(100) * 10.0 ** rng.integers(-8, 8, size=100) for _ in range(5)]
        parts = [client.submit(np.array, x, workers=[b], pure=False) for x in arrays]
        wait(parts)
        peers = [(r, b, f.key) for r, f in enumerate(parts)]
        values, partials = client.submit(peer_reads.read_peers, peers, resolve_op("sum"), workers=[a],
                                         pure=False).result()
        assert partials == {} and sorted(values) == list(range(5))
        for r in range(5):
            np.testing.assert_array_equal(values[r], arrays[r])
        assert set(_sent_by_get_data(client, [f.key for f in parts])) == {f.key for f in parts}


def test_a_bad_rank_on_a_worker_holding_several_is_named(proc_client):
    """Ranks 1 and 5 share a worker and agree with each other, not with the
    rest: that worker sends their sum with what each holds, and the readers'
    check names them from that (no input read value by value)."""
    arrays = [np.ones(10) for _ in range(8)]
    arrays[1] = arrays[5] = np.ones((2, 5))  # same bytes: the client does not see it
    parts = _submitted(proc_client, arrays)
    futures = flowreduce.allreduce(proc_client, parts, algorithm="direct")
    for f in futures:
        with pytest.raises(InputError, match=r"ranks \[1, 5\]: shape \(2, 5\)") as caught:
            f.result()
        caught.value.__traceback__ = None  # its frames hold `futures` (see test_errors.py)
    assert not _sent_by_get_data(proc_client, [f.key for f in parts])
    del futures, parts, caught, f
    gc.collect()
    assert_clean(proc_client)


@pytest.mark.parametrize("arrays,error,match", [
    ([np.ones(4), np.ones(4), np.ones(4, dtype=np.int64), np.ones(4)], InputError,
     r"ranks disagree on dtypes: ranks \[0, 1, 3\]: shape \(4,\), dtype float64; ranks \[2\]: shape \(4,\), dtype int64"),
    ([np.ones(4), np.ones((2, 2)), np.ones(4)], InputError,
     r"ranks disagree on shapes: ranks \[0, 2\]: shape \(4,\).*ranks \[1\]: shape \(2, 2\)"),
    ([np.ones(3, dtype=bool)] * 3, InputTypeError, "mean' of boolean"),
], ids=["dtypes", "shapes", "mean-of-bool"])
def test_the_tasks_check_the_inputs_and_name_the_ranks(proc_client, arrays, error, match):
    """Same sizes, so the scheduler cannot tell them apart: the tasks check,
    with the client's own message, and every rank's result fails with it."""
    parts = _submitted(proc_client, arrays)
    futures = flowreduce.allreduce(proc_client, parts, op="mean" if arrays[0].dtype == bool else "sum")
    assert describe(futures).plan.algorithm == "direct"
    for f in futures:
        with pytest.raises(error, match=match) as caught:
            f.result()
        caught.value.__traceback__ = None  # its frames hold `futures` (see test_errors.py)
    del futures, parts, caught, f
    gc.collect()
    assert_clean(proc_client)


def test_inputs_dropped_right_after_the_call_are_still_read(proc_client):
    """The tasks read peers' inputs they do not depend on: the call keeps
    them until it is done, even when the caller lets go at once."""
    rng = np.random.default_rng(2)
    arrays = [rng.integers(0, 100, size=1000) for _ in range(4)]
    parts = _submitted(proc_client, arrays)
    last = workers_of(proc_client)[-1]
    busy = proc_client.submit(time.sleep, 1.0, workers=[last], pure=False)  # its reader starts after the others end
    futures = flowreduce.allreduce(proc_client, parts)
    del parts
    for o in proc_client.gather(futures):
        np.testing.assert_array_equal(o, sum(arrays))
    del futures, busy
    assert_clean(proc_client)


def test_an_input_nobody_holds_fails_the_read_naming_rank_and_key():
    """A peer's input that no worker holds any more and the scheduler has
    forgotten: the reading task fails with WorkerLostError naming the rank."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        a, b = workers_of(client)
        gone = ("no-such-input", 3)
        reader = client.submit(peer_reads.read_peers, [(3, b, gone)], workers=[a], pure=False)
        with pytest.raises(WorkerLostError, match=r"input of rank 3 \(key \('no-such-input', 3\)\) was on worker"):
            reader.result()


def _die():
    import os

    os._exit(1)


@pytest.mark.parametrize("pinned", [False, True], ids=["recomputable", "pinned"])
def test_a_peer_killed_mid_call_recovers_or_names_the_rank(pinned):
    """The worker holding rank 3's input dies while another rank's task has
    yet to read it. Recomputable (unpinned): Dask recomputes it, the reader
    reads it where it lands, and the result is right. Pinned to the dead
    worker: rank 3's result fails with WorkerLostError naming the input;
    another rank's is right if its task read rank 3's post before the
    worker died (through shared memory, which outlives it), else fails the
    same way; nothing hangs."""
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ws = workers_of(client)
        arrays = [np.arange(1000) * (r + 1) for r in range(4)]
        parts = [client.submit(np.array, a, workers=[ws[r]] if pinned else None, pure=False)
                 for r, a in enumerate(arrays)]
        wait(parts)
        (victim,) = _holders(client, [parts[3].key])[parts[3].key]
        reader = next(w for w in ws if w != victim)
        busy = client.submit(time.sleep, 1.0, workers=[reader], pure=False)  # its read comes after the death
        futures = flowreduce.allreduce(client, parts)
        assert describe(futures).plan.algorithm == "direct"
        try:
            client.run(_die, workers=[victim])
        except Exception:
            pass  # the worker died under the call: that is the point
        if pinned:
            for r, f in enumerate(futures):
                try:
                    got = f.result()
                except WorkerLostError as e:
                    assert "rank 3" in str(e) and "left the cluster" in str(e), e
                    e.__traceback__ = None  # its frames hold the future (see test_errors.py)
                else:
                    assert r != 3, "rank 3's result lived on the dead worker"
                    np.testing.assert_array_equal(got, sum(arrays))
            del f
        else:
            for o in client.gather(futures):
                np.testing.assert_array_equal(o, sum(arrays))
        del futures, parts, busy
        gc.collect()
        assert_clean(client)



def test_auto_takes_one_decision_whether_or_not_it_glanced(proc_client):
    """Inputs already in memory go through the glance route, which once
    skipped the same-host preference that lower() applies, and ran
    ``direct`` where the model priced ``shm-direct`` lower (at 1e6 on 4
    ranks: 80 ms against 61). Both routes now take one decision: at a size
    where the same-host preference overrides the model's first choice, the
    call runs the preferred plan."""
    from flowreduce.cost import CostModel

    model = CostModel(cores=2)
    found = _same_host_pick_over_choose(model, 4)
    assert found is not None, "the default model has no such size any more: pick another case"
    n, expected = found
    parts = _submitted(proc_client, [np.full(n, float(r)) for r in range(4)], workers_of(proc_client))
    futures = flowreduce.allreduce(proc_client, parts, model=model)
    assert describe(futures).plan.algorithm == expected
    for o in proc_client.gather(futures):
        np.testing.assert_array_equal(o, np.full(n, 6.0))
    del futures, parts
    assert_clean(proc_client)
