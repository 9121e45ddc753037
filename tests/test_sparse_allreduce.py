"""Sparse all-reduce of scipy.sparse inputs against scipy: every sparse
algorithm × ranks 1..8 × densities × formats × dtypes on an in-process
cluster (integers exact), ops, options, errors, quantisation, and a real
multi-process subset."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import scipy.sparse as sp
from utils import assert_clean, error_of, scatter_ranks, transfer_bytes

import flowreduce
from flowreduce.algorithms.sparse import quantisation_bound

ALGS = [("sparse-recursive-doubling", {}), ("sparse-split-allgather", {}),
        ("sparse-split-allgather", {"inner": "ring"})]
DENSITIES = ["empty", "one", "disjoint", "identical", "dense"]
# (format, container, ndim): scipy has no 1-D CSC and no 1-D matrices
FORMATS = [("csr", "array", 2), ("csc", "array", 2), ("coo", "array", 2), ("csr", "matrix", 2),
           ("csc", "matrix", 2), ("coo", "array", 1), ("csr", "array", 1)]
DTYPES = ["int64", "int32", "int8", "uint16", "float64", "float32", "complex128"]


def _name(alg, opts):
    return alg + ("-" + "-".join(map(str, opts.values())) if opts else "")


def sparse_of(dense, fmt, container):
    cls = {"array": sp.coo_array, "matrix": sp.coo_matrix}[container]
    return cls(dense).asformat(fmt)


def make_dense(p, density, ndim, dtype, rng):
    shape = (7, 9) if ndim == 2 else (50,)
    n = int(np.prod(shape))
    masks = {
        "empty": [np.zeros(n, bool)] * p,
        "one": [np.zeros(n, bool)] * (p - 1) + [np.arange(n) == rng.integers(n)],
        "disjoint": [np.arange(n) % (p + 1) == r for r in range(p)],  # and some elements nobody has
        "identical": [rng.random(n) < 0.3] * p,
        "dense": [np.ones(n, bool)] * p,
    }[density]
    return [np.where(m, rng.integers(1, 10, n), 0).astype(dtype).reshape(shape) for m in masks]


def scipy_sum(mats):
    return functools.reduce(lambda a, b: a + b, mats)


def scatter_many(client, calls):
    """Rank r's input of every call on worker r mod W, one scatter per worker."""
    ws = sorted(client.nthreads())
    by_worker: dict[str, list] = {}
    for c, (inputs, _) in enumerate(calls):
        for r, x in enumerate(inputs):
            by_worker.setdefault(ws[r % len(ws)], []).append((c, r, x))
    futures: dict[tuple, object] = {}
    for w, items in by_worker.items():
        for (c, r, _), f in zip(items, client.scatter([x for _, _, x in items], workers=[w], hash=False)):
            futures[c, r] = f
    return [[futures[c, r] for r in range(len(inputs))] for c, (inputs, _) in enumerate(calls)]


def _launch_many(client, calls):
    """Every call launched at once (concurrent all-reduces), gathered in one round trip."""
    parts = scatter_many(client, calls)
    return client.gather([flowreduce.allreduce(client, ps, **kw) for ps, (_, kw) in zip(parts, calls)])


# the ring (split-allgather's other inner pattern, 3p² tasks) on a few rank counts
MATRIX = [(a, o, p) for a, o in ALGS for p in (range(1, 9) if not o else (2, 3, 5, 7))]


