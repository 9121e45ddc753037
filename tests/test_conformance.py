"""Numbers against numpy, in two tiers.

Fast tier, no cluster: each plan is lowered by :mod:`flowreduce.lower` and
its graph run by dask's synchronous scheduler. Every algorithm (and
``auto``, and planner options) x ranks 1..8 x lengths {0, 1, p-1, 1000,
1001} x chunks {1, 3, more than elements}; every op x dtype x ranks 1..8.

Cluster tier: the same calls through ``flowreduce.allreduce`` on an
in-process cluster for a representative subset (placement, input checks,
concurrent calls), and on a real multi-process LocalCluster (where
transfers copy and in-place reduction into received buffers really
happens). A failure names its algorithm, ranks and size.
"""

from __future__ import annotations

import functools

import dask
import numpy as np
import pytest
from dask.task_spec import DataNode, TaskRef
from utils import assert_clean, scatter_ranks

import flowreduce
from flowreduce.lower.direct import build_direct
from flowreduce.lower.graph import build_graph
from flowreduce.ops import resolve_op
from flowreduce.schedule.inputs import check_values

ALGS = list(flowreduce.ALGORITHMS)  # every registered algorithm, and auto
#: Planner options the defaults do not reach (the front door picks them by cost).
VARIANTS = [(a, {}) for a in ALGS] + [
    ("butterfly", {"radix": 3}), ("butterfly", {"radix": 4}), ("recursive-doubling", {"radix": 3}),
    ("tree", {"fan_in": 3}), ("reduce-broadcast", {"root": 1}), ("hierarchical", {"group_size": 3}),
]


def _lengths(p):
    return sorted({0, 1, max(p - 1, 0), 1000, 1001})


def _chunks(n):
    return [1, 3] + ([n + 2] if n < 10 else [])  # more chunks than elements on short vectors


def _label(algorithm, options):
    return algorithm + "".join(f"-{k}{v}" for k, v in options.items())


def _plan(algorithm, options, p, nbytes, chunks):
    if algorithm == "auto":
        return flowreduce.choose(p, nbytes, chunks=chunks)
    options = dict(options)
    if options.get("root", 0) >= p or options.get("group_size", 0) > p:
        options = {}
    return flowreduce.plan(algorithm, p, chunks=chunks, **options)


def run_graph(arrays, algorithm, options=(), *, op="sum", chunks=1, workers=None):
    """All-reduce ``arrays`` (one per rank) without a cluster: plan, lower,
    and run the graph with dask's synchronous scheduler. Objects pass by
    reference there, so the graph is built not to reduce in place (as for
    ``inproc://`` workers). ``direct`` in one chunk is lowered as the front
    door lowers it (:mod:`flowreduce.lower.direct`), with no workers to read
    from: every input a dependency, its tasks checking the inputs;
    ``workers`` (default one per rank) groups ranks sharing a worker."""
    p, a0 = len(arrays), arrays[0]
    op_ = resolve_op(op)
    plan = _plan(algorithm, dict(options), p, a0.nbytes, chunks)
    refs = [TaskRef(("input", r)) for r in range(p)]
    workers = workers or [f"worker-{r}" for r in range(p)]
    if plan.algorithm == "direct" and plan.chunks == 1:
        graph = build_direct(plan, refs, workers, input_keys=[ref.key for ref in refs], op=op_, read=None,
                             check=check_values)
    else:
        graph = build_graph(plan, refs, workers, size=a0.size, shape=a0.shape, op=op_, in_place=False,
                            accumulate=op_.accumulator(a0.dtype))
    tasks = {**graph.tasks, **{ref.key: DataNode(ref.key, a) for ref, a in zip(refs, arrays)}}
    return dask.get(tasks, graph.outputs, scheduler="sync")


FAST = {(a, tuple(o.items()), p): [(n, c) for n in _lengths(p) for c in _chunks(n)]
        for a, o in VARIANTS for p in range(1, 9)}


@pytest.mark.parametrize("algorithm,options,ranks", list(FAST), ids=[f"{_label(a, dict(o))}-p{p}" for a, o, p in FAST])
def test_sum_matrix(algorithm, options, ranks):
    """Integers, exact: every length x chunk count, and the inputs untouched."""
    for n, chunks in FAST[algorithm, options, ranks]:
        rng = np.random.default_rng(ranks * 10007 + n)
        arrays = [rng.integers(-1000, 1000, size=n) for _ in range(ranks)]
        before = [a.copy() for a in arrays]
        expected = functools.reduce(np.add, arrays)
        out = run_graph(arrays, algorithm, options, chunks=chunks)
        assert len(out) == ranks
        for r, o in enumerate(out):
            where = f"{_label(algorithm, dict(options))} ranks={ranks} n={n} chunks={chunks} rank {r}"
            assert o.dtype == expected.dtype and o.shape == expected.shape, where
            np.testing.assert_array_equal(o, expected, err_msg=where)
        for r, (a, b) in enumerate(zip(arrays, before)):
            np.testing.assert_array_equal(a, b, err_msg=f"{algorithm} ranks={ranks} n={n}: input of rank {r} modified")


