"""Workers lost one after the other, after a call or during it, for every
dense algorithm (issue #24): each rank's future settles, to the right sum
where its inputs can be recomputed, else to a WorkerLostError naming a rank
and a key. It never stays ``lost`` (rank 1's result used to, after rank 2's
pinned input had failed the call: docs/failures.md).

Each test runs three calls side by side on the same four workers, one whose
inputs are pinned strictly to their worker (``submit(..., workers=[w])``:
nothing can recompute them), one whose inputs are scattered there (no
lineage) and one whose inputs have lineage (``allow_other_workers=True``),
and SIGKILLs the workers of rank 2, then of rank 1. The cluster has two spare workers, so a test need not wait for the
nannies to restart the ones the last test killed. Waits are bounded only
so that a regression fails instead of hanging; nothing here is timed."""

from __future__ import annotations

import gc
import os
import signal
import uuid

import numpy as np
import pytest
from distributed import Client, Event, LocalCluster, wait
from utils import assert_clean, flush, wait_until

import flowreduce
from flowreduce.errors import WorkerLostError

N = 10**5  # elements per rank: enough for the shared-memory paths
HANG = 60  # s: past this a wait counts as a hang
DENSE = [a for a in flowreduce.ALGORITHMS if a != "auto"]
SPARE = 2


def rank_input(r: int) -> np.ndarray:
    """Deterministic, so a recomputed input equals the lost one."""
    return np.arange(N, dtype=np.int64) * (r + 1) + r


def expected() -> np.ndarray:
    return sum(rank_input(r) for r in range(4))


def _held_back(name: str, r: int) -> np.ndarray:
    Event(name).wait()
    return rank_input(r)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=4 + SPARE, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        yield c


@pytest.fixture
def client(cluster):
    """At least four running workers; the nannies bring back the killed ones
    meanwhile (one that never comes back is replaced)."""
    with Client(cluster) as c:
        for name, w in list(cluster.workers.items()):
            if w.status.name == "closed":
                cluster.workers.pop(name)
                cluster.worker_spec.pop(name, None)
        cluster.scale(4 + SPARE)
        c.wait_for_workers(4, timeout=HANG)
        yield c
        gc.collect()
        assert_clean(c)


def _process_started() -> float:
    import psutil

    return psutil.Process().create_time()


def settled_workers(client) -> list[str]:
    """Four ranks' workers: the longest running, sorted. A nanny that restarted a killed worker may
    still be settling it (CI saw a second start of the same name, refused as "name taken", end the
    worker that had registered, mid-call): the killed ones' successors are the spares."""
    started = client.run(_process_started)
    return sorted(sorted(started, key=lambda w: started[w])[:4])


def _scheduler_state(key, dask_scheduler=None):
    ts = dask_scheduler.tasks.get(key)
    return ts.state if ts is not None else None


def _kill(client, worker: str) -> None:
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
    assert wait_until(lambda: worker not in client.nthreads(), HANG)


KINDS = ("pinned", "scattered", "lineage")


def _inputs(client, ws: list[str], kind: str, ranks=range(4)) -> list:
    if kind == "scattered":
        return [client.scatter(rank_input(r), workers=[ws[r]], hash=False) for r in ranks]
    return [client.submit(rank_input, r, workers=[ws[r]], allow_other_workers=kind == "lineage", pure=False)
            for r in ranks]


def _names(e: BaseException, keys) -> bool:
    """Whether ``e`` is a WorkerLostError naming rank 1 or 2 and one of ``keys``."""
    return isinstance(e, WorkerLostError) and any(f"of rank {q} (key {k!r})" in str(e) for q in (1, 2) for k in keys)


@pytest.mark.parametrize("algorithm", DENSE)
def test_two_workers_killed_one_after_the_other_after_the_call(client, algorithm):
    """The calls finished; the worker of rank 2 is SIGKILLed and its results
    settle, then the worker of rank 1. Lineage: every rank recomputes the
    right sum. Pinned or scattered: ranks 1 and 2 fail naming their rank and
    a key (rank 1's result needs rank 2's input, which failed; a scattered
    one used to be cancelled, "already forgotten"), ranks 0 and 3 keep theirs."""
    ws = settled_workers(client)
    inputs = {kind: _inputs(client, ws, kind) for kind in KINDS}
    outs = {kind: flowreduce.allreduce(client, parts, algorithm=algorithm) for kind, parts in inputs.items()}
    wait([f for out in outs.values() for f in out], timeout=HANG)
    assert flowreduce.describe(outs["pinned"]).workers == tuple(ws)
    for r in (2, 1):
        _kill(client, ws[r])
        for kind, out in outs.items():
            key = out[r].key
            assert wait_until(lambda key=key: client.run_on_scheduler(_scheduler_state, key) in ("memory", "erred"),
                              HANG), (f"rank {r}'s result ({kind} inputs) did not settle after its worker died: "
                                      f"{client.run_on_scheduler(_scheduler_state, key)}")
    for kind, out in outs.items():
        wait(out, timeout=HANG)
        parts = inputs[kind]
        for r, f in enumerate(out):
            if kind != "lineage" and r in (1, 2):
                e = f.exception()
                assert _names(e, (f.key, parts[r].key, parts[2].key)) and f"rank {r}" in str(e), f"{kind} {r}: {e!r}"
            else:
                np.testing.assert_array_equal(f.result(), expected(), err_msg=f"rank {r}, {kind} inputs")
    del outs, out, f, inputs, parts


