"""The scheduler side of the dashboard: a bounded record of flowreduce
calls for the ``/flowreduce`` page, a part of flowreduce's scheduler
extension (:mod:`flowreduce.schedule.extension`), or alone in its place
until the extension comes (``--preload flowreduce.dashboard``,
:func:`flowreduce.dashboard.install`), which then adopts it; :func:`store_of`
finds it either way.

What it records, and when (everything else is read from the scheduler's
own task states when the page refreshes, :mod:`flowreduce.dashboard.views`):

* ``update_graph``: a graph with flowreduce keys opens a call per token and
  files its keys by cell (rank × step, from :func:`flowreduce.keys.parse`),
  with the cells that feed each other across ranks (the plan's transfers).
  Graphs without flowreduce keys cost one scan of their requested keys.
* the client's record (:func:`flowreduce.dashboard.publish`, one message on
  the client's existing batched stream): bytes, chunks, predicted seconds,
  transport, workers. A client that sends none (an older flowreduce) still
  gets its calls shown, from the keys alone.
* a ``method="p2p"`` call's engine steps: the workers running it tell the
  scheduler, at most every 100 ms each and only while their engine's log
  grows, how many plan nodes they computed per (rank, step)
  (:mod:`flowreduce.schedule.engine_log`, :meth:`DashboardStore.engine_steps`);
  they become cells ``(rank, ("engine", step))`` of the grid.
* transitions of flowreduce tasks only (one dict lookup rejects the
  others): the time each cell last finished a task, bytes fetched across
  ranks, and the end of the call (every output in memory: done; a task
  erred: failed, with the error; an output forgotten first: cancelled).

Bounded: every call in flight (they hold tasks on the scheduler anyway,
capped at :data:`MAX_IN_FLIGHT`) and the last :data:`HISTORY` finished, which
keep per-cell counters only (their keys are dropped), so memory stays flat
however many calls run.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time

from flowreduce import keys
from flowreduce.dashboard.jobs import SpmdJobs
from flowreduce.dashboard.record import ENGINE_OP, EXTENSION, SPMD_PREFIX, DashboardRecord

logger = logging.getLogger("flowreduce.dashboard")

#: Where the store is on the scheduler: the extension's plugin, or the store itself in its place.
NAME = EXTENSION
#: The stream message a client publishes a record with (a handler of the scheduler's client streams).
OP = "flowreduce-dashboard-publish"
HISTORY = 100
MAX_IN_FLIGHT = 10_000

#: A cell: (rank, step) for plan nodes, (rank, "out" | "pack" | "unpack") for the other tasks of a call.
Slot = tuple[int, Any]


def slot_of(parts: dict) -> Slot:
    """The cell of a parsed flowreduce key."""
    if parts["phase"] in ("output", "pack", "unpack"):
        return parts["rank"], {"output": "out"}.get(parts["phase"], parts["phase"])
    return parts["rank"], parts["step"]


@dataclass(eq=False)
class Call:
    """One call (one token) as the store knows it."""

    token: str
    algorithm: str
    submitted: float
    record: DashboardRecord | None = None
    state: str = "submitted"
    finished: float | None = None
    error: str = ""
    blame: str = ""  # the key whose failure failed the call
    names: set[str] = field(default_factory=set)  # key names of the call's tasks
    cells: dict[Slot, list] = field(default_factory=dict)  # keys per cell; emptied when the call ends
    sizes: dict[Slot, int] = field(default_factory=dict)  # tasks per cell
    phases: dict[Slot, str] = field(default_factory=dict)
    edges: set[tuple[Slot, Slot]] = field(default_factory=set)  # cells feeding a cell of another rank
    outputs: set = field(default_factory=set)  # output keys not in memory yet
    done_keys: set = field(default_factory=set)  # while in flight
    done_count: dict[Slot, int] = field(default_factory=dict)  # once ended
    done_at: dict[Slot, float] = field(default_factory=dict)  # when a task of the cell last finished
    erred: set[Slot] = field(default_factory=set)
    link_bytes: dict[tuple[int, int], float] = field(default_factory=dict)  # (source rank, dest rank)
    fetched: set = field(default_factory=set)  # (key, dest rank) counted in link_bytes, while in flight
    engine: dict[Slot, list[int]] = field(default_factory=dict)  # p2p: (rank, ("engine", step)) -> [done, total]
    engine_attempt: int = 0  # the p2p run's attempt the engine cells count (a restart starts them over)

    @property
    def in_flight(self) -> bool:
        return self.finished is None

    def elapsed(self, now: float) -> float:
        return (self.finished if self.finished is not None else now) - self.submitted


class DashboardStore(SchedulerPlugin):
    """Bounded record of flowreduce calls; serves the ``/flowreduce`` page."""

    name = NAME
    idempotent = True  # a second client registering it keeps the first one's history (or the extension holding one)

    def __init__(self, history: int = HISTORY):
        self.calls: dict[str, Call] = {}  # in flight, oldest first
        self.history: deque[Call] = deque(maxlen=history)  # finished, oldest first
        self._by_name: dict[str, Call] = {}  # key name -> call in flight
        self.malformed = 0  # records that could not be read (a client of another version)
        self.unknown = 0  # records and engine steps of calls not on the page (older than the history)
        self.generation = 0  # bumped by every change: a page with nothing in flight skips unchanged refreshes
        self.scheduler: Any = None
        #: SPMD jobs (flowreduce.spmd): live ones and each rank's last collective (:mod:`flowreduce.dashboard.jobs`)
        self.spmd = SpmdJobs(history)

    # -- lifecycle -----------------------------------------------------------
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.stream_handlers[OP] = self.publish
        # calls submitted before the plugin (the first call installs it after submitting)
        self._file(scheduler, [k for k in scheduler.tasks if _ours(k)])
        for k, ts in list(scheduler.tasks.items()):  # SPMD jobs running before the plugin arrived
            if type(k) is str and k.startswith(SPMD_PREFIX):
                self.spmd.transition(scheduler, k, ts.state)

    # -- recording -----------------------------------------------------------
    def publish(self, record: Any = None, **_: Any) -> None:
        """Stream handler: a client's record of one call. A record that is not
        one (:meth:`DashboardRecord.from_message`), is out of bounds
        (:func:`_out_of_bounds`) or names a call the scheduler has not seen
        (its keys open a call first) is counted, logged and dropped: a stream
        handler that raised would drop the client's connection."""
        try:
            rec = DashboardRecord.from_message(record)
            why = "not a record" if rec is None else _out_of_bounds(rec)
            call = self.find(rec.token) if rec is not None and why is None else None
            if rec is not None and why is None and call is None:
                self.unknown += 1
                logger.debug("flowreduce: %s of a call not on the page: %s", OP, rec.token[:100])
                return
        except Exception as e:
            why, call, rec = repr(e), None, None
        if call is None or rec is None:
            self.malformed += 1
            logger.error("flowreduce: %s refused a record (%s): %s", OP, why, repr(record)[:200])
            return
        call.record = rec
        self.generation += 1

    def engine_steps(self, token: Any = None, cells: Any = None, totals: Any = None, run: Any = None,
                     sent: Any = (), worker: Any = None, **_: Any) -> None:
        """A p2p engine's progress (:mod:`flowreduce.schedule.engine_log`):
        ``totals`` ``[[rank, step, phase, nodes], ...]`` the first time a worker
        reports a run, ``cells`` ``[[rank, step, nodes computed since its last
        report], ...]``, ``sent`` ``[[worker, bytes], ...]`` the bytes the
        reporting ``worker`` sent each worker since (links between the
        workers' lowest ranks). Filed under the call in flight or in the history (the
        last report may come after the outputs); anything else is counted and
        dropped."""
        call = self.find(token) if isinstance(token, str) else None
        if call is None and isinstance(token, str):  # a call older than the history, or never filed: not an error
            self.unknown += 1
            logger.debug("flowreduce: %s of a call not on the page: %s", ENGINE_OP, token[:100])
            return
        why = _engine_refusal(call, cells, totals) or _sent_refusal(sent)
        if why is not None or call is None:
            self.malformed += 1
            logger.error("flowreduce: %s refused engine steps of call %s: %s", ENGINE_OP, repr(token)[:100], why)
            return
        attempt = _attempt(run)
        if attempt < call.engine_attempt:  # a late report of an attempt that was restarted
            return
        if attempt > call.engine_attempt:  # the run restarted over the survivors: its steps start over
            call.engine_attempt = attempt
            for slot, cell in call.engine.items():
                cell[0] = 0
                call.done_at.pop(slot, None)
        for r, s, phase, n in totals:
            slot = (r, ("engine", s))
            call.engine.setdefault(slot, [0, 0])[1] = n
            call.phases[slot] = phase
        rank_of: dict[str, int] = {}
        for r, w in enumerate(call.record.workers if call.record is not None else ()):
            rank_of.setdefault(w, r)
        for dest, nbytes in sent or ():
            link = (rank_of.get(worker, -1), rank_of.get(dest, -1))
            if -1 not in link:
                call.link_bytes[link] = call.link_bytes.get(link, 0) + nbytes
        now = time()
        for r, s, n in cells:
            cell = call.engine.setdefault((r, ("engine", s)), [0, 0])
            cell[0] += n
            if cell[0] >= cell[1]:
                call.done_at[r, ("engine", s)] = now
        self.generation += 1

    def update_graph(self, scheduler, *, keys: Any = (), tasks: Any = (), **kwargs: Any) -> None:
        if any(_ours(k) for k in keys):
            self._file(scheduler, tasks)

    def _file(self, scheduler, tasks: Any) -> None:
        """Open the calls of flowreduce keys among ``tasks`` and file the keys by cell."""
        tasks_ = scheduler.tasks
        found: dict[Any, tuple[Call, Slot]] = {}
        for k in tasks:
            parts = keys_parse(k)
            if parts is None:
                continue
            call = self.calls.get(parts["token"]) or self._open(parts["token"], parts["algorithm"])
            if call.state == "submitted":
                call.state = "running"
            slot = slot_of(parts)
            call.names.add(k[0])
            self._by_name[k[0]] = call
            call.cells.setdefault(slot, []).append(k)
            call.phases.setdefault(slot, parts["phase"])
            if parts["phase"] == "output":
                call.outputs.add(k)
            found[k] = call, slot
        self.generation += bool(found)
        for k, (call, slot) in found.items():
            call.sizes[slot] = len(call.cells[slot])
            ts = tasks_.get(k)
            for dep in ts.dependencies if ts is not None else ():
                src = found.get(dep.key)
                if src is not None and src[1][0] != slot[0]:
                    call.edges.add((src[1], slot))
        for k, (call, _) in found.items():  # adopted at start: some may be done already
            ts = tasks_.get(k)
            if ts is not None and ts.state == "memory" and call.in_flight:
                self._done(call, k)

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if type(key) is not tuple or not key:
            if type(key) is str and key.startswith(SPMD_PREFIX):  # a rank of an SPMD job
                self.spmd.transition(self.scheduler, key, finish)
            return
        call = self._by_name.get(key[0]) if isinstance(key[0], str) else None
        if call is None:
            return
        if finish == "memory":
            self._done(call, key)
        elif finish == "erred":
            self._end(call, "failed", blame=key)
        elif finish == "forgotten" and key in call.outputs:
            self._end(call, "cancelled")

    def _done(self, call: Call, key) -> None:
        parts = keys_parse(key)
        if parts is None:  # filed under a call, so ours: never
            return
        slot = slot_of(parts)
        now = time()
        call.done_keys.add(key)
        call.done_at[slot] = now
        self.generation += 1
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        rank = slot[0]
        for dep in ts.dependencies if ts is not None else ():
            if not _ours(dep.key) or (dep.key, rank) in call.fetched:
                continue
            src = keys_parse(dep.key)
            if src is not None and src["phase"] in ("hand-in", "barrier"):  # p2p's gates: the engines report bytes
                continue
            if src is not None and src["token"] == call.token and src["rank"] != rank:
                call.fetched.add((dep.key, rank))
                link = (src["rank"], rank)
                node = src.get("node")  # None for outputs and fusion's pack/unpack: dask's size then
                sent = call.record.message_bytes(node) if call.record and node is not None else None
                call.link_bytes[link] = call.link_bytes.get(link, 0) + (max(dep.nbytes, 0) if sent is None else sent)
        call.outputs.discard(key)
        if parts["phase"] == "output" and not call.outputs:
            self._end(call, "done")

    def _end(self, call: Call, state: str, blame: Any = None) -> None:
        if not call.in_flight:
            return
        call.state, call.finished = state, time()
        self.generation += 1
        if blame is not None:
            call.blame, call.error = _error_of(self.scheduler, blame)
            parts = keys_parse(blame)
            if parts is not None:
                call.erred.add(slot_of(parts))
        call.done_count = {s: sum(k in call.done_keys for k in ks) for s, ks in call.cells.items()}
        call.cells, call.done_keys, call.fetched, call.outputs = {}, set(), set(), set()
        for n in call.names:
            self._by_name.pop(n, None)
        self.calls.pop(call.token, None)
        self.history.append(call)

    def _open(self, token: str, algorithm: str) -> Call:
        while len(self.calls) >= MAX_IN_FLIGHT:  # the oldest, most likely abandoned
            oldest = next(iter(self.calls.values()))
            oldest.error = f"dropped from the dashboard: more than {MAX_IN_FLIGHT} calls in flight"
            self._end(oldest, "cancelled")
        call = self.calls[token] = Call(token, algorithm, time())
        return call

    # -- reading -------------------------------------------------------------
    def find(self, token: str) -> Call | None:
        call = self.calls.get(token)
        if call is None:
            call = next((c for c in reversed(self.history) if c.token == token), None)
        return call

    def listing(self) -> list[Call]:
        """Calls in flight (oldest first), then finished (newest first)."""
        return [*self.calls.values(), *reversed(self.history)]


