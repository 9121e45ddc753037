"""Bad input: a clear exception naming the ranks, and a clean cluster."""

from __future__ import annotations

import gc
import os
import uuid

import dask
import numpy as np
import pytest
from distributed import Client, Event, LocalCluster, wait
from utils import assert_clean, scatter_ranks

import flowreduce


def test_mismatched_shapes_name_the_ranks(inproc_client):
    """Input errors come on the results (whatever the route: docs/workflows.md), every rank's."""
    parts = scatter_ranks(inproc_client, [np.ones(4), np.ones(4), np.ones(5)])
    out = flowreduce.allreduce(inproc_client, parts)
    for f in out:
        with pytest.raises(ValueError, match=r"ranks disagree on shapes: ranks \[0, 1\]: shape \(4,\).*ranks \[2\]: shape \(5,\)"):
            f.result()
    del out
    assert_clean(inproc_client)


def test_mismatched_dtypes_name_the_ranks(inproc_client):
    parts = scatter_ranks(inproc_client, [np.ones(4), np.ones(4, dtype=np.float32)])
    with pytest.raises(ValueError, match=r"ranks disagree on dtypes: .*ranks \[1\]: shape \(4,\), dtype float32"):
        inproc_client.gather(flowreduce.allreduce(inproc_client, parts))


def test_empty_input_list(inproc_client):
    with pytest.raises(ValueError, match="one input future per rank; got an empty list"):
        flowreduce.allreduce(inproc_client, [])


def test_non_future_input(inproc_client):
    parts = scatter_ranks(inproc_client, [np.ones(3)])
    with pytest.raises(TypeError, match="input of rank 1 is a ndarray, not a distributed.Future"):
        flowreduce.allreduce(inproc_client, [parts[0], np.ones(3)])


def test_non_array_values_name_the_ranks(inproc_client):
    parts = [inproc_client.scatter(np.ones(3)), inproc_client.submit(list, (1, 2, 3)),
             inproc_client.submit(str, "abc")]
    wait(parts)  # computed: the call checks them before submitting (on arrival it says the same, see below)
    with pytest.raises(TypeError, match=r"ranks \[1, 2\] hold \{1: 'list', 2: 'str'\}"):
        inproc_client.gather(flowreduce.allreduce(inproc_client, parts))


def test_non_numeric_dtype(inproc_client):
    parts = scatter_ranks(inproc_client, [np.array(["a", "b"])] * 2)
    with pytest.raises(TypeError, match="numeric or boolean dtype"):
        inproc_client.gather(flowreduce.allreduce(inproc_client, parts))


def test_unknown_algorithm_lists_valid(inproc_client):
    parts = scatter_ranks(inproc_client, [np.ones(3)] * 2)
    with pytest.raises(ValueError, match="unknown algorithm 'bfly'; valid: .*butterfly.*auto"):
        flowreduce.allreduce(inproc_client, parts, algorithm="bfly")


def test_unknown_op_lists_valid(inproc_client):
    parts = scatter_ranks(inproc_client, [np.ones(3)] * 2)
    with pytest.raises(ValueError, match="unknown op 'average'; valid: sum, prod, min, max, mean"):
        flowreduce.allreduce(inproc_client, parts, op="average")
    with pytest.raises(ValueError, match="not a binary ufunc"):
        flowreduce.allreduce(inproc_client, parts, op=np.sqrt)


def test_mean_of_booleans_refused(inproc_client):
    parts = scatter_ranks(inproc_client, [np.ones(3, dtype=bool)] * 2)
    with pytest.raises(TypeError, match="mean' of boolean"):
        inproc_client.gather(flowreduce.allreduce(inproc_client, parts, op="mean"))


@pytest.mark.parametrize("kw,match", [({"chunks": 0}, "chunks must be a positive integer"),
                                      ({"chunk_bytes": -5}, "chunk_bytes must be positive"),
                                      ({"algorithm": "auto", "radix": 4}, "need a named algorithm"),
                                      ({"chunks": True}, "chunks must be a positive integer, got the boolean True"),
                                      ({"chunks": 2.0}, "chunks must be a positive integer, got 2.0"),
                                      ({"chunk_bytes": True}, "chunk_bytes must be positive .* got the boolean"),
                                      ({"chunk_bytes": "lots"}, "chunk_bytes must be positive .* got 'lots'"),
                                      ({"bucket_bytes": "-1kB"}, "bucket_bytes must be >= 0"),
                                      ({"chunks": 10**9}, "chunks asks for 1000000000 chunks per vector; at most 1024"),
                                      ({"chunk_bytes": 1}, "chunk_bytes=1 on a vector of 24 bytes asks for 24 chunks"
                                                           ".*at most 16")])
