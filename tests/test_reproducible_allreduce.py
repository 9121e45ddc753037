"""``allreduce(deterministic="exact")`` on a cluster: every algorithm,
chunk count, transport and placement gives, element by element, math.fsum
over the ranks (float32: the exact sum rounded once), where the default
mode's bits differ between algorithms."""

from __future__ import annotations

import math

import dask
import numpy as np
import pytest
from utils import assert_clean, error_of, scatter_ranks, workers_of

import flowreduce
from flowreduce.errors import InputError, InputStateError, OptionError
from flowreduce.lower.graph import gathers_every_rank
from flowreduce.schedule import reproducible

RANKS = [1, 2, 3, 5, 8, 16]
DENSE = [a for a in flowreduce.ALGORITHMS if a != "auto"]


def wide(p: int, dtype=np.float64, size: int = 64, seed: int = 0) -> list[np.ndarray]:
    """Values over 16 orders of magnitude, either sign, and cancelling
    ones (1e16 + 1 - 1e16 across the ranks) in the first two elements."""
    rng = np.random.default_rng(seed + p)
    xs = [rng.standard_normal(size) * 10.0 ** rng.integers(-8, 9, size) for _ in range(p)]
    for r, x in enumerate(xs):
        x[:2] = [1e16, 1.0, -1e16][r % 3], [1.0, -1e16, 1e16][r % 3]
    return [x.astype(dtype) for x in xs]


def fsum(xs: list[np.ndarray]) -> np.ndarray:
    return np.array([math.fsum(v) for v in zip(*(x.tolist() for x in xs))])


def results(client, xs, workers=None, **kw) -> list[np.ndarray]:
    return client.gather(flowreduce.allreduce(client, scatter_ranks(client, xs, workers), **kw))


def test_the_default_differs_between_algorithms(inproc_client):
    xs = wide(8)
    seen = {results(inproc_client, xs, algorithm=a)[0].tobytes() for a in ["ring", "butterfly", "tree", "direct"]}
    assert len(seen) > 1  # else the tests below could not tell an exact sum from a lucky order


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("algorithm", DENSE)
def test_exact_is_fsum_for_every_algorithm(inproc_client, algorithm, p):
    # chunks 1 and 3, and both transports, spread over the cases (ranks share workers past 4)
    chunks = 3 if p in (2, 5, 8) else 1
    transport = "dask" if DENSE.index(algorithm) % 2 else "auto"
    xs = wide(p)
    got = results(inproc_client, xs, algorithm=algorithm, chunks=chunks, transport=transport,
                  deterministic="exact")
    want = fsum(xs)
    for r in range(p):
        assert got[r].tobytes() == want.tobytes(), (r, np.flatnonzero(got[r] != want))
    if p == 3:
        assert got[0][:2].tolist() == [1.0, 1.0]  # 1e16 + 1 - 1e16


@pytest.mark.parametrize("algorithm", ["butterfly", "ring", "direct", "hierarchical"])
def test_exact_with_every_rank_on_one_worker(inproc_client, algorithm):
    xs = wide(5, seed=1)
    got = results(inproc_client, xs, workers=workers_of(inproc_client)[:1], algorithm=algorithm,
                  deterministic="exact")
    assert all(g.tobytes() == fsum(xs).tobytes() for g in got)


@pytest.mark.parametrize("p", [3, 8])
def test_exact_float32_is_the_exact_sum_rounded_once(inproc_client, p):
    xs = wide(p, np.float32, seed=2)
    want = flowreduce.reference_reduce(xs, "sum")
    for algorithm in ["ring", "recursive-doubling"]:
        got = results(inproc_client, xs, algorithm=algorithm, chunks=3, deterministic="exact")
        assert all(g.dtype == np.float32 and g.tobytes() == want.tobytes() for g in got)


