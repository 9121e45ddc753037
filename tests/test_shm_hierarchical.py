"""``hierarchical`` across hosts with shared memory inside each host: the
plan and its graph (levels, tasks per kind), and on real worker processes
on emulated hosts (each worker's nanny sets ``SLURMD_NODENAME``, which is
what groups workers into hosts and memory domains): numbers against numpy,
handles on same-host edges only, the per-link transports in ``describe()``,
``transport="dask"`` keeping the old plan, and nothing left behind."""

from __future__ import annotations

import functools
import gc

import dask
import numpy as np
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster
from utils import assert_clean, error_of, graph_depth, task_levels, wait_until

import flowreduce
from flowreduce import describe
from flowreduce.algorithms import hierarchical
from flowreduce.cost import CostModel, Link
from flowreduce.kernels import shm as shm_kernels
from flowreduce.lower.shm_hierarchical import build_hierarchical
from flowreduce.ops import resolve_op
from flowreduce.phases import COMPUTE_PHASES
from flowreduce.schedule.shm_plugin import usage
from flowreduce.shm import pool as shm_pool

# These tests are about the task graph's hierarchical route over shared memory: method='tasks' (tests/test_p2p.py covers the engine)
pytestmark = pytest.mark.usefixtures("method_tasks")


IDLE = 0.5


@pytest.mark.parametrize("outer,depth", [("butterfly", 6), ("ring", 6), ("recursive-doubling", 4)])
@pytest.mark.parametrize("ranks_per_worker", [1, 4])
def test_graph_two_hosts_of_two_workers(outer, depth, ranks_per_worker):
    """2 hosts x 2 workers: one write and one publish per worker, one result
    per rank, two levels inside the hosts before the outer algorithm and
    two after (one when the outer algorithm ends in a reduction, which
    then writes into the segment itself), whatever the ranks per worker;
    the outer algorithm runs between same-position workers of the hosts."""
    host_of = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    procs = ["a0", "a1", "b0", "b1"]
    ws = [procs[r % 4] for r in range(4 * ranks_per_worker)]
    p = len(ws)
    groups = [[r for r in range(p) if host_of[ws[r]] == h] for h in "AB"]
    workers = [[r for r in range(p) if ws[r] == w] for w in procs]
    plan = hierarchical.plan(p, groups=groups, inner="shm-direct", outer=outer,
                             **({"workers": workers} if ranks_per_worker > 1 else {}))
    plan.check()
    graph = build_hierarchical(plan, [(f"x-{r}",) for r in range(p)], ws, size=1000, shape=(1000,),
                               dtype=np.dtype("f8"), op=resolve_op("sum"))
    levels_of = task_levels(graph)
    by_func: dict = {}
    for key, task in graph.tasks.items():
        name = task.func.__name__ if getattr(task.func, "__module__", "") == shm_kernels.__name__ else "outer"
        by_func.setdefault(name, []).append(key)
    top = max(levels_of.values())
    assert top == depth
    assert len(by_func["write"]) == 4 and {levels_of[k] for k in by_func["write"]} == {1}
    assert {levels_of[k] for k in by_func["reduce_range"]} == {2}
    published = by_func.get("publish_slice", []) + by_func.get("reduce_published", [])
    assert len(published) == 4 and {levels_of[k] for k in published} == {top - 1}
    assert len(by_func["gather"]) == p and {levels_of[k] for k in by_func["gather"]} == {top}
    assert set(by_func["gather"]) == set(graph.outputs)
    between = by_func.get("outer", []) + by_func.get("reduce_published", [])
    assert {levels_of[k] for k in by_func.get("outer", [])} == set(range(3, top - 1))
    # the inter-host algorithm pairs a0 with b0 and a1 with b1, never a0 with b1
    for k in between:
        for d in graph.tasks[k].dependencies:
            assert graph.placement[k][1] == graph.placement[d][1], (graph.placement[k], graph.placement[d])
    # ranks sharing a worker add one task each (their result), nothing else
    assert len(graph.tasks) - p == 4 + len(by_func["reduce_range"]) + len(between) + len(by_func.get("publish_slice", []))