def _cases(ranks):
    """Every density with two formats and a dtype that rotate with ``ranks``,
    so that over ranks 1..8 each density meets every format and dtype."""
    for i, density in enumerate(DENSITIES):
        for j in range(2):
            k = 2 * i + j + ranks
            yield density, FORMATS[k % len(FORMATS)], DTYPES[(k + ranks // 3) % len(DTYPES)]


@pytest.mark.parametrize("algorithm,options,ranks", MATRIX, ids=[f"{_name(a, o)}-p{p}" for a, o, p in MATRIX])
def test_sparse_sum_matrix(inproc_client, algorithm, options, ranks):
    """Densities {empty, one non-zero, disjoint, identical, fully dense} ×
    formats {CSR, CSC, COO} × {array, matrix} × {1-D, 2-D} × dtypes (rotating
    over the rank counts): same format, class and dtype as scipy's sum, and
    its values (integers exact)."""
    rng = np.random.default_rng(ranks)
    cases, calls = [], []
    for density, (fmt, container, ndim), dtype in _cases(ranks):
        mats = [sparse_of(x, fmt, container) for x in make_dense(ranks, density, ndim, dtype, rng)]
        cases.append((density, fmt, container, ndim, dtype, mats))
        calls.append((mats, {"algorithm": algorithm, **options}))
    for (density, fmt, container, ndim, dtype, mats), out in zip(cases, _launch_many(inproc_client, calls)):
        expected = scipy_sum(mats)
        for r, o in enumerate(out):
            where = f"{density} {fmt} {container} {ndim}-D {dtype} rank {r}"
            assert type(o) is type(mats[0]) and o.format == fmt, f"{where}: got {type(o).__name__} {o.format}"
            assert o.shape == expected.shape and o.dtype == expected.dtype, f"{where}: {o.shape} {o.dtype}"
            np.testing.assert_array_equal(o.toarray(), expected.toarray(), err_msg=where)
    assert_clean(inproc_client)


OPS = ["mean", "max", "min", "prod"]


def _scipy_reduce(op, mats):
    if op == "mean":
        return scipy_sum([m.astype(np.float64) if m.dtype.kind in "iu" else m for m in mats]) / len(mats)
    f = {"max": lambda a, b: a.maximum(b), "min": lambda a, b: a.minimum(b),
         "prod": lambda a, b: a.multiply(b)}[op]
    return functools.reduce(f, mats)


@pytest.mark.parametrize("algorithm", ["sparse-recursive-doubling", "sparse-split-allgather"])
def test_sparse_ops(inproc_client, algorithm):
    """mean (integers: float64, as np.mean), max/min/prod with implicit zeros
    taking part, on 5 ranks, sparse and dense-switched data."""
    rng = np.random.default_rng(9)
    cases, calls = [], []
    for op in OPS:
        for dtype in ("int32", "float64"):
            for frac in (0.2, 0.9):
                dense = [np.where(rng.random((6, 8)) < frac, rng.integers(-9, 10, (6, 8)), 0).astype(dtype)
                         for _ in range(5)]
                mats = [sp.csr_array(x) for x in dense]
                cases.append((op, dtype, frac, mats))
                calls.append((mats, {"algorithm": algorithm, "op": op}))
    for (op, dtype, frac, mats), out in zip(cases, _launch_many(inproc_client, calls)):
        expected = _scipy_reduce(op, mats)
        for o in out:
            where = f"{op} {dtype} density {frac}"
            assert o.dtype == expected.dtype, where
            np.testing.assert_allclose(o.toarray(), expected.toarray(), rtol=1e-12, err_msg=where)


@pytest.mark.parametrize("output", ["dense", "csr", "csc", "coo"])
def test_output_format_on_request(inproc_client, output):
    rng = np.random.default_rng(10)
    dense = [np.where(rng.random((5, 6)) < 0.3, rng.integers(1, 9, (5, 6)), 0) for _ in range(3)]
    parts = scatter_ranks(inproc_client, [sp.coo_array(x) for x in dense])
    out = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, algorithm="auto", output=output))
    for o in out:
        if output == "dense":
            assert isinstance(o, np.ndarray)
            np.testing.assert_array_equal(o, sum(dense))
        else:
            assert o.format == output
            np.testing.assert_array_equal(o.toarray(), sum(dense))


