"""The scheduler side of SPMD jobs, a part of flowreduce's scheduler
extension (:mod:`flowreduce.schedule.extension`): the owner of their failure paths.

:class:`SpmdSchedulerPlugin` learns each attempt's ranks from their tasks'
keys (:func:`rank_key`) and worker restrictions as the scheduler sees them,
and tells the attempt's workers (stream message :data:`ABORT`) when

* a worker holding ranks leaves (SIGKILL, node loss, retirement): every
  rank's pending collective raises, naming the lost ranks; the lost ranks'
  tasks, pinned to a worker that is gone, are let loose so that they run
  elsewhere and fail at once (:func:`flowreduce.spmd.job.run_rank` sees it
  is not on its worker) instead of waiting forever for a worker;
* a rank's task errs or is cancelled (a rank that raises also tells its
  peers itself, faster: this is the net under it).

Nothing here runs per collective: only per task transition of a rank.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from flowreduce.dashboard.record import SPMD_PREFIX, parse_spmd_key
from flowreduce.schedule.spmd_mailbox import ABORT

logger = logging.getLogger("flowreduce")

PREFIX = SPMD_PREFIX


def rank_key(run: str, rank: int) -> str:
    """The key of a rank's task: ``flowreduce-spmd-rank-<token>.<attempt>-<rank>``."""
    return f"{PREFIX}{run}-{rank}"


def parse_key(key: Hashable) -> tuple[str, int] | None:
    """``(run, rank)`` of a rank's key, else None."""
    return parse_spmd_key(key)


class SpmdSchedulerPlugin(SchedulerPlugin):
    """The SPMD jobs' part of flowreduce's scheduler extension: tells an
    attempt's workers when it cannot finish (see the module)."""

    def __init__(self) -> None:
        self.scheduler: Any = None
        #: run -> rank -> its worker, while some rank of it is not finished
        self.where: dict[str, dict[int, str]] = {}
        self.finished: dict[str, set[int]] = {}

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        parsed = parse_key(key)
        if parsed is None:
            return
        run, rank = parsed
        if finish in ("waiting", "processing", "no-worker"):  # learn where it runs
            where = self.where.setdefault(run, {})
            self.finished.setdefault(run, set())
            if rank not in where:
                ts = self.scheduler.tasks.get(key)
                restricted = sorted(ts.worker_restrictions or ()) if ts is not None else []
                if restricted:
                    where[rank] = restricted[0]
            return
        if run not in self.where:
            return
        if finish == "memory":
            self._done(run, rank)
        elif finish == "erred":
            ts = self.scheduler.tasks.get(key)
            text = getattr(ts, "exception_text", None) or "an error"
            self.tell(run, f"rank {rank} failed: {text}")
            self._done(run, rank)
        elif finish == "forgotten":
            self.tell(run, f"rank {rank}'s task was cancelled or forgotten")
            self._done(run, rank)

    def _done(self, run: str, rank: int) -> None:
        done = self.finished.setdefault(run, set())
        done.add(rank)
        if done >= set(self.where.get(run, {})):
            self.where.pop(run, None)
            self.finished.pop(run, None)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        for run, where in list(self.where.items()):
            lost = sorted(r for r, w in where.items() if w == worker and r not in self.finished.get(run, ()))
            if not lost:
                continue
            self.tell(run, f"worker {worker} holding rank(s) {lost} left the cluster")
            recs = {}
            for r in lost:
                ts = scheduler.tasks.get(rank_key(run, r))
                if ts is not None and ts.state in ("no-worker", "waiting", "released"):
                    # run it anywhere: it fails at once, naming its lost worker. Not loose restrictions: a
                    # task waiting in no-worker for a worker that left is only retried where it may run, so
                    # with every worker gone (a nanny restarting them all) it would wait there for good
                    ts.worker_restrictions, ts.loose_restrictions = None, False
                    if ts.state == "no-worker" and scheduler.running:
                        recs[ts.key] = "processing"
            if recs:
                scheduler.transitions(recs, stimulus_id=f"flowreduce-spmd-lost-{run}")

    def tell(self, run: str, why: str) -> None:
        for w in set(self.where.get(run, {}).values()):
            bs = self.scheduler.stream_comms.get(w)
            if bs is not None:
                bs.send({"op": ABORT, "run": run, "why": why})
