"""Block-sparse all-reduce (OmniReduce) of dense numpy inputs against numpy:
ranks 1..8 × zero-block patterns × lengths and block sizes × chunks × dtypes
in process; on real transfers, the bytes moved are exactly the blocks that
are non-zero somewhere; aggregators on workers with the ``aggregator``
resource; quantisation within its bound."""

from __future__ import annotations

import ast

import numpy as np
import pytest
from distributed import Client, Scheduler, SpecCluster, Worker
from utils import assert_clean, scatter_ranks, transfer_bytes

import flowreduce
from flowreduce import keys as keymod
from flowreduce.algorithms.sparse import quantisation_bound

PATTERNS = ["zero", "one", "disjoint", "identical", "random", "dense"]
# (shape, block, chunks): short last block, fewer elements than a block, more chunks than blocks
GEOMETRY = [((1000,), 16, 1), ((25, 40), 16, 3), ((4096,), 256, 1), ((100,), 256, 1), ((7,), 3, 4)]
DTYPES = ["int64", "int32", "int16", "uint8", "float64", "complex64"]
SLACK = 256  # dask's sizeof of a one-item tuple around a payload


def block_masks(p, nblocks, pattern, rng):
    return {
        "zero": [np.zeros(nblocks, bool)] * p,
        "one": [np.zeros(nblocks, bool)] * (p - 1) + [np.arange(nblocks) == rng.integers(nblocks)],
        "disjoint": [np.arange(nblocks) % (p + 1) == r for r in range(p)],
        "identical": [rng.random(nblocks) < 0.3] * p,
        "random": [rng.random(nblocks) < 0.3 for _ in range(p)],
        "dense": [np.ones(nblocks, bool)] * p,
    }[pattern]


def make_inputs(p, shape, block, pattern, dtype, rng):
    n = int(np.prod(shape))
    nblocks = -(-n // block)
    out = []
    for m in block_masks(p, nblocks, pattern, rng):
        keep = np.repeat(m, block)[:n]
        out.append(np.where(keep, rng.integers(1, 10, n), 0).astype(dtype).reshape(shape))
    return out


def _launch_many(client, calls):
    launched = [flowreduce.allreduce(client, scatter_ranks(client, xs), **kw) for xs, kw in calls]
    return client.gather(launched)


@pytest.mark.parametrize("ranks", range(1, 9))
def test_block_sparse_matrix(inproc_client, ranks):
    """Every pattern × two geometries × a dtype, rotating with ``ranks`` so that
    over ranks 1..8 every pattern meets every geometry: numpy's sum, exactly."""
    rng = np.random.default_rng(ranks)
    cases, calls = [], []
    for i, pattern in enumerate(PATTERNS):
        for j in range(2):
            shape, block, chunks = GEOMETRY[(2 * i + j + ranks) % len(GEOMETRY)]
            dtype = DTYPES[(i + j + ranks) % len(DTYPES)]
            xs = make_inputs(ranks, shape, block, pattern, dtype, rng)
            cases.append((pattern, shape, block, chunks, dtype, xs))
            calls.append((xs, {"algorithm": "block-sparse", "block_size": block, "chunks": chunks}))
    for (pattern, shape, block, chunks, dtype, xs), out in zip(cases, _launch_many(inproc_client, calls)):
        expected = np.sum(xs, axis=0, dtype=dtype)
        for r, o in enumerate(out):
            where = f"{pattern} {shape} block {block} chunks {chunks} {dtype} rank {r}"
            assert o.shape == expected.shape and o.dtype == expected.dtype, where
            np.testing.assert_array_equal(o, expected, err_msg=where)
    assert_clean(inproc_client)


def test_block_sparse_mean_and_errors(inproc_client):
    rng = np.random.default_rng(3)
    ints = make_inputs(3, (500,), 16, "random", "int32", rng)
    floats = make_inputs(3, (500,), 16, "random", "float32", rng)
    outs = _launch_many(inproc_client, [(ints, {"algorithm": "block-sparse", "op": "mean", "block_size": 16}),
                                        (floats, {"algorithm": "block-sparse", "op": "mean", "block_size": 16})])
    for xs, out in zip((ints, floats), outs):
        expected = np.mean(xs, axis=0)
        for o in out:
            assert o.dtype == expected.dtype
            np.testing.assert_allclose(o, expected, rtol=1e-6)
    parts = scatter_ranks(inproc_client, ints)
    with pytest.raises(ValueError, match="block-sparse all-reduce supports ops sum, mean; got 'max'"):
        flowreduce.allreduce(inproc_client, parts, algorithm="block-sparse", op="max")
    with pytest.raises(ValueError, match="aggregators must be None"):
        flowreduce.allreduce(inproc_client, parts, algorithm="block-sparse", aggregators=3)
    with pytest.raises(ValueError, match=r"not workers of this cluster"):
        flowreduce.allreduce(inproc_client, parts, algorithm="block-sparse", aggregators=["tcp://nowhere:1"])
    del parts
    assert_clean(inproc_client)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_block_sparse_quantised_within_bound(inproc_client, codec):
    rng = np.random.default_rng(4)
    p = 4
    xs = [x * rng.standard_normal(x.shape) for x in make_inputs(p, (20_000,), 64, "random", "float64", rng)]
    out = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, xs), algorithm="block-sparse",
                               block_size=64, compression=codec, seed=3)
    plan = flowreduce.describe(out).plan
    magnitude = np.sum(np.abs(xs), axis=0)
    bound = quantisation_bound(codec, plan.encodings(), magnitude if codec == "fp16" else magnitude.max())
    exact = np.sum(xs, axis=0)
    for o in inproc_client.gather(out):
        err = np.abs(o - exact)
        assert np.all(err <= bound * (1 + 1e-6) + 1e-12) and err.max() > 0
        assert np.all(o[magnitude == 0] == 0)  # zero blocks stay exactly zero


