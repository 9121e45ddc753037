"""``deterministic=True``: one fixed order of float additions, the reference
tree over rank indices (``flowreduce.reference_reduce(arrays, op,
order="tree")``), whatever the algorithm, radix, chunk count, transport,
placement of ranks on workers, and recovery after a lost worker
(docs/reproducibility.md).

The values span 16 orders of magnitude with random signs, so that different
orders of addition give different bits; the default mode is checked to differ
between configurations on them (else these tests could not fail).

Fast tier: the graphs the front door builds, run by dask's synchronous
scheduler (as tests/test_conformance.py does), for every algorithm and
planner option. Cluster tier: the front door on in-process and multi-process
LocalClusters (ranks sharing workers, the shared-memory routes, transport
"dask"), and a worker killed mid-call."""

from __future__ import annotations

import gc
import itertools
import random

import dask
import faults
import numpy as np
import pytest
from dask.task_spec import DataNode, TaskRef
from distributed import Client, LocalCluster, wait
from utils import assert_clean, scatter_ranks, wait_until

import flowreduce
from flowreduce.errors import OptionError
from flowreduce.fusion import Layout, make_buckets
from flowreduce.lower.buckets import build_pytree_graph
from flowreduce.lower.direct import build_direct as build_read_direct
from flowreduce.lower.graph import build_graph
from flowreduce.lower.shm_direct import build_direct as build_shm_direct
from flowreduce.ops import resolve_op
from flowreduce.pytree import flatten
from flowreduce.reproducible import (
    reference_reduce,
    tree_cover,
    tree_leaf,
    tree_merge,
    tree_ordered,
    tree_root,
)
from flowreduce.schedule.inputs import check_values

RANKS = (1, 2, 3, 5, 6, 8)
LENGTHS = (0, 1, 1001)
DTYPES = (np.float64, np.float32)
OPS = ("sum", "mean")
#: every algorithm (and auto) and the planner options the defaults do not reach
VARIANTS = [(a, {}) for a in flowreduce.ALGORITHMS] + [
    ("butterfly", {"radix": 3}), ("butterfly", {"radix": 4}), ("recursive-doubling", {"radix": 3}),
    ("recursive-doubling", {"radix": 4}), ("tree", {"fan_in": 3}), ("tree", {"fan_in": 4}),
    ("reduce-broadcast", {"root": 1}), ("hierarchical", {"group_size": 3}), ("hierarchical", {"group_size": 2}),
]


def wide(p: int, n: int, dtype=np.float64, seed: int = 0) -> list[np.ndarray]:
    """Rank r's values: random signs and magnitudes from 1e-8 to 1e8 (16 orders)."""
    rng = np.random.default_rng(seed + 1000 * p + n)
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 9, n)).astype(dtype) for _ in range(p)]


def _plan(algorithm, options, p, nbytes, chunks):
    if algorithm == "auto":
        return flowreduce.choose(p, nbytes, chunks=chunks)
    options = dict(options)
    if options.get("root", 0) >= p or options.get("group_size", 0) > p:
        options = {}
    return flowreduce.plan(algorithm, p, chunks=chunks, **options)


def _run(graph, refs, arrays):
    tasks = {**graph.tasks, **{ref.key: DataNode(ref.key, a) for ref, a in zip(refs, arrays)}}
    return dask.get(tasks, graph.outputs, scheduler="sync")


def run_plan(arrays, algorithm, options=(), *, op="sum", chunks=1, ordered=True, workers=None):
    """The plan's graph as the front door lowers it over Dask's comm, run without a cluster."""
    p, a0 = len(arrays), arrays[0]
    op_ = resolve_op(op)
    plan = _plan(algorithm, dict(options), p, a0.nbytes, chunks)
    refs = [TaskRef(("input", r)) for r in range(p)]
    graph = build_graph(plan, refs, workers or [f"w{r}" for r in range(p)], size=a0.size, shape=a0.shape, op=op_,
                        in_place=False, ordered=ordered)
    return _run(graph, refs, arrays)


def run_direct(arrays, workers, *, op="sum", ordered=True):
    """The one-level ``direct`` lowering (no workers to read from: every input a dependency)."""
    p = len(arrays)
    plan = flowreduce.plan("direct", p)
    refs = [TaskRef(("input", r)) for r in range(p)]
    graph = build_read_direct(plan, refs, workers, input_keys=[r.key for r in refs], op=resolve_op(op), read=None,
                              check=check_values, ordered=ordered)
    return _run(graph, refs, arrays)