#: Most ranks, dimensions and characters a record may carry (the page draws them).
MAX_RANKS, MAX_DIMS, MAX_TEXT = 1 << 16, 64, 256
#: Most cells one engine progress message may carry.
MAX_ENGINE_CELLS = 1 << 20


def store_of(scheduler: Any) -> DashboardStore | None:
    """The store on ``scheduler``: the extension's part, or the store alone in its place; None before either."""
    plugin = scheduler.plugins.get(NAME)
    return plugin if isinstance(plugin, DashboardStore) else getattr(plugin, "dashboard", None)


def _out_of_bounds(rec: DashboardRecord) -> str | None:
    """Why ``rec`` does not describe an all-reduce this page could draw, or None."""
    import math

    from flowreduce import config
    from flowreduce.dashboard.record import MAX_WIDTHS

    if not 0 < rec.ranks <= MAX_RANKS or not 0 < rec.chunks <= int(config.get("max-chunks")):
        return f"{rec.ranks} ranks, {rec.chunks} chunks"
    if rec.nbytes < 0 or not 0 <= rec.steps <= 4 * MAX_RANKS:
        return f"{rec.nbytes} bytes, {rec.steps} steps"
    if len(rec.workers) > rec.ranks or len(rec.output_columns) > rec.ranks or len(rec.widths) > MAX_WIDTHS \
            or len(rec.shape) > MAX_DIMS:
        return "more workers, columns, widths or dimensions than the call can have"
    if any(len(t) > MAX_TEXT for t in (rec.token, rec.algorithm, rec.transport, rec.group, rec.dtype, *rec.workers)):
        return f"a text longer than {MAX_TEXT} characters"
    numbers = (rec.segment_bytes, *(() if rec.predicted is None else (rec.predicted,)))
    if not all(math.isfinite(x) and x >= 0 for x in numbers):
        return f"predicted {rec.predicted!r}, segment bytes {rec.segment_bytes!r}"
    return None


