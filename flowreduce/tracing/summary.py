"""What one traced all-reduce call did, in numbers.

:func:`summarize` reads the events of one call (its key token) and reports,
per rank and in total: seconds in each phase, idle time, how much of the
communication overlapped computation, bytes per link (worker pair, measured
and as planned), the measured critical path through the task graph, the
straggler, and measured against predicted time.

Definitions (all within the call's *window*: first task start to last task
stop, over all ranks; ``wait-for-input`` lies before it and is reported
apart):

* busy = union of the rank's compute and communication intervals;
  idle = window - busy.
* communication = union of serialise, transfer, deserialise intervals on
  the rank's worker (transfers are counted at the receiver);
  overlapped = the part of it during which the worker also computed.
* critical path: from the task that finished last, repeatedly step to the
  dependency (from the plan) that arrived last: a local dependency arrives
  when its task stops, a remote one when the transfer carrying its key
  stops. Time on the path is compute, transfer, or ``gap`` (waiting for the
  scheduler, a free thread or a connection).
"""

from __future__ import annotations

import io
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from flowreduce import keys as keymod
from flowreduce.phases import (
    COMM_PHASES,
    COMPUTE_PHASES,
    OTHER,
    SHM_COPY,
    TRACE_PHASES,
    TRANSFER,
    WAIT_FOR_INPUT,
)
from flowreduce.tracing.events import Event


# -- interval arithmetic ----------------------------------------------------------
def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(iv))


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    x, y = union(x), union(y)
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


# -- results ----------------------------------------------------------------------

def text_console() -> tuple[io.StringIO, Any]:
    """A rich console that prints plain text, 120 columns wide, into the buffer returned with it
    (what a summary's ``str`` is made with)."""
    from rich.console import Console

    buf = io.StringIO()
    return buf, Console(file=buf, width=120, color_system=None, force_terminal=False)

@dataclass
class RankStats:
    rank: int
    worker: str
    phases: dict[str, float]
    busy: float
    idle: float
    comm: float
    overlapped: float

    @property
    def overlap_fraction(self) -> float:
        return self.overlapped / self.comm if self.comm else 0.0


@dataclass
class PathStep:
    kind: str  # a compute phase, "transfer" or "gap"
    start: float
    stop: float
    key: str = ""
    worker: str = ""


@dataclass
class Straggler:
    rank: int
    lag: float  # after the first rank's input
    margin: float  # after the second-latest rank's input
    ready: list[float | None]