@pytest.mark.parametrize("algorithm", ["sparse-recursive-doubling", "sparse-split-allgather"])
def test_chunks_and_delta(inproc_client, algorithm):
    """Chunked pipelines and any dense-switch threshold give the same sums."""
    rng = np.random.default_rng(11)
    dense = [np.where(rng.random(300) < 0.3, rng.integers(1, 9, 300), 0) for _ in range(6)]
    mats = [sp.csr_array(x) for x in dense]
    kws = [{"chunks": 3}, {"chunks": 5, "delta": 0.0}, {"delta": 1.0}, {"delta": 0.05}]
    outs = _launch_many(inproc_client, [(mats, {"algorithm": algorithm, **kw}) for kw in kws])
    for kw, out in zip(kws, outs):
        for o in out:
            np.testing.assert_array_equal(o.toarray(), sum(dense), err_msg=str(kw))


def test_auto_says_what_ran(inproc_client):
    mats = [sp.random_array((1, 10**5), density=1e-4, format="csr", random_state=r) for r in range(4)]
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, mats))
    info = flowreduce.describe(out)
    assert info.algorithm in flowreduce.SPARSE_ALGORITHMS
    assert info.plan.density == pytest.approx(tuple(m.nnz / 1e5 for m in mats))
    assert 0 < info.bytes_on_wire < info.plan.cost(info.nbytes).messages * info.nbytes
    np.testing.assert_allclose(inproc_client.gather(out)[0].toarray(), scipy_sum(mats).toarray())


# -- quantisation ------------------------------------------------------------------------------

QUANT = [(a, c, p) for a in ("sparse-recursive-doubling", "sparse-split-allgather") for c in ("fp16", "int8")
         for p in (3, 4)]


@pytest.mark.parametrize("algorithm,codec,ranks", QUANT, ids=[f"{a}-{c}-p{p}" for a, c, p in QUANT])
def test_quantised_within_documented_bound(inproc_client, algorithm, codec, ranks):
    """Every element within quantisation_bound(codec, plan.encodings(), ...)
    of the exact sum, at a fixed seed; and not exact (the values did travel
    quantised)."""
    rng = np.random.default_rng(12)
    dense = [np.where(rng.random(4000) < 0.4, rng.standard_normal(4000) * 10, 0) for _ in range(ranks)]
    mats = [sp.csr_array(x) for x in dense]
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, mats), algorithm=algorithm,
                               compression=codec, seed=7)
    plan = flowreduce.describe(out).plan
    magnitude = np.sum(np.abs(dense), axis=0)
    bound = quantisation_bound(codec, plan.encodings(), magnitude if codec == "fp16" else magnitude.max())
    exact = np.sum(dense, axis=0)
    for o in inproc_client.gather(out):
        err = np.abs(o.toarray() - exact)
        assert np.all(err <= bound * (1 + 1e-6) + 1e-12), f"worst {err.max()} > {np.max(bound)}"
        assert err.max() > 0


# -- errors ---------------------------------------------------------------------------------------


def test_mixing_sparse_and_dense_names_the_ranks(inproc_client):
    parts = scatter_ranks(inproc_client, [sp.csr_array(np.eye(3)), np.eye(3), sp.csr_array(np.eye(3)), np.eye(3)])
    e = error_of(lambda: flowreduce.allreduce(inproc_client, parts))
    assert isinstance(e, TypeError) and re.search(r"not a mix: ranks \[0, 2\] hold scipy.sparse; ranks \[1, 3\] "
                                                  r"hold numpy", str(e)), repr(e)
    e = error_of(lambda: flowreduce.allreduce(inproc_client, parts, algorithm="block-sparse"))
    assert isinstance(e, TypeError) and re.search(r"ranks \[0, 2\] hold", str(e)), repr(e)
    e = None
    parts = None
    assert_clean(inproc_client)