def test_bad_settings(inproc_client, kw, match):
    parts = scatter_ranks(inproc_client, [np.ones(3)] * 2)
    with dask.config.set({"flowreduce.max-chunks": 16 if kw.get("chunk_bytes") == 1 else 1024}):
        with pytest.raises(ValueError, match=match):
            flowreduce.allreduce(inproc_client, parts, **kw)
    del parts
    assert_clean(inproc_client)


@pytest.mark.parametrize("kw", [{"chunks": np.int64(2)}, {"chunk_bytes": "8B"}, {"chunk_bytes": np.int32(8)},
                                {"bucket_bytes": "1MiB"}], ids=["np.int64-chunks", "string-chunk_bytes",
                                                                "np.int32-chunk_bytes", "string-bucket_bytes"])
def test_integer_likes_and_byte_strings_are_settings(inproc_client, kw):
    """What numpy and dask users pass: numpy integers, dask's byte strings."""
    arrays = [np.arange(5) * (r + 1) for r in range(3)]
    futures = flowreduce.allreduce(inproc_client, scatter_ranks(inproc_client, arrays), algorithm="ring", **kw)
    for r, out in enumerate(inproc_client.gather(futures)):
        np.testing.assert_array_equal(out, sum(arrays), err_msg=f"rank {r}")
    if "chunk_bytes" in kw or "chunks" in kw:  # 8 bytes = one int64 element per chunk, or 2 chunks
        assert flowreduce.describe(futures).plan.chunks == (5 if "chunk_bytes" in kw else 2)


def test_futures_of_another_cluster_are_refused(inproc_client):
    """Their keys would be looked up here; with colliding keys the call would
    reduce this cluster's data instead."""
    arrays = [np.full(4, r) for r in range(3)]
    here = [inproc_client.scatter(a, hash=False, workers=[w]) for a, w in zip(arrays, sorted(inproc_client.nthreads()))]
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as other, \
            Client(other, set_as_default=False) as elsewhere:
        there = elsewhere.scatter(np.full(4, 99), hash=False)
        with pytest.raises(ValueError, match=r"futures of this client's cluster .*; ranks \[2\] belong to "):
            flowreduce.allreduce(inproc_client, [here[0], here[1], there])
        del there
    del here
    assert_clean(inproc_client)


def _boom(x, name=None):
    if name is not None:
        Event(name).wait()
    raise ZeroDivisionError("rank input failed")


def test_errored_input_names_the_rank(inproc_client):
    """Failed before the call: the results say which rank's input failed. Failing while the call, placed
    on arrival, waits for it: the results raise that input's own exception, as any Dask task depending on
    it does (docs/workflows.md), whichever of the input's failure and the call's graph reaches the
    scheduler first (the input fails as soon as the test sets the event)."""
    good = scatter_ranks(inproc_client, [np.ones(3)] * 2)
    name = f"boom-{uuid.uuid4().hex}"
    bad = inproc_client.submit(_boom, 1, name, pure=False)
    later = flowreduce.allreduce(inproc_client, [*good, bad])
    Event(name, client=inproc_client).set()
    wait([bad])
    with pytest.raises(RuntimeError, match="input of rank 2 failed: ZeroDivisionError"):
        inproc_client.gather(flowreduce.allreduce(inproc_client, [*good, bad]))
    for f in later:
        e = f.exception()
        assert isinstance(e, ZeroDivisionError) and "rank input failed" in str(e), repr(e)
    del later, e, f
    assert_clean(inproc_client)


def test_an_input_failing_as_the_call_is_made_fails_every_result(inproc_client):
    """The input fails at once, racing the call: found failed when the call is made (the results say
    which rank's input failed), or failing after (its own exception), also when its failure reaches the
    scheduler before the call's graph does (the call's result for that rank fails before the call is
    registered: it used to be missed, and the other ranks waited for good)."""
    from flowreduce.errors import InputStateError

    for _ in range(10):
        good = scatter_ranks(inproc_client, [np.ones(3)] * 2)
        bad = inproc_client.submit(_boom, 1, pure=False)
        later = flowreduce.allreduce(inproc_client, [*good, bad])
        wait(later, timeout=30)  # a missed failure leaves ranks 0 and 1 waiting: this raises
        for f in later:
            e = f.exception()
            assert isinstance(e, (ZeroDivisionError, InputStateError)) and "rank input failed" in str(e), repr(e)
        del later, good, bad, e, f
    assert_clean(inproc_client)