def _run(client, arrays, **kw):
    parts = scatter_ranks(client, arrays)
    futures = flowreduce.allreduce(client, parts, **kw)
    out = client.gather(futures)
    del futures
    return parts, out


def _run_many(client, calls):
    """Launch every ``(arrays, kwargs)`` call at once (concurrent all-reduces
    on one cluster, as users do), then gather all results in one round trip."""
    launched = [flowreduce.allreduce(client, scatter_ranks(client, arrays), **kw) for arrays, kw in calls]
    return client.gather(launched)


#: The front door's share of the matrix: every algorithm at a few rank counts.
CASES = {(a, p): [(n, c) for n in (0, 1, 1001) for c in (1, 3)] for a in ALGS for p in (1, 3, 5, 8)}


@pytest.mark.parametrize("algorithm,ranks", list(CASES), ids=[f"{a}-p{p}" for a, p in CASES])
def test_sum_through_the_front_door(inproc_client, algorithm, ranks):
    """The same sums through ``flowreduce.allreduce``, all calls at once on one cluster."""
    calls, expected = [], []
    for n, chunks in CASES[algorithm, ranks]:
        rng = np.random.default_rng(ranks * 10007 + n)
        arrays = [rng.integers(-1000, 1000, size=n) for _ in range(ranks)]
        calls.append((arrays, {"algorithm": algorithm, "chunks": chunks}))
        expected.append(functools.reduce(np.add, arrays))
    for (n, chunks), out, exp in zip(CASES[algorithm, ranks], _run_many(inproc_client, calls), expected):
        assert len(out) == ranks
        for r, o in enumerate(out):
            where = f"{algorithm} ranks={ranks} n={n} chunks={chunks} rank {r}"
            assert o.dtype == exp.dtype and o.shape == exp.shape, where
            np.testing.assert_array_equal(o, exp, err_msg=where)
    assert_clean(inproc_client)


def _maximum(a, b):  # a plain callable, not a ufunc: exercises the copying path
    return np.maximum(a, b)


INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
OPS_DTYPES = (
    [(op, dt) for dt in INTS + FLOATS + COMPLEX + ["bool"] for op in ["sum", "prod", "min", "max", "mean", _maximum]
     if not (op == "mean" and dt == "bool")]
    + [("logaddexp", dt) for dt in FLOATS] + [(np.bitwise_xor, dt) for dt in INTS + ["bool"]]
)
OPS_FAST = [(a, p) for a in ALGS for p in range(1, 9)]
OPS_DIRECT = list(range(1, 9))  # direct's own lowering (one chunk), ranks sharing 3 workers
OPS_CASES = [("butterfly", 3), ("ring", 5), ("auto", 4)]  # through the front door


def _opname(op):
    return op if isinstance(op, str) else op.__name__


def _reference(op, arrays):
    if op == "mean":
        return np.mean(np.stack(arrays), axis=0)
    if op in ("sum", "prod") and arrays[0].dtype == np.bool_:  # numpy counts booleans in int64
        return {"sum": np.sum, "prod": np.prod}[op](np.stack(arrays), axis=0)
    f = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}.get(op, op)
    f = getattr(np, f) if isinstance(f, str) else f
    return functools.reduce(f, arrays)


def _inputs(rng, dtype, p, n, op):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return [rng.integers(0, 2, size=n).astype(bool) for _ in range(p)]
    if op == "prod" and dt.kind in "fc":
        return [rng.uniform(0.5, 1.5, size=n).astype(dt) for _ in range(p)]
    if dt.kind in "iu":
        lo = 0 if dt.kind == "u" else -50
        return [rng.integers(lo, 50, size=n).astype(dt) for _ in range(p)]
    return [(rng.standard_normal(n) + (1j * rng.standard_normal(n) if dt.kind == "c" else 0)).astype(dt)
            for _ in range(p)]


