"""Sparse plans, cost cards, the dense-switch rule, quantisation and the
kernels, without a cluster: against scipy/numpy references."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp
from dask.sizeof import sizeof

import flowreduce
from flowreduce.algorithms import SPARSE_ALGORITHMS
from flowreduce.algorithms.sparse import INT8_BUCKET, quantisation_bound, switch_density
from flowreduce.cost import choose_sparse
from flowreduce.kernels import blocks
from flowreduce.kernels import sparse as sparse_kernels
from flowreduce.kernels.sparse_payload import BlockPack, Encoded, Wire, decode_piece, encode_piece, quantize
from flowreduce.ops import resolve_op

# -- plans ---------------------------------------------------------------------------------

OPTIONS = {
    "sparse-recursive-doubling": [{}, {"radix": 3}, {"radix": 8}],
    "sparse-split-allgather": [{}, {"inner": "ring"}, {"radix": 4}],
    "block-sparse": [{}, {"aggregators": 1}, {"aggregators": 3}],
}
PLANS = [(a, p, o) for a in SPARSE_ALGORITHMS for p in range(1, 10) for o in OPTIONS[a]]


@pytest.mark.parametrize("algorithm,ranks,options", PLANS, ids=[f"{a}-p{p}-{o}" for a, p, o in PLANS])
def test_sparse_plans_are_complete(algorithm, ranks, options):
    flowreduce.plan(algorithm, ranks, **options).check()


@pytest.mark.parametrize("algorithm,dense", [("sparse-recursive-doubling", "recursive-doubling"),
                                             ("sparse-split-allgather", "butterfly")])
@pytest.mark.parametrize("ranks", [2, 5, 8])
def test_dense_data_costs_what_the_dense_plan_costs(algorithm, dense, ranks):
    """At density 1 every message is dense: the dense algorithm's card."""
    sparse = replace(flowreduce.plan(algorithm, ranks), density=(1.0,) * ranks, value_bytes=8)
    assert sparse.cost(8e6) == flowreduce.plan(dense, ranks).cost(8e6)


@pytest.mark.parametrize("algorithm", ["sparse-recursive-doubling", "sparse-split-allgather"])
def test_sparse_bytes_follow_density(algorithm):
    """Very sparse: the first messages carry d·(v+i) bytes per element; the
    card grows with density and never exceeds the dense card."""
    base = flowreduce.plan(algorithm, 4)
    cards = [replace(base, density=(d,) * 4, value_bytes=4).cost(4e6).bytes_on_wire
             for d in (1e-4, 1e-3, 1e-2, 0.1, 0.3, 1.0)]
    assert cards == sorted(cards)
    assert cards[-1] == base.cost(4e6).bytes_on_wire
    # recursive doubling, step 1: every rank sends its own k = d·n pairs of 8 bytes
    if algorithm == "sparse-recursive-doubling":
        tiny = replace(base, density=(1e-4,) * 4, value_bytes=4).cost(4e6)
        k = 1e-4 * 1e6
        first, second = 4 * k * 8, 4 * (1 - (1 - 1e-4) ** 2) * 1e6 * 8
        assert tiny.bytes_on_wire == pytest.approx(first + second)


def test_switch_density_is_the_byte_break_even():
    for itemsize in (4, 8):
        d = switch_density(itemsize)
        assert d * (itemsize + 4) == pytest.approx(itemsize)  # pairs cost what dense costs
    assert switch_density(4, "int8") < switch_density(4, "fp16") < switch_density(4)
    p = replace(flowreduce.plan("sparse-split-allgather", 4), value_bytes=4)
    assert p.threshold == pytest.approx(0.5)
    assert replace(p, delta=0.1).threshold == 0.1


def test_auto_rule_prefers_doubling_when_sparse_and_split_when_dense():
    """The documented rule: levels dominate tiny messages (recursive doubling
    has half the levels), bytes dominate big dense ones (split-allgather
    moves 2(p-1)/p·n instead of lg p·n)."""
    sparse = choose_sparse(8, 10**6, 4, [1e-5] * 8)
    dense = choose_sparse(8, 10**8, 4, [0.5] * 8)
    assert sparse.algorithm == "sparse-recursive-doubling"
    assert dense.algorithm == "sparse-split-allgather"
    model = flowreduce.CostModel()
    for chosen, d, n in ((sparse, 1e-5, 10**6), (dense, 0.5, 10**8)):
        for other in SPARSE_ALGORITHMS[:2]:
            alt = replace(flowreduce.plan(other, 8), density=(d,) * 8, value_bytes=4)
            assert model.predict(chosen, n * 4) <= model.predict(alt, n * 4)


