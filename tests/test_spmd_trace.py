"""SPMD jobs in traces and on the dashboard (issue #27 item 6).

One real job (a LocalCluster of 3 single-threaded worker processes, 4 ranks:
ranks 0 and 3 share a worker, routes shared memory inside it and Dask's comm
between workers) runs four collectives of known sizes inside
``flowreduce.trace``, then holds: rank 0 waits on a ``distributed.Event``
the test sets, the others wait in the job's last barrier. While it is held
the dashboard's data lists it live with each rank's last collective; after
it, done with the final barrier. The trace holds exactly one event per
collective and rank (phase, bytes, peers, path), each inside its rank's task
on the task stream, and the Chrome and CSV exports and the drawing hold them.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
import time

import dask
import numpy as np
import pytest
from distributed import Client, Event, LocalCluster

import flowreduce
import flowreduce.dashboard
from flowreduce.tracing import to_chrome, to_csv
from flowreduce.tracing.plot import layout

#: the job's collectives: (phase, seq, bytes of rank r's input)
COLLECTIVES = [("allreduce", 1, lambda r: 8 * 1000), ("broadcast", 2, lambda r: 4 * 100),
               ("allgather", 3, lambda r: 8 * 10 * (r + 1)), ("barrier", 4, lambda r: 0)]
#: seconds of rounding allowed between a collective and its task's bar (epoch seconds in floats: ~2e-7 each;
#: the tracer puts a rank's task where its communicator opened, so nothing else separates them)
HOP = 1e-5


@pytest.fixture(autouse=True)
def no_segment_left(shm_dir):
    """The jobs' shared memory in a directory of this module's, none of it left after a test."""
    yield
    deadline = time.monotonic() + 5
    while glob.glob(os.path.join(shm_dir, "frspmd-*")) and time.monotonic() < deadline:  # survivors sweep as they end
        time.sleep(0.05)
    assert glob.glob(os.path.join(shm_dir, "frspmd-*")) == [], "an SPMD job left shared-memory segments behind"


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            yield c


def _job(comm, gate):
    comm.allreduce(np.ones(1000))
    comm.broadcast(np.arange(100, dtype=np.int32) if comm.rank == 1 else None, root=1)
    comm.allgather(np.ones(10 * (comm.rank + 1)))
    if comm.rank == 0:  # the others wait for rank 0 in the barrier
        assert Event(gate).wait(timeout=120), "the test never opened the gate"
    comm.barrier()
    return comm.run, comm.layout.workers


def _peers(workers, rank):
    """The ranks ``rank`` exchanges with: its worker's other ranks, and if it leads its worker (its
    lowest rank) the other workers' leaders (the ``worker`` route: each worker a host)."""
    group = [r for r, w in enumerate(workers) if w == workers[rank]]
    leaders = sorted({min(r for r, w in enumerate(workers) if w == x) for x in workers})
    peers = [r for r in group if r != rank]
    if group[0] == rank and len(leaders) > 1:
        peers += [r for r in leaders if r != rank]
    return tuple(peers)


def _poll(client, check, what, seconds=60):
    """The dashboard's SPMD rows once ``check`` accepts them (polled with a deadline)."""
    deadline = time.monotonic() + seconds
    while True:
        got = flowreduce.dashboard.spmd_jobs(client)
        if check(got):
            return got
        assert time.monotonic() < deadline, f"the dashboard never showed {what}: {got}"
        time.sleep(0.05)


@contextlib.contextmanager
def _traced_job(client, shm_dir, fn):
    """``fn(comm, gate)`` as a 4-rank job (each worker a host: shared memory in a worker, Dask's comm
    between them) inside a trace; yields (trace, futures, the job attempt, the gate's name)."""
    gate = f"flowreduce-test-gate-{time.monotonic_ns()}"
    with dask.config.set({"flowreduce.spmd.transport": "worker", "flowreduce.shm.directory": shm_dir}):
        with flowreduce.trace(client) as tr:
            futures = flowreduce.spmd(client, fn, ranks=4, gate=gate, timeout=120)
            yield tr, futures, futures[0].key.removeprefix("flowreduce-spmd-rank-").rpartition("-")[0], gate