@pytest.mark.parametrize("inputs,kw,error,match", [
    ([sp.csr_array(np.eye(3)), sp.csc_array(np.eye(3))], {}, ValueError, r"disagree on format: ranks \[0\]: csr; ranks \[1\]: csc"),
    ([sp.csr_array(np.eye(3)), sp.csr_matrix(np.eye(3))], {}, ValueError, r"disagree on container: .*sparse matrixs|disagree on container"),
    ([sp.csr_array(np.eye(3)), sp.csr_array(np.eye(4))], {}, ValueError, r"disagree on shape: ranks \[0\]: \(3, 3\); ranks \[1\]: \(4, 4\)"),
    ([sp.csr_array(np.eye(3)), sp.csr_array(np.eye(3, dtype=np.float32))], {}, ValueError, r"disagree on dtype: .*ranks \[1\]: float32"),
    ([sp.lil_array(np.eye(3))] * 2, {}, TypeError, r"formats csr, csc, coo; ranks \[0, 1\] hold lil"),
    ([sp.csr_array(np.eye(3))] * 2, {"algorithm": "butterfly"}, ValueError, "need a sparse algorithm, not 'butterfly'"),
    ([np.eye(3)] * 2, {"algorithm": "sparse-split-allgather"}, TypeError, r"need scipy.sparse inputs; ranks \[0, 1\] hold numpy"),
    ([sp.csr_array(np.eye(3))] * 2, {"op": "logaddexp"}, ValueError, "supports ops sum, mean, max, min, prod; got 'logaddexp'"),
    ([sp.csr_array(np.eye(3, dtype=int))] * 2, {"compression": "int8"}, TypeError, "quantises floating-point values"),
    ([sp.csr_array(np.eye(3))] * 2, {"compression": "int4"}, ValueError, "compression must be one of"),
    ([sp.csr_array(np.eye(3))] * 2, {"delta": 2}, ValueError, r"delta is a density in \[0, 1\]"),
    ([sp.csr_array(np.eye(3))] * 2, {"output": "lil"}, ValueError, "output must be one of"),
    ([sp.csr_array(np.eye(3))] * 2, {"radix": 2}, ValueError, "need a named algorithm, not 'auto'"),
], ids=["format", "container", "shape", "dtype", "lil", "dense-algorithm", "dense-inputs", "op", "int-compression",
        "codec", "delta", "output", "auto-options"])
def test_bad_sparse_calls(inproc_client, inputs, kw, error, match):
    parts = scatter_ranks(inproc_client, inputs)
    e = error_of(lambda: flowreduce.allreduce(inproc_client, parts, **kw))  # from the call, or its results
    assert isinstance(e, error) and re.search(match, str(e)), repr(e)
    parts = e = None
    assert_clean(inproc_client)


# -- real transfers ------------------------------------------------------------------------------

PROC = [("sparse-recursive-doubling", 3, "csr"), ("sparse-recursive-doubling", 6, "coo"),
        ("sparse-split-allgather", 4, "csc"), ("sparse-split-allgather", 5, "csr"), ("auto", 4, "coo")]


@pytest.mark.parametrize("algorithm,ranks,fmt", PROC, ids=[f"{a}-p{p}-{f}" for a, p, f in PROC])
def test_multiprocess_sparse_and_inputs_untouched(proc_client, algorithm, ranks, fmt):
    """Real transfers (pickled scipy arrays, in-place accumulation into
    received dense buffers after the switch): exact, inputs unchanged."""
    rng = np.random.default_rng(ranks)
    dense = [np.where(rng.random((40, 50)) < frac, rng.integers(-10**6, 10**6, (40, 50)), 0)
             for frac in np.linspace(0.05, 0.6, ranks)]
    mats = [sparse_of(x, fmt, "array") for x in dense]
    parts = scatter_ranks(proc_client, mats)
    out = proc_client.gather(flowreduce.allreduce(proc_client, parts, algorithm=algorithm, delta=0.3))
    for r, o in enumerate(out):
        assert o.format == fmt
        np.testing.assert_array_equal(o.toarray(), sum(dense), err_msg=f"rank {r}")
    for r, (after, before) in enumerate(zip(proc_client.gather(parts), dense)):
        np.testing.assert_array_equal(after.toarray(), before, err_msg=f"input of rank {r} was modified")
    del parts, out
    assert_clean(proc_client)