def test_encodings_counts_each_quantisation_once():
    """p=2 recursive doubling: each rank's view is read by its partner
    (encoded, 2 encodings feed every result); the finals are not sent."""
    assert flowreduce.plan("sparse-recursive-doubling", 2).encodings() == 2
    # block-sparse: the p-1 packs sent to a co-located aggregator, and its sum
    assert [flowreduce.plan("block-sparse", p).encodings() for p in (2, 3, 8)] == [2, 3, 8]
    # separate aggregators: all p packs travel
    assert flowreduce.plan("block-sparse", 3, aggregators=2).encodings() == 4


def test_block_plan_puts_aggregators_on_their_own_ranks():
    plan = flowreduce.plan("block-sparse", 4, aggregators=2)
    aggs = [n for n in plan.nodes if n.phase == "aggregate"]
    assert sorted(n.rank for n in aggs) == [4, 5] and all(len(n.inputs) == 4 for n in aggs)
    card = plan.cost(4e6)
    # every rank sends its whole vector and receives it back; an aggregator handles p halves in and out
    assert card.bytes_on_wire == pytest.approx(2 * 4 * 4e6)
    assert card.max_rank_bytes == pytest.approx(2 * 4 * 2e6)


# -- the dense switch in the kernels ----------------------------------------------------------


def _spec(shape, fmt="csr", threshold=0.5, dtype="float64", **kw):
    return sparse_kernels.SegmentSpec(format=fmt, container="array", shape=shape, order="F" if fmt == "csc" else "C",
                                threshold=threshold, dtype=np.dtype(dtype).str, **kw)


def _piece(values):
    return sp.csr_array(np.asarray(values, dtype=float).reshape(1, -1))


@pytest.mark.parametrize("nnz,dense", [(0, False), (4, False), (5, True), (10, True)],
                         ids=["empty", "at-threshold", "above", "full"])
def test_pack_switches_above_threshold(nnz, dense):
    x = sp.csr_array(np.r_[np.arange(1, nnz + 1), np.zeros(10 - nnz)].reshape(1, 10))
    (piece,) = sparse_kernels.pack(x, 0, 10, _spec((1, 10), threshold=0.4), None)
    assert isinstance(piece, np.ndarray) == dense
    np.testing.assert_array_equal(decode_piece(piece) if dense else piece.toarray().ravel(), x.toarray().ravel())


def test_merge_switches_by_union_and_stays_dense():
    op = resolve_op("sum")
    spec = _spec((1, 10), threshold=0.5)
    a, b = _piece([1, 2, 3, 0, 0, 0, 0, 0, 0, 0]), _piece([0, 0, 0, 4, 5, 0, 0, 0, 0, 0])
    (u,) = sparse_kernels.merge(spec, op, 4, False, [(a,), (b,)], (((0, 0, 10),),) * 2, (False, False), None, False)
    assert not isinstance(u, np.ndarray) and u.nnz == 5  # 5 of 10 is not above 0.5
    c = _piece([0, 0, 0, 0, 0, 6, 0, 0, 0, 0])
    (v,) = sparse_kernels.merge(spec, op, 4, False, [(u,), (c,)], (((0, 0, 10),),) * 2, (False, False), None, False)
    assert isinstance(v, np.ndarray)  # 6 of 10
    empty = _piece(np.zeros(10))
    (w,) = sparse_kernels.merge(spec, op, 4, False, [(v,), (empty,)], (((0, 0, 10),),) * 2, (False, False), None, False)
    assert isinstance(w, np.ndarray)  # once dense, dense
    np.testing.assert_array_equal(w, [1, 2, 3, 4, 5, 6, 0, 0, 0, 0])
    assert v is not w


FORMATS = ["csr", "csc", "coo"]


PACK_CASES = [(f, s) for f in FORMATS for s in [(7, 9), (1, 40), (40,)] if not (f == "csc" and len(s) == 1)]