def test_a_call_done_before_its_watch_arrived_still_names_a_lost_scattered_input(client, monkeypatch):
    """A small call can finish before the scheduler reads the message that
    watches it (CI saw it once, for ``direct``). Its scattered inputs must
    still be patched to name their rank when lost: unpatched, losing rank 2's
    worker made Dask forget rank 2's result, which then never settled."""
    from flowreduce.schedule import guard

    original = guard.watch

    def late(c, token, outputs, inputs, timeout, hold=False):
        assert wait_until(lambda: all(c.run_on_scheduler(_scheduler_state, k) == "memory" for k in outputs), HANG)
        original(c, token, outputs, inputs, timeout, hold)

    monkeypatch.setattr(guard, "watch", late)
    ws = settled_workers(client)
    parts = _inputs(client, ws, "scattered")
    out = flowreduce.allreduce(client, parts, algorithm="direct")
    monkeypatch.undo()
    wait(out, timeout=HANG)
    flush(client)
    _kill(client, ws[2])
    key = out[2].key
    assert wait_until(lambda: client.run_on_scheduler(_scheduler_state, key) in ("memory", "erred"), HANG), (
        f"rank 2's result did not settle: {client.run_on_scheduler(_scheduler_state, key)}")
    e = out[2].exception()
    assert _names(e, (key, parts[2].key)) and "rank 2" in str(e), repr(e)
    for r in (0, 1, 3):
        np.testing.assert_array_equal(out[r].result(), expected(), err_msg=f"rank {r}")
    del out, parts, e


@pytest.mark.parametrize("method", ["tasks", "p2p"])
def test_a_worker_lost_before_the_watch_arrived_names_the_scattered_input(client, monkeypatch, method):
    """Rank 2's worker dies after the call's graph reached the scheduler
    but before its watch did (CI saw a hand-in start and its worker die
    first). Its scattered input still fails every rank naming rank 2 and the
    key: the guard patched it when the graph arrived. Unpatched, Dask forgot
    the call and every result was cancelled ("already forgotten")."""
    from flowreduce.schedule import guard

    original = guard.watch
    ws = settled_workers(client)

    def late(c, token, outputs, inputs, timeout, hold=False):
        flush(c)  # the graph is there
        _kill(c, ws[2])
        original(c, token, outputs, inputs, timeout, hold)

    monkeypatch.setattr(guard, "watch", late)
    parts = _inputs(client, ws, "scattered")
    out = flowreduce.allreduce(client, parts, algorithm="butterfly", method=method)
    monkeypatch.undo()
    for r, f in enumerate(out):  # a rank whose result was in memory on a survivor before the loss keeps it
        e = f.exception(timeout=HANG)
        if r == 2 or e is not None:
            assert _names(e, (parts[2].key,)) and "rank 2" in str(e), f"rank {r}: {e!r}"
        else:
            np.testing.assert_array_equal(f.result(), expected(), err_msg=f"rank {r}")
    del out, parts, f, e


@pytest.mark.parametrize("algorithm", DENSE)
def test_two_workers_killed_during_the_call(client, algorithm):
    """The calls wait for rank 3's input (held back by an Event) while the
    workers of rank 2, then of rank 1, are SIGKILLed. Lineage: the call
    recovers twice and every rank gets the right sum, its inputs untouched.
    Pinned or scattered: every rank fails naming rank 1 or 2 and its input's key."""
    ws = settled_workers(client)
    inputs = {kind: _inputs(client, ws, kind, range(3)) for kind in KINDS}
    wait([f for parts in inputs.values() for f in parts], timeout=HANG)
    name = f"flowreduce-test-{uuid.uuid4().hex}"
    event = Event(name, client=client)
    try:
        for parts in inputs.values():
            parts.append(client.submit(_held_back, name, 3, workers=[ws[3]], pure=False))
        outs = {kind: flowreduce.allreduce(client, parts, algorithm=algorithm, like=np.zeros(N, np.int64))
                for kind, parts in inputs.items()}
        assert flowreduce.describe(outs["pinned"]).workers == tuple(ws)
        assert not any(f.done() for out in outs.values() for f in out)
        flush(client)  # the scheduler has the calls: a kill before would race their graphs (Dask cancels those)
        _kill(client, ws[2])
        _kill(client, ws[1])
    finally:
        event.set()
    for kind, out in outs.items():
        wait(out, timeout=HANG)
        parts = inputs[kind]
        for r, f in enumerate(out):
            if kind != "lineage":
                e = f.exception()
                assert _names(e, (parts[1].key, parts[2].key)), f"{kind} {r}: {e!r}"
            else:
                np.testing.assert_array_equal(f.result(), expected(), err_msg=f"rank {r}")
    for r, x in enumerate(client.gather(inputs["lineage"])):
        np.testing.assert_array_equal(x, rank_input(r), err_msg=f"input of rank {r}")
    del outs, out, f, inputs, parts
