"""What the p2p engine did, recorded as it runs: one bounded log per worker
(:class:`EngineLog`, ``engine.log`` of :class:`flowreduce.schedule.p2p.Engine`)
that ``flowreduce.trace`` reads (:mod:`flowreduce.tracing.capture`) and that
feeds the dashboard's ranks x steps grid live (:func:`engine_steps_handler`).

Recording is always on and costs one tuple appended to a ``deque`` per
event (a clock read and an integer increment besides): one per plan node
computed per chunk, one per message sent, one per message received.
Entries, times raw ``time.time()`` of the worker (the tracer aligns them as
it aligns the shared-memory copies: :mod:`flowreduce.tracing.clocks`):

* ``(NODE, run, chunk, node, start, stop, nbytes, executor)``: a plan node
  computed (a reduction, or a gather of pieces); ``executor`` 1 when it ran
  on the worker's executor (start is then when it was handed to it);
* ``(SEND, run, dest, start, stop, values, nbytes, ids)``: one message, the
  rpc's round trip; ``ids`` is ``(chunk, node, chunk, node, ...)`` of the
  values it carried;
* ``(RECV, run, time, chunk, node, values, nbytes)``: a message handed to
  the run here (``chunk``, ``node``: its first value, which names the
  message together with the run and this worker);
* ``(BEGIN, run, time)``: the run started here.

The dashboard: every :data:`REPORT_MS` a worker whose log grew sends the
scheduler one stream message per run (:data:`flowreduce.dashboard.record.ENGINE_OP`)
with how many nodes it computed per (rank, step) since the last one, the
bytes it sent to each worker, and the first time each cell's total; the scheduler extension forwards it to
the dashboard's store (:func:`engine_steps_handler`). That is one message per worker and
run every 100 ms at most, on the worker's existing batched stream, rather
than the page asking every worker at each refresh: no work at all while
no run moves, nothing on the scheduler beyond folding the counts in.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from flowreduce.dashboard.record import ENGINE_OP

logger = logging.getLogger("flowreduce")

NODE, SEND, RECV, BEGIN = "node", "send", "recv", "begin"
#: Entries kept per worker (the newest): ~100 bytes each.
LENGTH = 100_000
#: Milliseconds between the dashboard's progress messages of a worker (only while its log grows).
REPORT_MS = 100
#: Runs whose programs the progress reporter keeps (to map nodes to cells).
KEPT_RUNS = 64

#: The clock of every entry (raw worker time, as the shared-memory copies' log).
now = time.time


def token_of(run: str) -> str:
    """The call's token of a run id ``"<token>.<attempt>"``."""
    return run.rpartition(".")[0] or run