@pytest.mark.parametrize("fmt,shape", PACK_CASES, ids=[f"{f}-{'x'.join(map(str, s))}" for f, s in PACK_CASES])
def test_pack_selects_the_index_range(fmt, shape):
    """Every format's entries of a range of the index space (scipy has no 1-D CSC)."""
    rng = np.random.default_rng(1)
    dense = np.where(rng.random(shape) < 0.3, rng.integers(1, 9, shape), 0)
    x = sp.coo_array(dense).asformat(fmt)
    if fmt == "coo" and x.nnz > 2:  # unsorted entries with a duplicate: COO semantics add them
        x = sp.coo_array((np.r_[x.data[::-1], 1], tuple(np.r_[c[::-1], c[0]] for c in x.coords)), shape=shape)
    elif x.nnz > 2:  # a non-canonical CSR/CSC: a row's entries reversed, its first repeated
        j = int(np.flatnonzero(np.diff(x.indptr) > 0)[0])
        a, b = x.indptr[j], x.indptr[j + 1]
        indices = np.r_[x.indices[:a], x.indices[a:b][::-1], x.indices[a], x.indices[b:]]
        data = np.r_[x.data[:a], x.data[a:b][::-1], 1, x.data[b:]]
        indptr = np.r_[x.indptr[:j + 1], x.indptr[j + 1:] + 1]
        x = type(x)((data, indices, indptr), shape=shape)
        assert not x.has_canonical_format
    before = x.copy()
    order = "F" if fmt == "csc" else "C"
    flat = x.toarray().reshape(-1, order=order)
    n = flat.size
    for start, stop in [(0, n), (0, 5), (3, 17), (n - 4, n), (5, 5)]:
        (piece,) = sparse_kernels.pack(x, start, stop, _spec(shape, fmt, threshold=1.0), None)
        got = piece if isinstance(piece, np.ndarray) else piece.toarray().ravel()
        np.testing.assert_array_equal(got, flat[start:stop], err_msg=f"[{start}, {stop})")
    for a, b in zip((x.data, x.coords if fmt == "coo" else x.indices), (before.data, before.coords if fmt == "coo"
                                                                        else before.indices)):
        np.testing.assert_array_equal(a, b, err_msg="the input was modified")