@dataclass
class Summary:
    algorithm: str
    token: str
    ranks: int
    chunks: int
    nbytes: int
    predicted: float
    measured: float
    start: float
    stop: float
    per_rank: list[RankStats]
    total: dict[str, float]
    links: dict[tuple[str, str], int]
    planned_links: dict[tuple[str, str], float]
    critical_path: list[PathStep] = field(default_factory=list)
    straggler: Straggler | None = None
    shm_links: dict[tuple[str, str], int] = field(default_factory=dict)  # bytes read through shared memory

    @property
    def critical_length(self) -> float:
        return (self.critical_path[-1].stop - self.critical_path[0].start) if self.critical_path else 0.0

    @property
    def bytes_moved(self) -> int:
        """Bytes the call moved between workers (all links, as measured)."""
        return sum(self.links.values())

    @property
    def bytes_planned(self) -> float:
        """Bytes the plan says it moves between workers (sparse plans: expected
        at the inputs' density)."""
        return sum(self.planned_links.values())

    @property
    def critical_breakdown(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for s in self.critical_path:
            out[s.kind] += s.stop - s.start
        return dict(out)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["links"] = [{"source": s, "dest": t, "bytes": b} for (s, t), b in self.links.items()]
        d["planned_links"] = [{"source": s, "dest": t, "bytes": b} for (s, t), b in self.planned_links.items()]
        d["shm_links"] = [{"source": s, "dest": t, "bytes": b} for (s, t), b in self.shm_links.items()]
        for r, rs in zip(d["per_rank"], self.per_rank, strict=True):
            r["overlap_fraction"] = rs.overlap_fraction
        d["critical_length"] = self.critical_length
        d["bytes_moved"] = self.bytes_moved
        d["critical_breakdown"] = self.critical_breakdown
        return d

    def __str__(self) -> str:
        from rich.table import Table

        buf, con = text_console()
        ms = 1e3
        con.print(f"{self.algorithm}: {self.ranks} ranks x {self.nbytes / 1e6:.3g} MB, {self.chunks} chunk(s), "
                  f"token {self.token[:8]}")
        ratio = self.measured / self.predicted if self.predicted else float("nan")
        con.print(f"measured {self.measured * ms:.1f} ms (first task start -> last task stop), "
                  f"predicted {self.predicted * ms:.1f} ms, measured/predicted {ratio:.2f}")
        shown = [p for p in TRACE_PHASES if self.total.get(p, 0) > 0 or any(r.phases.get(p) for r in self.per_rank)]
        t = Table(title="time per phase (ms)")
        for col in ["rank", "worker", *shown, "busy", "idle", "comm overlapped"]:
            t.add_column(col, justify="right")
        for r in self.per_rank:
            t.add_row(str(r.rank), _short(r.worker), *(f"{r.phases.get(p, 0) * ms:.1f}" for p in shown),
                      f"{r.busy * ms:.1f}", f"{r.idle * ms:.1f}", f"{r.overlap_fraction:.0%}")
        t.add_row("total", "", *(f"{self.total.get(p, 0) * ms:.1f}" for p in shown),
                  f"{self.total['busy'] * ms:.1f}", f"{self.total['idle'] * ms:.1f}",
                  f"{self.total['overlap_fraction']:.0%}")
        con.print(t)
        lt = Table(title="bytes per link")
        for col in ("source", "dest", "measured MB", "planned MB", "shared memory MB"):
            lt.add_column(col, justify="right")
        for link in sorted(set(self.links) | set(self.planned_links) | set(self.shm_links)):
            lt.add_row(_short(link[0]), _short(link[1]), f"{self.links.get(link, 0) / 1e6:.3f}",
                       f"{self.planned_links.get(link, 0) / 1e6:.3f}", f"{self.shm_links.get(link, 0) / 1e6:.3f}")
        con.print(lt)
        con.print(f"bytes moved: {self.bytes_moved / 1e6:.3f} MB measured, {self.bytes_planned / 1e6:.3f} MB planned")
        br = ", ".join(f"{k} {v * ms:.1f}" for k, v in sorted(self.critical_breakdown.items(), key=lambda x: -x[1]))
        con.print(f"critical path: {self.critical_length * ms:.1f} ms over {len(self.critical_path)} steps ({br} ms)")
        for s in self.critical_path:
            con.print(f"  {(s.start - self.start) * ms:8.1f} +{(s.stop - s.start) * ms:6.1f} ms  {s.kind:<12} "
                      f"{s.key} @ {_short(s.worker)}", highlight=False, soft_wrap=True)
        if self.straggler:
            st = self.straggler
            con.print(f"straggler: rank {st.rank}, input ready {st.lag * ms:.1f} ms after the first rank's "
                      f"({st.margin * ms:.1f} ms after the next-latest)")
        else:
            con.print("straggler: unknown (input readiness not recorded; pass inputs to tr.add)")
        return buf.getvalue()


def _short(worker: str) -> str:
    return worker.split("://", 1)[-1]


# -- computing it -----------------------------------------------------------------
def summarize(trace: Any, token: str | None = None) -> Summary:
    """Summary of call ``token`` (default: the last call of the trace)."""
    if token is None:
        call = trace.last_call
        if call is None:
            raise ValueError("the trace holds no flowreduce call; tell it with tr.add(futures, inputs)")
        token = call.token
    call = trace.calls.get(token)
    if call is None:
        raise ValueError(f"no call with token {token!r} in this trace; known: {list(trace.calls)}")
    mine = [e for e in trace.iter_events(token) if e.phase != WAIT_FOR_INPUT]
    if not mine:
        raise ValueError(f"no events recorded for call {token!r}: wait for its results inside the trace block")
    t0, t1 = min(e.start for e in mine), max(e.stop for e in mine)
    worker_of = {r: w for w, r in trace.ranks_of(token).items()}
    for r, w in enumerate(call.workers):
        worker_of.setdefault(r, w)
    if engine_run_over_workers(call):  # the plan's rank i is the i-th worker: its ranks are one row
        worker_of = dict(enumerate(plan_workers(call)))
    per_rank = []
    all_busy = all_comm = all_over = 0.0
    totals: dict[str, float] = defaultdict(float)
    others = [e for e in trace.iter_events() if e.token == "" and e.phase != WAIT_FOR_INPUT]
    for r in range(call.plan.ranks):
        w = worker_of.get(r, "")
        evs = [e for e in mine if e.worker == w] + [e for e in others if e.worker == w]
        clipped = [(e.phase, max(e.start, t0), min(e.stop, t1)) for e in evs if e.stop > t0 and e.start < t1]
        phases: dict[str, float] = defaultdict(float)
        for p, a, b in clipped:
            phases[p] += b - a
        label = plan_ranks(call)[r] if engine_run_over_workers(call) else r  # a worker's row: its lowest rank
        for e in trace.iter_events(token):
            if e.phase == WAIT_FOR_INPUT and e.rank == label:
                phases[WAIT_FOR_INPUT] += e.duration
        comp = [(a, b) for p, a, b in clipped if p in COMPUTE_PHASES]
        comm = [(a, b) for p, a, b in clipped if p in COMM_PHASES]
        busy = length(comp + comm)
        c, o = length(comm), intersect(comm, comp)
        per_rank.append(RankStats(label, w, dict(phases), busy, (t1 - t0) - busy, c, o))
        all_busy, all_comm, all_over = all_busy + busy, all_comm + c, all_over + o
        for p, v in phases.items():
            totals[p] += v
    totals.update(busy=all_busy, idle=len(per_rank) * (t1 - t0) - all_busy, comm=all_comm,
                  overlapped=all_over, overlap_fraction=all_over / all_comm if all_comm else 0.0)
    links: dict[tuple[str, str], int] = defaultdict(int)
    shm_links: dict[tuple[str, str], int] = defaultdict(int)
    for e in mine:
        if e.phase == TRANSFER:  # a p2p engine's message: its bytes as sent (the keys' are the plan's)
            links[(e.source, e.dest)] += e.nbytes if e.detail.startswith("p2p") else (sum(e.key_bytes) or e.nbytes)
        elif e.phase == SHM_COPY and e.detail == "shm-read" and e.source != e.dest:
            shm_links[(e.source, e.dest)] += e.nbytes
    straggler = None
    ready = trace.input_ready.get(token)
    if ready and sum(t is not None for t in ready) >= 2:
        known = sorted((t, r) for r, t in enumerate(ready) if t is not None)
        (tl, rl), (tn, _) = known[-1], known[-2]
        straggler = Straggler(rl, tl - known[0][0], tl - tn, list(ready))
    return Summary(
        algorithm=call.algorithm, token=token, ranks=call.plan.ranks, chunks=call.plan.chunks,
        nbytes=call.nbytes, predicted=call.predicted, measured=t1 - t0, start=t0, stop=t1,
        per_rank=per_rank, total=dict(totals), links=dict(links),
        planned_links=planned_links(call, worker_of), critical_path=critical_path(trace, call, mine),
        straggler=straggler, shm_links=dict(shm_links),
    )


def engine_run_over_workers(call: Any) -> bool:
    """A ``method="p2p"`` call whose plan runs over its workers, not its
    ranks (ranks sharing a worker are combined there first: docs/p2p.md)."""
    return getattr(call, "method", "tasks") == "p2p" and call.plan.ranks != len(call.workers)


def plan_workers(call: Any) -> list[str]:
    """The worker of each of the plan's ranks: the call's ranks' workers, or,
    for a p2p plan over workers, each worker once in the order of its first rank."""
    return list(dict.fromkeys(call.workers)) if engine_run_over_workers(call) else list(call.workers)


def plan_ranks(call: Any) -> list[int]:
    """The call's rank each of the plan's ranks stands for (itself, or for a
    p2p plan over workers, the lowest rank of that worker: its hand-in's key)."""
    if not engine_run_over_workers(call):
        return list(range(call.plan.ranks))
    first: dict[str, int] = {}
    for r, w in enumerate(call.workers):
        first.setdefault(w, r)
    return [first[w] for w in plan_workers(call)]


def planned_links(call: Any, worker_of: dict[int, str]) -> dict[tuple[str, str], float]:
    """Bytes the plan moves between workers (all chunks; segments as equal
    fractions of ``nbytes``, so off by at most an element per segment)."""
    plan = call.plan
    out: dict[tuple[str, str], float] = defaultdict(float)
    seg = call.nbytes / plan.segments / plan.chunks
    sizes = plan.node_bytes(call.nbytes) if hasattr(plan, "node_bytes") else None  # sparse plans
    for t in plan.transfers():
        a, b = worker_of.get(t.source, ""), worker_of.get(t.dest, "")
        if a != b:
            out[(a, b)] += (sizes[t.src] if sizes else (t.hi - t.lo) * seg) * plan.chunks
    return dict(out)


def task_keys(call: Any) -> dict[str, list[str]]:
    """``repr(key) -> [repr(dependency key)]`` of the call's graph, rebuilt
    from the plan with the builder's naming rules (input keys excluded)."""
    plan, token, alg = call.plan, call.token, call.algorithm
    merged = {plan.finals[r]: r for r in range(plan.ranks) if not plan.output_is_separate(r)}
    deps: dict[str, list[str]] = {}
    finals: dict[int, list[str]] = defaultdict(list)
    for c in range(plan.chunks):
        name: dict[int, str] = {}
        for n in plan.nodes:
            k = (keymod.output_key(alg, token, merged[n.id]) if n.id in merged
                 else keymod.node_key(alg, n.phase, token, n.step, n.rank, c, n.id))
            name[n.id] = repr(k)
            deps[name[n.id]] = [name[i] for i in n.inputs]
        for r, f in enumerate(plan.finals):
            finals[r].append(name[f])
    for r in range(plan.ranks):
        if plan.output_is_separate(r):
            deps[repr(keymod.output_key(alg, token, r))] = finals[r]
    return deps


def engine_keys(call: Any) -> tuple[dict[str, list[str]], dict[str, str]]:
    """A ``method="p2p"`` call's dependencies, as :func:`task_keys`: every
    plan node the engine computes, per chunk, under the key its task would
    have (its events carry it), and each rank's output task depending on its
    final nodes. Views of an input (nodes without inputs) are made by the
    rank's hand-in task: the second dict maps their keys to its key."""
    plan, token, alg = call.plan, call.token, call.algorithm
    deps: dict[str, list[str]] = {}
    alias: dict[str, str] = {}
    ranks = plan_ranks(call)
    finals: dict[int, list[str]] = defaultdict(list)
    for c in range(plan.chunks):
        name = {n.id: repr(keymod.node_key(alg, n.phase, token, n.step, n.rank, c, n.id)) for n in plan.nodes}
        for n in plan.nodes:
            deps[name[n.id]] = [name[i] for i in n.inputs]
            if not n.inputs:
                alias[name[n.id]] = repr(keymod.hand_in_key(alg, token, ranks[n.rank]))
        for r, f in enumerate(plan.finals):
            finals[r].append(name[f])
    index = {w: i for i, w in enumerate(plan_workers(call))}
    for r, w in enumerate(call.workers):  # each of the call's ranks takes its worker's result out
        deps[repr(keymod.output_key(alg, token, r))] = finals[index.get(w, r) if engine_run_over_workers(call) else r]
    return deps, alias


def critical_path(trace: Any, call: Any, events: list[Event]) -> list[PathStep]:
    """The chain of tasks and transfers that decided when the call ended."""
    if getattr(call, "method", "tasks") == "p2p":
        deps, alias = engine_keys(call)
        task = {e.key: e for e in events if (e.phase in COMPUTE_PHASES or e.phase == OTHER)
                and (e.key in deps or e.key in alias.values())}
        for k, hand_in in alias.items():
            if hand_in in task:
                task[k] = task[hand_in]
    else:
        deps = task_keys(call)
        task = {e.key: e for e in events if e.phase in COMPUTE_PHASES and e.key in deps}
    arrive: dict[tuple[str, str], Event] = {}
    for e in events:
        if e.phase == TRANSFER:
            for k in e.keys:
                arrive[(e.dest, k)] = e
    if not task:
        return []
    cur = max(task.values(), key=lambda e: e.stop)
    path: list[PathStep] = []
    while True:
        path.append(PathStep(cur.phase, cur.start, cur.stop, cur.key, cur.worker))
        best: tuple[float, Event, Event | None] | None = None
        for d in deps.get(cur.key, []):
            src = task.get(d)
            if src is None:
                continue
            via = arrive.get((cur.worker, d)) if src.worker != cur.worker else None
            t = via.stop if via is not None else src.stop
            if best is None or t > best[0]:
                best = (t, src, via)
        if best is None:
            break
        t, src, via = best
        if cur.start > t:
            path.append(PathStep("gap", t, cur.start, "", cur.worker))
        if via is not None:
            path.append(PathStep(TRANSFER, via.start, via.stop, via.key, via.worker))
            if via.start > src.stop:
                path.append(PathStep("gap", src.stop, via.start, "", via.worker))
        cur = src
    path.reverse()
    if len(path) > 1 and path[-1].kind == OTHER:  # p2p: the output task awaited the engine: its part is the hand-out
        path[-1].start = min(max(path[-1].start, path[-2].stop), path[-1].stop)
    return path
