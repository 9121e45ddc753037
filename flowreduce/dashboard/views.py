"""What the ``/flowreduce`` page shows, computed at refresh from the store
(:mod:`flowreduce.dashboard.store`) and the scheduler's task states.

Plain data (lists of dicts, no Bokeh), so the page is a thin layer over it
and tests can read the same numbers the page draws.

A cell's state, from its tasks (one per chunk) as the scheduler sees them:

* ``done``: every task finished (in memory, or released after use);
* ``erred``: a task failed;
* ``transferring``: a task is on its worker, which has yet to fetch an input held elsewhere;
* ``running``: a task is on its worker with its inputs there (and the worker has a thread for it);
* ``ready``: a task waits for a thread (queued on the scheduler, or on a worker busier than its threads);
* ``waiting``: a task waits for an input (an earlier step, another rank, or the rank's own input).

A ``method="p2p"`` call's plan steps are not tasks: the engines tell the
store how many of a cell's plan nodes (times chunks) they computed
(:meth:`~flowreduce.dashboard.store.DashboardStore.engine_steps`), and such
a cell is ``done`` once all are, ``running`` once some are, else
``waiting``. Its columns are the hand-ins (0), the barrier (1), the plan's
steps (from :data:`~flowreduce.dashboard.record.ENGINE_COLUMN`), the outputs.

A cell shows the first of :data:`~flowreduce.dashboard.record.CELL_STATES`
any of its tasks is in, so a half-finished cell shows what is still moving.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from flowreduce.dashboard.record import CELL_STATES, ENGINE_COLUMN, PACK_COLUMN
from flowreduce.dashboard.store import Call, DashboardStore, Slot, keys_parse

_ORDER = {s: i for i, s in enumerate(CELL_STATES)}


@dataclass(frozen=True)
class Cell:
    rank: int
    column: int
    phase: str
    state: str
    tasks: int
    done: int


def task_state(ts, finished_before: bool) -> str:
    """One task's cell state (see the module docstring). ``finished_before``:
    the task reached memory once; released since (its data used and
    dropped, ``ts`` None once forgotten) it still counts as done."""
    if ts is None or ts.state == "memory":
        return "done"
    state = ts.state
    if state == "released" and finished_before:
        return "done"
    if state == "erred":
        return "erred"
    if state == "processing":
        ws = ts.processing_on
        if ws is None:
            return "ready"
        if any(ws not in (d.who_has or ()) for d in ts.dependencies):
            return "transferring"
        return "running" if ts in ws.executing or len(ws.processing) <= ws.nthreads else "ready"
    if state in ("queued", "no-worker"):
        return "ready"
    return "waiting"  # released, waiting


def columns(call: Call) -> dict[Slot, int]:
    """The grid column of every cell: its step; pack before step 0; a rank's
    output on its final step (the client's record says which) or one past
    the last step; unpack after the outputs."""
    slots = list(call.sizes)
    steps = [s for _, s in slots if isinstance(s, int)]
    last = max(steps, default=-1)
    rec = call.record
    out_cols = rec.output_columns if rec is not None else ()
    out: dict[Slot, int] = {}
    if call.engine:  # p2p: hand-in, barrier, the engine's steps, the outputs
        for rank, s in call.engine:
            out[rank, s] = ENGINE_COLUMN + s[1]
        last = max(out.values())
        out_cols = ()
    for rank, s in slots:
        if isinstance(s, int):
            out[rank, s] = s
        elif s == "out":
            out[rank, s] = out_cols[rank] if rank < len(out_cols) else last + 1
        elif s == "pack":
            out[rank, s] = PACK_COLUMN
    after = max((c for (_, s), c in out.items() if s == "out"), default=last) + 1
    for rank, s in slots:
        if s == "unpack":
            out[rank, s] = after
    return out


def grid(call: Call, scheduler) -> list[Cell]:
    """The call's cells, ranks × columns, with their states (merged when an
    output is its rank's final plan node)."""
    cols = columns(call)
    merged: dict[tuple[int, int], list] = {}  # (rank, column) -> [phase, state, tasks, done]
    tasks = scheduler.tasks if scheduler is not None else {}
    for slot, n in call.sizes.items():
        if call.in_flight:
            states = [task_state(tasks.get(k), k in call.done_keys) for k in call.cells.get(slot, ())]
        else:
            states = (["erred"] if slot in call.erred else []) + ["done"] * call.done_count.get(slot, 0)
            states += ["waiting"] * (n - len(states))
        state = min(states, key=_ORDER.__getitem__, default="waiting")
        done = sum(s == "done" for s in states)
        at = (slot[0], cols[slot])
        if at in merged:  # a rank's output that is its final node: one cell
            m = merged[at]
            m[1] = min(m[1], state, key=_ORDER.__getitem__)
            m[2] += n
            m[3] += done
        else:
            merged[at] = [call.phases.get(slot, "?"), state, n, done]
    for slot, (done, n) in call.engine.items():
        state = "done" if done >= n else "running" if done else "waiting"
        merged[slot[0], cols[slot]] = [call.phases.get(slot, "?"), state, n, min(done, n)]
    return [Cell(r, c, *m) for (r, c), m in sorted(merged.items())]


def column_labels(call: Call) -> dict[int, str]:
    """What the page writes under each column: the step, ``pack``, and for a
    p2p call ``hand-in``, ``barrier``, ``step s`` and ``out``."""
    cols = columns(call)
    labels = {c: str(c) for c in cols.values()}
    labels.update({c: "pack" for c in cols.values() if c == PACK_COLUMN})
    if call.engine:
        labels.update({c: f"step {s[1]}" for (_, s), c in cols.items() if isinstance(s, tuple)})
        labels.update({0: "hand-in", 1: "barrier"})
        labels.update({c: "out" for (_, s), c in cols.items() if s == "out"})
    return labels


def edges(call: Call) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Cross-rank transfers between cells, as ((rank, column), (rank, column))."""
    cols = columns(call)
    return sorted({((a[0], cols[a]), (b[0], cols[b])) for a, b in call.edges if a in cols and b in cols})


def rank_progress(cells: list[Cell]) -> list[dict[str, Any]]:
    per: dict[int, list[int]] = {}
    for c in cells:
        p = per.setdefault(c.rank, [0, 0])
        p[0] += c.done
        p[1] += c.tasks
    return [{"rank": r, "done": d, "tasks": n, "fraction": d / n if n else 1.0} for r, (d, n) in sorted(per.items())]


def links(call: Call, scheduler, now: float) -> list[dict[str, Any]]:
    """Bytes fetched so far between ranks, their mean rate over the call,
    and the bandwidth the workers measure between the two workers."""
    workers = call.record.workers if call.record is not None else ()
    elapsed = max(call.elapsed(now), 1e-9)
    measured = getattr(scheduler, "bandwidth_workers", {}) if scheduler is not None else {}
    rows = []
    for (src, dst), nbytes in sorted(call.link_bytes.items(), key=lambda kv: -kv[1]):
        ws, wd = (workers[src] if src < len(workers) else ""), (workers[dst] if dst < len(workers) else "")
        rows.append({"source": src, "dest": dst, "source_worker": ws, "dest_worker": wd, "bytes": nbytes,
                     "rate": nbytes / elapsed, "measured": float(measured.get((wd, ws), 0.0))})
    return rows


def straggler(call: Call, cells: list[Cell], scheduler, now: float) -> dict[str, Any]:
    """The rank whose input or step is latest, and by how much.

    In flight: the rank whose first unfinished column is earliest; the lag is
    how long ago another rank finished that column. Ended: the rank that
    finished last, and how long after the median of the others."""
    by_rank: dict[int, list[Cell]] = {}
    for c in cells:
        by_rank.setdefault(c.rank, []).append(c)
    cols = columns(call)
    if len(by_rank) < 2:
        return {"rank": -1, "column": -1, "lag": 0.0, "text": "no straggler: fewer than two ranks seen"}
    if not call.in_flight:
        last = {r: max((t for (rr, _), t in call.done_at.items() if rr == r), default=call.submitted)
                for r in by_rank}
        rank = max(last, key=last.__getitem__)
        others = [t for r, t in last.items() if r != rank]
        lag = last[rank] - statistics.median(others)
        return {"rank": rank, "column": -1, "lag": lag,
                "text": f"rank {rank} finished last, {lag:.3f} s after the median rank ({call.state})"}
    frontier = {r: min((c for c in cs if c.state != "done"), key=lambda c: c.column, default=None)
                for r, cs in by_rank.items()}
    pending = {r: c for r, c in frontier.items() if c is not None}
    if not pending:
        return {"rank": -1, "column": -1, "lag": 0.0, "text": "every rank has finished its steps"}
    rank = min(pending, key=lambda r: (pending[r].column, r))
    cell = pending[rank]
    ahead = [call.done_at[r, s] for (r, s), col in cols.items()
             if col == cell.column and r != rank and (r, s) in call.done_at
             and ((f := frontier.get(r)) is None or f.column > cell.column)]
    step = _column_name(cell.column, cell.phase, column_labels(call) if call.engine else None)
    if not ahead:
        return {"rank": rank, "column": cell.column, "lag": 0.0,
                "text": f"no straggler: every rank is at {step} or before"}
    lag = now - min(ahead)
    what = _waiting_on(call, rank, cell, cols, scheduler)
    return {"rank": rank, "column": cell.column, "lag": lag,
            "text": f"rank {rank} is behind at {step} ({cell.state}{what}): the first other rank finished "
                    f"that step {lag:.1f} s ago"}


def _waiting_on(call: Call, rank: int, cell: Cell, cols: dict[Slot, int], scheduler) -> str:
    """', waiting for <key> (<state>)' naming an input of the cell's tasks that is not in memory."""
    if scheduler is None:
        return ""
    for slot, col in cols.items():
        if slot[0] != rank or col != cell.column:
            continue
        for k in call.cells.get(slot, ()):
            ts = scheduler.tasks.get(k)
            for d in ts.dependencies if ts is not None else ():
                if d.state != "memory":
                    whose = "another rank's" if keys_parse(d.key) is not None else "its input"
                    where = f" on {d.processing_on.address}" if d.processing_on is not None else ""
                    return f", waiting for {whose} {d.key!r}, {d.state}{where}"
    return ""


def _column_name(column: int, phase: str, labels: dict[int, str] | None = None) -> str:
    if labels is not None:  # p2p: hand-in, barrier, step s of the engine, out
        label = labels.get(column, str(column))
        return label if label in (phase, "out") or phase in ("hand-in", "barrier") else f"{label} ({phase})"
    if column == PACK_COLUMN:
        return "pack"
    return f"step {column} ({phase})"


def calls_table(store: DashboardStore, now: float) -> list[dict[str, Any]]:
    """One row per call: in flight (oldest first), then finished (newest first)."""
    rows = []
    for call in store.listing():
        rec = call.record
        rows.append({
            "token": call.token, "algorithm": call.algorithm,
            "ranks": rec.ranks if rec else len({r for r, _ in call.sizes}),
            "nbytes": rec.nbytes if rec else -1, "chunks": rec.chunks if rec else -1,
            "transport": rec.transport if rec else "?", "state": call.state,
            "elapsed": round(call.elapsed(now), 1), "predicted": rec.predicted if rec and rec.predicted is not None else -1.0,
            "group": rec.group if rec else "", "error": call.error,
        })
    return rows


def default_selection(store: DashboardStore) -> Call | None:
    """The call to show when none is chosen: the oldest in flight (the one
    most likely stuck), else the latest finished."""
    if store.calls:
        return next(iter(store.calls.values()))
    return store.history[-1] if store.history else None


# -- SPMD jobs ---------------------------------------------------------------------------
def spmd_jobs(store: DashboardStore, now: float) -> list[dict[str, Any]]:
    """One row per SPMD job (one attempt): live ones (oldest first), then ended ones (newest
    first). ``workers``: the distinct workers of its ranks, comma-separated."""
    rows = []
    for job in store.spmd.listing():
        rows.append({"job": job.token, "run": job.run, "attempt": job.attempt, "ranks": len(job.states),
                     "workers": ", ".join(sorted(set(job.workers.values()))), "state": job.state,
                     "elapsed": round(job.elapsed(now), 1), "error": job.error})
    return rows


def spmd_ranks(store: DashboardStore, now: float) -> list[dict[str, Any]]:
    """One row per rank of every SPMD job :func:`spmd_jobs` lists, with its last collective as
    the dashboard last polled it (``collective`` empty: none seen yet): ``seq``, ``nbytes`` (the
    rank's input), ``at`` (when it ended, the worker's ``time.time()``), ``ago`` (seconds before
    ``now``, the scheduler's time: the same clock on one host), ``duration``."""
    rows = []
    for job in store.spmd.listing():
        for rank in sorted(job.states):
            last = job.last.get(rank)
            rows.append({"job": job.token, "run": job.run, "rank": rank, "worker": job.workers.get(rank, ""),
                         "task": job.states[rank], "collective": last.collective if last else "",
                         "seq": last.seq if last else 0, "nbytes": last.nbytes if last else 0,
                         "at": last.stop if last else 0.0,
                         "ago": round(now - last.stop, 3) if last else -1.0,
                         "duration": (last.stop - last.start) if last else 0.0})
    return rows