def same_bytes(results, ref):
    return all(np.asarray(x).dtype == ref.dtype and np.asarray(x).tobytes() == ref.tobytes() for x in results)


# -- the reference tree ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 18))
def test_merging_any_partition_in_any_order_gives_the_reference_bits(p):
    xs = wide(p, 257)
    ref = reference_reduce(xs, "sum", order="tree")
    rng = random.Random(p)
    for _ in range(20):
        ranks = list(range(p))
        rng.shuffle(ranks)
        parts = [dict({tree_leaf(p, r): xs[r]}) for r in ranks]  # one rank each, merged in a random grouping
        while len(parts) > 1:
            i = rng.randrange(len(parts) - 1)
            a, b = parts[i], parts.pop(i + 1)
            parts[i] = tree_merge(p, {**a, **b}, np.add)
        (root, total), = parts[0].items()
        assert root == tree_root(p)
        assert total.tobytes() == ref.tobytes()


def test_cover_is_the_maximal_subtrees():
    assert tree_cover(8, range(8)) == (tree_root(8),)
    assert tree_cover(8, [0, 1, 2]) == ((0, 2), (1, 0))  # (x0 + x1) and x2
    assert tree_cover(5, [0, 4]) == ((0, 0),)  # rank 4 folds into rank 0
    assert tree_cover(5, [1, 2, 3]) == ((0, 1), (1, 1))
    assert len(tree_cover(6, [0, 1])) == 2  # ranks 0 and 1 wait for 4 and 5


def test_which_reductions_the_order_changes():
    assert tree_ordered("sum", np.float32) and tree_ordered("mean", np.float64) and tree_ordered("prod", "f8")
    assert tree_ordered("sum", np.complex128)
    assert not tree_ordered("sum", np.int64) and not tree_ordered("mean", np.int32)
    assert not tree_ordered("max", np.float64) and not tree_ordered("min", np.float32)


# -- the default's bits do depend on the configuration (so the tests below can fail) --------------


def test_the_default_gives_different_bits_for_different_configurations():
    xs = wide(5, 1001)
    seen = {run_plan(xs, a, o, chunks=c, ordered=False)[0].tobytes()
            for a, o, c in [("ring", {}, 1), ("butterfly", {}, 1), ("tree", {"fan_in": 3}, 1),
                            ("reduce-broadcast", {}, 1), ("butterfly", {"radix": 4}, 3)]}
    seen.add(run_direct(xs, ["a", "b", "a", "c", "b"], ordered=False)[0].tobytes())
    assert len(seen) >= 3, "the test data does not tell orders apart"
    assert reference_reduce(xs, "sum", order="tree").tobytes() != reference_reduce(xs, "sum").tobytes()


# -- True: every configuration, the reference's bytes -------------------------------------------------


@pytest.mark.parametrize("algorithm,options", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         "".join(f"{k}{x}" for k, x in v.items()) or "-")
@pytest.mark.parametrize("p", RANKS)
def test_every_plan_gives_the_reference_bits(algorithm, options, p):
    failures = []
    for n, chunks, dtype, op in itertools.product(LENGTHS, (1, 3), DTYPES, OPS):
        xs = wide(p, n, dtype)
        ref = reference_reduce(xs, op, order="tree")
        got = run_plan(xs, algorithm, options, op=op, chunks=chunks)
        if len(got) != p or not same_bytes(got, ref):
            failures.append((n, chunks, np.dtype(dtype).name, op))
    assert not failures, f"{algorithm} {options} p={p}: not the reference's bits for {failures}"


@pytest.mark.parametrize("p", RANKS)
def test_direct_with_ranks_sharing_workers_gives_the_reference_bits(p):
    placements = {"own": [f"w{r}" for r in range(p)], "shared": [f"w{r % 2}" for r in range(p)],
                  "mixed": [f"w{(r * 7) % 3}" for r in range(p)]}
    for (name, workers), n, dtype, op in itertools.product(placements.items(), LENGTHS, DTYPES, OPS):
        xs = wide(p, n, dtype)
        assert same_bytes(run_direct(xs, workers, op=op), reference_reduce(xs, op, order="tree")), \
            (name, n, np.dtype(dtype).name, op)