def test_plan_rejects_a_worker_on_two_hosts():
    with pytest.raises(ValueError, match=r"workers \[\[1, 2\]\] hold ranks of several groups"):
        hierarchical.plan(4, groups=[[0, 1], [2, 3]], inner="shm-direct", workers=[[0], [1, 2], [3]])
    with pytest.raises(ValueError, match="workers is an option of inner='shm-direct'"):
        hierarchical.plan(4, groups=[[0, 1], [2, 3]], inner="ring", workers=[[0], [1], [2], [3]])


# -- emulated hosts ----------------------------------------------------------------


def emulated_hosts(directory: str, hosts: int = 2, per_host: int = 2) -> SpecCluster:
    """Worker processes on one machine that flowreduce sees on ``hosts``
    nodes (the batch system's node name, set per nanny)."""
    workers = {f"h{h}-w{w}": {"cls": Nanny, "options": {"nthreads": 1, "env": {"SLURMD_NODENAME": f"host-{h}"}}}
               for h in range(hosts) for w in range(per_host)}
    settings = {"flowreduce.shm.directory": directory, "flowreduce.shm.idle-seconds": IDLE}
    with dask.config.set(settings):
        return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}})


@pytest.fixture(scope="module")
def client(shm_dir):
    with emulated_hosts(shm_dir) as cluster, Client(cluster) as c:
        c.wait_for_workers(4)
        yield c