def test_describe_answers_for_an_exact_call(inproc_client):
    xs = wide(3)
    inputs = scatter_ranks(inproc_client, xs)
    futures = flowreduce.allreduce(inproc_client, inputs, algorithm="ring", deterministic="exact")
    described = flowreduce.describe(futures[1])  # the limbs' all-reduce moved the data
    assert (described.algorithm, described.deterministic, described.shape) == ("ring", "exact", xs[0].shape)
    assert described.input_keys == tuple(f.key for f in inputs)
    inproc_client.gather(futures)


def test_exact_mean_divides_the_rounded_sum(inproc_client):
    xs = wide(5, seed=3)
    got = results(inproc_client, xs, op="mean", algorithm="tree", deterministic="exact")
    assert got[0].tobytes() == (fsum(xs) / 5).tobytes() == flowreduce.reference_reduce(xs, "mean").tobytes()


def test_exact_is_the_same_at_any_rank_count(inproc_client):
    # 6 ranks, 2 of them holding zeros, give the bits of the 4 that hold the values
    xs = wide(4, seed=4)
    four = results(inproc_client, xs, algorithm="butterfly", deterministic="exact")[0]
    six = results(inproc_client, [*xs, np.zeros(64), -np.zeros(64)], algorithm="ring", deterministic="exact")[0]
    assert four.tobytes() == six.tobytes() == fsum(xs).tobytes()


def test_exact_with_a_template(inproc_client):
    xs = wide(3, seed=7)
    futures = scatter_ranks(inproc_client, xs)
    got = inproc_client.gather(flowreduce.allreduce(inproc_client, futures, like=xs[0], algorithm="butterfly",
                                                    deterministic="exact"))
    assert all(g.tobytes() == fsum(xs).tobytes() for g in got)


@pytest.mark.parametrize("algorithm", ["ring", "direct", "shm-direct", "butterfly"])
def test_exact_with_the_decode_shared_out(inproc_client, monkeypatch, algorithm):
    # every size takes the path of large vectors: each rank decodes 1/p, a float all-reduce assembles
    monkeypatch.setattr(reproducible, "SPLIT_DECODE", 1)
    xs = wide(5, seed=8)
    for r, x in enumerate(xs):  # a mean that underflows: +0.0
        x[2] = -5e-324 if r == 0 else 0.0
    futures = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, xs), algorithm=algorithm,
                                   deterministic="exact")
    described = flowreduce.describe(futures)
    assert described.algorithm in (algorithm, "hierarchical") and described.deterministic == "exact"
    assert described.dtype == xs[0].dtype.str and described.shape == xs[0].shape
    assert all(g.tobytes() == fsum(xs).tobytes() for g in inproc_client.gather(futures))
    mean = results(inproc_client, xs, op="mean", algorithm=algorithm, deterministic="exact")
    assert all(g.tobytes() == flowreduce.reference_reduce(xs, "mean").tobytes() for g in mean)
    assert not np.signbit(mean[0][2])


def test_inf_and_nan(inproc_client):
    xs = [np.array([np.inf, np.inf, np.nan, 1.0]), np.array([1.0, -np.inf, 1.0, 2.0])]
    got = results(inproc_client, xs, algorithm="ring", deterministic="exact")[1]
    assert np.array_equal(got, [np.inf, np.nan, np.nan, 3.0], equal_nan=True)


@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_integers_and_min_max_pass_through(inproc_client, op):
    ints = [np.arange(10) * (r + 1) for r in range(3)]
    assert [g.tolist() for g in results(inproc_client, ints, op=op, deterministic="exact")] == \
        [g.tolist() for g in results(inproc_client, ints, op=op)]
    xs = wide(3)
    assert results(inproc_client, xs, op="max", deterministic="exact")[0].tobytes() == np.max(xs, axis=0).tobytes()


def test_helper_tasks_are_released(inproc_client):
    futures = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, wide(3)), algorithm="ring",
                                   deterministic="exact")
    keys = {str(f.key) for f in futures}
    assert all("flowreduce-exact-unpack-" in k for k in keys)
    inproc_client.gather(futures)
    del futures
    assert_clean(inproc_client)


