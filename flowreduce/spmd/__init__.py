"""SPMD jobs on Dask: ranks that call collectives themselves, on a persistent communicator.

``flowreduce.spmd(client, fn, *per_rank_args, ranks=None, workers=None, restarts=0, timeout=None, **kwargs)``
(:func:`flowreduce.spmd.job.spmd`) runs ``fn(comm, ...)`` once per rank;
``comm`` (:class:`flowreduce.spmd.comm.Communicator`) has ``rank``, ``size``,
``allreduce``, ``broadcast``, ``allgather``, ``barrier`` and ``subgroup``.
docs/spmd.md tells the whole story. Modules: ``layout`` (the peer table),
``planrun`` (a plan run by its ranks), ``comm`` (the communicator), ``job``
(the front door), ``events`` (what jobs did). Their worker and scheduler
sides are parts of flowreduce's one extension (:mod:`flowreduce.schedule.extension`):
:mod:`flowreduce.schedule.spmd_mailbox` (between hosts, and failures, on the
workers) and :mod:`flowreduce.schedule.spmd_watch` (lost workers). A host's ranks exchange through :mod:`flowreduce.shm.host_group`
(the same-host data plane, which the p2p engine uses too), and results of
its two-step all-reduce (from 128 KiB) and of broadcasts and all-gathers from
64 KiB are made in :mod:`flowreduce.shm.result_buffers`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from flowreduce.spmd.comm import Communicator, Event
from flowreduce.spmd.events import collect
from flowreduce.spmd.job import spmd

__all__ = ["Communicator", "Event", "collect", "spmd"]


class _Callable(types.ModuleType):
    """``flowreduce.spmd`` is both this package and the function: once the package is imported,
    ``import flowreduce`` finds the package under that name, so calling it runs :func:`spmd`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return spmd(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable
