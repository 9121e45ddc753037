"""flowreduce is one scheduler plugin and one worker plugin on a cluster
(flowreduce.schedule.extension), whatever a client ran on it (all-reduces of
both methods, an SPMD job, the dashboard's install, the dashboard's preload),
and a worker that joins later gets the worker plugin too."""

from __future__ import annotations

import numpy as np
import pytest
from distributed import Client, LocalCluster
from utils import scatter_ranks

import flowreduce
import flowreduce.dashboard
from flowreduce.dashboard.store import store_of
from flowreduce.schedule.guard import guard_of
from flowreduce.schedule.p2p import engine_of, p2p_of
from flowreduce.schedule.spmd_mailbox import mailbox_of


def _ours(plugins: dict) -> list[str]:
    """The names of the plugins flowreduce put there."""
    return sorted(name for name, p in plugins.items() if type(p).__module__.startswith("flowreduce"))


def _scheduler_side(dask_scheduler=None) -> dict:
    return {"plugins": _ours(dask_scheduler.plugins), "guard": guard_of(dask_scheduler) is not None,
            "p2p": p2p_of(dask_scheduler) is not None, "calls": len(store_of(dask_scheduler).listing())}


def _worker_side(dask_worker=None) -> dict:
    return {"plugins": _ours(dask_worker.plugins), "engine": engine_of(dask_worker) is not None,
            "mailbox": mailbox_of(dask_worker) is not None}


def _summed(comm, x):
    return comm.allreduce(x)


def _check(client, workers: int, calls: int) -> None:
    seen = client.run_on_scheduler(_scheduler_side)
    assert seen == {"plugins": ["flowreduce"], "guard": True, "p2p": True, "calls": seen["calls"]}
    assert seen["calls"] >= calls  # the store's history: a preloaded store was adopted, not replaced
    on_workers = client.run(_worker_side)
    assert len(on_workers) == workers
    assert all(w == {"plugins": ["flowreduce"], "engine": True, "mailbox": True} for w in on_workers.values()), \
        on_workers


@pytest.mark.parametrize("preload", [False, True], ids=["installed-by-the-calls", "dashboard-preloaded"])
def test_one_plugin_on_the_scheduler_and_on_every_worker_whatever_ran(preload):
    options = {"scheduler_kwargs": {"preload": ["flowreduce.dashboard"]}} if preload else {}
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0",
                      **options) as cluster, Client(cluster) as client:
        if preload:
            assert client.run_on_scheduler(lambda dask_scheduler: _ours(dask_scheduler.plugins)) == ["flowreduce"]
        xs = scatter_ranks(client, [np.full(8, r + 1.0) for r in range(4)])
        for method in ("tasks", "p2p"):
            out = flowreduce.allreduce(client, xs, method=method)
            np.testing.assert_array_equal(client.gather(out)[3], np.full(8, 10.0))
        jobs = flowreduce.spmd(client, _summed, [np.full(3, r + 1.0) for r in range(4)], timeout=30)
        np.testing.assert_array_equal(client.gather(jobs)[0], np.full(3, 10.0))
        assert flowreduce.dashboard.install(client)
        with Client(cluster) as other:  # a client that never ran a call asks the scheduler itself
            assert flowreduce.dashboard.install(other)
        _check(client, workers=2, calls=2)

        cluster.scale(3)
        client.wait_for_workers(3)
        _check(client, workers=3, calls=2)
        late = scatter_ranks(client, [np.full(8, r + 1.0) for r in range(3)])  # a rank on the new worker
        out = flowreduce.allreduce(client, late, method="p2p")
        np.testing.assert_array_equal(client.gather(out)[2], np.full(8, 6.0))
        del out, xs, late, jobs