@pytest.mark.parametrize("p", RANKS)
def test_shm_direct_lowering_gives_the_reference_bits(p, shm_dir):
    """The fused shared-memory lowering of ``shm-direct``, ranks sharing workers, run in this process
    (its segments are this process's pool)."""
    for workers, n, dtype, op in itertools.product(([f"w{r}" for r in range(p)], [f"w{r % 3}" for r in range(p)]),
                                                   LENGTHS, DTYPES, OPS):
        xs = wide(p, n, dtype)
        groups = [[r for r in range(p) if workers[r] == w] for w in dict.fromkeys(workers)]
        plan = flowreduce.plan("shm-direct", p, **({"groups": groups} if len(groups) < p else {}))
        refs = [TaskRef(("input", r)) for r in range(p)]
        graph = build_shm_direct(plan, refs, workers, size=xs[0].size, shape=xs[0].shape, dtype=xs[0].dtype,
                                 op=resolve_op(op), ordered=True)
        with dask.config.set({"flowreduce.shm.directory": shm_dir, "flowreduce.shm.min-bytes": 1}):
            got = _run(graph, refs, xs)
        assert same_bytes(got, reference_reduce(xs, op, order="tree")), \
            (workers, n, np.dtype(dtype).name, op)


def test_placement_on_workers_changes_nothing():
    """The same plan lowered for ranks on their own workers and ranks sharing them. (Reduction
    into received buffers, which placement decides, needs real copies on the wire: the
    multi-process tests below run it.)"""
    xs = wide(6, 1001)
    ref = reference_reduce(xs, "sum", order="tree")
    for algorithm in ("ring", "butterfly", "tree", "recursive-doubling", "reduce-broadcast"):
        for workers in ([f"w{r}" for r in range(6)], ["a", "a", "b", "b", "c", "c"], ["a", "b", "a", "b", "a", "b"]):
            assert same_bytes(run_plan(xs, algorithm, chunks=2, workers=workers), ref), (algorithm, workers)


def test_pytrees_bucket_by_bucket():
    """Tensors fused into buckets: each bucket in the tree order (every tensor's elements have the
    reference's bits), integers as they were."""
    p = 5
    trees = [{"w": wide(p, 300, seed=1)[r].reshape(20, 15), "b": wide(p, 7, np.float32, seed=2)[r],
              "n": np.arange(4, dtype=np.int64) * r} for r in range(p)]
    layout = Layout.from_template(flatten(0)[1], trees[0])
    buckets = make_buckets([t.spec for t in layout.tensors], 1 << 20)
    plans = [flowreduce.plan("ring", p) for _ in buckets]
    refs = [TaskRef(("input", r)) for r in range(p)]
    g = build_pytree_graph(layout, buckets, plans, [[ref] for ref in refs], [f"w{r}" for r in range(p)],
                         op=resolve_op("sum"), in_place=False, ordered=True)
    tasks = {**g.tasks, **{ref.key: DataNode(ref.key, t) for ref, t in zip(refs, trees)}}
    out = dask.get(tasks, [row[0] for row in g.outputs], scheduler="sync")
    for name in ("w", "b", "n"):
        ref = reference_reduce([t[name] for t in trees], "sum", order="tree")
        assert all(o[name].tobytes() == ref.tobytes() for o in out), name


def test_default_graphs_are_unchanged():
    """deterministic=False lowers with the ordinary kernel and the same keys."""
    from flowreduce.kernels import dense

    plan = flowreduce.plan("ring", 4, chunks=2)
    refs = [TaskRef(("input", r)) for r in range(4)]
    kw = dict(size=100, shape=(100,), op=resolve_op("sum"), token="t")
    plain = build_graph(plan, refs, ["a", "b", "c", "d"], **kw)
    ordered = build_graph(plan, refs, ["a", "b", "c", "d"], ordered=True, **kw)
    assert plain.tasks.keys() == ordered.tasks.keys()
    assert {t.func for t in plain.tasks.values()} >= {dense.reduce} and dense.reduce_ordered not in \
        {t.func for t in plain.tasks.values()}
    assert dense.reduce_ordered in {t.func for t in ordered.tasks.values()}


def _hand_plan(p, segments, spec, finals):
    """A plan written node by node: ``spec`` rows ``(kind, rank, lo, hi, inputs)``."""
    from flowreduce.algorithms.ir import Node, Plan

    nodes = tuple(Node(i, kind, rank, lo, hi, inputs, 0, "reduce")
                  for i, (kind, rank, lo, hi, inputs) in enumerate(spec))
    return Plan("hand", p, segments, nodes, finals)


