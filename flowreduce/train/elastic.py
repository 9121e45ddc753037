"""Elastic membership for data-parallel trainers on Dask (issue #15), the
way Horovod elastic runs (``hvd.elastic.run``, ``state.commit()`` /
``restore()``, ``on_hosts_updated``): workers may die or join while a run
goes on, and the run continues on whoever is there.

Framework-free: a trainer keeps one replica per rank as the value of one
future on that rank's worker (the numpy trainer's ``{"params",
"velocity"}``, a torch trainer's model + optimizer), and this module decides
which workers are the ranks and which replicas are consistent:

* :class:`Membership` watches the scheduler's workers. The rank set changes
  only at a step boundary (:meth:`Membership.change`): ranks whose worker
  left are dropped, the survivors keep their order, and running workers that
  joined are appended (up to ``max_ranks``). :meth:`Membership.wait` waits
  for a step and reports a rank's worker lost during it instead of waiting
  for tasks pinned to a dead worker (which Dask would keep in ``no-worker``
  forever).
* :class:`Committed` is the last consistent state: every rank's replica
  future after the last step that finished on every rank, and the trainer's
  progress counters. A step that lost a worker is abandoned and re-run from
  there, by every surviving rank (the global batch is re-sharded over the new
  rank set, so every rank must redo it).
* :func:`replicate` puts a copy of a surviving replica on a joining worker:
  after every all-reduce the replicas are bitwise identical, so rank 0's is
  everybody's.

A trainer adopting this needs: its per-rank replicas as futures pinned to
their workers (``allow_other_workers=False``), a step that is a pure function
of (committed replicas, progress, rank set) so it can be re-run, its data
sharded by (progress, rank, ranks) rather than by a fixed rank count, and a
``resize(change)`` that rebuilds whatever it holds per worker. The loop is
then :func:`run` (see :class:`flowreduce.train.loop.ElasticDataParallel`
and :class:`flowreduce.torch.elastic.ElasticTrainer`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flowreduce.schedule.placement import wait_for_a_while, worker_statuses

logger = logging.getLogger("flowreduce")


@dataclass(frozen=True)
class Change:
    """The rank set before and after a step boundary."""

    before: tuple[str, ...]
    after: tuple[str, ...]

    @property
    def lost(self) -> tuple[str, ...]:
        return tuple(w for w in self.before if w not in self.after)

    @property
    def joined(self) -> tuple[str, ...]:
        return tuple(w for w in self.after if w not in self.before)

    def __str__(self) -> str:
        parts = [f"{len(self.before)} -> {len(self.after)} ranks"]
        if self.lost:
            parts.append(f"lost {', '.join(self.lost)}")
        if self.joined:
            parts.append(f"joined {', '.join(self.joined)}")
        return "; ".join(parts)


class StepLost(Exception):
    """A rank's worker left while a step ran: the step must be re-run from
    the last commit on the new rank set."""

    def __init__(self, lost: Sequence[str]):
        super().__init__(f"worker(s) {', '.join(lost)} left the cluster during the step")
        self.lost = tuple(lost)


class Membership:
    """Which running workers are the ranks, decided at step boundaries.

    Parameters
    ----------
    client:
        The Dask client.
    workers:
        The initial ranks, in rank order.
    max_ranks:
        Never grow past this many ranks (default: no limit).
    min_ranks:
        Fewer surviving ranks than this is an error (default 1).
    """

    def __init__(self, client: Any, workers: Sequence[str], max_ranks: int | None = None, min_ranks: int = 1):
        if not workers:
            raise ValueError("an elastic run needs at least one worker to start on")
        self.client = client
        self.workers: tuple[str, ...] = tuple(workers)
        self.max_ranks = max_ranks
        self.min_ranks = min_ranks
        self.history: list[tuple[int, Change]] = []  # (step count when it happened, change)

    def running(self) -> dict[str, str]:
        """Address -> status of every worker the scheduler knows."""
        return worker_statuses(self.client)

    def lost(self) -> list[str]:
        """Ranks' workers the scheduler no longer has (died, retired) or that are leaving."""
        live = self.running()
        return [w for w in self.workers if live.get(w, "closed") not in ("running", "paused")]

    def change(self, step: int = 0) -> Change | None:
        """The new rank set at a step boundary, or None if it stays.

        Raises
        ------
        RuntimeError
            Fewer than ``min_ranks`` workers are left.
        """
        live = self.running()
        keep = [w for w in self.workers if live.get(w) in ("running", "paused")]
        room = (self.max_ranks or len(live)) - len(keep)
        joined = sorted(w for w, st in live.items() if st == "running" and w not in keep)[:max(0, room)]
        after = tuple(keep + joined)
        if after == self.workers:
            return None
        if len(after) < self.min_ranks:
            raise RuntimeError(f"elastic run: {len(after)} worker(s) left ({', '.join(after) or 'none'}), "
                               f"fewer than the minimum of {self.min_ranks} ranks")
        change = Change(self.workers, after)
        self.workers = after
        self.history.append((step, change))
        logger.warning("flowreduce elastic: at step %d: %s", step, change)
        return change

    def wait(self, futures: Sequence[Any], poll: float = 0.2) -> None:
        """Wait for ``futures`` (a step's results).

        Raises
        ------
        StepLost
            A rank's worker left before they all finished: they may never
            finish (tasks pinned to a dead worker), so stop waiting.
        Exception
            A future failed while every rank's worker is still there (a real
            error, not a membership change): re-raised as is.
        """
        futures = list(futures)
        while True:
            wait_for_a_while(self.client, futures, poll)
            lost = self.lost()
            if lost:
                raise StepLost(lost)
            bad = [f for f in futures if f.status in ("error", "cancelled", "lost")]
            if bad:
                bad[0].result()  # raises the task's own error
                raise RuntimeError(f"{bad[0].key!r} is {bad[0].status}")
            if all(f.status == "finished" for f in futures):
                return


