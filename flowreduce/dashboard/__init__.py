"""A live flowreduce page in the Dask dashboard, at ``/flowreduce``.

Every all-reduce shows there while it runs: the calls in flight and the
last ones finished, the selected call's plan as ranks × steps coloured by
the state of its tasks, bytes per link, progress per rank and the
straggler (docs/dashboard.md); and the SPMD jobs (``flowreduce.spmd``)
live or recently ended, with each rank's last collective
(:mod:`flowreduce.dashboard.jobs`; :func:`spmd_jobs` gives the rows).

The page lives on the scheduler, fed by a store
(:class:`~flowreduce.dashboard.plugin.DashboardPlugin`), a part of
flowreduce's scheduler extension (:mod:`flowreduce.schedule.extension`). It is there

* as soon as a client has run an all-reduce (which installs the extension
  once per client), or after :func:`install`;
* from the scheduler's start with ``--preload flowreduce.dashboard``
  (``dask scheduler --preload flowreduce.dashboard``, dask-jobqueue's
  ``scheduler_options={"preload": ["flowreduce.dashboard"]}``, or the config
  key ``distributed.scheduler.preload``).

The page needs bokeh on the scheduler (``pip install flowreduce[viz]``);
without it the plugin records calls and serves no page. Nothing here
imports bokeh until the scheduler serves the page.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

from flowreduce.dashboard.record import CALL_STATES, CELL_STATES, DashboardRecord, record_of

__all__ = ["CALL_STATES", "CELL_STATES", "DashboardRecord", "dask_setup", "install", "publish", "record_of",
           "spmd_jobs"]

logger = logging.getLogger("flowreduce.dashboard")

_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(client) -> bool:
    """Install the dashboard's store (and so the page) once per client: alone,
    in the place of flowreduce's extension, which adopts it when it comes; a
    scheduler that has one already (alone or in the extension) keeps it and
    its history. False, with a warning logged, when the scheduler cannot take
    it (the all-reduce goes on)."""
    ok = _installed.get(client)
    if ok is None:
        from flowreduce.dashboard.plugin import DashboardPlugin

        try:
            client.register_plugin(DashboardPlugin())
            ok = True
        except Exception as e:  # never fail an all-reduce for its dashboard
            logger.warning("flowreduce dashboard not installed on the scheduler: %r", e)
            ok = False
        _installed[client] = ok
    return ok


def installed(client) -> None:
    """``client``'s scheduler has the store (flowreduce's extension, just
    installed, holds one): :func:`install` need not ask it."""
    _installed[client] = True


def publish(client, calls: Sequence[Any], *, group: str = "", transport: str | None = None) -> None:
    """Tell the scheduler's dashboard about the all-reduces one call just submitted.

    ``calls`` are the schedule layer's records of them (one, or one per
    bucket of a pytree call; anything with ``plan``, ``token``, ``nbytes``,
    ``predicted``, ``workers``), ``group`` the token of the whole call. One
    message each on the client's batched stream to the scheduler, after the
    graph (no round trip)."""
    if not install(client):
        return
    from flowreduce.dashboard.store import OP

    for call in calls:
        client._send_to_scheduler({"op": OP, "record": record_of(call, group=group, transport=transport).message()})


async def _spmd_jobs(poll: bool = True, dask_scheduler: Any = None) -> dict[str, list[dict[str, Any]]]:
    from distributed.metrics import time

    from flowreduce.dashboard import views
    from flowreduce.dashboard.store import store_of

    store = store_of(dask_scheduler)
    if store is None or getattr(store, "spmd", None) is None:  # no page, or one of a flowreduce without SPMD jobs
        return {"jobs": [], "ranks": []}
    if poll:
        await store.spmd.poll(dask_scheduler)
    now = time()
    return {"jobs": views.spmd_jobs(store, now), "ranks": views.spmd_ranks(store, now)}


def spmd_jobs(client, poll: bool = True) -> dict[str, list[dict[str, Any]]]:
    """What the ``/flowreduce`` page shows of SPMD jobs, as data: ``{"jobs": [...], "ranks": [...]}``
    (rows of :func:`flowreduce.dashboard.views.spmd_jobs` and :func:`~flowreduce.dashboard.views.spmd_ranks`:
    live jobs first, each rank's last collective). ``poll``: ask the live jobs' workers for their
    ranks' last collectives first (one rpc per worker), as the page does at each refresh."""
    return client.run_on_scheduler(_spmd_jobs, poll)


def dask_setup(scheduler) -> None:
    """``--preload flowreduce.dashboard``: the store (and the page) from the scheduler's start, alone in the
    place of flowreduce's extension, which adopts it when a client installs it."""
    from flowreduce.dashboard.plugin import DashboardPlugin
    from flowreduce.dashboard.store import NAME

    if NAME not in scheduler.plugins:
        scheduler.add_plugin(DashboardPlugin(), name=NAME)
