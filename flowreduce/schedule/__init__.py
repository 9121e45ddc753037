"""Run plans on a dask.distributed cluster: the only layer that talks to
the scheduler to place, submit, guard and record a call.

One module per concept: :mod:`~flowreduce.schedule.call` (the front door:
``allreduce``, ``describe``), :mod:`~flowreduce.schedule.inputs` (what each
rank holds, and the checks that the ranks agree), :mod:`~flowreduce.schedule.placement`
(which worker runs each rank), :mod:`~flowreduce.schedule.hosts` (which
ranks share a host), :mod:`~flowreduce.schedule.records` (one record per
call), :mod:`~flowreduce.schedule.extension` (flowreduce's one scheduler
plugin and one worker plugin, made of parts such as
:mod:`~flowreduce.schedule.guard`, the lost-worker guard).

The package itself imports nothing heavy: ``allreduce`` and ``describe``
are loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["allreduce", "describe"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from flowreduce.schedule import call

        return getattr(call, name)
    raise AttributeError(f"module 'flowreduce.schedule' has no attribute {name!r}")
