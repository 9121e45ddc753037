"""Pytrees of tensors per rank: structure round-trip against numpy, fused
and unfused identical, per-tensor futures, non-blocking calls with a
template, clear errors, fusion in traces."""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import re

import numpy as np
import pytest
from distributed import Event, wait
from utils import assert_clean, workers_of

import flowreduce
from flowreduce.fusion import Layout, make_buckets
from flowreduce.pytree import LEAF, TensorSpec, flatten, leaves_as, paths, same_structure, spec, unflatten

Pair = collections.namedtuple("Pair", "a b")

# -- pure: structures and buckets ----------------------------------------------------


@pytest.mark.parametrize("tree", [
    np.int64(3), [1, 2], (1,), {"b": 1, "a": [2, (3, 4)]}, Pair(1, {"x": 2}), [], {"w": []},
], ids=["leaf", "list", "tuple1", "nested", "namedtuple", "empty-list", "empty-inner"])
def test_flatten_unflatten_round_trip(tree):
    leaves, treedef = flatten(tree)
    back = unflatten(treedef, leaves)
    assert type(back) is type(tree) and repr(back) == repr(tree)
    assert len(paths(treedef)) == treedef.num_leaves == len(leaves)


def test_dict_order_is_not_structure():
    _, a = flatten({"x": 1, "y": [2]})
    _, b = flatten({"y": [2], "x": 1})
    assert a != b and same_structure(a, b)
    assert leaves_as({"y": [20], "x": 10}, a) == [10, 20]
    with pytest.raises(ValueError, match=r"dict at \['y'\]|has keys"):
        leaves_as({"x": 1, "z": [2]}, a)


def _specs(*pairs):
    return [TensorSpec(tuple(s), np.dtype(d).str) for s, d in pairs]


def test_buckets_fill_from_the_last_tensor_and_respect_the_cap():
    specs = _specs(((10,), "f8"), ((10,), "f8"), ((10,), "f8"), ((30,), "f8"))  # 80, 80, 80, 240 bytes
    got = make_buckets(specs, 160)
    assert [b.tensors for b in got] == [(3,), (2, 1), (0,)]  # 240 > cap alone; 80+80 fit; the first left over
    assert [b.offsets for b in got] == [(0,), (0, 10), (0,)]
    assert all(b.nbytes <= 160 or len(b.tensors) == 1 for b in got)


def test_buckets_group_by_dtype_and_take_empty_tensors():
    specs = _specs(((4,), "f4"), ((4,), "i8"), ((0, 3), "f4"), ((), "f4"))
    got = make_buckets(specs, 1 << 20)
    assert {b.dtype: b.tensors for b in got} == {np.dtype("f4").str: (3, 2, 0), np.dtype("i8").str: (1,)}
    assert [b.size for b in got] == [5, 4]


@pytest.mark.parametrize("bucket_bytes", [0, None], ids=["zero", "none"])
def test_no_fusion_is_one_bucket_per_tensor(bucket_bytes):
    specs = _specs(((3,), "f8"), ((2,), "f8"))
    assert [b.tensors for b in make_buckets(specs, bucket_bytes)] == [(1,), (0,)]


def test_template_must_fit_the_futures():
    _, outer = flatten([0, 0])
    with pytest.raises(ValueError, match="does not have the structure of the inputs"):
        Layout.from_template(outer, [np.ones(2)])
    with pytest.raises(TypeError, match=r"like= leaf under input \[1\]"):
        Layout.from_template(outer, [np.ones(2), "x"])
    lay = Layout.from_template(outer, [{"W": spec((2, 3), "f4")}, np.ones(2)])
    assert [t.path for t in lay.tensors] == ["[0]['W']", "[1]"] and lay.inner[1] == LEAF


# -- on a cluster: results against numpy -------------------------------------------

def _same(x):
    return x


def put(client, tree, worker=None):
    """One future holding the whole pytree (``scatter`` would split a dict)."""
    return client.submit(_same, tree, workers=[worker] if worker else None, pure=False)