def _check_op(out, expected, where, ranks):
    for r, o in enumerate(out):
        at = f"{where} rank {r}"
        assert o.dtype == expected.dtype, f"{at}: {o.dtype} != {expected.dtype}"
        if expected.dtype.kind in "iub":
            np.testing.assert_array_equal(o, expected, err_msg=at)
        else:
            tol = {2: 2e-2, 4: 1e-5, 8: 1e-12}[np.finfo(expected.dtype).bits // 8]
            np.testing.assert_allclose(o, expected, rtol=tol, atol=tol * ranks, err_msg=at)


@pytest.mark.parametrize("algorithm,ranks", OPS_FAST, ids=[f"{a}-p{p}" for a, p in OPS_FAST])
def test_ops_and_dtypes(algorithm, ranks):
    """sum/prod/min/max/mean, a ufunc by name and object, and a plain callable,
    over every numeric dtype; integers exact."""
    rng = np.random.default_rng(7)
    for op, dtype in OPS_DTYPES:
        arrays = _inputs(rng, dtype, ranks, 257, op)
        out = run_graph(arrays, algorithm, op=op, chunks=2)
        _check_op(out, _reference(op, arrays), f"{algorithm} ranks={ranks} n=257 {_opname(op)} {dtype}", ranks)


@pytest.mark.parametrize("ranks", OPS_DIRECT, ids=[f"direct-p{p}" for p in OPS_DIRECT])
def test_ops_and_dtypes_direct(ranks):
    """The same for the one-level ``direct`` lowering: its kernel sums in
    rank order (ranks sharing a worker summed once, copied per rank)."""
    rng = np.random.default_rng(7)
    workers = [f"w{r % 3}" for r in range(ranks)]
    for op, dtype in OPS_DTYPES:
        arrays = _inputs(rng, dtype, ranks, 257, op)
        out = run_graph(arrays, "direct", op=op, workers=workers)
        _check_op(out, _reference(op, arrays), f"direct ranks={ranks} n=257 {_opname(op)} {dtype}", ranks)


@pytest.mark.parametrize("algorithm,ranks", OPS_CASES, ids=[f"{a}-p{p}" for a, p in OPS_CASES])
def test_ops_and_dtypes_through_the_front_door(inproc_client, algorithm, ranks):
    rng = np.random.default_rng(7)
    inputs = [_inputs(rng, dtype, ranks, 257, op) for op, dtype in OPS_DTYPES]
    calls = [(arrays, {"algorithm": algorithm, "op": op, "chunks": 1})
             for arrays, (op, _) in zip(inputs, OPS_DTYPES)]
    for (op, dtype), arrays, out in zip(OPS_DTYPES, inputs, _run_many(inproc_client, calls)):
        _check_op(out, _reference(op, arrays), f"{algorithm} ranks={ranks} n=257 {_opname(op)} {dtype}", ranks)


def test_any_shape_reduced_elementwise(inproc_client):
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 9, size=(3, 5, 7)) for _ in range(4)]
    for alg in ["butterfly", "ring"]:
        _, out = _run(inproc_client, arrays, algorithm=alg, chunks=4)
        for o in out:
            assert o.shape == (3, 5, 7)
            np.testing.assert_array_equal(o, sum(arrays))


def test_non_contiguous_input(inproc_client):
    rng = np.random.default_rng(4)
    arrays = [rng.integers(0, 9, size=(40, 30))[:, ::3] for _ in range(3)]
    _, out = _run(inproc_client, arrays, algorithm="butterfly", chunks=3)
    for o in out:
        np.testing.assert_array_equal(o, sum(arrays))


PROC = [(a, p, c) for a in ALGS for p in (1, 3, 4, 6) for c in (1, 3)]


@pytest.mark.parametrize("algorithm,ranks,chunks", PROC, ids=[f"{a}-p{p}-c{c}" for a, p, c in PROC])
def test_multiprocess_subset_and_inputs_untouched(proc_client, algorithm, ranks, chunks):
    """Real transfers: results exact, and no rank's input was overwritten by
    in-place reduction (6 ranks on 4 workers: some share a worker)."""
    rng = np.random.default_rng(ranks)
    arrays = [rng.integers(-10**6, 10**6, size=10_001) for _ in range(ranks)]
    parts, out = _run(proc_client, arrays, algorithm=algorithm, chunks=chunks)
    for r, o in enumerate(out):
        np.testing.assert_array_equal(o, sum(arrays), err_msg=f"rank {r}")
    for r, (after, before) in enumerate(zip(proc_client.gather(parts), arrays)):
        np.testing.assert_array_equal(after, before, err_msg=f"input of rank {r} was modified")
    del parts
    assert_clean(proc_client)


def test_multiprocess_mean_float(proc_client):
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal(100_003) for _ in range(4)]
    _, out = _run(proc_client, arrays, algorithm="butterfly", op="mean", chunks=5)
    for o in out:
        np.testing.assert_allclose(o, np.mean(arrays, axis=0), rtol=1e-12, atol=1e-15)


def test_boolean_sum_counts_like_numpy_also_in_fused_pytrees(inproc_client):
    """``np.sum`` over the ranks counts booleans (int64), it is no logical OR:
    the same for a bool leaf fused into a bucket beside other tensors."""
    rng = np.random.default_rng(5)
    trees = [{"mask": rng.integers(0, 2, size=9).astype(bool), "w": rng.integers(0, 9, size=4)} for _ in range(3)]
    parts = [inproc_client.scatter([t], hash=False)[0] for t in trees]  # a future of the whole dict
    out = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, op="sum"))
    expected = np.sum(np.stack([t["mask"] for t in trees]), axis=0)
    for r, o in enumerate(out):
        assert o["mask"].dtype == expected.dtype, f"rank {r}: {o['mask'].dtype}"
        np.testing.assert_array_equal(o["mask"], expected, err_msg=f"rank {r}")
        np.testing.assert_array_equal(o["w"], sum(t["w"] for t in trees), err_msg=f"rank {r}")