def test_the_config_key_sets_the_default(inproc_client):
    xs = wide(5, seed=5)
    with dask.config.set({"flowreduce.deterministic": "exact"}):
        got = results(inproc_client, xs, algorithm="ring")
    assert got[0].tobytes() == fsum(xs).tobytes()


@pytest.mark.parametrize("kw, match", [
    ({"deterministic": "bits"}, "False, True or 'exact'"),
    ({"deterministic": "exact", "op": "prod"}, "no exact form"),
    ({"deterministic": "exact", "op": lambda a, b: a + b}, "no exact form"),
])
def test_refusals(inproc_client, kw, match):
    with pytest.raises(OptionError, match=match):
        flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, wide(2)), **kw)


def same(a, b) -> bool:
    """The same type, dtype, shape and bits (numpy arrays and torch tensors)."""
    if type(a) is not type(b) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("p", [1, 3, 5])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_torch_tensors(inproc_client, dtype, p):
    torch = pytest.importorskip("torch")
    xs = wide(p, np.dtype(dtype), seed=9)
    want = flowreduce.reference_reduce(xs, "sum")  # float64: fsum; float32: the exact sum rounded once
    if dtype == "float64":
        assert want.tobytes() == fsum(xs).tobytes()
    got = results(inproc_client, [torch.from_numpy(x) for x in xs], algorithm="ring" if p % 2 else "butterfly",
                  chunks=2, deterministic="exact")
    for g in got:
        assert isinstance(g, torch.Tensor) and g.dtype == getattr(torch, dtype) and tuple(g.shape) == xs[0].shape
        assert g.numpy().tobytes() == want.tobytes()
    if p == 3:
        assert got[0][:2].tolist() == [1.0, 1.0]  # 1e16 + 1 - 1e16


def scatter_trees(client, parts) -> list:
    """One future per rank holding its pytree (``client.scatter`` of a dict scatters its values under
    its keys instead: the same keys for every rank)."""
    ws = workers_of(client)
    return [client.scatter([t], workers=[ws[r % len(ws)]], hash=False)[0] for r, t in enumerate(parts)]


def tree_results(client, parts, **kw) -> list:
    return client.gather(flowreduce.allreduce(client, scatter_trees(client, parts), **kw))


def trees(p: int, seed: int, zeros: int = 0) -> list[dict]:
    """Rank r's {"w": float64 array, "b": [float32 tensor, int64 array]}; ``zeros`` more ranks of zeros."""
    torch = pytest.importorskip("torch")
    w, b = wide(p, seed=seed), wide(p, np.float32, size=17, seed=seed + 1)
    out = [{"w": w[r], "b": [torch.from_numpy(b[r]), np.arange(6, dtype=np.int64) * (r + 1) - 2 ** 40]}
           for r in range(p)]
    return out + [{"w": np.zeros(64), "b": [torch.zeros(17), np.zeros(6, np.int64)]} for _ in range(zeros)]


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_exact_pytrees(inproc_client, op):
    torch = pytest.importorskip("torch")
    parts = trees(3, seed=10)
    ws, bs, ints = [t["w"] for t in parts], [t["b"][0].numpy() for t in parts], [t["b"][1] for t in parts]
    got = tree_results(inproc_client, parts, op=op, algorithm="ring", deterministic="exact")
    want_w = fsum(ws) if op == "sum" else fsum(ws) / 3
    assert want_w.tobytes() == flowreduce.reference_reduce(ws, op).tobytes()
    want_b = flowreduce.reference_reduce(bs, op)
    want_i = np.sum(ints, axis=0) if op == "sum" else np.sum(ints, axis=0) / 3
    for g in got:
        assert list(g) == ["w", "b"] and isinstance(g["b"], list) and len(g["b"]) == 2
        assert same(g["w"], want_w), np.flatnonzero(g["w"] != want_w)
        assert same(g["b"][0], torch.from_numpy(want_b)), (g["b"][0], want_b)
        assert same(g["b"][1], want_i)  # integers: exact already, as the ordinary call gives them
    if op == "sum":
        assert got[0]["w"][:2].tolist() == [1.0, 1.0]