def rank_tree(kind: str, r: int):
    """Rank r's pytree of integer arrays (exact sums)."""
    rng = np.random.default_rng(r)
    if kind == "list":
        return [rng.integers(-9, 9, size=n) for n in (5, 1, 7)]
    if kind == "tuple":
        return (rng.integers(-9, 9, size=(2, 3)), rng.integers(-9, 9, size=4).astype(np.int32))
    if kind == "dict":
        return {"W": rng.integers(-9, 9, size=(3, 4)), "b": rng.integers(-9, 9, size=3)}
    # nested, mixed dtypes and shapes, an empty tensor and a 0-d array
    return {"layers": [{"W": rng.integers(-9, 9, size=(4, 2)).astype(np.int32), "b": np.int64(r)},
                       {"W": rng.integers(-9, 9, size=(2, 3)).astype(np.float32), "empty": np.zeros((0, 2))}],
            "step": np.array(r, dtype=np.int16), "pair": Pair(rng.integers(0, 5, size=2), np.ones(3, np.uint8))}


KINDS = ["list", "tuple", "dict", "nested"]


def expected(kind: str, p: int):
    trees = [rank_tree(kind, r) for r in range(p)]
    leaves = [flatten(t)[0] for t in trees]
    _, treedef = flatten(trees[0])
    return unflatten(treedef, [np.sum([np.asarray(x[i]) for x in leaves], axis=0, dtype=np.asarray(leaves[0][i]).dtype)
                               for i in range(len(leaves[0]))])


def assert_tree_equal(got, want):
    gl, gt = flatten(got)
    wl, wt = flatten(want)
    assert gt == wt, f"structure {gt} != {wt}"
    for path, a, b in zip(paths(gt), gl, wl):
        assert isinstance(a, np.ndarray), f"{path}: {type(a)}"
        assert a.shape == np.shape(b) and a.dtype == np.asarray(b).dtype, f"{path}: {a.shape} {a.dtype}"
        np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.parametrize("bucket_bytes", [0, 24, 1 << 20], ids=["unfused", "small-buckets", "one-bucket"])
@pytest.mark.parametrize("kind", KINDS)
def test_future_of_a_pytree(inproc_client, kind, bucket_bytes):
    ws = workers_of(inproc_client)
    p = 3
    parts = [inproc_client.submit(rank_tree, kind, r, workers=[ws[r]], pure=False) for r in range(p)]
    out = flowreduce.allreduce(inproc_client, parts, algorithm="ring", bucket_bytes=bucket_bytes)
    assert len(out) == p
    for got in inproc_client.gather(out):
        assert_tree_equal(got, expected(kind, p))


def _per_tensor(client, kind, r, w):
    """Rank r's tree as one future per tensor (each made by its own task)."""
    leaves, treedef = flatten(rank_tree(kind, r))
    futs = [client.submit(_same, x, workers=[w], pure=False) for x in leaves]
    return unflatten(treedef, futs)


@pytest.mark.parametrize("with_template", [False, True], ids=["in-memory", "template"])
@pytest.mark.parametrize("kind", ["dict", "nested"])
def test_pytree_of_futures(proc_client, kind, with_template):
    ws = workers_of(proc_client)
    parts = [_per_tensor(proc_client, kind, r, ws[r]) for r in range(4)]
    like = rank_tree(kind, 0) if with_template else None
    out = flowreduce.allreduce(proc_client, parts, like=like, bucket_bytes=40, algorithm="butterfly")
    for r in range(4):
        leaves, treedef = flatten(out[r])
        assert same_structure(treedef, flatten(parts[r])[1])
        assert all(type(f).__name__ == "Future" for f in leaves)
        wait(leaves)
        where = proc_client.who_has(leaves)
        assert {w for f in leaves for w in where[f.key]} == {ws[r]}, f"rank {r}'s results are elsewhere"
        assert_tree_equal(unflatten(treedef, proc_client.gather(leaves)), expected(kind, 4))
    info = flowreduce.describe(out)
    assert len(info.tensors) == len(flatten(parts[0])[0]) and len(info.buckets) == len(set(info.bucket_of))
    del out, parts, leaves, where
    assert_clean(proc_client)


#: Options a named algorithm needs on 3 ranks of one host: hierarchical gets
#: two uneven "hosts" (one in-process host would make it the flat inner algorithm).
ALGORITHM_OPTIONS = {"hierarchical": {"groups": [[0, 2], [1]]}}