# -- the dense switch and the bytes, traced on real transfers ----------------------------------------

SLACK = 512  # dask's sizeof around a payload: tuple, scipy's indptr and attributes


def test_dense_switch_where_the_byte_rule_says(proc_client):
    """p=4 recursive doubling, float32 with int32 indices (break-even 0.5):
    ranks 0, 1, 2, 3 hold disjoint 30%, 30%, 30%, 10% of the elements. Step 1
    sends every pack sparse; the unions of step 1 hold 60% (ranks 0, 1) and
    40% (ranks 2, 3), so step 2 sends 0 and 1 dense, 2 and 3 sparse; with
    delta=0.7 all of them sparse. Asserted on the traced bytes of each message,
    and the trace's total is the call's bytes moved."""
    n = 100_000
    digit = np.arange(n) % 10
    owned = [digit < 3, (digit >= 3) & (digit < 6), (digit >= 6) & (digit < 9), digit == 9]
    dense = [np.where(m, np.arange(n) + 1, 0).astype(np.float32) for m in owned]
    mats = [sp.csr_array(x) for x in dense]
    parts = scatter_ranks(proc_client, mats)
    nnz = {("compact", r): int(m.sum()) for r, m in enumerate(owned)}
    for r in range(4):  # what rank r holds after step 1: its pair's union
        nnz[("exchange", r)] = int((owned[r] | owned[r ^ 1]).sum())
    with flowreduce.trace(proc_client) as tr:
        calls = {d: flowreduce.allreduce(proc_client, parts, algorithm="sparse-recursive-doubling", delta=d)
                 for d in (None, 0.7)}
        results = proc_client.gather(calls)
    for d, out in results.items():
        for o in out:
            np.testing.assert_array_equal(o.toarray(), sum(dense))
        token = flowreduce.describe(calls[d]).token
        got = transfer_bytes(tr, token)
        threshold = 0.5 if d is None else d
        assert len(got) == 8  # 4 packs, 4 step-1 unions
        for (key, _), b in got.items():
            k = flowreduce.keys.parse(key)
            count = nnz[(k["phase"], k["rank"])]
            expected = count * 8 if count <= threshold * n else n * 4
            assert expected <= b <= expected + SLACK, (d, k["phase"], k["rank"], b, expected)
        summary = flowreduce.tracing.summarize(tr, token)
        assert summary.bytes_moved == sum(got.values())
    del parts, calls
    assert_clean(proc_client)


def _expected_pieces(plan, owned, threshold, value_bytes=4, index_bytes=4):
    """Node id -> the pieces of every node's value, each ``(range, dense,
    bytes)``, by the byte rule alone (no kernel code): a pack or merge over
    ``W`` elements holding the union ``U`` of its ranks' non-zeros is one
    piece, dense iff ``|U| > threshold·W`` (or ``|U| = W``) or an input is
    dense, and then costs ``v·W``, else ``(v + i)·|U|``; a gather forwards
    its inputs' pieces as they are."""
    from flowreduce.algorithms.ir import GATHER, VIEW

    seg = owned[0].size // plan.segments
    ranks_of, out = {}, {}
    for node in plan.nodes:
        if node.kind == GATHER:
            out[node.id] = [piece for i in node.inputs for piece in out[i]]
            continue
        lo, hi = node.lo * seg, node.hi * seg
        ranks_of[node.id] = ({node.rank} if node.kind == VIEW
                             else set().union(*(ranks_of[i] for i in node.inputs)))
        nnz = int(np.logical_or.reduce([owned[r][lo:hi] for r in ranks_of[node.id]]).sum())
        width, label = hi - lo, "ABCD"[node.lo:node.hi]
        dense = nnz > threshold * width or nnz == width or any(d for i in node.inputs for _, d, _ in out[i])
        out[node.id] = [(label, True, value_bytes * width) if dense
                        else (label, False, (value_bytes + index_bytes) * nnz)]
    return out