def test_exact_pytrees_are_the_same_bits_for_any_algorithm_and_rank_count(inproc_client):
    # 3 ranks by ring and by butterfly, and the same values over 5 ranks of which 2 hold zeros
    parts = trees(3, seed=11)
    ring = tree_results(inproc_client, parts, algorithm="ring", deterministic="exact")[0]
    butterfly = tree_results(inproc_client, parts, algorithm="butterfly", chunks=3, deterministic="exact")[2]
    five = tree_results(inproc_client, trees(3, seed=11, zeros=2), algorithm="tree", deterministic="exact")[4]
    for got in (butterfly, five):
        assert same(got["w"], ring["w"]) and same(got["b"][0], ring["b"][0]) and same(got["b"][1], ring["b"][1])
    assert ring["w"].tobytes() == fsum([t["w"] for t in parts]).tobytes()
    default = tree_results(inproc_client, parts, algorithm="tree")[0]["w"]
    assert default.tobytes() != ring["w"].tobytes()  # else this could not tell the exact sum from an order's


def test_exact_with_several_futures_per_rank(inproc_client):
    parts = trees(3, seed=12)
    futures = [scatter_trees(inproc_client, [t["w"], t["b"]]) for t in parts]
    out = flowreduce.allreduce(inproc_client, futures, algorithm="butterfly", deterministic="exact")
    assert all(isinstance(o, list) and len(o) == 2 for o in out)
    got = inproc_client.gather(out)
    whole = tree_results(inproc_client, parts, algorithm="butterfly", deterministic="exact")
    assert got[0][0].tobytes() == fsum([t["w"] for t in parts]).tobytes()
    for g, w in zip(got, whole):
        assert same(g[0], w["w"]) and same(g[1][0], w["b"][0]) and same(g[1][1], w["b"][1])


@pytest.mark.parametrize("template", [False, True])
def test_exact_pytrees_that_disagree_name_the_rank(inproc_client, template):
    parts = trees(3, seed=13)
    parts[2]["w"] = parts[2]["w"].astype(np.float32)  # rank 2's float64 leaf is a float32 one
    like = trees(1, seed=13)[0] if template else None
    e = error_of(lambda: flowreduce.allreduce(inproc_client, scatter_trees(inproc_client, parts), like=like,
                                              deterministic="exact"))
    if not template:  # the call checked the ranks' inputs: told on the results
        assert isinstance(e, InputError) and "ranks [2]: shape (64,), dtype float32" in str(e), repr(e)
        return
    # rank 2's pack task checks it against the template; an inner all-reduce placed after that task
    # failed passes its error on wrapped (InputStateError) instead of as it is, and one placed after
    # such an all-reduce failed wraps it once more (quotes escaped by each repr: matched without them)
    assert isinstance(e, (ValueError, InputStateError)), repr(e)
    assert "rank 2: input [" in str(e) and "w" in str(e) and "does not match like=" in str(e), str(e)
    assert "got shape (64,), dtype float32, expected shape (64,), dtype float64" in str(e), str(e)


def test_exact_pytree_helper_tasks_are_released(inproc_client):
    futures = flowreduce.allreduce(inproc_client, scatter_trees(inproc_client, trees(3, seed=14)),
                                   op="mean", deterministic="exact")
    assert all("flowreduce-exact-unpack-" in str(f.key) for f in futures)
    described = flowreduce.describe(futures[0])
    assert [b.deterministic for b in described.buckets] == [False, "exact", "exact"]  # int64, float32, float64
    inproc_client.gather(futures)
    del futures
    assert_clean(inproc_client)


