"""The p2p engine's log (flowreduce.schedule.engine_log) and what the dashboard's store makes of its
progress messages, without a cluster: entries and cursors, entries pushed out counted, progress per
(rank, step) with each cell's total, the grid's engine columns, malformed messages refused."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import flowreduce
from flowreduce import keys
from flowreduce.dashboard import views
from flowreduce.dashboard.record import ENGINE_COLUMN, ENGINE_OP
from flowreduce.dashboard.store import DashboardStore
from flowreduce.schedule.engine_log import BEGIN, NODE, RECV, SEND, EngineLog, cell_totals, token_of


def test_entries_are_tuples_read_past_a_cursor():
    log = EngineLog()
    log.begin("tok.0", None)
    log.node("tok.0", 1, 7, 10.0, 800)
    log.send("tok.0", "tcp://b:1", 11.0, [[0, 3, [["<f8", 2]]], [1, 3, [["<f8", 2]]]], np.zeros(32, np.uint8),
             [(0, 9, (np.zeros(100), np.zeros(28)))])
    log.receive("tok.0", [(0, 4, (np.zeros(5),)), (1, 4, (np.zeros(5),))])
    entries, lost = log.since(0)
    assert lost == 0 and [e[0] for e in entries] == [BEGIN, NODE, SEND, RECV]
    _, run, c, n, t0, t1, nbytes, executor = entries[1]
    assert (run, c, n, t0, nbytes, executor) == ("tok.0", 1, 7, 10.0, 800, 0) and t1 >= t0
    _, run, dest, t0, t1, values, nbytes, ids = entries[2]
    assert (dest, values, nbytes, ids) == ("tcp://b:1", 3, 32 + 1024, (0, 3, 1, 3, 0, 9))
    assert entries[3][3:] == (0, 4, 2, 80)
    assert log.since(log.count) == ([], 0) and log.since(None) == ([], 0)
    assert [e[0] for e in log.since(2)[0]] == [SEND, RECV]
    assert token_of("abc.0") == "abc"


def test_a_full_log_keeps_the_newest_and_counts_the_rest():
    log = EngineLog(length=10)
    for i in range(25):
        log.node("t.0", 0, i, 0.0, 8)
    entries, lost = log.since(5)
    assert lost == 10 and [e[3] for e in entries] == list(range(15, 25))


def _program(ranks=4, chunks=2, address=0):
    """What the log reads of a worker's Program: the plan, its nodes here, the chunks."""
    plan = flowreduce.plan("butterfly", ranks, chunks=chunks)
    return SimpleNamespace(plan=plan, local_nodes=tuple(n.id for n in plan.nodes if n.rank == address),
                           spec=SimpleNamespace(chunks=chunks, where=tuple(range(ranks))))


def _p2p_call(store, scheduler, token, ranks=4):
    """A p2p call's tasks through the store's hooks: hand-ins, the barrier, outputs."""
    ks = [keys.hand_in_key("butterfly", token, r) for r in range(ranks)]
    ks += [keys.barrier_key("butterfly", token)] + [keys.output_key("butterfly", token, r) for r in range(ranks)]
    for k in ks:
        scheduler.tasks[k] = SimpleNamespace(key=k, state="waiting", nbytes=100, dependencies=[],
                                             processing_on=None)
    store.update_graph(scheduler, keys=set(ks), tasks=ks)
    return ks


def test_progress_fills_the_grid_between_the_barrier_and_the_outputs():
    scheduler = SimpleNamespace(tasks={})
    store = DashboardStore()
    store.scheduler = scheduler
    token = "f" * 32
    _p2p_call(store, scheduler, token)
    progs = [_program(address=w) for w in range(4)]
    logs = [EngineLog() for _ in progs]
    messages = []
    for log, prog in zip(logs, progs, strict=True):
        log.begin(f"{token}.0", prog)
        messages += log.progress(log.since(0)[0])  # begun, nothing computed: the totals
    for m in messages:
        assert m["op"] == ENGINE_OP
        store.engine_steps(**{k: v for k, v in m.items() if k != "op"}, worker="tcp://w:1")
    call = store.find(token)
    cells = views.grid(call, scheduler)
    engine = [c for c in cells if c.phase not in ("hand-in", "barrier", "output")]
    plan = progs[0].plan
    steps = sorted({n.step for n in plan.nodes if n.inputs})
    assert {(c.rank, c.column) for c in engine} == {(r, ENGINE_COLUMN + s) for r in range(4) for s in steps}
    assert all(c.state == "waiting" and c.done == 0 for c in engine)
    assert sum(c.tasks for c in engine) == plan.chunks * sum(bool(n.inputs) for n in plan.nodes)
    out_col = max(c.column for c in cells)
    assert {c.column for c in cells if c.phase == "output"} == {out_col} and out_col > ENGINE_COLUMN + steps[-1]
    labels = views.column_labels(call)
    assert (labels[0], labels[1], labels[out_col]) == ("hand-in", "barrier", "out")
    assert views.straggler(call, cells, scheduler, 0.0)["text"] == "no straggler: every rank is at hand-in or before"

    # rank 0 computes its first step's nodes of chunk 0: that cell runs, then all of it: done
    first = [n for n in plan.nodes if n.rank == 0 and n.inputs and n.step == steps[0]]
    logs[0].node(f"{token}.0", 0, first[0].id, 0.0, 8)
    for m in logs[0].progress(logs[0].since(1)[0]):
        store.engine_steps(**{k: v for k, v in m.items() if k != "op"})
    state = {(c.rank, c.column): c for c in views.grid(call, scheduler)}
    assert state[0, ENGINE_COLUMN + steps[0]].state == "running"
    for c in range(plan.chunks):
        for n in first:
            if (c, n.id) != (0, first[0].id):
                logs[0].node(f"{token}.0", c, n.id, 0.0, 8)
    for m in logs[0].progress(logs[0].since(2)[0]):
        assert not m["totals"]  # told once per run
        store.engine_steps(**{k: v for k, v in m.items() if k != "op"})
    cell = {(c.rank, c.column): c for c in views.grid(call, scheduler)}[0, ENGINE_COLUMN + steps[0]]
    assert (cell.state, cell.done, cell.tasks) == ("done", len(first) * plan.chunks, len(first) * plan.chunks)
    assert (0, ("engine", steps[0])) in call.done_at
    assert store.malformed == 0


