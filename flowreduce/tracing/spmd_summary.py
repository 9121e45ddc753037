"""What one traced SPMD job did, in numbers (:func:`summarize_spmd`; the
all-reduce calls' own summary is :mod:`flowreduce.tracing.summary`).

An SPMD job's trace holds, per rank, its task (``user-compute``, with the
rank and the job) and one event per collective (:data:`~flowreduce.phases.SPMD_PHASES`).
A collective ends on every rank only once its last rank entered it, so:

* a rank's **wait** in a collective: from its entry until the last rank's
  entry (none for that last rank, never more than the collective lasted on it);
* a collective's **straggler**: the rank that entered last, late by its
  entry minus the next-latest rank's;
* the job's straggler: the rank whose lateness, summed over the collectives
  it entered last, is the largest: the others waited for it that long;
* a rank's **own work**: its task's time outside collectives.

A subgroup's collectives (``job`` ``<token>.<attempt>/<tag>``) count in their
job, each with its own numbering; their ranks are the job's.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from flowreduce.phases import SPMD_PHASES
from flowreduce.tracing.events import Event
from flowreduce.tracing.summary import text_console


@dataclass
class Collective:
    """One collective over its ranks."""

    run: str  # the job attempt, "/<tag>" appended for a subgroup's
    seq: int
    phase: str
    ranks: tuple[int, ...]
    start: float  # the first rank's entry
    stop: float  # the last rank's return
    last: int  # the rank that entered last
    lateness: float  # its entry after the next-latest rank's (0 with one rank)
    nbytes: int  # the largest input over its ranks


@dataclass
class SpmdRankStats:
    rank: int
    worker: str
    task: float  # seconds of the rank's task (0.0 if the trace did not see it)
    collectives: int
    in_collectives: float
    waited: float  # inside collectives, before their last rank entered
    own_work: float  # task outside collectives (0.0 without the task)
    nbytes: int  # of its inputs, over its collectives
    sent: int  # between hosts
    received: int
    by_phase: dict[str, float] = field(default_factory=dict)  # seconds per collective kind
    count_by_phase: dict[str, int] = field(default_factory=dict)
    last_in: int = 0  # collectives it entered last
    made_wait: float = 0.0  # its lateness summed over those


@dataclass
class SpmdSummary:
    job: str
    ranks: int
    start: float
    stop: float
    per_rank: list[SpmdRankStats]
    collectives: list[Collective]
    paths: dict[str, int]  # collective events per path (local, shm, dask, shm+dask)
    straggler: int | None  # the rank that made the others wait longest, None if none did

    @property
    def in_collectives(self) -> float:
        """Rank-seconds in collectives, over every rank."""
        return sum(r.in_collectives for r in self.per_rank)

    @property
    def waited(self) -> float:
        """Rank-seconds waiting for a later rank, over every rank."""
        return sum(r.waited for r in self.per_rank)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["in_collectives"], d["waited"] = self.in_collectives, self.waited
        return d

    def __str__(self) -> str:
        from rich.table import Table

        buf, con = text_console()
        ms = 1e3
        con.print(f"spmd job {self.job}: {self.ranks} ranks, {len(self.collectives)} collectives, "
                  f"{(self.stop - self.start) * ms:.1f} ms (first rank task start -> last stop), paths "
                  + ", ".join(f"{p} {n}" for p, n in sorted(self.paths.items())))
        kinds = [p for p in SPMD_PHASES if any(r.count_by_phase.get(p) for r in self.per_rank)]
        t = Table(title="per rank (ms)")
        for col in ["rank", "worker", "task", "own work", *(f"{k} (n)" for k in kinds), "waited", "entered last",
                    "made others wait", "sent MB", "received MB"]:
            t.add_column(col, justify="right")
        for r in self.per_rank:
            t.add_row(str(r.rank), r.worker.split("://", 1)[-1], f"{r.task * ms:.1f}", f"{r.own_work * ms:.1f}",
                      *(f"{r.by_phase.get(k, 0.0) * ms:.1f} ({r.count_by_phase.get(k, 0)})" for k in kinds),
                      f"{r.waited * ms:.1f}", str(r.last_in), f"{r.made_wait * ms:.1f}", f"{r.sent / 1e6:.3f}",
                      f"{r.received / 1e6:.3f}")
        con.print(t)
        if self.straggler is None:
            con.print("straggler: none (no collective had a rank entering after another)")
        else:
            s = self.per_rank[[r.rank for r in self.per_rank].index(self.straggler)]
            con.print(f"straggler: rank {s.rank}, entered {s.last_in} collective(s) last, the others waited "
                      f"{s.made_wait * ms:.1f} ms for it")
        worst = sorted(self.collectives, key=lambda c: -c.lateness)[:5]
        if worst and worst[0].lateness > 0:
            con.print("latest entries:")
            for c in worst:
                con.print(f"  {c.phase} #{c.seq} of {c.run}: rank {c.last} {c.lateness * ms:.1f} ms after the "
                          f"next-latest, {c.nbytes} bytes", highlight=False)
        return buf.getvalue()


def spmd_jobs(trace: Any) -> list[str]:
    """The SPMD job attempts of a trace (``<token>.<attempt>``), by first event."""
    first: dict[str, float] = {}
    for e in trace.iter_events():
        if e.job:
            job = e.job.partition("/")[0]
            first[job] = min(first.get(job, e.start), e.start)
    return sorted(first, key=lambda j: first[j])


def summarize_spmd(trace: Any, job: str | None = None) -> SpmdSummary:
    """Summary of SPMD job ``job`` (``<token>.<attempt>``, or a job token: its
    last attempt; default: the trace's last job). See the module."""
    jobs = spmd_jobs(trace)
    if not jobs:
        raise ValueError("the trace holds no SPMD job: trace around flowreduce.spmd and wait inside the block")
    if job is None:
        job = jobs[-1]
    elif job not in jobs:
        attempts = [j for j in jobs if j.rpartition(".")[0] == job]
        if not attempts:
            raise ValueError(f"no SPMD job {job!r} in this trace; known: {jobs}")
        job = attempts[-1]
    mine = [e for e in trace.iter_events() if e.job.partition("/")[0] == job and e.rank is not None]
    tasks = {e.rank: e for e in mine if e.phase == "user-compute"}
    calls = [e for e in mine if e.phase in SPMD_PHASES]
    by_collective: dict[tuple[str, int], list[Event]] = defaultdict(list)
    for e in calls:
        by_collective[e.job, e.seq or 0].append(e)
    collectives: list[Collective] = []
    waited: dict[int | None, float] = defaultdict(float)
    made_wait: dict[int | None, float] = defaultdict(float)
    last_in: Counter[int | None] = Counter()
    for (run, seq), evs in sorted(by_collective.items(), key=lambda kv: min(e.start for e in kv[1])):
        entries = sorted(evs, key=lambda e: e.start)
        last = entries[-1]
        lateness = last.start - entries[-2].start if len(entries) > 1 else 0.0
        for e in entries:
            waited[e.rank] += max(0.0, min(last.start, e.stop) - e.start)
        if lateness > 0:
            last_in[last.rank] += 1
            made_wait[last.rank] += lateness
        collectives.append(Collective(run, seq, last.phase, tuple(sorted(e.rank for e in evs if e.rank is not None)),
                                      entries[0].start, max(e.stop for e in evs), int(last.rank or 0), lateness,
                                      max(e.nbytes for e in evs)))
    per_rank = []
    for rank in sorted({e.rank for e in mine if e.rank is not None}):
        own = [e for e in calls if e.rank == rank]
        task = tasks.get(rank)
        by_phase: dict[str, float] = defaultdict(float)
        counts: Counter[str] = Counter()
        for e in own:
            by_phase[e.phase] += e.duration
            counts[e.phase] += 1
        inside = sum(e.duration for e in own)
        worker = task.worker if task is not None else (own[0].worker if own else "")
        per_rank.append(SpmdRankStats(
            rank, worker, task.duration if task is not None else 0.0, len(own), inside, waited[rank],
            max(0.0, task.duration - inside) if task is not None else 0.0, sum(e.nbytes for e in own),
            sum(e.sent for e in own), sum(e.received for e in own), dict(by_phase), dict(counts),
            last_in[rank], made_wait[rank]))
    straggler = max(made_wait, key=lambda r: made_wait[r]) if made_wait else None
    return SpmdSummary(job, len(per_rank), min(e.start for e in mine), max(e.stop for e in mine), per_rank,
                       collectives, dict(Counter(e.path for e in calls)), straggler)