# -- bytes moved on real transfers ---------------------------------------------------------------


def _pack_bytes(mask_range, block, itemsize) -> int:
    """Payload bytes of one pack: every block (no ids) or the non-zero ones and their int32 ids."""
    if mask_range.all():
        return mask_range.size * block * itemsize
    k = int(mask_range.sum())
    return k * 4 + k * block * itemsize


def test_block_sparse_moves_only_blocks_nonzero_somewhere(proc_client):
    """Traced on real transfers: each pack carries exactly its rank's non-zero
    blocks of the range, each aggregated sum the union of them; far less
    than the dense butterfly."""
    rng = np.random.default_rng(5)
    p, block, nblocks = 4, 256, 256
    n = block * nblocks
    masks = [rng.random(nblocks) < 0.1 for _ in range(p)]
    xs = [np.where(np.repeat(m, block), rng.standard_normal(n), 0).astype(np.float32) for m in masks]
    parts = scatter_ranks(proc_client, xs)
    with flowreduce.trace(proc_client) as tr:
        out = flowreduce.allreduce(proc_client, parts, algorithm="block-sparse")
        result = proc_client.gather(out)
    np.testing.assert_allclose(result[0], np.sum(xs, axis=0), rtol=1e-6)
    info = flowreduce.describe(out)
    got = transfer_bytes(tr, info.token)
    ranges = [slice(a * nblocks // p, (a + 1) * nblocks // p) for a in range(p)]
    union = np.logical_or.reduce(masks)
    seen = 0
    for (key, _), b in got.items():
        k = keymod.parse(key)
        if k["phase"] == "compact":
            expected = _pack_bytes(masks[k["rank"]][ranges[k["node"] % p]], block, 4)
        else:  # an aggregated range, read by the other ranks' unpacking outputs
            assert k["phase"] == "aggregate", key
            expected = _pack_bytes(union[ranges[k["rank"]]], block, 4)
        assert expected <= b <= expected + SLACK, (key, b, expected)
        seen += 1
    assert seen == p * (p - 1) * 2  # every pack to its owner, every sum to every other rank
    dense = flowreduce.plan("butterfly", p).cost(n * 4).bytes_on_wire
    assert sum(got.values()) < 0.5 * dense
    assert info.bytes_on_wire == pytest.approx(dense, rel=0.02)  # the plan alone cannot know the zeros
    del parts, out
    assert_clean(proc_client)


@pytest.mark.parametrize("pattern", ["dense", "random"])
def test_multiprocess_block_sparse_inputs_untouched(proc_client, pattern):
    """Real transfers, 6 ranks on 4 workers (some share one): aggregators add
    in place into received packs, never into a rank's input."""
    rng = np.random.default_rng(7)
    xs = make_inputs(6, (3000,), 64, pattern, "int64", rng)
    parts = scatter_ranks(proc_client, xs)
    out = proc_client.gather(flowreduce.allreduce(proc_client, parts, algorithm="block-sparse", block_size=64))
    for r, o in enumerate(out):
        np.testing.assert_array_equal(o, np.sum(xs, axis=0), err_msg=f"rank {r}")
    for r, (after, before) in enumerate(zip(proc_client.gather(parts), xs)):
        np.testing.assert_array_equal(after, before, err_msg=f"input of rank {r} was modified")
    del parts
    assert_clean(proc_client)


# -- separate aggregators ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agg_client():
    """Four rank workers and two started with the resource ``aggregator`` (as
    ``dask worker --resources aggregator=1``), talking over TCP."""
    workers = {f"rank-{i}": {"cls": Worker, "options": {"nthreads": 1}} for i in range(4)}
    workers |= {f"agg-{i}": {"cls": Worker, "options": {"nthreads": 1, "resources": {"aggregator": 1}}}
                for i in range(2)}
    with SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}}) as cl:
        with Client(cl) as client:
            client.wait_for_workers(6)
            yield client


