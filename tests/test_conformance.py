"""Numbers against numpy: every algorithm × ranks × lengths × chunks on an
in-process cluster, ops × dtypes, and a representative subset on a real
multi-process LocalCluster (where transfers copy and in-place reduction
into received buffers really happens)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import assert_clean, scatter_ranks

import flowreduce

ALGS = list(flowreduce.ALGORITHMS)  # every registered algorithm, and auto


def _lengths(p):
    return sorted({0, 1, max(p - 1, 0), 1000, 1001})


def _chunks(n):
    return [1, 3] + ([n + 2] if n < 10 else [])  # more chunks than elements on short vectors


CASES = {(a, p): [(n, c) for n in _lengths(p) for c in _chunks(n)] for a in ALGS for p in range(1, 9)}


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


@pytest.mark.parametrize("algorithm,ranks", list(CASES), ids=[f"{a}-p{p}" for a, p in CASES])
def test_sum_matrix(inproc_client, algorithm, ranks):
    """Every length {0, 1, ranks-1, 1000, 1001} x chunks {1, 3, more than elements}."""
    calls, expected = [], []
    for n, chunks in CASES[algorithm, ranks]:
        rng = np.random.default_rng(ranks * 10007 + n)
        arrays = [rng.integers(-1000, 1000, size=n) for _ in range(ranks)]
        calls.append((arrays, {"algorithm": algorithm, "chunks": chunks}))
        expected.append(functools.reduce(np.add, arrays))
    for (n, chunks), out, exp in zip(CASES[algorithm, ranks], _run_many(inproc_client, calls), expected):
        assert len(out) == ranks
        for r, o in enumerate(out):
            where = f"n={n} chunks={chunks} rank {r}"
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
OPS_CASES = [(a, p) for a in ALGS if a != "auto" for p in ([5] if a != "butterfly" else [3, 5])] + [("auto", 4)]


def _opname(op):
    return op if isinstance(op, str) else op.__name__


def _reference(op, arrays):
    if op == "mean":
        return np.mean(np.stack(arrays), axis=0)
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


@pytest.mark.parametrize("algorithm,ranks", OPS_CASES, ids=[f"{a}-p{p}" for a, p in OPS_CASES])
def test_ops_and_dtypes(inproc_client, algorithm, ranks):
    """sum/prod/min/max/mean, a ufunc by name and object, and a plain callable,
    over every numeric dtype; integers exact."""
    rng = np.random.default_rng(7)
    inputs = [_inputs(rng, dtype, ranks, 257, op) for op, dtype in OPS_DTYPES]
    calls = [(arrays, {"algorithm": algorithm, "op": op, "chunks": 1})
             for arrays, (op, _) in zip(inputs, OPS_DTYPES)]
    for (op, dtype), arrays, out in zip(OPS_DTYPES, inputs, _run_many(inproc_client, calls)):
        expected = _reference(op, arrays)
        for r, o in enumerate(out):
            where = f"{_opname(op)} {dtype} rank {r}"
            assert o.dtype == expected.dtype, f"{where}: {o.dtype} != {expected.dtype}"
            if expected.dtype.kind in "iub":
                np.testing.assert_array_equal(o, expected, err_msg=where)
            else:
                tol = {2: 2e-2, 4: 1e-5, 8: 1e-12}[np.finfo(expected.dtype).bits // 8]
                np.testing.assert_allclose(o, expected, rtol=tol, atol=tol * ranks, err_msg=where)


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
