"""flowreduce on a cluster: one scheduler plugin and one worker plugin, both
named :data:`NAME`, installed once per cluster by :func:`ensure_extension`
(as ``distributed.shuffle`` has one of each).

Each is made of parts, one concept per module, each with its own state:

* :class:`SchedulerExtension` (``scheduler.plugins["flowreduce"]``):
  ``p2p`` (:class:`~flowreduce.schedule.p2p.P2PSchedulerPlugin`: the p2p
  runs, their run ids and restarts), ``guard``
  (:class:`~flowreduce.schedule.guard.PinGuard`: call records, recovery,
  timeouts, the replica guard), ``spmd``
  (:class:`~flowreduce.schedule.spmd_watch.SpmdSchedulerPlugin`: SPMD jobs'
  lost workers) and ``dashboard``
  (:class:`~flowreduce.dashboard.plugin.DashboardPlugin`: the ``/flowreduce``
  page's store);
* :class:`WorkerExtension` (``worker.plugins["flowreduce"]``, on every
  worker, present and future): ``shm``
  (:class:`~flowreduce.schedule.shm_plugin.SharedMemoryPlugin`: the
  shared-memory pool and result buffers), ``p2p``
  (:class:`~flowreduce.schedule.p2p.P2PWorkerPlugin`: the engine),
  ``peer_reads`` (:class:`~flowreduce.schedule.peer_reads.PeerHandlersPlugin`)
  and ``spmd`` (:class:`~flowreduce.schedule.spmd_mailbox.SpmdWorkerPlugin`:
  the mailbox).

The composites forward the scheduler's and the worker's hooks to the parts
that have them, one part's failure logged without keeping the others from
theirs (as distributed does between plugins), and register the handlers
and stream handlers the parts name.

The dashboard layer, below this one, cannot install the extension: the
preload (``--preload flowreduce.dashboard``) and
:func:`flowreduce.dashboard.install` put the store alone in the
extension's place, and the extension adopts it, with its history, when it
comes (:func:`install`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from flowreduce.dashboard import installed as dashboard_installed
from flowreduce.dashboard.plugin import DashboardPlugin
from flowreduce.dashboard.record import EXTENSION
from flowreduce.dashboard.store import DashboardStore
from flowreduce.schedule.guard import PinGuard
from flowreduce.schedule.p2p import P2PSchedulerPlugin, P2PWorkerPlugin
from flowreduce.schedule.peer_reads import PeerHandlersPlugin
from flowreduce.schedule.shm_plugin import SharedMemoryPlugin, workers_settings
from flowreduce.schedule.spmd_mailbox import SpmdWorkerPlugin
from flowreduce.schedule.spmd_watch import SpmdSchedulerPlugin

__all__ = ["NAME", "SchedulerExtension", "WorkerExtension", "ensure_extension"]

logger = logging.getLogger("flowreduce")

#: The name of both plugins (``scheduler.plugins[NAME]``, ``worker.plugins[NAME]``).
NAME = EXTENSION

_SCHEDULER_HOOKS = ("update_graph", "restart", "transition", "add_worker", "remove_worker", "add_client",
                    "remove_client", "log_event")


def _overrides(part: Any, base: type, hook: str) -> bool:
    return getattr(type(part), hook, None) is not getattr(base, hook, None)


def _owner(method: Callable[..., Any]) -> str:
    """The name of the part whose hook ``method`` is (for a log line)."""
    return type(getattr(method, "__self__", None)).__name__


class SchedulerExtension(SchedulerPlugin):
    """flowreduce's scheduler plugin: its parts, in the order they see each hook."""

    name = NAME
    idempotent = True

    def __init__(self, attempts: int | None = None) -> None:
        self.p2p = P2PSchedulerPlugin()
        self.guard = PinGuard(attempts)  # attempts: the dask config of the client installing it
        self.spmd = SpmdSchedulerPlugin()
        self.dashboard: DashboardStore = DashboardPlugin()
        self._hooks: dict[str, list[Callable[..., Any]]] = {}
        self._transitions: list[Callable[..., Any]] = []

    def parts(self) -> tuple[SchedulerPlugin, ...]:
        return (self.p2p, self.guard, self.spmd, self.dashboard)

    async def start(self, scheduler: Any) -> None:
        await self._start(scheduler, adopted=None)

    async def _start(self, scheduler: Any, adopted: DashboardStore | None) -> None:
        for part in (self.p2p, self.guard, self.spmd):
            await part.start(scheduler)
            scheduler.handlers.update(getattr(part, "handlers", dict)())
            scheduler.stream_handlers.update(getattr(part, "stream_handlers", dict)())
        if adopted is not None:  # started already, alone: it keeps its history and its page
            self.dashboard = adopted
        else:
            try:  # it registers its own stream handler, as it does alone
                await self.dashboard.start(scheduler)
            except Exception as e:  # never fail an all-reduce for its dashboard
                logger.warning("flowreduce: the dashboard's store did not start: %r", e)
        # only the parts that have a hook are called for it: transition runs for every task
        self._hooks = {hook: [getattr(p, hook) for p in self.parts() if _overrides(p, SchedulerPlugin, hook)]
                       for hook in _SCHEDULER_HOOKS}
        self._transitions = self._hooks["transition"]

    def _each(self, hook: str, *args: Any, **kwargs: Any) -> list[Any]:
        out = []
        for method in self._hooks.get(hook, ()):
            try:
                out.append(method(*args, **kwargs))
            except Exception:
                logger.info("flowreduce: %s of %s failed", hook, _owner(method),
                            exc_info=True)
        return out

    def _each_awaitable(self, hook: str, *args: Any, **kwargs: Any) -> Awaitable[Any] | None:
        """The parts' hook called now; an awaitable of those that return one (the scheduler awaits it), else None."""
        pending = [r for r in self._each(hook, *args, **kwargs) if inspect.isawaitable(r)]
        return asyncio.gather(*pending, return_exceptions=True) if pending else None

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        for method in self._transitions:
            try:
                method(key, start, finish, *args, **kwargs)
            except Exception:
                logger.info("flowreduce: transition of %s failed", _owner(method), exc_info=True)

    def update_graph(self, scheduler: Any, **kwargs: Any) -> None:
        self._each("update_graph", scheduler, **kwargs)

    def restart(self, scheduler: Any) -> None:
        self._each("restart", scheduler)

    def add_worker(self, scheduler: Any, worker: str) -> Awaitable[Any] | None:
        return self._each_awaitable("add_worker", scheduler=scheduler, worker=worker)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> Awaitable[Any] | None:
        return self._each_awaitable("remove_worker", scheduler=scheduler, worker=worker, **kwargs)

    def add_client(self, scheduler: Any, client: str) -> None:
        self._each("add_client", scheduler=scheduler, client=client)

    def remove_client(self, scheduler: Any, client: str) -> None:
        self._each("remove_client", scheduler=scheduler, client=client)

    def log_event(self, topic: str, msg: Any) -> None:
        self._each("log_event", topic, msg)

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        for part in self.parts():
            if _overrides(part, SchedulerPlugin, "valid_workers_downscaling"):
                workers = part.valid_workers_downscaling(scheduler, workers)
        return workers

    async def before_close(self) -> None:
        for part in self.parts():
            await part.before_close()

    async def close(self) -> None:
        for part in self.parts():
            await part.close()


