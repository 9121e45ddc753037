"""Say where a stuck all-reduce is stuck (run on the scheduler when a
call's timeout expires): for each pending result, the tasks it ultimately
waits for, each with its rank, plan step, key, state and worker."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from distributed.metrics import monotonic, time

from flowreduce.keys import parse

#: At most this many stuck tasks are described (the rest are counted).
MAX_LINES = 4


def explain(s: Any, pending: list[Hashable], input_ranks: dict[Hashable, list[int]], since: dict[Hashable, float]
            ) -> str:
    """What results ``pending`` wait for: the tasks at the frontier of what
    is not computed yet (nothing below them is missing)."""
    frontier: list[Any] = []
    seen: set[Hashable] = set()
    stack = [s.tasks[k] for k in pending if k in s.tasks]
    while stack:
        ts = stack.pop()
        if ts.key in seen:
            continue
        seen.add(ts.key)
        missing = [d for d in ts.dependencies if d.state != "memory"]
        if ts.state == "waiting" and missing:
            stack.extend(missing)
        else:
            frontier.append(ts)
    frontier.sort(key=lambda ts: (ts.state != "processing", str(ts.key)))
    lines = [describe(s, ts, input_ranks, since) for ts in frontier[:MAX_LINES]]
    more = f"; and {len(frontier) - MAX_LINES} more" if len(frontier) > MAX_LINES else ""
    return "waiting for " + "; ".join(lines) + more


def describe(s: Any, ts: Any, input_ranks: dict[Hashable, list[int]], since: dict[Hashable, float]) -> str:
    """One task: whose it is (rank, plan step, key) and what it is doing."""
    info = parse(ts.key)
    if info is None:
        ranks = input_ranks.get(ts.key)
        who = (f"input of rank {', '.join(map(str, sorted(set(ranks))))} (key {ts.key!r}), computed by your own task"
               if ranks else f"key {ts.key!r} (a task of yours this call depends on)")
    elif info.get("step") is None:
        who = f"rank {info['rank']}, {info['phase']} key {ts.key!r}"
    else:
        who = f"rank {info['rank']}, plan step {info['step']} ({info['phase']}), key {ts.key!r}"
    return f"{who}: {_state(s, ts, since)}"


def _state(s: Any, ts: Any, since: dict[Hashable, float]) -> str:
    if ts.state == "processing":
        ws = ts.processing_on
        started = since.get(ts.key)
        elapsed = ws.executing.get(ts) if hasattr(ws, "executing") else None
        if elapsed is None and started is not None:
            elapsed = monotonic() - started
        out = f"processing on worker {ws.address}" + (f" for {elapsed:.1f} s" if elapsed is not None else "")
        fetching = [(d.key, sorted(w.address for w in d.who_has or ())) for d in ts.dependencies
                    if ws not in (d.who_has or ())]
        for key, holders in fetching[:2]:
            out += f", its input {key!r} being transferred from {', '.join(holders) or 'nowhere'} to {ws.address}"
        return out + f" (worker last heard from {time() - ws.last_seen:.1f} s ago)"
    if ts.state == "no-worker":
        pinned = sorted(ts.worker_restrictions or ())
        status = [f"{w} ({s.workers[w].status.name})" if w in s.workers else f"{w} (gone)" for w in pinned]
        return "no-worker: no running worker may run it" + (f"; pinned to {', '.join(status)}" if status else "")
    if ts.state == "queued":
        return "queued: every worker thread is busy"
    if ts.state == "waiting":
        return "waiting to be scheduled"
    return ts.state