@pytest.mark.parametrize("value, match", [("bfloat16", "bfloat16"), ("float16", "float16"), ("complex", "complex")])
def test_exact_refuses_what_it_cannot_round_once(inproc_client, value, match):
    torch = pytest.importorskip("torch")
    x = {"bfloat16": torch.ones(4, dtype=torch.bfloat16), "float16": np.ones(4, np.float16),
         "complex": np.ones(4, np.complex128)}[value]
    e = error_of(lambda: flowreduce.allreduce(inproc_client, scatter_trees(inproc_client, [{"a": x, "w": np.ones(3)}] * 2), deterministic="exact"))
    assert isinstance(e, OptionError) and match in str(e), repr(e)


@pytest.mark.parametrize("transport", ["auto", "dask"])
@pytest.mark.parametrize("algorithm", ["shm-direct", "hierarchical", "ring"])
def test_exact_between_processes(proc_client, algorithm, transport):
    xs = wide(5, seed=6)
    got = results(proc_client, xs, algorithm=algorithm, chunks=3, transport=transport, deterministic="exact")
    assert all(g.tobytes() == fsum(xs).tobytes() for g in got)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("algorithm, ranks", [("auto", 4), ("shm-direct", 4), ("direct", 6), ("auto", 7)])
def test_exact_on_one_host_folds_the_gathered_values(proc_client, algorithm, ranks, dtype, op):
    # the plans that bring every rank's values to where they are reduced fold them exactly there:
    # no codec, no helper tasks, the default's bytes; the same bits as the codec's route (ring)
    xs = wide(ranks, dtype, size=3000, seed=8)
    inputs = scatter_ranks(proc_client, xs)
    futures = flowreduce.allreduce(proc_client, inputs, op=op, algorithm=algorithm, deterministic="exact")
    described = flowreduce.describe(futures[0])
    assert described.algorithm in ("direct", "shm-direct") and described.deterministic == "exact"
    assert not any("flowreduce-exact" in str(f.key) for f in futures)
    got = proc_client.gather(futures)
    codec = results(proc_client, xs, op=op, algorithm="ring", deterministic="exact")
    want = flowreduce.reference_reduce(xs, op)
    assert all(g.tobytes() == want.tobytes() == c.tobytes() for g, c in zip(got, codec))


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("ranks", [3, 4, 6])
def test_exact_across_hosts_folds_where_the_values_meet(proc_client, ranks, op):
    # no shared memory between the ranks (transport="dask", as across hosts): auto still picks a plan whose
    # reductions take every rank's own values (a reduce-scatter by direct sends, or direct) and folds them there,
    # at the default's bytes: no limbs, no helper tasks; the same bits as the codec's route (ring)
    xs = wide(ranks, size=3000, seed=9)
    futures = flowreduce.allreduce(proc_client, scatter_ranks(proc_client, xs), op=op, transport="dask",
                                   deterministic="exact")
    described = flowreduce.describe(futures[0])
    assert described.deterministic == "exact" and gathers_every_rank(described.plan), described.plan
    assert not any("flowreduce-exact" in str(f.key) for f in futures)
    got = proc_client.gather(futures)
    codec = results(proc_client, xs, op=op, algorithm="ring", transport="dask", deterministic="exact")
    want = flowreduce.reference_reduce(xs, op)
    assert all(g.tobytes() == want.tobytes() == c.tobytes() for g, c in zip(got, codec))


@pytest.mark.parametrize("algorithm, options", [("butterfly", {"radix": 5}), ("recursive-doubling", {"radix": 8}),
                                                ("reduce-broadcast", {}), ("direct", {})])
def test_exact_on_a_named_gathering_plan_folds_without_the_codec(proc_client, algorithm, options):
    xs = wide(5, np.float32, size=2000, seed=10)
    futures = flowreduce.allreduce(proc_client, scatter_ranks(proc_client, xs), algorithm=algorithm,
                                   transport="dask", deterministic="exact", **options)
    assert flowreduce.describe(futures[0]).algorithm == algorithm
    assert not any("flowreduce-exact" in str(f.key) for f in futures)
    want = flowreduce.reference_reduce(xs, "sum")
    assert all(g.tobytes() == want.tobytes() for g in proc_client.gather(futures))
