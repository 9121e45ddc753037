"""Deterministic fault injection for tests (as Horovod's ``exit_schedule``
and torchft's ``FailureInjector.fail_at(rank, step)``): hurt the worker of
rank ``r`` at the moment step ``s`` of an all-reduce reaches it. A test
helper, not part of the library: the tests import it as ``faults``
(tests/ is on pytest's ``pythonpath``), benchmarks/failure_soak.py puts
tests/ on its path. The plugin is pickled by reference, so the scheduler
must import this module too: it does in a LocalCluster, whose scheduler
runs in the client's process.

``FailAt`` is a scheduler plugin watching flowreduce keys
(``("flowreduce-<algorithm>-<phase>-<token>", step, rank, chunk, node)``,
:mod:`flowreduce.keys`). When the first task of plan step ``step`` on rank
``rank`` leaves ``waiting`` (dispatched to its worker, or found unrunnable
there because the worker is paused), the plugin acts on that worker, once
(``step=None``: when the rank's result task starts; with one chunk a
rank's last plan node *is* its result, keyed without a step):

* ``"kill"``: SIGKILL the worker process (a node failure; a nanny restarts it);
* ``"stop"``: SIGSTOP it (a worker that stops responding; SIGCONT it after);
* ``"retire"``: ``Scheduler.retire_workers`` on it (dask-jobqueue's walltime
  ``--lifetime``), moving its data to the others.

The kill happens inside the transition, before the task's message leaves
the scheduler: the same key, the same state of the call, every run. Needs
the workers on the scheduler's host (a LocalCluster), for the signals.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Hashable
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from flowreduce.keys import parse

ACTIONS = ("kill", "stop", "retire")


class FailAt(SchedulerPlugin):
    """Act on the worker of ``rank`` when plan step ``step`` of a call
    (of ``algorithm``, if given) starts there; ``fired`` records
    ``(key, worker)`` once it did. ``more``: further ``(rank, step)``
    targets, each acted on once, in whatever order the call reaches them
    (several workers lost during one call)."""

    name = "flowreduce-fail-at"

    def __init__(self, rank: int, step: int | None, action: str = "kill", algorithm: str | None = None,
                 more: tuple[tuple[int, int | None], ...] = ()):
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.rank, self.step, self.action, self.algorithm = rank, step, action, algorithm
        self.pending = [(rank, step), *more]
        self.fired: list[tuple[Hashable, str]] = []

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if not self.pending or start != "waiting" or finish not in ("processing", "no-worker"):
            return
        info = parse(key)
        if info is None or self.algorithm not in (None, info["algorithm"]):
            return
        target = next(((r, s) for r, s in self.pending if info["rank"] == r
                       and (info["phase"] == "output" if s is None else info.get("step") == s)), None)
        if target is None:
            return
        ts = self.scheduler.tasks[key]
        ws = ts.processing_on or next((self.scheduler.workers[w] for w in sorted(ts.worker_restrictions or ())
                                       if w in self.scheduler.workers), None)
        if ws is None or any(w == ws.address for _, w in self.fired):
            return
        self.pending.remove(target)
        self.fired.append((key, ws.address))
        if self.action == "retire":
            self.scheduler.loop.add_callback(self.scheduler.retire_workers, workers=[ws.address], close_workers=True,
                                             stimulus_id=f"flowreduce-fail-at-{key!r}")
        else:
            os.kill(ws.pid, signal.SIGKILL if self.action == "kill" else signal.SIGSTOP)


def fail_at(client: Any, rank: int, step: int | None, action: str = "kill", algorithm: str | None = None,
            more: tuple[tuple[int, int | None], ...] = ()) -> None:
    """Arm :class:`FailAt` on ``client``'s scheduler (replacing one armed before)."""
    client.register_plugin(FailAt(rank, step, action, algorithm, more))


def fired(client: Any) -> list[tuple[Hashable, str]]:
    """``(key, worker)`` of the armed injector's action, empty if it did not act (yet)."""
    return client.run_on_scheduler(_fired)


def disarm(client: Any) -> None:
    """Remove the injector, if one is armed."""
    client.run_on_scheduler(_disarm)


def _disarm(dask_scheduler: Any = None) -> None:
    if FailAt.name in dask_scheduler.plugins:
        dask_scheduler.remove_plugin(name=FailAt.name)


def _fired(dask_scheduler: Any = None) -> list[tuple[Hashable, str]]:
    plugin = dask_scheduler.plugins.get(FailAt.name)
    return list(plugin.fired) if plugin is not None else []
