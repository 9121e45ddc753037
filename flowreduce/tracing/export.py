"""Exporters: Chrome Trace Event JSON (Perfetto, chrome://tracing), CSV and
an optional pandas DataFrame. All read ``trace.events``; times are written
relative to ``trace.origin`` (the scheduler's time when the trace started).

Chrome layout: one process (``pid``) per worker, named ``rank r · address``
and sorted by rank; one thread (``tid``) per phase lane (``reduce``,
``transfer``, ``transfer #2`` when messages overlap ...); ``"X"`` complete
events; for every transfer a flow (``"s"`` on the sender, ``"f"`` on the
receiver, same ``id``) so Perfetto draws an arrow from sender to receiver.
An SPMD job's rank gets threads of its own in its worker's process
(``rank r · allreduce`` ...: its task and its collectives), since several
ranks may share a worker.
"""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from typing import Any

from flowreduce.phases import TASK_PHASES
from flowreduce.tracing.events import EVENT_FIELDS, PHASES, Event, pack_lanes


def _label(e: Event) -> str:
    if e.job and e.seq is not None:  # an SPMD collective
        return f"{e.phase} #{e.seq} {e.nbytes / 1e6:.3g} MB"
    if e.phase in ("transfer", "serialise", "deserialise") and e.keys:
        more = f" +{len(e.keys) - 1}" if len(e.keys) > 1 else ""
        return f"{e.phase} {e.nbytes / 1e6:.3g} MB{more}"
    if e.token:
        where = f" s{e.step} c{e.chunk}" if e.step is not None else ""
        return f"{e.phase}{where} n{e.node}" if e.node is not None else f"{e.phase}{where}"
    return e.phase


def lanes(events: list[Event]) -> dict[int, tuple[str, int]]:
    """``index in events -> (worker, lane name)`` with non-overlapping lanes:
    one per phase, split into ``phase #2``... where a phase overlaps itself."""
    groups: dict[tuple[str, str, int | None], list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        # an SPMD rank's task and collectives: lanes of that rank (several ranks may share a worker)
        groups[(e.worker, e.phase, e.rank if e.job else None)].append(i)
    out: dict[int, tuple[str, int]] = {}
    for (_w, phase, rank), idx in groups.items():
        packed = pack_lanes([events[i] for i in idx])
        for i, lane in zip(idx, packed, strict=True):
            name = phase if lane == 0 else f"{phase} #{lane + 1}"
            tid = PHASES.index(phase) * 100 + lane
            if rank is not None:
                name, tid = f"rank {rank} · {name}", 100_000 + rank * 10_000 + tid
            out[i] = (name, tid)
    return out


def chrome_events(trace: Any) -> list[dict]:
    """The ``traceEvents`` list of :func:`to_chrome`."""
    events = trace.events
    origin = trace.origin

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    rank_of: dict[str, int | None] = {}
    for e in events:
        if e.phase in TASK_PHASES and e.rank is not None:
            rank_of[e.worker] = min(rank_of.get(e.worker, e.rank), e.rank)
    workers = sorted({e.worker for e in events if e.worker} | {e.source for e in events if e.source}
                     | set(getattr(trace, "clocks", {})),
                     key=lambda w: (rank_of.get(w) is None, rank_of.get(w) or 0, w))
    pid = {w: i + 1 for i, w in enumerate(workers)}
    out: list[dict] = []
    for w in workers:
        r = rank_of.get(w)
        name = f"rank {r} · {w}" if r is not None else w
        out.append({"ph": "M", "name": "process_name", "pid": pid[w], "tid": 0, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid[w], "tid": 0,
                    "args": {"sort_index": pid[w]}})
    lane = lanes(events)
    named = set()
    for i, e in enumerate(events):
        lname, tid = lane[i]
        if (e.worker, tid) not in named:
            named.add((e.worker, tid))
            out.append({"ph": "M", "name": "thread_name", "pid": pid[e.worker], "tid": tid,
                        "args": {"name": lname}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid[e.worker], "tid": tid,
                        "args": {"sort_index": tid}})
        args = {k: v for k, v in e.as_dict().items() if not (v is None or v is False or v in ("", ()))
                and k not in ("start", "stop", "worker", "phase")}  # rank, step, chunk 0 are kept
        out.append({"ph": "X", "name": _label(e), "cat": e.phase, "pid": pid[e.worker], "tid": tid,
                    "ts": us(e.start), "dur": round(e.duration * 1e6, 3), "args": args})
    # Flows: from the sender's serialise (or the task that made the first key)
    # to the receiver's transfer.
    where = {i: lane[i] for i in range(len(events))}
    serialise = {(e.source, e.dest, e.keys): i for i, e in enumerate(events) if e.phase == "serialise" and e.keys}
    made = {(e.worker, e.key): i for i, e in enumerate(events) if e.phase in TASK_PHASES}
    flow = 0
    for i, e in enumerate(events):
        if e.phase != "transfer" or e.source not in pid:
            continue
        j = serialise.get((e.source, e.dest, e.keys))
        if j is None:  # the task (or p2p engine node) that made a key of the message, the first one first
            j = next((made[e.source, k] for k in (e.key, *e.keys) if (e.source, k) in made), None)
        if j is None:
            continue
        s = events[j]
        flow += 1
        eps = min(1e-6, s.duration / 2)
        out.append({"ph": "s", "id": flow, "name": "transfer", "cat": "transfer", "pid": pid[s.worker],
                    "tid": where[j][1], "ts": us(s.stop - eps)})
        eps = min(1e-6, e.duration / 2)
        out.append({"ph": "f", "bp": "e", "id": flow, "name": "transfer", "cat": "transfer",
                    "pid": pid[e.worker], "tid": where[i][1], "ts": us(e.stop - eps)})
    return out


def to_chrome(trace: Any, path: str | os.PathLike) -> str:
    """Write ``trace`` as Chrome Trace Event JSON; open it at
    https://ui.perfetto.dev or chrome://tracing. Returns the path."""
    doc = {"traceEvents": chrome_events(trace), "displayTimeUnit": "ms", "metadata": trace.metadata()}
    with open(path, "w") as f:
        json.dump(doc, f, default=str)
    return os.fspath(path)


def rows(trace: Any) -> list[dict[str, Any]]:
    """One dict per event, times relative to the trace's origin."""
    out = []
    for e in trace.events:
        d = e.as_dict()
        d["start"] = e.start - trace.origin
        d["stop"] = e.stop - trace.origin
        d["duration"] = e.duration
        d["keys"] = json.dumps(list(e.keys))
        d["key_bytes"] = json.dumps(list(e.key_bytes))
        d["peers"] = json.dumps(list(e.peers))
        out.append(d)
    return out


def to_csv(trace: Any, path: str | os.PathLike) -> str:
    """Write one row per event (columns: the :class:`Event` fields plus
    ``duration``; ``start``/``stop`` in seconds since the trace's origin;
    ``keys``/``key_bytes``/``peers`` as JSON lists). Returns the path."""
    cols = [*EVENT_FIELDS, "duration"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows(trace):
            w.writerow({k: ("" if r[k] is None else r[k]) for k in cols})
    return os.fspath(path)


def to_dataframe(trace: Any):
    """The events as a ``pandas.DataFrame`` (needs pandas)."""
    try:
        import pandas as pd
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("to_dataframe needs pandas: pip install pandas") from e
    return pd.DataFrame(rows(trace))
