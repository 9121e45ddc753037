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
from flowreduce.errors import OptionError
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
    futures = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, wide(3)), deterministic="exact")
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


def test_pytrees_are_refused_for_now(inproc_client):
    parts = [{"a": x, "b": x} for x in wide(2)]
    e = error_of(lambda: flowreduce.allreduce(inproc_client, [inproc_client.scatter(t) for t in parts],
                                              deterministic="exact"))  # from the call or its results
    assert isinstance(e, ValueError) and "one numpy array" in str(e), repr(e)


@pytest.mark.parametrize("transport", ["auto", "dask"])
@pytest.mark.parametrize("algorithm", ["shm-direct", "hierarchical", "ring"])
def test_exact_between_processes(proc_client, algorithm, transport):
    xs = wide(5, seed=6)
    got = results(proc_client, xs, algorithm=algorithm, chunks=3, transport=transport, deterministic="exact")
    assert all(g.tobytes() == fsum(xs).tobytes() for g in got)