def host_workers(client) -> list[str]:
    """Workers ordered host by host: [host-0 w0, host-0 w1, host-1 w0, host-1 w1]."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(info, key=lambda w: info[w]["name"])


def scatter(client, arrays, ws):
    """Rank r on host r % 2 (so two ranks already span both hosts)."""
    order = [ws[0], ws[2], ws[1], ws[3]]
    return [client.scatter(a, workers=[order[r % 4]], hash=False) for r, a in enumerate(arrays)]


def settled(client, directory) -> None:
    assert_clean(client)
    leased = lambda: sum(s.get("leased", 0) for s in usage(client).values())  # noqa: E731
    assert wait_until(lambda: leased() == 0, 30), usage(client)
    assert wait_until(lambda: not shm_pool.segments(directory), 30 + 4 * IDLE), shm_pool.segments(directory)


OPS = [("sum", "int64"), ("prod", "int32"), ("max", "uint8"), ("min", "int16"), ("mean", "int16"),
       ("mean", "float32"), ("sum", "bool"), ("logaddexp", "float64")]


@pytest.mark.parametrize("op,dtype", OPS, ids=[f"{o}-{d}" for o, d in OPS])
def test_numbers_match_numpy(client, shm_dir, op, dtype):
    """Ranks 2..8 on 2 hosts x 2 workers (sharing workers from 5 ranks on),
    lengths from empty to past the shared-memory threshold."""
    ws = host_workers(client)
    ufunc = {"sum": np.add, "prod": np.multiply, "mean": np.add, "max": np.maximum, "min": np.minimum}.get(op) \
        or getattr(np, op)
    calls, expected = [], []
    for p in (2, 4, 6, 8):
        for n in (0, 7, 30_001):
            rng = np.random.default_rng(p * 100 + n)
            arrays = [rng.integers(0, 2 if dtype == "bool" else 3, size=n).astype(dtype) for _ in range(p)]
            counted = dtype == "bool" and op in ("sum", "prod")
            exp = functools.reduce(ufunc, [a.astype(np.int64) for a in arrays] if counted else arrays)
            expected.append(exp / p if op == "mean" else exp)
            calls.append(flowreduce.allreduce(client, scatter(client, arrays, ws), op=op, algorithm="hierarchical"))
    for futures, exp in zip(calls, expected):
        rec = describe(futures)
        assert rec.plan.options["inner"] == "shm-direct", rec.plan
        assert rec.transport == "shared memory within hosts, dask across"
        for r, o in enumerate(client.gather(futures)):
            assert o.dtype == exp.dtype and o.shape == exp.shape, (r, o.dtype, exp.dtype)
            np.testing.assert_allclose(o, exp, rtol=1e-5, err_msg=f"rank {r}")
    del calls, futures
    settled(client, shm_dir)


def _clear_logs(dask_worker=None):
    dask_worker.transfer_outgoing_log.clear()


def _wire(dask_worker=None) -> list[tuple[str, int]]:
    return [(e["who"], e["compressed"]) for e in dask_worker.transfer_outgoing_log
            if any("flowreduce-" in str(k) for k in e["keys"])]


def test_handles_inside_hosts_arrays_across(client, shm_dir):
    """On the transfer log: between workers of one host only handles (< 1 kB),
    between hosts the slices themselves; and describe() says so per link."""
    ws = host_workers(client)
    host = {w: i // 2 for i, w in enumerate(ws)}
    n = 400_000
    arrays = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(4)]
    parts = scatter(client, arrays, ws)
    client.run(_clear_logs)
    with flowreduce.trace(client) as tr:
        futures = flowreduce.allreduce(client, parts, algorithm="hierarchical")
        for o in client.gather(futures):
            np.testing.assert_array_equal(o, sum(arrays))
    # lowered the shared-memory way: one write per worker (the plan's views fused into it), no split task
    # (the tasks themselves: a transfer of a write's handle to a peer carries its key too, on the peer)
    writes = {e.key: e.worker for e in tr.events
              if e.token and e.node is not None and e.node < 0 and e.phase in COMPUTE_PHASES}
    assert sorted(writes.values()) == sorted(ws), writes
    assert not [e for e in tr.events if e.phase == "split" and e.token], "views ran as tasks"
    sent = client.run(_wire)
    inside = [b for src, log in sent.items() for dst, b in log if dst in host and host[dst] == host[src]]
    across = [b for src, log in sent.items() for dst, b in log if dst in host and host[dst] != host[src]]
    assert inside and across
    assert max(inside) < 1024, sorted(inside)[-4:]
    assert min(across) > n * 8 // 8, sorted(across)[:4]  # a quarter of the vector, halved by the outer step
    links = describe(futures).link_transports()
    assert {how for (a, b), how in links.items() if host[a] == host[b]} == {"shared memory"}
    assert {how for (a, b), how in links.items() if host[a] != host[b]} == {"dask"}
    del futures, parts
    settled(client, shm_dir)


def test_describe_names_each_links_transport(client, shm_dir):
    """8 ranks on 4 workers of 2 hosts: same-worker, same-host and cross-host
    links in one call, each named in describe()'s record and repr."""
    ws = host_workers(client)
    host = {w: i // 2 for i, w in enumerate(ws)}
    arrays = [np.full(50_000, r, dtype=np.int64) for r in range(8)]
    futures = flowreduce.allreduce(client, scatter(client, arrays, ws), algorithm="hierarchical")
    rec = describe(futures)
    links = rec.link_transports()
    assert {how for (a, b), how in links.items() if a == b} == {"same worker"}
    assert {how for (a, b), how in links.items() if a != b and host[a] == host[b]} == {"shared memory"}
    assert {how for (a, b), how in links.items() if host[a] != host[b]} == {"dask"}
    assert "links=" in repr(rec) and "'shared memory'" in repr(rec) and "'same worker'" in repr(rec)
    np.testing.assert_array_equal(client.gather(futures[5]), np.full(50_000, 28))
    # the same call over Dask's comm: no link through memory
    plain = describe(flowreduce.allreduce(client, scatter(client, arrays, ws), algorithm="hierarchical",
                                          transport="dask"))
    assert set(plain.link_transports().values()) <= {"same worker", "dask"}
    del futures
    settled(client, shm_dir)


def test_transport_dask_keeps_the_old_plan(client, shm_dir):
    ws = host_workers(client)
    arrays = [np.arange(100_000, dtype=np.int64) + r for r in range(4)]
    futures = flowreduce.allreduce(client, scatter(client, arrays, ws), algorithm="hierarchical", transport="dask")
    rec = describe(futures)
    assert rec.plan.options["inner"] in hierarchical.SCATTER_ALGORITHMS and rec.transport == "dask", rec
    assert rec.plan.options["groups"] == [[0, 2], [1, 3]]
    np.testing.assert_array_equal(client.gather(futures[3]), sum(arrays))
    # an inner algorithm named by the user is kept too (its same-host edges carry handles)
    named = describe(flowreduce.allreduce(client, scatter(client, arrays, ws), algorithm="hierarchical",
                                          inner="ring"))
    assert named.plan.options["inner"] == "ring"
    del futures
    settled(client, shm_dir)


def test_auto_can_choose_it_across_hosts(client, shm_dir):
    """When Dask's comm inside a host is slow next to shared memory, auto's
    pick for a large vector is hierarchical with shared memory inside the
    hosts (and for a small one something with fewer levels)."""
    ws = host_workers(client)
    slow = CostModel(intra=Link(4e-3, 1 / 1e9))
    small = describe(flowreduce.allreduce(client, scatter(client, [np.ones(10) for _ in range(4)], ws), model=slow))
    assert small.plan.options.get("inner") != "shm-direct", small.plan
    arrays = [np.arange(2_000_000, dtype=np.int64) * r for r in range(4)]
    futures = flowreduce.allreduce(client, scatter(client, arrays, ws), model=slow)
    rec = describe(futures)
    assert rec.plan.algorithm == "hierarchical" and rec.plan.options["inner"] == "shm-direct", rec.plan
    np.testing.assert_array_equal(client.gather(futures[0]), sum(arrays))
    del futures
    settled(client, shm_dir)


def test_no_segment_left_after_an_error(client, shm_dir):
    ws = host_workers(client)
    parts = scatter(client, [np.ones(100_000) for _ in range(4)], ws)
    bad = client.submit(lambda x: x.astype("f4")[:10], parts[3], workers=[ws[3]])  # disagrees in shape
    e = error_of(lambda: flowreduce.allreduce(client, [*parts[:3], bad], algorithm="hierarchical"))
    assert isinstance(e, ValueError) and "rank" in str(e), repr(e)
    bad = parts = e = None
    settled(client, shm_dir)
    # and an op failing in the tasks (after segments were leased)
    parts = scatter(client, [np.ones(100_000) for _ in range(4)], ws)
    futures = flowreduce.allreduce(client, parts, algorithm="hierarchical", op=_boom)
    with pytest.raises(ArithmeticError) as caught:
        client.gather(futures)
    caught.value.__traceback__ = None  # its frames hold `futures`
    futures = caught = parts = None
    gc.collect()
    settled(client, shm_dir)


def _boom(a, b):
    raise ArithmeticError("no")


def test_no_segment_left_after_cancellation(client, shm_dir):
    ws = host_workers(client)
    parts = scatter(client, [np.ones(2_000_000) for _ in range(4)], ws)
    futures = flowreduce.allreduce(client, parts, algorithm="hierarchical")
    assert describe(futures).plan.options["inner"] == "shm-direct"
    client.cancel(futures)
    del futures, parts
    settled(client, shm_dir)


LAYOUTS = {"2x2": ([[0, 1], [2, 3]], None, "abcd"),
           "2x2, 2 ranks a worker": ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]], "ababcdcd"),
           "3+2": ([[0, 1, 2], [3, 4]], None, "abcde"),
           "4x2": ([[0, 1], [2, 3], [4, 5], [6, 7]], None, "abcdefgh")}


@pytest.mark.parametrize("outer", hierarchical.ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cost_card_counts_the_lowered_graph(outer, layout):
    """The cost model prices the graph that runs: its card's tasks and
    levels are those of the shared-memory lowering, not of the plan's nodes."""
    from flowreduce.schedule.routes import lowered_card

    groups, workers, ws = LAYOUTS[layout]
    p = len(ws)
    plan = hierarchical.plan(p, groups=groups, inner="shm-direct", outer=outer,
                             **({"workers": workers} if workers else {}))
    graph = build_hierarchical(plan, [(f"x-{r}",) for r in range(p)], list(ws), size=1000, shape=(1000,),
                               dtype=np.dtype("f8"), op=resolve_op("sum"))
    card, shared_inside = lowered_card(plan, plan.cost(1.0))
    assert shared_inside
    assert (card.tasks, card.steps) == (len(graph.tasks), graph_depth(graph))
    assert card.tasks < plan.cost(1.0).tasks