def _attempt(run: Any) -> int:
    """The attempt of a run id ``"<token>.<attempt>"`` (0 when it says none)."""
    tail = run.rpartition(".")[2] if isinstance(run, str) else ""
    return int(tail) if tail.isdigit() and len(tail) < 6 else 0


def _sent_refusal(sent: Any) -> str | None:
    if not isinstance(sent, (list, tuple)) or len(sent) > MAX_RANKS or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) and len(x[0]) <= MAX_TEXT
            and type(x[1]) is int and x[1] >= 0 for x in sent):
        return "sent is not [[worker, bytes], ...]"
    return None


def _engine_refusal(call: Call | None, cells: Any, totals: Any) -> str | None:
    """Why an engine's progress message is not one :mod:`flowreduce.schedule.engine_log` sends, or None."""
    if call is None:
        return "unknown call"
    if not isinstance(cells, (list, tuple)) or not isinstance(totals, (list, tuple)) \
            or len(cells) + len(totals) > MAX_ENGINE_CELLS:
        return "cells and totals must be lists"

    def count(x: Any) -> bool:
        return type(x) is int and 0 <= x <= MAX_ENGINE_CELLS * MAX_RANKS

    for t in totals:
        if not (isinstance(t, (list, tuple)) and len(t) == 4 and count(t[0]) and count(t[1]) and count(t[3])
                and isinstance(t[2], str) and len(t[2]) <= MAX_TEXT):
            return f"a total is not [rank, step, phase, nodes]: {t!r}"[:200]
    for c in cells:
        if not (isinstance(c, (list, tuple)) and len(c) == 3 and all(count(x) for x in c)):
            return f"a cell is not [rank, step, nodes]: {c!r}"[:200]
    return None


def keys_parse(key) -> dict | None:
    """:func:`flowreduce.keys.parse`, tolerant of keys of another flowreduce version."""
    try:
        return keys.parse(key)
    except (ValueError, TypeError, IndexError):
        return None


def _ours(key) -> bool:
    return type(key) is tuple and bool(key) and isinstance(key[0], str) and key[0].startswith("flowreduce-")


def _error_of(scheduler, key) -> tuple[str, str]:
    """(the key to blame, its error text) for a task of ours that erred."""
    ts = scheduler.tasks.get(key) if scheduler is not None else None
    if ts is None:
        return str(key), "failed"
    blame = ts.exception_blame or ts
    text = blame.exception_text or ""
    if not text and blame.exception is not None:
        try:
            from distributed.protocol.pickle import loads

            exc = blame.exception
            text = repr(loads(exc.data if hasattr(exc, "data") else exc))
        except Exception:  # an exception that cannot be read back: say so rather than fail the page
            text = "an exception that cannot be unpickled on the scheduler"
    return str(blame.key), text