@pytest.mark.parametrize("algorithm", flowreduce.ALGORITHMS)
def test_fused_and_unfused_identical(inproc_client, algorithm):
    ws = workers_of(inproc_client)
    options = ALGORITHM_OPTIONS.get(algorithm, {})
    parts = [inproc_client.submit(rank_tree, "nested", r, workers=[ws[r]], pure=False) for r in range(3)]
    wait(parts)  # computed: the pytree path (still computing, auto gathers them: tests/test_workflows.py)
    fused = flowreduce.allreduce(inproc_client, parts, algorithm=algorithm, bucket_bytes=1 << 20, **options)
    alone = flowreduce.allreduce(inproc_client, parts, algorithm=algorithm, bucket_bytes=0, **options)
    infos = [flowreduce.describe(fused), flowreduce.describe(alone)]
    assert len(infos[0].buckets) < len(infos[1].buckets)
    for b in (b for info in infos for b in info.buckets):
        assert b.plan.algorithm in (set(flowreduce.ALGORITHMS) - {"auto"} if algorithm == "auto" else {algorithm})
        for k, v in options.items():
            assert b.plan.options[k] == v, (k, b.plan.options)
    want = expected("nested", 3)
    for a, b in zip(inproc_client.gather(fused), inproc_client.gather(alone)):
        assert_tree_equal(a, b)
        assert_tree_equal(a, want)


def test_mean_of_integer_tensors_is_float(inproc_client):
    ws = workers_of(inproc_client)
    parts = [inproc_client.submit(rank_tree, "dict", r, workers=[ws[r]], pure=False) for r in range(4)]
    out = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, op="mean"))
    want = expected("dict", 4)
    for k in want:
        np.testing.assert_allclose(out[0][k], want[k] / 4)
        assert out[0][k].dtype == np.float64


# -- non-blocking ----------------------------------------------------------------------

def _gated(name: str, r: int):
    Event(name).wait()
    return {"W": np.full((2, 3), r, dtype=np.int64), "b": np.arange(3) * r}


def test_returns_while_inputs_are_still_computing(proc_client):
    """The inputs cannot finish before the event is set, and it is set only
    after allreduce returned: a call that waited for them would time out here."""
    ws = workers_of(proc_client)
    gate = Event("flowreduce-test-gate", client=proc_client)
    parts = [proc_client.submit(_gated, gate.name, r, workers=[ws[r]], pure=False) for r in range(4)]
    like = {"W": spec((2, 3), "int64"), "b": np.zeros(3, dtype=np.int64)}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(flowreduce.allreduce, proc_client, parts, like=like, bucket_bytes=0)
        try:
            out = call.result(timeout=30)
        finally:
            statuses = [f.status for f in parts]
            gate.set()
    assert statuses == ["pending"] * 4
    for r, got in enumerate(proc_client.gather(out)):
        np.testing.assert_array_equal(got["W"], np.full((2, 3), 6))
        np.testing.assert_array_equal(got["b"], np.arange(3) * 6)
        assert list(proc_client.who_has([out[r]])[out[r].key]) == [ws[r]]
    del out, call
    assert_clean(proc_client)


def test_unpinned_pending_input_is_waited_for(inproc_client):
    parts = [inproc_client.submit(np.full, 4, r, pure=False) for r in range(3)]
    out = flowreduce.allreduce(inproc_client, parts, like=np.zeros(4, dtype=np.int64))
    assert all(f.status == "finished" for f in parts)  # waited: unpinned inputs could land anywhere
    np.testing.assert_array_equal(out[1].result(), np.full(4, 3))