class EngineLog:
    """One worker's log of its engine's steps (see the module docstring)."""

    def __init__(self, worker: Any = None, length: int = LENGTH):
        self.entries: deque[tuple] = deque(maxlen=length)
        self.count = 0  # entries ever appended: a reader's cursor
        self.worker = worker
        self.programs: OrderedDict[str, Any] = OrderedDict()  # run -> its Program here
        self.reported = 0
        self.told: OrderedDict[str, None] = OrderedDict()  # runs whose cells' totals were sent
        if worker is not None:
            self._start_reporting(worker)

    # -- recording (the engine's hot path: one tuple each) ------------------------
    def begin(self, run: str, prog: Any) -> None:
        self.programs[run] = prog
        if len(self.programs) > KEPT_RUNS:
            self.programs.popitem(last=False)
        self.entries.append((BEGIN, run, now()))
        self.count += 1

    def node(self, run: str, chunk: int, node: int, start: float, nbytes: int, executor: int = 0) -> None:
        self.entries.append((NODE, run, chunk, node, start, now(), nbytes, executor))
        self.count += 1

    def send(self, run: str, dest: str, start: float, index: Sequence[Any], packed: Any,
             large: Sequence[tuple]) -> None:
        nbytes = int(packed.nbytes)
        ids: list[int] = []
        for entry in index:
            ids.append(entry[0])
            ids.append(entry[1])
        for c, n, pieces in large:
            ids.append(c)
            ids.append(n)
            for a in pieces:
                nbytes += a.nbytes
        self.entries.append((SEND, run, dest, start, now(), len(index) + len(large), nbytes, tuple(ids)))
        self.count += 1

    def receive(self, run: str, items: Sequence[tuple]) -> None:
        t = now()
        nbytes = 0
        for _, _, pieces in items:
            for a in pieces:
                nbytes += a.nbytes
        c, n = (items[0][0], items[0][1]) if items else (-1, -1)
        self.entries.append((RECV, run, t, c, n, len(items), nbytes))
        self.count += 1

    # -- reading -----------------------------------------------------------------
    def since(self, mark: int | None) -> tuple[list[tuple], int]:
        """Entries appended after cursor ``mark`` (None: none, only where the log
        ends), and how many of them were already pushed out of the log."""
        if mark is None:
            return [], 0
        new = self.count - mark
        if new <= 0:
            return [], 0
        kept = min(new, len(self.entries))
        entries = list(self.entries)[len(self.entries) - kept:]
        return entries, new - kept

    # -- the dashboard's feed ------------------------------------------------------
    def _start_reporting(self, worker: Any) -> None:
        try:
            from tornado.ioloop import PeriodicCallback

            pc = PeriodicCallback(self.report, REPORT_MS)
            worker.periodic_callbacks["flowreduce-engine-log"] = pc
            pc.start()
        except Exception as e:  # never fail the engine for its dashboard
            logger.debug("flowreduce: engine progress not reported to the dashboard: %r", e)

    def report(self) -> None:
        """Tell the scheduler what was computed since the last report (see the module docstring)."""
        if self.count == self.reported or self.worker is None:
            return
        entries, _ = self.since(self.reported)
        self.reported = self.count
        try:
            for msg in self.progress(entries):
                self.worker.batched_send(msg)
        except Exception as e:  # a scheduler gone, a closing worker: the dashboard misses a beat
            logger.debug("flowreduce: engine progress not sent: %r", e)

    def progress(self, entries: list[tuple]) -> list[dict[str, Any]]:
        """The progress messages of ``entries``: per run, nodes computed per
        (rank, step), and each new cell's plan phase and total (nodes x chunks)."""
        done: dict[str, dict[tuple[int, int], int]] = {}
        sent: dict[str, dict[str, int]] = {}
        for e in entries:
            if e[0] == NODE:
                prog = self.programs.get(e[1])
                if prog is None:
                    continue
                nd = prog.plan.nodes[e[3]]
                cells = done.setdefault(e[1], {})
                rank = _rank(prog, nd.rank)
                cells[rank, nd.step] = cells.get((rank, nd.step), 0) + 1
            elif e[0] == BEGIN and e[1] in self.programs:
                done.setdefault(e[1], {})
            elif e[0] == SEND and e[1] in self.programs:
                done.setdefault(e[1], {})
                to = sent.setdefault(e[1], {})
                to[e[2]] = to.get(e[2], 0) + e[6]
        out = []
        for run, cells in done.items():
            totals = []
            if run not in self.told:
                self.told[run] = None
                totals = cell_totals(self.programs[run])
                if len(self.told) > KEPT_RUNS:
                    self.told.popitem(last=False)
            out.append({"op": ENGINE_OP, "token": token_of(run), "run": run,
                        "cells": [[r, s, n] for (r, s), n in cells.items()], "totals": totals,
                        "sent": [[dest, n] for dest, n in sent.get(run, {}).items()]})
        return out


def cell_totals(prog: Any) -> list[list[Any]]:
    """``[rank, step, plan phase, nodes x chunks]`` of the nodes a worker
    computes in a run (its ranks' nodes with inputs: views are not steps)."""
    nodes = prog.plan.nodes
    per: dict[tuple[int, int], list[Any]] = {}
    for i in prog.local_nodes:
        nd = nodes[i]
        if not nd.inputs:
            continue
        cell = per.setdefault((_rank(prog, nd.rank), nd.step), [nd.phase, 0])
        cell[1] += prog.spec.chunks
    return [[r, s, phase, n] for (r, s), (phase, n) in sorted(per.items())]


def _rank(prog: Any, plan_rank: int) -> int:
    """The call's rank a plan rank of this worker stands for on the grid: the
    plan rank itself, or where the plan runs over workers (ranks sharing one
    are combined first), the worker's lowest rank (its hand-in's row)."""
    members = getattr(prog, "members", None)
    if isinstance(members, dict):  # plan rank -> the call's ranks it combines
        return members[plan_rank][0] if members.get(plan_rank) else plan_rank
    return members[0] if members and len(prog.spec.where) != prog.plan.ranks else plan_rank


def engine_steps_handler(scheduler: Any) -> dict[str, Any]:
    """The scheduler's stream handler (the extension registers it with its
    p2p part's, before any run can send: a stream message without a handler
    would close the worker's stream) that hands the engines' progress
    messages to the dashboard's store."""

    def engine_steps(**msg: Any) -> None:
        from flowreduce.dashboard.store import store_of

        store = store_of(scheduler)
        if store is None:
            return
        try:
            store.engine_steps(**msg)
        except Exception as e:  # a stream handler that raised would close the worker's stream
            logger.error("flowreduce: %s: could not file engine steps: %r", ENGINE_OP, e)

    return {ENGINE_OP: engine_steps}