def test_split_allgather_dense_switch_where_the_byte_rule_says(proc_client):
    """p=4 split-allgather (butterfly, radix 2), float32 with int32 indices
    (break-even 0.5), ranges A B C D of the index space. Ranks hold disjoint
    20% of A and C each and 10% of B and D each: every pack (a half, 15%)
    and every step-1 merge (a pair's union: 40% of A, 20% of B) is sparse;
    the fully reduced ranges A and C (80%) are dense, B and D (40%) sparse,
    so the all-gather sends A and C dense and B and D sparse. delta=0.3
    moves the switch one step earlier for A and C (their pair unions, 40%)
    and makes B and D dense once fully reduced (40%); delta=0.9 keeps
    everything sparse. Asserted per message on the traced bytes (each
    message: its pieces' bytes, plus framing), and the trace's total is the
    call's bytes moved."""
    n, p = 100_000, 4
    digit = np.arange(n) % 20
    in_ac = (np.arange(n) // (n // p)) % 2 == 0  # ranges A and C
    owned = [np.where(in_ac, (digit >= 4 * r) & (digit < 4 * r + 4), (digit >= 4 * r) & (digit < 4 * r + 2))
             for r in range(p)]
    dense = [np.where(m, np.arange(n) + 1, 0).astype(np.float32) for m in owned]
    parts = scatter_ranks(proc_client, [sp.csr_array(x) for x in dense])
    # the pieces the byte rule makes dense: (key phase, step, range); all others travel sparse
    rs, ag = "reduce-scatter", "all-gather"
    want_dense = {
        None: {(rs, 2, "A"), (rs, 2, "C"), (ag, 3, "A"), (ag, 3, "C")},
        0.3: {(rs, 1, "A"), (rs, 1, "C"), *((rs, 2, x) for x in "ABCD"), *((ag, 3, x) for x in "ABCD")},
        0.9: set(),
    }
    with flowreduce.trace(proc_client) as tr:
        calls = {d: flowreduce.allreduce(proc_client, parts, algorithm="sparse-split-allgather", delta=d)
                 for d in want_dense}
        results = proc_client.gather(calls)
    for d, out in results.items():
        for o in out:
            np.testing.assert_array_equal(o.toarray(), sum(dense))
        info = flowreduce.describe(calls[d])
        plan = info.plan
        assert (plan.algorithm, plan.segments) == ("sparse-split-allgather", p)
        assert plan.threshold == (0.5 if d is None else d)
        expected = _expected_pieces(plan, owned, plan.threshold)
        got = transfer_bytes(tr, info.token)
        assert len(got) == len(plan.transfers()) == 16  # packs, step-1 merges, reduced ranges, gathers: 4 each
        dense_seen, sparse_seen = set(), set()
        for (key, _), b in got.items():
            k = flowreduce.keys.parse(key)
            pieces = expected[k["node"]]
            for label, is_dense, _ in pieces:
                (dense_seen if is_dense else sparse_seen).add((k["phase"], k["step"], label))
            nbytes = sum(x for _, _, x in pieces)
            assert nbytes <= b <= nbytes + len(pieces) * SLACK, (d, k["phase"], k["step"], k["rank"], b,
                                                                 nbytes)
        assert dense_seen == want_dense[d], d
        assert not dense_seen & sparse_seen
        assert flowreduce.tracing.summarize(tr, info.token).bytes_moved == sum(got.values())
    del parts, calls
    assert_clean(proc_client)