@pytest.mark.parametrize("bad,match", [
    ({"W": np.ones((2, 4), dtype=np.int64), "b": np.zeros(3, np.int64)},
     r"rank 2: input \['W'\] does not match like=: got shape \(2, 4\), dtype int64, expected shape \(2, 3\)"),
    ({"W": np.ones((2, 3), dtype=np.int64)},
     r"rank 2: input \(the future\) does not match the structure .* of like=.*missing \['b'\]"),
    ({"W": np.ones((2, 3), dtype=np.int32), "b": np.zeros(3, np.int64)},
     r"rank 2: input \['W'\] does not match like=: got shape \(2, 3\), dtype int32"),
], ids=["shape", "structure", "dtype"])
@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20], ids=["unfused", "fused"])
def test_template_mismatch_fails_every_rank(proc_client, bad, match, bucket_bytes):
    ws = workers_of(proc_client)
    good = {"W": np.ones((2, 3), dtype=np.int64), "b": np.zeros(3, np.int64)}
    parts = [put(proc_client, bad if r == 2 else good, ws[r]) for r in range(4)]
    out = flowreduce.allreduce(proc_client, parts, like=good, bucket_bytes=bucket_bytes)
    wait(out)
    for f in out:
        with pytest.raises((ValueError, TypeError), match=match) as caught:
            f.result()
        # the future's state keeps the exception object; raising appends our frames
        # (which hold `out`) to its traceback: a cycle that would keep the keys
        caught.value.__traceback__ = None
    del out, f, caught
    gc.collect()
    assert_clean(proc_client)


# -- errors upfront -----------------------------------------------------------------------

def test_ranks_disagreeing_on_structure_are_named(inproc_client):
    parts = [put(inproc_client, {"W": np.ones(2), "b": np.ones(1)}),
             put(inproc_client, {"W": np.ones(2), "b": np.ones(1)}),
             put(inproc_client, {"W": np.ones(2)})]
    out = flowreduce.allreduce(inproc_client, parts)  # input errors come on the results, every rank's
    for f in out:
        e = f.exception(timeout=60)
        assert isinstance(e, ValueError) and re.search(r"ranks disagree on structure: ranks \[0, 1\]: .*ranks \[2\]",
                                                       str(e)), repr(e)
    del out, f, e
    assert_clean(inproc_client)


def test_ranks_disagreeing_on_a_tensor_are_named(inproc_client):
    parts = [put(inproc_client, {"W": np.ones(2), "b": np.ones(n)}) for n in (1, 1, 2)]
    out = flowreduce.allreduce(inproc_client, parts)
    e = out[2].exception(timeout=60)
    assert isinstance(e, ValueError) and re.search(r"disagree on shapes of tensor \['b'\]: ranks \[0, 1\]: "
                                                   r"shape \(1,\).*ranks \[2\]: shape \(2,\)", str(e)), repr(e)
    del out, e
    assert_clean(inproc_client)


def test_futures_arranged_differently_are_named(inproc_client):
    a, b = inproc_client.scatter([np.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match=r"structure of their inputs: ranks \[0\]: \[\*, \*\]; ranks \[1\]: \[\*\]"):
        flowreduce.allreduce(inproc_client, [[a, b], [a]])
    with pytest.raises(TypeError, match=r"input of rank 1 at \['x'\] is a ndarray, not a distributed.Future"):
        flowreduce.allreduce(inproc_client, [{"x": a}, {"x": np.ones(2)}])


def test_dicts_built_in_another_order_still_agree(inproc_client):
    parts = [put(inproc_client, {"a": np.ones(2), "b": np.arange(3)}),
             put(inproc_client, {"b": np.arange(3), "a": np.ones(2)})]
    out = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, bucket_bytes=1 << 20))
    np.testing.assert_array_equal(out[1]["b"], 2 * np.arange(3))
    np.testing.assert_array_equal(out[1]["a"], np.full(2, 2.0))


# -- traces -------------------------------------------------------------------------------

def test_fusion_is_its_own_phase_in_traces(proc_client):
    from flowreduce.keys import parse

    ws = workers_of(proc_client)
    parts = [_per_tensor(proc_client, "dict", r, ws[r]) for r in range(4)]
    wait([f for p in parts for f in flatten(p)[0]])
    with flowreduce.trace(proc_client) as tr:
        out = flowreduce.allreduce(proc_client, parts, bucket_bytes=1 << 20)
        wait(flatten(out)[0])
    fusion = [e for e in tr.events if e.phase == "fusion"]
    kinds = {(parse(eval(e.key))["phase"], e.rank) for e in fusion}  # noqa: S307 - keys are repr'd tuples
    assert kinds == {(k, r) for k in ("pack", "unpack") for r in range(4)}
    info = flowreduce.describe(out)
    assert {b.token for b in info.buckets} <= set(tr.calls)  # each bucket is a call of the trace
    assert {e.worker for e in fusion if e.rank == 1} == {ws[1]}
