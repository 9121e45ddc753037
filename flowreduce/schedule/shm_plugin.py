"""The worker side of the same-host data plane: a part of flowreduce's
worker extension (:mod:`flowreduce.schedule.extension`) that gives each
worker process its shared-memory pool's lifecycle.

At setup the worker makes its pool (which unlinks segments left by dead
workers on its host: a nanny's restart after SIGKILL reclaims them); while it
runs, free segments and peer mappings idle for ``flowreduce.shm.idle-seconds``
are dropped; at teardown (the worker closing) every segment it owns is
unlinked. The pool itself lives in :mod:`flowreduce.shm.pool`, which
tasks use without importing distributed. The warm buffers results are made in
(:mod:`flowreduce.shm.result_buffers`) get the same bound by memory, idle
release and close.
"""

from __future__ import annotations

import logging
from typing import Any

from dask.typing import Key
from distributed import Client, Worker
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.worker_state_machine import TaskStateState

from flowreduce import keys
from flowreduce.shm import pool as shm_pool
from flowreduce.shm import result_buffers

logger = logging.getLogger("flowreduce")


class SharedMemoryPlugin(WorkerPlugin):
    """The pool's part of the worker extension (a second client keeps the running one, and its pool)."""

    def __init__(self, settings: dict[str, Any] | None = None):
        # The shm settings every worker ran with when the plugin was installed. A worker its nanny
        # restarts gets the nanny's config snapshot, a shallow copy: a ``dask.config.set`` around
        # ``LocalCluster`` has since been undone in it, so without these that worker would put its
        # segments in another directory than its peers read (and reclaim none of the dead one's).
        self.settings = settings

    def setup(self, worker: Worker) -> None:
        import dask.config
        from tornado.ioloop import PeriodicCallback

        self.worker = worker
        why = None if self.settings is None else shm_pool.settings_refusal(self.settings)
        if why is not None:  # the worker keeps its own configuration
            logger.error("flowreduce: the shared-memory pool refused its settings (%s): %s", why,
                         repr(self.settings)[:200])
        elif self.settings is not None and shm_pool.current() is None:
            dask.config.set({f"flowreduce.shm.{k}": v for k, v in self.settings.items()})
        pool = shm_pool.pool()
        fraction = shm_pool.config()["memory-fraction"]
        bound_by_memory(pool, worker.memory_manager.memory_limit, fraction)
        bound_by_memory(result_buffers.buffers(), worker.memory_manager.memory_limit, fraction)
        interval = max(0.05, min(pool.idle / 2, 5.0)) * 1000
        self._idle = PeriodicCallback(self._release_idle, interval)
        self._idle.start()

    def _release_idle(self) -> None:
        for pool in (shm_pool.current(), result_buffers.current()):
            if pool is not None:
                pool.release_idle()

    def transition(self, key: Key, start: TaskStateState, finish: TaskStateState, **kwargs: Any) -> None:
        """Once the last key of a call leaves this worker, give back what the
        call still leases (normally nothing: its values are gone and took
        their leases with them; after an error, a kept traceback may hold one)."""
        if finish != "forgotten":
            return
        info = keys.parse(key)
        pool = shm_pool.current()
        if info is None or pool is None or not pool.owns(info["token"]):
            return
        token = info["token"]
        if not any(k != key and (i := keys.parse(k)) is not None and i["token"] == token
                   for k in self.worker.state.tasks):
            pool.release_owner(token)

    def teardown(self, worker: Worker) -> None:
        from distributed.core import Status

        idle = getattr(self, "_idle", None)
        if idle is not None:
            idle.stop()
        if worker.status in (Status.closing, Status.closed, Status.closing_gracefully, Status.failed):
            shm_pool.close()  # the worker is going; a replaced plugin leaves the pool to its successor
            result_buffers.close()


def bound_by_memory(pool: shm_pool.Pool | result_buffers.Buffers, memory_limit: int | None, fraction: float) -> None:
    """Keep the pool within ``fraction`` of the worker's memory limit: its
    pages count in the worker's RSS, and a worker past its limit is paused,
    then killed by its nanny (seen at 1e8 elements with the 4 GiB default
    and 6 GiB workers). No limit, no change."""
    if memory_limit:
        pool.limit = min(pool.limit, int(fraction * memory_limit))


def pool_stats(dask_worker: Worker | None = None) -> dict:
    """This worker's pool (leased and free segments, bytes): run by
    ``client.run``; what :func:`usage` reports."""
    pool, results = shm_pool.current(), result_buffers.current()
    return {**(pool.stats() if pool is not None else {}), **(results.stats() if results is not None else {})}


def usage(client: Client) -> dict[str, dict]:
    """Each worker's shared-memory pool: segments leased and free, bytes held
    (counted in the worker's memory, as its process maps them), and why shared
    memory is off there, if it is."""
    return client.run(pool_stats)


def workers_settings(client: Client) -> dict[str, Any] | None:
    """The shm settings every worker runs with now, if they agree (None: they do not, or no worker):
    what :class:`SharedMemoryPlugin` gives the workers, present and future."""
    seen = list(client.run(shm_pool.config).values())
    return seen[0] if seen and all(s == seen[0] for s in seen) else None