def test_cell_totals_are_the_workers_nodes_with_inputs_times_chunks():
    prog = _program(chunks=3)
    totals = cell_totals(prog)
    nodes = [prog.plan.nodes[i] for i in prog.local_nodes if prog.plan.nodes[i].inputs]
    assert sum(t[3] for t in totals) == 3 * len(nodes)
    assert {(t[0], t[1], t[2]) for t in totals} == {(n.rank, n.step, n.phase) for n in nodes}


def test_malformed_progress_is_counted_and_dropped():
    scheduler = SimpleNamespace(tasks={})
    store = DashboardStore()
    store.scheduler = scheduler
    token = "e" * 32
    _p2p_call(store, scheduler, token)
    bad = [dict(token="nobody", cells=[], totals=[]), dict(token=token, cells="x", totals=[]),
           dict(token=token, cells=[[0, 1]], totals=[]), dict(token=token, cells=[[0, -1, 2]], totals=[]),
           dict(token=token, cells=[], totals=[[0, 1, 2, 3]]), dict(token=token, cells=[[0, 1, 2.5]], totals=[]),
           dict(token=None, cells=[], totals=[])]
    for m in bad:
        store.engine_steps(**m)
    # a call not on the page (older than the history) is counted apart and not logged as an error
    assert store.malformed == len(bad) - 1 and store.unknown == 1 and not store.find(token).engine


def test_a_restarted_run_starts_its_cells_over_and_late_reports_of_the_old_one_are_ignored():
    scheduler = SimpleNamespace(tasks={})
    store = DashboardStore()
    store.scheduler = scheduler
    token = "d" * 32
    _p2p_call(store, scheduler, token)
    store.engine_steps(token=token, run=f"{token}.0", totals=[[0, 1, "reduce-scatter", 2]], cells=[[0, 1, 2]])
    cell = store.find(token).engine[0, ("engine", 1)]
    assert cell == [2, 2]
    store.engine_steps(token=token, run=f"{token}.1", totals=[[0, 1, "reduce-scatter", 2]], cells=[[0, 1, 1]])
    assert cell == [1, 2]
    store.engine_steps(token=token, run=f"{token}.0", totals=[], cells=[[0, 1, 1]])  # late, of attempt 0
    assert cell == [1, 2] and store.malformed == 0


def test_bytes_sent_by_the_engines_are_the_links_of_the_workers_lowest_ranks():
    scheduler = SimpleNamespace(tasks={})
    store = DashboardStore()
    store.scheduler = scheduler
    token = "c" * 32
    _p2p_call(store, scheduler, token)
    workers = ["tcp://a:1", "tcp://b:1", "tcp://a:1", "tcp://b:1"]  # ranks 0, 2 on a; 1, 3 on b
    store.publish(record={"token": token, "algorithm": "butterfly", "ranks": 4, "nbytes": 800, "chunks": 1,
                          "workers": workers})
    log = EngineLog()
    log.begin(f"{token}.0", _program())
    log.send(f"{token}.0", "tcp://b:1", 0.0, [], np.zeros(0, np.uint8), [(0, 9, (np.zeros(100),))])
    log.send(f"{token}.0", "tcp://b:1", 0.0, [[1, 9, [["<f8", 4]]]], np.zeros(32, np.uint8), [])
    (msg,) = log.progress(log.since(0)[0])
    assert msg["sent"] == [["tcp://b:1", 832]]
    store.engine_steps(**{k: v for k, v in msg.items() if k != "op"}, worker="tcp://a:1")
    assert store.find(token).link_bytes == {(0, 1): 832}
    store.engine_steps(token=token, run=f"{token}.0", cells=[], totals=[], sent=[["tcp://b:1", -5]])
    assert store.malformed == 1