@pytest.mark.parametrize("p,segments,spec,message", [
    # rank 0's value twice
    (2, 1, [("view", 0, 0, 1, ()), ("view", 1, 0, 1, ()), ("reduce", 0, 0, 1, (0, 0))],
     "node 2 combines some rank twice"),
    # x0 + x2 (rank 2 folds into rank 0 at p=3), then x2 again
    (3, 1, [("view", 0, 0, 1, ()), ("view", 1, 0, 1, ()), ("view", 2, 0, 1, ()), ("reduce", 0, 0, 1, (0, 2)),
            ("reduce", 0, 0, 1, (3, 2, 1))], "node 4 combines some rank twice"),
    # ranks 0, 1, 2 on segment 0 beside ranks 0, 1 on segment 1
    (3, 2, [("view", 0, 0, 2, ()), ("view", 1, 0, 2, ()), ("view", 2, 0, 2, ()), ("reduce", 0, 0, 1, (0, 1, 2)),
            ("reduce", 0, 1, 2, (0, 1)), ("gather", 0, 0, 2, (3, 4))],
     "gather node 5 puts together values of different ranks"),
])
def test_the_walk_refuses_a_plan_that_is_not_a_sum_of_every_rank(p, segments, spec, message):
    """The ordered lowering and the cost model's count walk the plan once, the
    same way, and refuse the same plans."""
    from flowreduce.algorithms.partials import carried

    plan = _hand_plan(p, segments, spec, (len(spec) - 1,) * p)
    refs = [TaskRef(("input", r)) for r in range(p)]
    with pytest.raises(ValueError, match=message):
        build_graph(plan, refs, ["w"] * p, size=10, shape=(10,), op=resolve_op("sum"), ordered=True)
    with pytest.raises(ValueError, match=message):
        carried(plan)


def test_ordered_graph_at_many_ranks_adds_the_reference_tree():
    """Butterfly over 256 ranks (its partials merged reduce by reduce, not
    re-covered from every rank): each rank's result is the tree's root, and
    the last reduce of each rank's segment adds the root's two children."""
    from flowreduce.kernels import dense

    p = 256
    plan = flowreduce.plan("butterfly", p)
    refs = [TaskRef(("input", r)) for r in range(p)]
    g = build_graph(plan, refs, [f"w{r}" for r in range(p)], size=p, shape=(p,), op=resolve_op("sum"), ordered=True)
    root = tree_root(p)
    children = [((root[0] - 1, 0),), ((root[0] - 1, 1),)]
    lasts = [t for t in g.tasks.values() if t.func is dense.reduce_ordered and t.args[2]]  # sums every rank
    assert len(lasts) == p and all(sorted(t.args[-1]) == children for t in lasts)


# -- the front door's option --------------------------------------------------------------------------


def test_option_values(no_cluster):
    from flowreduce.schedule.reproducible import mode

    assert mode(True) is True and mode(False) is False and mode(None) is False and mode("exact") == "exact"
    for bad in ("true", 1, "tree"):
        with pytest.raises(OptionError, match="False, True or 'exact'"):
            mode(bad)


# -- cluster tier ----------------------------------------------------------------------------------------

CLUSTER_ALGORITHMS = ["auto", "direct", "shm-direct", "butterfly", "ring", "tree", "recursive-doubling",
                      "reduce-broadcast", "hierarchical"]


def _check_front_door(client, p, n, dtype, op, algorithms, transports=("auto", "dask"), **kw):
    xs = wide(p, n, dtype, seed=7)
    ref = reference_reduce(xs, op, order="tree")
    parts = scatter_ranks(client, xs)
    failures, how = [], {}
    for algorithm, transport in itertools.product(algorithms, transports):
        out = flowreduce.allreduce(client, parts, op=op, algorithm=algorithm, transport=transport,
                                   deterministic=True, **kw)
        record = flowreduce.describe(out)
        assert record.deterministic is True
        how[algorithm, transport] = record.transport
        if not same_bytes(client.gather(out), ref):
            failures.append((algorithm, transport, record.plan.algorithm, record.transport))
        del out
    del parts
    assert not failures, f"p={p} n={n} {np.dtype(dtype).name} {op}: not the reference's bits: {failures}"
    return how


@pytest.mark.parametrize("p", [3, 5, 8])
def test_front_door_in_process(inproc_client, p):
    for dtype, op in itertools.product(DTYPES, OPS):
        _check_front_door(inproc_client, p, 1001, dtype, op, CLUSTER_ALGORITHMS, transports=("auto",))
    _check_front_door(inproc_client, p, 1001, np.float64, "sum", ["butterfly", "ring", "tree"], chunks=3)
    assert_clean(inproc_client)


