"""SPMD jobs (``flowreduce.spmd``) on the dashboard: which jobs are live, and
each rank's last collective.

Two sources, neither of which costs a collective anything:

* **the ranks' task transitions** (the store's ``transition``, one
  ``startswith`` per task with a string key): a rank's task key
  (``flowreduce-spmd-rank-<token>.<attempt>-<rank>``,
  :func:`~flowreduce.dashboard.record.parse_spmd_key`) opens the job (one per
  attempt), its worker restriction says where the rank runs, and its states
  say the job's: ``submitted`` until a rank's task is processing,
  ``running``, then ``done`` (every rank's result in memory), ``failed`` (a
  rank erred) or ``cancelled`` (a rank forgotten first);
* **the last collective of each rank, polled** (:meth:`SpmdJobs.poll`): the
  scheduler asks the live jobs' workers (handler
  :data:`~flowreduce.dashboard.record.SPMD_LAST`, one rpc per worker), which
  read the last event each rank keeps anyway. The page polls at its refresh
  (every 500 ms) while a job is live and the page is open; nothing is
  polled, and the ranks send nothing, otherwise. A job that ended is polled
  once more, for its final collectives.

Bounded: the live jobs (capped at :data:`MAX_LIVE`) and the last
:data:`HISTORY` that ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from distributed.metrics import time

from flowreduce.dashboard.record import SPMD_LAST, parse_spmd_key

logger = logging.getLogger("flowreduce.dashboard")

HISTORY = 100
MAX_LIVE = 10_000
#: Seconds a poll waits for a worker's answer.
POLL_TIMEOUT = 2.0


@dataclass
class Last:
    """A rank's last collective as its worker told it (times: the worker's ``time.time()``)."""

    collective: str
    seq: int
    nbytes: int
    start: float
    stop: float
    running: bool  # the rank's communicator was still open
    polled: float  # scheduler time of the answer


@dataclass(eq=False)
class SpmdJob:
    """One attempt of an SPMD job, as the dashboard knows it."""

    run: str  # "<token>.<attempt>"
    submitted: float
    workers: dict[int, str] = field(default_factory=dict)  # rank -> its worker
    states: dict[int, str] = field(default_factory=dict)  # rank -> its task's state
    last: dict[int, Last] = field(default_factory=dict)
    state: str = "submitted"
    finished: float | None = None
    error: str = ""
    final_polled: bool = False  # polled once since it ended

    @property
    def token(self) -> str:
        return self.run.rpartition(".")[0] or self.run

    @property
    def attempt(self) -> int:
        tail = self.run.rpartition(".")[2]
        return int(tail) if tail.isdigit() else 0

    @property
    def live(self) -> bool:
        return self.finished is None

    def elapsed(self, now: float) -> float:
        return (self.finished if self.finished is not None else now) - self.submitted


class SpmdJobs:
    """The dashboard's record of SPMD jobs (see the module)."""

    def __init__(self, history: int = HISTORY):
        self.live: dict[str, SpmdJob] = {}  # oldest first
        self.history: deque[SpmdJob] = deque(maxlen=history)  # ended, oldest first
        self.generation = 0
        self.polls = 0
        self.polled: float = 0.0  # scheduler time of the last poll's end
        self._polling: asyncio.Future | None = None

    # -- transitions -------------------------------------------------------------
    def transition(self, scheduler: Any, key: str, finish: str) -> None:
        parsed = parse_spmd_key(key)
        if parsed is None:
            return
        run, rank = parsed
        job = self.live.get(run) or self.find(run)
        if job is None:
            if finish in ("forgotten", "released"):
                return
            while len(self.live) >= MAX_LIVE:
                self._end(next(iter(self.live.values())), "cancelled", "dropped: too many live SPMD jobs")
            job = self.live[run] = SpmdJob(run, time())
        self.generation += 1
        job.states[rank] = finish
        if rank not in job.workers:
            ts = scheduler.tasks.get(key) if scheduler is not None else None
            restricted = sorted(ts.worker_restrictions or ()) if ts is not None else []
            if restricted:
                job.workers[rank] = restricted[0]
            elif ts is not None and ts.processing_on is not None:
                job.workers[rank] = ts.processing_on.address
        if not job.live:
            return
        if finish == "processing" and job.state == "submitted":
            job.state = "running"
        elif finish == "erred":
            ts = scheduler.tasks.get(key) if scheduler is not None else None
            text = getattr(ts, "exception_text", "") or "an error"
            self._end(job, "failed", f"rank {rank}: {text}")
        elif finish == "forgotten":
            self._end(job, "cancelled", f"rank {rank}'s task was cancelled or forgotten")
        elif finish == "memory" and all(s == "memory" for s in job.states.values()):
            self._end(job, "done")

    def _end(self, job: SpmdJob, state: str, error: str = "") -> None:
        job.state, job.finished, job.error = state, time(), error
        self.live.pop(job.run, None)
        self.history.append(job)
        self.generation += 1

    def find(self, run: str) -> SpmdJob | None:
        job = self.live.get(run)
        if job is None:
            job = next((j for j in reversed(self.history) if j.run == run), None)
        return job

    def listing(self) -> list[SpmdJob]:
        """Live jobs (oldest first), then ended ones (newest first)."""
        return [*self.live.values(), *reversed(self.history)]

    # -- the ranks' last collectives -------------------------------------------------
    def due(self) -> list[SpmdJob]:
        """The jobs a poll asks about: the live ones, and those ended since the last poll."""
        return [*self.live.values(), *(j for j in self.history if not j.final_polled)]

    async def poll(self, scheduler: Any) -> int:
        """Ask the workers of the jobs :meth:`due` for their ranks' last collectives (one rpc per
        worker, at once); the answers they gave. A worker that does not answer is skipped."""
        jobs = self.due()
        asks: dict[str, list[str]] = {}
        for job in jobs:
            for w in set(job.workers.values()):
                asks.setdefault(w, []).append(job.run)
        ended = [j for j in jobs if not j.live]

        async def ask(worker: str, runs: list[str]) -> list[Any]:
            try:
                return await asyncio.wait_for(getattr(scheduler.rpc(worker), SPMD_LAST)(runs=runs), POLL_TIMEOUT)
            except Exception as e:  # a worker gone, or without the SPMD plugin: nothing from it this time
                logger.debug("flowreduce: %s of %s failed: %r", SPMD_LAST, worker, e)
                return []

        answers = await asyncio.gather(*(ask(w, runs) for w, runs in asks.items()))
        now = time()
        n = 0
        for rows in answers:
            for row in rows if isinstance(rows, (list, tuple)) else ():  # msgpack may give tuples
                try:
                    run, rank, running, collective, seq, nbytes, start, stop = row
                    found = self.find(run)
                    if found is None or not collective:
                        continue
                    old = found.last.get(int(rank))
                    if old is None or int(seq) >= old.seq:
                        found.last[int(rank)] = Last(str(collective), int(seq), int(nbytes), float(start), float(stop),
                                                   bool(running), now)
                    n += 1
                except (TypeError, ValueError):
                    continue
        for job in ended:
            job.final_polled = True
        self.polls += 1
        self.polled = now
        self.generation += 1
        return n

    def request_poll(self, scheduler: Any, every: float) -> None:
        """Start a poll on the scheduler's loop unless one is running or the last ended under
        ``every`` seconds ago (the page's refresh calls this; it does not wait for it)."""
        if not self.due() or (self._polling is not None and not self._polling.done()):
            return
        if time() - self.polled < every:
            return
        self._polling = asyncio.ensure_future(self.poll(scheduler))