class WorkerExtension(WorkerPlugin):
    """flowreduce's worker plugin: its parts, set up in this order (the pool
    first: its settings are the worker's before anything reads them) and
    torn down in the reverse."""

    name = NAME
    idempotent = True  # a second client keeps the running one (its pool, runs and mailboxes)

    def __init__(self, shm_settings: dict[str, Any] | None = None) -> None:
        self.shm = SharedMemoryPlugin(shm_settings)
        self.p2p = P2PWorkerPlugin()
        self.peer_reads = PeerHandlersPlugin()
        self.spmd = SpmdWorkerPlugin()
        self._transitions: list[Callable[..., Any]] = []
        self._registered: list[tuple[dict[str, Any], str]] = []

    def parts(self) -> tuple[WorkerPlugin, ...]:
        return (self.shm, self.p2p, self.peer_reads, self.spmd)

    def setup(self, worker: Any) -> None:
        failed: Exception | None = None
        for part in self.parts():
            try:
                part.setup(worker)
            except Exception as e:  # the others still set up; the client sees the error, as from its own plugin
                logger.exception("flowreduce: setup of %s failed", type(part).__name__)
                failed = failed or e
                continue
            tables: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
                (worker.handlers, getattr(part, "handlers", dict)()),
                (worker.stream_handlers, getattr(part, "stream_handlers", dict)()))
            for table, named in tables:
                table.update(named)
                self._registered.extend((table, name) for name in named)
        self._transitions = [p.transition for p in self.parts() if _overrides(p, WorkerPlugin, "transition")]
        if failed is not None:
            raise failed

    def transition(self, key: Any, start: Any, finish: Any, **kwargs: Any) -> None:
        for method in self._transitions:
            try:
                method(key, start, finish, **kwargs)
            except Exception:
                logger.info("flowreduce: transition of %s failed", _owner(method), exc_info=True)

    def teardown(self, worker: Any) -> None:
        for table, name in self._registered:
            table.pop(name, None)
        self._registered.clear()
        failed: Exception | None = None
        for part in reversed(self.parts()):
            try:
                part.teardown(worker)
            except Exception as e:  # the other parts still let go of theirs
                logger.exception("flowreduce: teardown of %s failed", type(part).__name__)
                failed = failed or e
        if failed is not None:
            raise failed


async def install(extension: SchedulerExtension, worker_extension: WorkerExtension,
                  dask_scheduler: Any = None) -> dict[str, Any]:
    """On the scheduler (``run_on_scheduler``): put ``extension`` in place
    unless one is there (adopting a store found alone in its place), then
    ``worker_extension`` on every worker, present and future, unless it is
    there; the workers' replies."""
    from distributed.protocol.pickle import dumps

    s = dask_scheduler
    there = s.plugins.get(NAME)
    if not isinstance(there, SchedulerExtension):
        # no await before the plugin is in place (every part's start is synchronous): no other client's install
        # runs in between
        await extension._start(s, adopted=there if isinstance(there, DashboardStore) else None)
        s.plugins[NAME] = extension
    return await s.register_worker_plugin(None, dumps(worker_extension), name=NAME, idempotent=True)


_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ensure_extension(client: Any) -> None:
    """Install flowreduce's extension once per client (on the scheduler and
    every worker, present and future); after the first call, no round trip.
    Not once per scheduler address: a scheduler started later on the same
    port is another scheduler, without it."""
    if client in _installed:
        return
    from distributed.core import clean_exception

    replies = client.run_on_scheduler(install, SchedulerExtension(), WorkerExtension(workers_settings(client)))
    for reply in (replies or {}).values():
        if reply.get("status") == "error":  # as client.register_plugin raises a worker's setup error
            _, exc, tb = clean_exception(reply["exception"], reply["traceback"])
            assert exc is not None
            raise exc.with_traceback(tb)
    _installed[client] = True
    dashboard_installed(client)  # the extension holds the store: the dashboard's install costs nothing more