@pytest.mark.parametrize("p,n", [(4, 1001), (4, 300_000), (6, 300_000), (8, 1)])
def test_front_door_processes_and_shared_memory(proc_client, p, n, method_tasks):
    """Worker processes on one host: the shared-memory routes of the task graph (shm-direct's segments,
    direct's posts, published edges) and transport='dask'; ranks 4..7 share workers 0..3. (The p2p
    engine's order: test_the_p2p_engine_adds_in_the_reference_order.)"""
    how = _check_front_door(proc_client, p, n, np.float64, "sum", CLUSTER_ALGORITHMS)
    if n > 1:  # the routes through shared memory did run
        assert how["shm-direct", "auto"] == "shared memory" and how["direct", "auto"] == "shared memory", how
        assert how["ring", "dask"] == "dask" and (n < 100_000 or "shared memory" in how["ring", "auto"]), how
    _check_front_door(proc_client, p, n, np.float32, "mean", ["auto", "direct", "shm-direct", "ring"],
                      transports=("auto",))
    assert_clean(proc_client)


def test_config_key_and_describe(inproc_client):
    xs = wide(5, 1001)
    parts = scatter_ranks(inproc_client, xs)
    with dask.config.set({"flowreduce.deterministic": True}):
        out = flowreduce.allreduce(inproc_client, parts, algorithm="ring")
    assert flowreduce.describe(out).deterministic is True
    assert same_bytes(inproc_client.gather(out), reference_reduce(xs, "sum", order="tree"))
    plain = flowreduce.allreduce(inproc_client, parts, algorithm="ring")
    assert flowreduce.describe(plain).deterministic is False
    del out, plain, parts
    assert_clean(inproc_client)


def test_integers_min_max_are_unchanged(inproc_client):
    """Order-free reductions: the ordinary call (tree_ordered is False for them), the same results."""
    xs = [np.arange(1001, dtype=np.int64) * (r + 1) for r in range(5)]
    parts = scatter_ranks(inproc_client, xs)
    out = flowreduce.allreduce(inproc_client, parts, algorithm="ring", deterministic=True)
    np.testing.assert_array_equal(inproc_client.gather(out)[0], sum(xs))
    fx = scatter_ranks(inproc_client, wide(5, 1001))
    top = flowreduce.allreduce(inproc_client, fx, op="max", algorithm="ring", deterministic=True)
    np.testing.assert_array_equal(inproc_client.gather(top)[0], np.max(wide(5, 1001), axis=0))
    del out, top, parts, fx
    assert_clean(inproc_client)


@pytest.mark.parametrize("algorithm", [a for a in flowreduce.ALGORITHMS if a != "auto"])
def test_the_p2p_engine_adds_in_the_reference_order(inproc_client, algorithm):
    """One rank per worker: the engine's values carry the reference tree's partial sums, as the task
    graph's do; the bits are reference_reduce's for every algorithm, chunking, dtype and op. Without
    deterministic=, a ring's differ from it (butterflies over 3 and 4 ranks happen to add in the tree's order)."""
    differs = False
    for dtype, op, chunks, p in itertools.product(DTYPES, OPS, (1, 3), (3, 4)):
        xs = [x.astype(dtype) for x in wide(p, 1001)]
        parts = scatter_ranks(inproc_client, xs)
        out = flowreduce.allreduce(inproc_client, parts, algorithm=algorithm, chunks=chunks, op=op, method="p2p",
                                   deterministic=True)
        want = reference_reduce(xs, op, order="tree")
        for r, got in enumerate(inproc_client.gather(out)):
            np.testing.assert_array_equal(got, want, err_msg=f"{algorithm} {dtype.__name__} {op} chunks={chunks} "
                                                               f"p={p} rank {r}")
        assert flowreduce.describe(out).deterministic is True and flowreduce.describe(out).method == "p2p"
        plain = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, algorithm=algorithm, chunks=chunks,
                                                          op=op, method="p2p"))
        differs |= any(not np.array_equal(x, want) for x in plain)
        del out, parts
    if algorithm == "ring":  # on these inputs its own order gives other bits (else this test could not fail)
        assert differs, "ring: the default order never differed from the tree's"
    assert_clean(inproc_client)