@pytest.mark.parametrize("container", ["array", "matrix"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_output_rebuilds_the_format(fmt, container):
    rng = np.random.default_rng(2)
    dense = np.where(rng.random((6, 5)) < 0.4, rng.standard_normal((6, 5)), 0)
    order = "F" if fmt == "csc" else "C"
    flat = dense.reshape(-1, order=order)
    pieces = (sp.csr_array(flat[:13].reshape(1, -1)), flat[13:20].copy(), sp.csr_array(flat[20:].reshape(1, -1)))
    spec = replace(_spec((6, 5), fmt), container=container)
    out = sparse_kernels.output(spec, [pieces[:2], pieces[2:]])
    assert out.format == fmt and isinstance(out, sp.sparray) == (container == "array")
    np.testing.assert_array_equal(out.toarray(), dense)
    np.testing.assert_array_equal(sparse_kernels.output(replace(spec, dense_output=True), [pieces]), dense)


@pytest.mark.parametrize("op", ["max", "min", "prod", "mean"])
def test_merge_ops_keep_implicit_zeros(op):
    rng = np.random.default_rng(3)
    mats = [sp.csr_array(np.where(rng.random((1, 30)) < 0.5, rng.standard_normal((1, 30)), 0)) for _ in range(3)]
    mats.append(sp.csr_array(np.ones((1, 30))).toarray().ravel() * 0.5)  # a dense input too
    o = resolve_op(op)
    (got,) = sparse_kernels.merge(_spec((1, 30), threshold=1.0), o, 4, True, [(m,) for m in mats],
                            (((0, 0, 30),),) * 4, (False,) * 4, None, False)
    dense = [m if isinstance(m, np.ndarray) else m.toarray().ravel() for m in mats]
    ref = {"max": np.maximum, "min": np.minimum, "prod": np.multiply, "mean": np.add}[op]
    expected = functools.reduce(ref, dense) / (4 if op == "mean" else 1)
    np.testing.assert_allclose(got, expected)


# -- quantisation --------------------------------------------------------------------------------


def test_int8_errs_less_than_one_scale_and_is_unbiased():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(10 * INT8_BUCKET + 7) * np.repeat(rng.uniform(0.1, 100, 11), INT8_BUCKET)[:10 * 512 + 7]
    q = quantize(x, Wire("int8", (1,)))
    assert q.codes.dtype == np.int8 and q.scales.size == 11
    scale = np.repeat(np.maximum.reduceat(np.abs(x), np.arange(0, x.size, INT8_BUCKET)) / 127, INT8_BUCKET)[:x.size]
    err = q.decode() - x
    assert np.all(np.abs(err) < scale * (1 + 1e-6))
    runs = np.mean([quantize(x, Wire("int8", (s,))).decode() for s in range(200)], axis=0)
    assert np.abs(runs - x).mean() < 0.1 * scale.mean()  # stochastic rounding: no bias
    np.testing.assert_array_equal(quantize(x, Wire("int8", (1,))).codes, q.codes)  # the seed fixes it


def test_fp16_bound_and_overflow():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000) * 1e3
    err = np.abs(quantize(x, Wire("fp16")).decode() - x)
    assert np.all(err <= quantisation_bound("fp16", 1, np.abs(x)))
    with pytest.raises(OverflowError, match="exceeds float16's range"):
        quantize(np.array([1e6]), Wire("fp16"))


def test_encoded_pieces_travel_smaller_and_decode():
    piece = sp.csr_array(np.r_[np.zeros(500), np.arange(1, 501, dtype=float)].reshape(1, -1))
    enc = encode_piece(piece, Wire("fp16"))
    assert isinstance(enc, Encoded) and encode_piece(enc, Wire("int8")) is enc  # forwarding keeps it
    assert sizeof(enc) < sizeof(piece)
    np.testing.assert_allclose(decode_piece(enc).toarray(), piece.toarray(), rtol=2**-11)


def test_sizeof_counts_the_buffers():
    x = sp.csr_array(sp.random(100, 100, density=0.1, format="csr", random_state=0))
    buffers = x.data.nbytes + x.indices.nbytes + x.indptr.nbytes
    assert buffers <= sizeof(x) <= buffers + 1024
    pack = BlockPack(8, np.arange(3, dtype=np.int32), np.ones((3, 256), np.float32))
    assert sizeof(pack) == 64 + 12 + 3 * 256 * 4


# -- blocks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,block", [(1000, 16), (1024, 256), (100, 256), (7, 3)])
def test_nonzero_blocks_match_numpy(n, block):
    rng = np.random.default_rng(n)
    x = np.where(rng.random(n) < 0.02, rng.standard_normal(n), 0.0).astype(np.float32)
    x[1] = -0.0  # a negative zero travels (harmless) but never hides a non-zero
    nb = -(-n // block)
    padded = np.zeros(nb * block, np.float32)
    padded[:n] = x
    expected = np.abs(padded.reshape(nb, block)).max(axis=1) > 0
    got = blocks.nonzero_blocks(x, block, nb)
    np.testing.assert_array_equal(got[1:], expected[1:])
    assert got[0] >= expected[0]  # block 0 holds the negative zero


@pytest.mark.parametrize("pattern", ["zero", "one", "disjoint", "identical", "dense", "mixed"])
def test_block_pack_aggregate_unpack(pattern):
    rng = np.random.default_rng(6)
    n, block, p = 1000, 16, 3
    nb = -(-n // block)
    masks = {
        "zero": [np.zeros(nb, bool)] * p,
        "one": [np.eye(1, nb, 5, dtype=bool)[0]] + [np.zeros(nb, bool)] * (p - 1),
        "disjoint": [np.arange(nb) % p == r for r in range(p)],
        "identical": [np.arange(nb) % 4 == 0] * p,
        "dense": [np.ones(nb, bool)] * p,
        "mixed": [np.ones(nb, bool), rng.random(nb) < 0.3, np.zeros(nb, bool)],
    }[pattern]
    xs = [np.where(np.repeat(m, block)[:n], rng.integers(1, 9, n), 0) for m in masks]
    spec = blocks.BlockSpec(block=block, size=n, shape=(n,), dtype=np.dtype(int).str)
    packs = [blocks.pack(x, 0, nb, spec, None) for x in xs]
    for m, (pk,) in zip(masks, packs):
        assert pk.full == m.all() and (pk.full or np.array_equal(pk.ids, np.flatnonzero(m)))
    out = blocks.aggregate(spec, resolve_op("sum"), p, True, packs, None, (False,) * p, None, True)
    np.testing.assert_array_equal(out, sum(xs))
    for x in xs:
        assert x.any() or not blocks.nonzero_blocks(x, block, nb).any()