def test_cancelled_input(inproc_client):
    good = scatter_ranks(inproc_client, [np.ones(3)] * 2)
    gone = inproc_client.submit(np.ones, 3, pure=False)
    gone.cancel()
    with pytest.raises(RuntimeError, match=r"input of rank 2 was cancelled"):
        inproc_client.gather(flowreduce.allreduce(inproc_client, [*good, gone]))
    del good, gone
    assert_clean(inproc_client)


def _die():
    os._exit(1)


def test_worker_death_mid_call_is_a_clear_error():
    """A worker dying under a running all-reduce fails it with
    WorkerLostError naming that worker; nothing waits forever, nothing leaks."""
    from flowreduce import WorkerLostError

    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ws = sorted(client.nthreads())
        parts = [client.submit(np.random.rand, 4 * 10**6, workers=[w], pure=False) for w in ws]
        wait(parts)
        futures = flowreduce.allreduce(client, parts, algorithm="ring", chunks=16)
        try:
            client.run(_die, workers=[ws[2]])
        except Exception:
            pass  # the worker died under the call: that is the point
        with pytest.raises(WorkerLostError, match="left the cluster") as caught:
            client.gather(futures, errors="raise")
        # distributed re-raises the exception object its future state keeps, so the
        # raise appends gather's frames (which hold `futures`) to that object's
        # traceback: a cycle through the client that keeps the keys. Cut it.
        caught.value.__traceback__ = None
        del futures, parts, caught
        gc.collect()
        assert_clean(client)


def test_cancelled_input_is_named_the_same_on_every_path(inproc_client):
    """One status check for every kind of call: a template (``like=``, which
    does not wait) and a pytree of futures say what a plain call says."""
    good = scatter_ranks(inproc_client, [np.ones(3)] * 2)
    gone = inproc_client.submit(np.ones, 3, pure=False)
    gone.cancel()
    with pytest.raises(RuntimeError, match=r"input of rank 2 was cancelled \(key "):
        inproc_client.gather(flowreduce.allreduce(inproc_client, [*good, gone], like=np.ones(3)))
    with pytest.raises(RuntimeError, match=r"input of rank 2 was cancelled \(key "):
        inproc_client.gather(flowreduce.allreduce(inproc_client, [[g] for g in good] + [[gone]]))
    del good, gone
    assert_clean(inproc_client)


def _bad_calls(client):
    parts = scatter_ranks(client, [np.ones(4), np.ones(4), np.ones(5)])
    good = parts[:2]
    failed = client.submit(_boom, 1, pure=False)
    wait([failed])
    return {
        "empty": (ValueError, lambda: flowreduce.allreduce(client, [])),
        "not-a-future": (TypeError, lambda: flowreduce.allreduce(client, [np.ones(3)])),
        "unknown-algorithm": (ValueError, lambda: flowreduce.allreduce(client, good, algorithm="nope")),
        "unknown-op": (ValueError, lambda: flowreduce.allreduce(client, good, op="nope")),
        "bad-chunks": (ValueError, lambda: flowreduce.allreduce(client, good, chunks=0)),
        "planner-option": (ValueError, lambda: flowreduce.allreduce(client, good, algorithm="butterfly", radix=1)),
        "shapes": (ValueError, lambda: flowreduce.allreduce(client, parts)),
        "template": (ValueError, lambda: flowreduce.allreduce(client, [[g] for g in good],
                                                              like=[np.ones(4), np.ones(4)])),
        "failed-input": (RuntimeError, lambda: flowreduce.allreduce(client, [*good, failed])),
        "topology": (TypeError, lambda: flowreduce.allreduce(client, good, algorithm="hierarchical", topology=3)),
    }


@pytest.mark.parametrize("case", ["empty", "not-a-future", "unknown-algorithm", "unknown-op", "bad-chunks",
                                  "planner-option", "shapes", "template", "failed-input", "topology"])
def test_errors_are_flowreduce_errors_and_the_builtins(inproc_client, case):
    builtin, call = _bad_calls(inproc_client)[case]
    with pytest.raises(builtin) as caught:  # option errors from the call, input errors from its results
        inproc_client.gather(call())
    assert isinstance(caught.value, flowreduce.FlowreduceError), repr(caught.value)
    assert_clean(inproc_client)


def test_worker_lost_error_is_a_flowreduce_runtime_error():
    import pickle

    from flowreduce import WorkerLostError

    exc = pickle.loads(pickle.dumps(WorkerLostError("worker tcp://a:1 left")))  # the plugin pickles it
    assert isinstance(exc, flowreduce.FlowreduceError) and isinstance(exc, RuntimeError)
    assert str(exc) == "worker tcp://a:1 left"