@dataclass
class Committed:
    """The last consistent state (Horovod's ``state.commit()`` /
    ``state.restore()``): each rank's replica future after the last step
    that finished on every rank, and the trainer's progress (epoch, position
    in the data, step count...)."""

    replicas: dict[str, Any] = field(default_factory=dict)  # worker -> future of its replica
    progress: dict[str, Any] = field(default_factory=dict)

    def commit(self, workers: Sequence[str], replicas: Sequence[Any], **progress: Any) -> None:
        self.replicas = dict(zip(workers, replicas))
        self.progress = dict(progress)

    def restore(self, workers: Sequence[str]) -> list[Any | None]:
        """The committed replicas of ``workers`` in rank order (None for a
        worker that had none: it joined, and needs :func:`replicate`)."""
        return [self.replicas.get(w) for w in workers]


def _copy_replica(replica: Any) -> Any:
    return copy.deepcopy(replica)


def replicate(client: Any, replica: Any, worker: str, key: str) -> Any:
    """A copy of ``replica`` (a future) held on ``worker``: the state a
    joining rank starts from."""
    return client.submit(_copy_replica, replica, workers=[worker], allow_other_workers=False, pure=False, key=key)


class ElasticTrainer(Protocol):
    """What :func:`run` drives."""

    def finished(self) -> bool: ...

    def resize(self, change: Change) -> None: ...

    def submit_step(self) -> Sequence[Any]: ...

    def commit(self) -> None: ...

    def abandon(self, lost: StepLost) -> None: ...


def run(trainer: ElasticTrainer, membership: Membership, on_step: Callable[[], None] | None = None) -> None:
    """``hvd.elastic.run``: step until ``trainer.finished()``; at every step
    boundary adopt the rank set the membership decides; a step that lost a
    worker is abandoned and re-run from the last commit.

    Raises
    ------
    RuntimeError
        Too few workers left (``membership.min_ranks``).
    """
    step = 0
    while True:
        change = membership.change(step)
        if change is not None:
            trainer.resize(change)
        if trainer.finished():
            return
        futures = trainer.submit_step()
        try:
            membership.wait(futures)
        except StepLost as lost:
            # the message, not the exception: a log handler keeping the record would keep its frames (and the step's futures)
            logger.warning("flowreduce elastic: step %d abandoned: %s; re-running it from the last commit", step, str(lost))
            trainer.abandon(lost)
            continue
        trainer.commit()
        step += 1
        if on_step is not None:
            on_step()