def _by_resource(client):
    info = client.run_on_scheduler(lambda dask_scheduler: {w: dict(ws.resources)
                                                           for w, ws in dask_scheduler.workers.items()})
    aggs = sorted(w for w, r in info.items() if r.get("aggregator"))
    return sorted(set(info) - set(aggs)), aggs


@pytest.mark.parametrize("choice", [None, "ranks", "one"])
def test_aggregators_run_on_aggregator_workers(agg_client, choice):
    """By default the sums run on the aggregator workers and every pack
    travels to them; ``aggregators="ranks"`` keeps them on the ranks; a list
    names them."""
    ranks, aggs = _by_resource(agg_client)
    rng = np.random.default_rng(6)
    p, block, nblocks = 4, 64, 64
    xs = [np.where(np.repeat(rng.random(nblocks) < 0.3, block), rng.integers(1, 9, block * nblocks), 0)
          for _ in range(p)]
    parts = [agg_client.scatter(x, workers=[w], hash=False) for x, w in zip(xs, ranks)]
    option = {None: None, "ranks": "ranks", "one": aggs[1:]}[choice]
    want = {None: set(aggs), "ranks": set(ranks), "one": {aggs[1]}}[choice]
    with flowreduce.trace(agg_client) as tr:
        out = flowreduce.allreduce(agg_client, parts, algorithm="block-sparse", block_size=block,
                                   aggregators=option)
        result = agg_client.gather(out)
    for o in result:
        np.testing.assert_array_equal(o, np.sum(xs, axis=0))
    token = flowreduce.describe(out).token
    ran = {e.worker for e in tr.iter_events(token)
           if e.phase == "reduce" and keymod.parse(ast.literal_eval(e.key))["phase"] == "aggregate"}
    assert ran == want
    packs_sent = [k for (k, _) in transfer_bytes(tr, token) if keymod.parse(k)["phase"] == "compact"]
    assert len(packs_sent) == p * len(want) - (p if choice == "ranks" else 0)
    del parts, out
    assert_clean(agg_client)