def test_p2p_refuses_float_sums_of_ranks_sharing_a_worker(inproc_client):
    parts = scatter_ranks(inproc_client, wide(8, 100))  # 8 ranks on 4 workers: combined there in rank order
    with pytest.raises(OptionError, match="tree order"):
        flowreduce.allreduce(inproc_client, parts, deterministic=True, method="p2p")
    out = flowreduce.allreduce(inproc_client, parts, deterministic=True)  # auto: the task graph keeps the order
    np.testing.assert_array_equal(inproc_client.gather(out)[0], reference_reduce(wide(8, 100), "sum", order="tree"))
    del parts, out
    assert_clean(inproc_client)


def test_scipy_sparse_float_sums_are_refused_integers_pass(inproc_client):
    import scipy.sparse as sp

    floats = scatter_ranks(inproc_client, [sp.csr_matrix(x.reshape(10, 10)) for x in wide(4, 100)])
    with pytest.raises(OptionError, match="scipy.sparse"):
        flowreduce.allreduce(inproc_client, floats, deterministic=True)
    ints = [sp.csr_matrix(np.arange(100, dtype=np.int64).reshape(10, 10) * r) for r in range(4)]
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, ints), deterministic=True)
    np.testing.assert_array_equal(out[0].result().toarray(), sum(m.toarray() for m in ints))
    del floats, out
    assert_clean(inproc_client)


# -- recovery: a worker killed mid-call -----------------------------------------------------------------

N = 200_000


def rank_input(r: int) -> np.ndarray:
    """Recomputable (the same values when a lost input runs again)."""
    return wide(4, N, seed=11)[r]


@pytest.fixture(scope="module")
def nanny_client():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield cluster, client


@pytest.mark.parametrize("algorithm,step,mode", [("ring", 3, True), ("butterfly", 1, True), ("shm-direct", 2, True),
                                                ("shm-direct", 2, "exact")])
def test_worker_lost_mid_call_gives_the_reference_bits(nanny_client, algorithm, step, mode, method_tasks):
    """As tests/test_failures.py kills a rank's worker when a plan step starts there (a task per step:
    method='tasks'). "exact" on shm-direct folds the gathered values: an ordinary call, recovered as one."""
    cluster, client = nanny_client
    # four running workers (a killed one's nanny restarts it), nothing of the last test left
    assert wait_until(lambda: all(w.status.name == "running" for w in cluster.workers.values()), 60)
    cluster.scale(4)
    client.wait_for_workers(4, timeout=60)
    assert_clean(client, timeout=60)
    ws: list[str] = []

    def four_workers() -> bool:  # read once per look: a restarted worker may still be replacing its old self
        ws[:] = sorted(client.nthreads())
        return len(ws) == 4

    assert wait_until(four_workers, 60), ws
    parts = [client.submit(rank_input, r, workers=[ws[r]], allow_other_workers=True, pure=False) for r in range(4)]
    wait(parts)
    faults.fail_at(client, rank=1, step=step, action="kill")
    try:
        out = flowreduce.allreduce(client, parts, algorithm=algorithm, deterministic=mode,
                                   chunks=2 if algorithm in ("ring", "butterfly") else None)
        wait(out, timeout=120)
        assert faults.fired(client), "the fault was not injected"
        ref = reference_reduce([rank_input(r) for r in range(4)], "sum", order="tree" if mode is True else "exact")
        assert same_bytes(client.gather(out), ref)
    finally:
        faults.disarm(client)
    del out, parts
    gc.collect()
    assert_clean(client, timeout=60)  # the recovered call's re-runs may still be releasing on a loaded machine


def test_templates_and_torch_tensors(inproc_client):
    """like= templates and torch tensors go through the pytree path (buckets): the same bits."""
    xs = wide(5, 1001, seed=3)
    parts = scatter_ranks(inproc_client, xs)
    ref = reference_reduce(xs, "sum", order="tree")
    for algorithm in ("ring", "tree", "auto"):
        out = flowreduce.allreduce(inproc_client, parts, algorithm=algorithm, like=xs[0], deterministic=True)
        assert same_bytes(inproc_client.gather(out), ref), algorithm
        del out
    torch = pytest.importorskip("torch")
    ts = scatter_ranks(inproc_client, [torch.from_numpy(x.astype(np.float32)) for x in xs])
    tref = reference_reduce([x.astype(np.float32) for x in xs], "mean", order="tree")
    for algorithm in ("ring", "butterfly"):
        out = flowreduce.allreduce(inproc_client, ts, algorithm=algorithm, op="mean", deterministic=True)
        assert all(t.numpy().tobytes() == tref.tobytes() for t in inproc_client.gather(out)), algorithm
        del out
    del parts, ts
    assert_clean(inproc_client)
