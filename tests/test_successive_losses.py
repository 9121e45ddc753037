"""Workers lost one after the other, after a call or during it, for every
dense algorithm (issue #24): each rank's future settles, to the right sum
where its inputs can be recomputed, else to a WorkerLostError naming a rank
and a key. It never stays ``lost`` (rank 1's result used to, after rank 2's
pinned input had failed the call: docs/failures.md).

Each test runs two calls side by side on the same four workers, one whose
inputs are pinned strictly to their worker (``submit(..., workers=[w])``:
nothing can recompute them) and one whose inputs have lineage
(``allow_other_workers=True``), and SIGKILLs the workers of rank 2, then of
rank 1. The cluster has two spare workers, so a test need not wait for the
nannies to restart the ones the last test killed. Waits are bounded only
so that a regression fails instead of hanging; nothing here is timed."""

from __future__ import annotations

import gc
import os
import signal
import uuid

import numpy as np
import pytest
from conftest import assert_clean, wait_until
from distributed import Client, Event, LocalCluster, wait

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


def _scheduler_state(key, dask_scheduler=None):
    ts = dask_scheduler.tasks.get(key)
    return ts.state if ts is not None else None


def _kill(client, worker: str) -> None:
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
    assert wait_until(lambda: worker not in client.nthreads(), HANG)


def _inputs(client, ws: list[str], pinned: bool, ranks=range(4)) -> list:
    return [client.submit(rank_input, r, workers=[ws[r]], allow_other_workers=not pinned, pure=False) for r in ranks]


def _names(e: BaseException, keys) -> bool:
    """Whether ``e`` is a WorkerLostError naming rank 1 or 2 and one of ``keys``."""
    return isinstance(e, WorkerLostError) and any(f"of rank {q} (key {k!r})" in str(e) for q in (1, 2) for k in keys)


@pytest.mark.parametrize("algorithm", DENSE)
def test_two_workers_killed_one_after_the_other_after_the_call(client, algorithm):
    """Both calls finished; the worker of rank 2 is SIGKILLed and its results
    settle, then the worker of rank 1. Lineage: every rank recomputes the
    right sum. Pinned: ranks 1 and 2 fail naming their rank and a key (rank
    1's result needs rank 2's input, which failed), ranks 0 and 3 keep theirs."""
    ws = sorted(client.nthreads())[:4]
    pinned, lineage = _inputs(client, ws, True), _inputs(client, ws, False)
    outs = {True: flowreduce.allreduce(client, pinned, algorithm=algorithm),
            False: flowreduce.allreduce(client, lineage, algorithm=algorithm)}
    wait([*outs[True], *outs[False]], timeout=HANG)
    assert flowreduce.describe(outs[True]).workers == tuple(ws)
    for r in (2, 1):
        _kill(client, ws[r])
        for out in outs.values():
            key = out[r].key
            assert wait_until(lambda key=key: client.run_on_scheduler(_scheduler_state, key) in ("memory", "erred"),
                              HANG), f"rank {r}'s result did not settle after its worker died"
    for is_pinned, out in outs.items():
        wait(out, timeout=HANG)
        inputs = pinned if is_pinned else lineage
        for r, f in enumerate(out):
            if is_pinned and r in (1, 2):
                e = f.exception()
                assert _names(e, (f.key, inputs[r].key, inputs[2].key)) and f"rank {r}" in str(e), f"rank {r}: {e!r}"
            else:
                np.testing.assert_array_equal(f.result(), expected(), err_msg=f"rank {r}, pinned={is_pinned}")
    del outs, out, f, pinned, lineage, inputs


@pytest.mark.parametrize("algorithm", DENSE)
def test_two_workers_killed_during_the_call(client, algorithm):
    """Both calls wait for rank 3's input (held back by an Event) while the
    workers of rank 2, then of rank 1, are SIGKILLed. Lineage: the call
    recovers twice and every rank gets the right sum, its inputs untouched.
    Pinned: every rank fails naming rank 1 or 2 and its input's key."""
    ws = sorted(client.nthreads())[:4]
    pinned, lineage = _inputs(client, ws, True, range(3)), _inputs(client, ws, False, range(3))
    wait([*pinned, *lineage], timeout=HANG)
    name = f"flowreduce-test-{uuid.uuid4().hex}"
    event = Event(name, client=client)
    try:
        for inputs in (pinned, lineage):
            inputs.append(client.submit(_held_back, name, 3, workers=[ws[3]], pure=False))
        outs = {True: flowreduce.allreduce(client, pinned, algorithm=algorithm, like=np.zeros(N, np.int64)),
                False: flowreduce.allreduce(client, lineage, algorithm=algorithm, like=np.zeros(N, np.int64))}
        assert flowreduce.describe(outs[True]).workers == tuple(ws)
        assert not any(f.done() for out in outs.values() for f in out)
        _kill(client, ws[2])
        _kill(client, ws[1])
    finally:
        event.set()
    for is_pinned, out in outs.items():
        wait(out, timeout=HANG)
        for r, f in enumerate(out):
            if is_pinned:
                e = f.exception()
                assert _names(e, (pinned[1].key, pinned[2].key)), f"rank {r}: {e!r}"
            else:
                np.testing.assert_array_equal(f.result(), expected(), err_msg=f"rank {r}")
    for r, x in enumerate(client.gather(lineage)):
        np.testing.assert_array_equal(x, rank_input(r), err_msg=f"input of rank {r}")
    del outs, out, f, pinned, lineage, inputs