def test_trace_and_dashboard_of_an_spmd_job(client, shm_dir, tmp_path):
    with _traced_job(client, shm_dir, _job) as (tr, futures, run, gate):
        def held(got):
            mine = [r for r in got["ranks"] if r["run"] == run]
            return len(mine) == 4 and all(r["seq"] == 3 for r in mine)

        live = _poll(client, held, "the held job with every rank past its allgather")
        (job,) = [j for j in live["jobs"] if j["run"] == run]
        assert (job["state"], job["ranks"], job["attempt"]) == ("running", 4, 0)
        assert live["jobs"][0]["run"] == run, "a live job is listed first"
        ranks = sorted((r for r in live["ranks"] if r["run"] == run), key=lambda r: r["rank"])
        assert [(r["rank"], r["collective"], r["seq"], r["nbytes"]) for r in ranks] == [
            (r, "allgather", 3, 80 * (r + 1)) for r in range(4)]
        assert all(r["at"] > 0 and r["ago"] >= 0 for r in ranks)

        Event(gate, client=client).set()
        results = client.gather(futures)
    (run_, workers), = {(a, tuple(b)) for a, b in results}
    assert run_ == run
    assert len(set(workers)) == 3 and workers[0] == workers[3], "ranks 0 and 3 share a worker, 1 and 2 alone"
    assert job["workers"] == ", ".join(sorted(set(workers)))
    assert [ranks[r]["worker"] for r in range(4)] == list(workers)

    # -- the dashboard: the job ended, with its final barrier -------------------------------------------------------
    def ended(got):
        mine = [r for r in got["ranks"] if r["run"] == run]
        return any(j["run"] == run and j["state"] == "done" for j in got["jobs"]) and all(
            (r["collective"], r["seq"]) == ("barrier", 4) for r in mine) and len(mine) == 4

    after = _poll(client, ended, "the job done, every rank through its final barrier")
    (job,) = [j for j in after["jobs"] if j["run"] == run]
    assert job["state"] == "done" and job["error"] == ""

    # -- the trace: one event per collective and rank, inside its rank's task ---------------------------------------
    events = [e for e in tr.events if e.job == run and e.phase != "user-compute"]
    assert sorted((e.rank, e.phase, e.seq) for e in events) == sorted(
        (r, phase, seq) for r in range(4) for phase, seq, _ in COLLECTIVES), "not one event per collective and rank"
    tasks = {e.rank: e for e in tr.events if e.phase == "user-compute" and e.job == run}
    assert sorted(tasks) == [0, 1, 2, 3], "the ranks' tasks are on the trace, with their rank and job"
    for e in events:
        phase, seq, nbytes = next(c for c in COLLECTIVES if c[0] == e.phase)
        assert e.nbytes == nbytes(e.rank), (e.rank, e.phase)
        assert e.peers == _peers(workers, e.rank), (e.rank, e.phase, e.peers)
        assert e.path == ("shm+dask" if e.rank in (0, 3) else "dask"), (e.rank, e.path)
        assert e.worker == workers[e.rank]
        task = tasks[e.rank]
        assert task.worker == e.worker and e.key == task.key
        assert task.start - HOP <= e.start <= e.stop <= task.stop + HOP, (
            f"rank {e.rank}'s {e.phase} [{e.start}, {e.stop}] is not inside its task [{task.start}, {task.stop}]")
    leaders = [e for e in events if e.phase == "allreduce" and e.rank in (0, 1, 2)]
    assert all(e.sent > 0 and e.received > 0 for e in leaders), "leaders exchange between workers"
    assert all(e.sent == e.received == 0 for e in events if e.rank == 3), "rank 3 only talks to rank 0"
    by_rank = {r: sorted((e for e in events if e.rank == r), key=lambda e: e.seq) for r in range(4)}
    for evs in by_rank.values():  # in order on each rank's own timeline
        assert all(a.stop <= b.start for a, b in zip(evs, evs[1:]))

    # -- exported and drawn like every other event ------------------------------------------------------------------
    doc = json.loads(open(to_chrome(tr, tmp_path / "trace.json")).read())
    spans = [x for x in doc["traceEvents"] if x["ph"] == "X" and x["args"].get("job") == run and x["cat"] != "user-compute"]
    assert sorted((x["args"]["rank"], x["cat"], x["args"]["seq"]) for x in spans) == sorted(
        (e.rank, e.phase, e.seq) for e in events)
    assert all(x["args"]["peers"] == list(_peers(workers, x["args"]["rank"])) for x in spans if x["cat"] != "barrier"
               or _peers(workers, x["args"]["rank"]))
    threads = {(x["pid"], x["args"]["name"]) for x in doc["traceEvents"] if x.get("name") == "thread_name"}
    assert {name for _, name in threads} >= {f"rank {r} · allreduce" for r in range(4)}
    with open(to_csv(tr, tmp_path / "trace.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r["job"] == run and r["phase"] != "user-compute"]
    assert sorted((int(r["rank"]), r["phase"], int(r["seq"]), int(r["nbytes"]), tuple(json.loads(r["peers"])))
                  for r in rows) == sorted((e.rank, e.phase, e.seq, e.nbytes, e.peers) for e in events)
    drawing = layout(tr)
    lanes = [f"job {run[:8]} rank {r}" for r in range(4)]
    assert set(lanes) <= set(drawing.lanes)
    drawn = sorted((drawing.lanes[rect.lane], rect.phase) for rect in drawing.rects if rect.phase in
                   {c[0] for c in COLLECTIVES} and drawing.lanes[rect.lane] in lanes)
    assert drawn == sorted((f"job {run[:8]} rank {e.rank}", e.phase) for e in events)


def _subgroups_then_late(comm, gate):
    """Rank r's subgroup (evens or odds) all-reduces 100 ones (odds: 300), then gathers; rank 1 holds before the final
    barrier until the test opens the gate (the others wait in it), and comes last."""
    mine = comm.subgroup([0, 2]) if comm.rank % 2 == 0 else None
    theirs = comm.subgroup([1, 3]) if comm.rank % 2 == 1 else None
    sub = mine or theirs
    total = sub.allreduce(np.ones(300 if comm.rank % 2 else 100))
    sub.allgather(np.ones(3))
    if comm.rank == 1:
        assert Event(gate).wait(timeout=120), "the test never opened the gate"
        # the others are in the barrier by now: rank 1 enters it last, later than any rank entered a collective
        # before (with 4 ranks on 3 workers one rank's task starts when its worker's first rank waits: under a
        # loaded CI rank 2 once entered its subgroup's all-reduce 0.2 s late and was taken for the straggler)
        time.sleep(1.0)
    comm.barrier()
    return float(total.sum())


def test_subgroups_on_the_job_ranks_timeline_dashboard_and_summary(client, shm_dir, tmp_path):
    """A subgroup's collectives carry the job's ranks (the trace puts them in the rank's task, peers
    in job ranks), are each rank's last collective on the dashboard while the job is held, and
    ``summarize_spmd`` counts them per rank, with rank 1, held back before the barrier, the straggler."""
    from flowreduce.cli.trace_files import write_all
    from flowreduce.tracing import summarize_spmd

    with _traced_job(client, shm_dir, _subgroups_then_late) as (tr, futures, run, gate):
        def held(got):
            mine = [r for r in got["ranks"] if r["run"] == run]
            return len(mine) == 4 and all(r["collective"].startswith("allgather in subgroup") for r in mine)

        live = _poll(client, held, "every rank's subgroup allgather as its last collective")
        names = {r["rank"]: r["collective"] for r in live["ranks"] if r["run"] == run}
        assert names == {0: "allgather in subgroup 0,2", 2: "allgather in subgroup 0,2",
                         1: "allgather in subgroup 1,3", 3: "allgather in subgroup 1,3"}
        Event(gate, client=client).set()
        totals = client.gather(futures)
    assert totals == [200.0, 600.0, 200.0, 600.0]

    subs = [e for e in tr.events if e.job.startswith(run + "/")]
    assert sorted((e.rank, e.phase) for e in subs) == sorted(
        (r, p) for r in range(4) for p in ("allreduce", "allgather")), "one event per subgroup collective and rank"
    tasks = {e.rank: e for e in tr.events if e.phase == "user-compute" and e.job == run}
    for e in subs:
        assert e.peers == ((e.rank + 2) % 4,), (e.rank, e.peers)  # its subgroup's other rank, as a job rank
        task = tasks[e.rank]
        assert e.key == task.key and task.start - HOP <= e.start <= e.stop <= task.stop + HOP

    s = summarize_spmd(tr)
    assert s.job == run and s.ranks == 4
    by_rank = {r.rank: r for r in s.per_rank}
    for r in range(4):
        assert by_rank[r].count_by_phase == {"allreduce": 1, "allgather": 1, "barrier": 1}, by_rank[r]
        assert by_rank[r].nbytes == 8 * (300 if r % 2 else 100) + 8 * 3
        assert by_rank[r].worker == tasks[r].worker
        assert 0 < by_rank[r].in_collectives <= by_rank[r].task
    barrier = next(c for c in s.collectives if c.run == run and c.phase == "barrier")
    assert barrier.last == 1 and barrier.lateness > 0
    assert s.straggler == 1 and by_rank[1].waited < min(by_rank[r].waited for r in (0, 2, 3))
    assert {(c.run, c.phase) for c in s.collectives} == {(run, "barrier")} | {
        (f"{run}/{tag}", p) for tag in {e.job.partition("/")[2] for e in subs} for p in ("allreduce", "allgather")}
    paths = write_all(tr, str(tmp_path / "out"))
    with open(paths["spmd_summary.json"]) as f:
        assert json.load(f)["straggler"] == 1
    assert "straggler: rank 1" in open(paths["spmd_summary.txt"]).read()


# -- the page in a real browser ---------------------------------------------------------------------------------------

def _held(comm, gate):
    comm.allreduce(np.ones(500))
    if comm.rank == 0:
        assert Event(gate).wait(timeout=120), "the test never opened the gate"
    comm.barrier()
    return comm.run


def test_the_page_lists_the_live_job_and_each_ranks_last_collective(shm_dir):
    from browser import chromium, wait_for

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      scheduler_kwargs={"preload": ["flowreduce.dashboard"]}) as cluster, Client(cluster) as client:
        gate = f"flowreduce-test-page-gate-{time.monotonic_ns()}"
        with dask.config.set({"flowreduce.spmd.transport": "worker", "flowreduce.shm.directory": shm_dir}), \
                chromium() as driver:
            driver.get(cluster.dashboard_link.rsplit("/", 1)[0] + "/flowreduce")
            futures = flowreduce.spmd(client, _held, ranks=3, gate=gate, timeout=120)
            run = futures[0].key.removeprefix("flowreduce-spmd-rank-").rpartition("-")[0]

            def ranks_at(collective, seq):
                def check(d):
                    mine = [i for i, r in enumerate(d["run"]) if r == run]
                    return len(mine) == 3 and all((d["collective"][i], d["seq"][i]) == (collective, seq)
                                                  for i in mine)
                return check

            jobs = wait_for(driver, "flowreduce-spmd-jobs", lambda d: run in d["run"])
            assert jobs["state"][jobs["run"].index(run)] in ("submitted", "running")
            ranks = wait_for(driver, "flowreduce-spmd-ranks", ranks_at("allreduce", 1))  # held: polled live
            mine = sorted((r, n) for r, n, x in zip(ranks["rank"], ranks["nbytes"], ranks["run"]) if x == run)
            assert mine == [(0, 4000), (1, 4000), (2, 4000)]
            jobs = wait_for(driver, "flowreduce-spmd-jobs", lambda d: d["state"][d["run"].index(run)] == "running")

            Event(gate, client=client).set()
            assert client.gather(futures) == [run] * 3
            wait_for(driver, "flowreduce-spmd-jobs", lambda d: d["state"][d["run"].index(run)] == "done")
            wait_for(driver, "flowreduce-spmd-ranks", ranks_at("barrier", 2))
            errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors  # the page rendered: Bokeh logs rendering failures here


def test_the_workers_log_is_a_ring_read_past_a_mark():
    """A worker's log of collectives (flowreduce.schedule.spmd_log.Log, a ring of records made into events
    only when read): read past a mark in order, the oldest let go when it laps, a lap past the mark counted
    as lost, and a position taken but not yet stored (a rank's thread between the two) read at the next call."""
    from flowreduce.schedule.spmd_log import Event, Log

    log = Log(size=8)

    def add(seq, run="j.0", rank=0):
        return log.add(run, rank, "allreduce", seq, float(seq), seq + 0.5, 8 * seq, 0, 0, (1,), "shm", "")

    assert log.since(None) == ([], -1, False) and log.entries() == []
    for seq in range(1, 6):
        add(seq)
    rows, mark, lost = log.since(-1)
    assert [r[3] for r in rows] == [1, 2, 3, 4, 5] and mark == 4 and not lost
    assert rows[0] == ("j.0", 0, "allreduce", 1, 1.0, 1.5, 8, 0, 0, (1,), "shm", "")
    assert log.since(mark) == ([], 4, False)
    for seq in range(6, 11):  # 10 records in a ring of 8: 1 and 2 let go, none unread
        add(seq, rank=seq % 2)
    rows, mark, lost = log.since(mark)
    assert [r[3] for r in rows] == [6, 7, 8, 9, 10] and mark == 9 and not lost
    assert [(rank, e.seq) for _, rank, e in log.entries()] == [(s % 2 if s > 5 else 0, s) for s in range(3, 11)]
    assert log.entries(lambda run, rank: rank == 1)[-1] == ("j.0", 1, Event("allreduce", 9, 9.0, 9.5, 72, 0, 0,
                                                                            (1,), "shm", ""))
    for seq in range(11, 21):  # 10 more: the 2 after the mark were overwritten unread
        add(seq)
    rows, mark, lost = log.since(mark)
    assert lost and [r[3] for r in rows] == list(range(13, 21)) and mark == 19
    taken = next(log.count)  # position 20 taken by a writer that has not stored its record yet
    add(22)
    rows, held, lost = log.since(mark)
    assert rows == [] and held == mark and not lost, "read past a position not stored yet"
    log.ring[taken % log.size] = (taken, "j.0", 0, "barrier", 21, 21.0, 21.5, 0, 0, 0, (1,), "shm", "")
    rows, mark, lost = log.since(held)
    assert [r[3] for r in rows] == [21, 22] and mark == 21 and not lost
