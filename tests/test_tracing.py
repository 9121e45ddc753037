"""Traces of real all-reduce calls on a real (multi-process) LocalCluster.

The tests parse what was exported (Chrome JSON, CSV) and compare it with
what the plan promises: every task once, every cross-worker edge fetched,
bytes of each key within dask's framing of its segment size.
"""

from __future__ import annotations

import ast
import csv
import json
import time
from collections import Counter, defaultdict

import numpy as np
import pytest
from utils import cli_args

distributed = pytest.importorskip("distributed")

import flowreduce  # noqa: E402
from flowreduce import keys as keymod  # noqa: E402
from flowreduce.lower.graph import chunk_bounds  # noqa: E402
from flowreduce.tracing import PHASES, registry, summarize, to_chrome, to_csv, trace  # noqa: E402
from flowreduce.tracing.events import COMPUTE_PHASES  # noqa: E402

N = 60_000  # elements per rank: 480 kB of float64
RANKS = 4
SIZEOF_SLACK = 256  # dask's sizeof of a tuple of arrays adds a few dozen bytes


def make_input(n: int, seed: int, delay: float = 0.0) -> np.ndarray:
    if delay:
        time.sleep(delay)
    return np.random.default_rng(seed).random(n)


def train_step(n: int, seed: int, seconds: float) -> np.ndarray:
    """A stand-in training step: compute for ``seconds``, return a gradient."""
    t0 = time.perf_counter()
    g = np.random.default_rng(seed).random(n)
    while time.perf_counter() - t0 < seconds:
        g = g * 1.0
    return g


def _memory_times(key, dask_scheduler=None) -> list[float]:
    """Scheduler times at which ``key`` reached memory (its transition log)."""
    return [t.timestamp for t in dask_scheduler.story(key) if t.finish == "memory"]


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=RANKS, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as c:
        yield c


def _inputs(client, delays=None, seed=0):
    workers = sorted(client.nthreads())
    delays = delays or {}
    return [client.submit(make_input, N, seed + r, delays.get(r, 0.0), workers=[w], pure=False)
            for r, w in enumerate(workers)]


def _traced(client, algorithm, chunks, delays=None, **trace_kw):
    with trace(client, **trace_kw) as tr:
        xs = _inputs(client, delays)
        out = flowreduce.allreduce(client, xs, algorithm=algorithm, chunks=chunks, method="tasks")
        tr.add(out, xs)
        client.gather(out)
    who = client.who_has(out)
    rank_worker = [sorted(who[f.key])[0] for f in out]
    return tr, out, rank_worker


CASES = [("butterfly", 1), ("butterfly", 2), ("reduce-broadcast", 1), ("ring", 1)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-c{c}" for a, c in CASES])
def run(request, client, tmp_path_factory):
    algorithm, chunks = request.param
    tr, out, rank_worker = _traced(client, algorithm, chunks)
    d = tmp_path_factory.mktemp(f"{algorithm}-{chunks}")
    to_chrome(tr, d / "trace.json")
    to_csv(tr, d / "trace.csv")
    with open(d / "trace.json") as f:
        doc = json.load(f)
    with open(d / "trace.csv") as f:
        rows = list(csv.DictReader(f))
    call = tr.last_call
    return {"tr": tr, "out": out, "workers": rank_worker, "doc": doc, "rows": rows, "call": call, "dir": d}


def _expected_keys(call) -> set:
    """Every task key of the call, named from the plan the builder's way."""
    plan = call.plan
    merged = {plan.finals[r]: r for r in range(plan.ranks) if not plan.output_is_separate(r)}
    out = set()
    for c in range(plan.chunks):
        for n in plan.nodes:
            out.add(keymod.output_key(plan.algorithm, call.token, merged[n.id]) if n.id in merged
                    else keymod.node_key(plan.algorithm, n.phase, call.token, n.step, n.rank, c, n.id))
    out |= {keymod.output_key(plan.algorithm, call.token, r) for r in range(plan.ranks)}
    return out


def _expected_transfers(call, rank_worker) -> list[tuple]:
    """(key, planned source worker, dest worker, bytes) of every cross-worker edge."""
    plan = call.plan
    merged = {plan.finals[r]: r for r in range(plan.ranks) if not plan.output_is_separate(r)}
    itemsize = call.nbytes // N
    out = []
    for c, (c0, c1) in enumerate(chunk_bounds(N, plan.chunks)):
        def elem(s, c0=c0, c1=c1):
            return c0 + (c1 - c0) * s // plan.segments

        for t in plan.transfers():
            a, b = rank_worker[t.source], rank_worker[t.dest]
            if a == b:
                continue
            n = plan.nodes[t.src]
            key = (keymod.output_key(plan.algorithm, call.token, merged[n.id]) if n.id in merged
                   else keymod.node_key(plan.algorithm, n.phase, call.token, n.step, n.rank, c, n.id))
            out.append((key, a, b, (elem(t.hi) - elem(t.lo)) * itemsize))
    return out


# -- every task exactly once ---------------------------------------------------------
def test_every_task_once_in_json(run):
    call = run["call"]
    xs = [e for e in run["doc"]["traceEvents"]
          if e["ph"] == "X" and e["args"].get("token") == call.token and e["cat"] in COMPUTE_PHASES]
    counts = Counter(ast.literal_eval(e["args"]["key"]) for e in xs)
    assert all(v == 1 for v in counts.values()), [k for k, v in counts.items() if v > 1]
    assert len(counts) == call.plan.cost().tasks
    assert set(counts) <= _expected_keys(call)
    assert all(keymod.parse(k)["token"] == call.token for k in counts)


def test_every_task_once_in_csv(run):
    call = run["call"]
    keys = [ast.literal_eval(r["key"]) for r in run["rows"]
            if r["token"] == call.token and r["phase"] in COMPUTE_PHASES]
    assert len(keys) == len(set(keys)) == call.plan.cost().tasks


def test_tasks_ran_on_their_rank(run):
    for r in run["rows"]:
        if r["token"] == run["call"].token and r["phase"] in COMPUTE_PHASES:
            assert r["worker"] == run["workers"][int(r["rank"])], r["key"]


def test_phases_follow_the_keys(run):
    """split -> split; reduce-scatter/reduce/exchange -> reduce; gathers and
    the output copy -> copy, except a merged output that is a reduction."""
    by_key_phase = {"split": "split", "reduce-scatter": "reduce", "reduce": "reduce", "exchange": "reduce",
                    "all-gather": "copy", "broadcast": "copy"}
    plan = run["call"].plan
    seen = set()
    for r in run["rows"]:
        if r["token"] != run["call"].token or r["phase"] not in COMPUTE_PHASES:
            continue
        info = keymod.parse(ast.literal_eval(r["key"]))
        if info["phase"] == "output":
            rank = info["rank"]
            final = plan.nodes[plan.finals[rank]]
            want = "copy" if plan.output_is_separate(rank) or final.kind == "gather" else "reduce"
        else:
            want = by_key_phase[info["phase"]]
        assert r["phase"] == want, (r["key"], r["phase"], want)
        seen.add(r["phase"])
    assert {"split", "reduce"} <= seen


# -- transfers are the plan's edges -----------------------------------------------
def test_transfers_match_plan_per_key(run):
    call, rank_worker = run["call"], run["workers"]
    expected = _expected_transfers(call, rank_worker)
    got = []
    for r in run["rows"]:
        if r["phase"] == "transfer" and r["token"] == call.token:
            for k, b in zip(json.loads(r["keys"]), json.loads(r["key_bytes"]), strict=True):
                got.append((ast.literal_eval(k), r["source"], r["dest"], b))
    assert Counter((k, d) for k, _, d, _ in got) == Counter((k, d) for k, _, d, _ in expected)
    planned = {(k, d): (s, b) for k, s, d, b in expected}
    readers = defaultdict(set)
    for k, _, d, _ in expected:
        readers[k].add(d)
    for k, s, d, b in got:
        ps, pb = planned[(k, d)]
        # dask may fetch from any holder: the planned source or a rank that
        # already received the same key
        assert s == ps or s in readers[k] - {d}, (k, s, d)
        assert pb <= b <= pb + SIZEOF_SLACK, (k, b, pb)


def test_flows_join_sender_and_receiver(run):
    evs = run["doc"]["traceEvents"]
    starts = {e["id"]: e for e in evs if e["ph"] == "s"}
    ends = {e["id"]: e for e in evs if e["ph"] == "f"}
    assert starts and set(starts) == set(ends)
    names = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    transfers = [e for e in evs if e["ph"] == "X" and e["cat"] == "transfer"]
    assert len(starts) == len(transfers)
    for i, s in starts.items():
        assert s["pid"] != ends[i]["pid"]
        assert s["pid"] in names and ends[i]["pid"] in names


# -- lanes ------------------------------------------------------------------------
def test_lanes_do_not_overlap_and_are_ordered(run):
    lanes = defaultdict(list)
    for e in run["doc"]["traceEvents"]:
        if e["ph"] == "X":
            lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert lanes
    for lane, iv in lanes.items():
        assert iv == sorted(iv), lane
        for (_, a1), (b0, _) in zip(iv, iv[1:], strict=False):
            assert a1 <= b0 + 1e-3, (lane, a1, b0)


def test_one_thread_computes_one_task_at_a_time(run):
    """Workers have one thread: their compute events, whatever the phase,
    must not overlap once clocks are aligned, beyond the alignment
    uncertainty the trace itself declares for that worker."""
    unc = {w: c["uncertainty_s"] for w, c in run["doc"]["metadata"]["clock_alignment"]["workers"].items()}
    per_worker = defaultdict(list)
    for r in run["rows"]:
        if r["phase"] in COMPUTE_PHASES:
            per_worker[r["worker"]].append((float(r["start"]), float(r["stop"])))
    for w, iv in per_worker.items():
        iv.sort()
        for (_, a1), (b0, _) in zip(iv, iv[1:], strict=False):
            assert a1 <= b0 + 2 * unc[w] + 1e-6, (w, a1, b0, unc[w])


def test_aligned_clocks_respect_causality(run):
    """A key is fetched only after the task that made it stopped on another
    worker: checks the clock alignment across workers, within the
    uncertainty the trace declares (plus 2 ms for event-loop hops)."""
    unc = {w: c["uncertainty_s"] for w, c in run["doc"]["metadata"]["clock_alignment"]["workers"].items()}
    made = {r["key"]: float(r["stop"]) for r in run["rows"] if r["phase"] in COMPUTE_PHASES}
    checked = 0
    for r in run["rows"]:
        if r["phase"] == "transfer" and r["token"] == run["call"].token:
            for k in json.loads(r["keys"]):
                slack = unc[r["source"]] + unc[r["dest"]] + 2e-3
                assert made[k] <= float(r["stop"]) + slack, (k, made[k], r["stop"])
                checked += 1
    assert checked


def test_metadata_names_the_call_and_alignment(run):
    md = run["doc"]["metadata"]
    (c,) = md["calls"]
    assert c["token"] == run["call"].token and c["tasks"] == run["call"].plan.cost().tasks
    assert c["ranks"] == RANKS and c["nbytes_per_rank"] == run["call"].nbytes
    workers = md["clock_alignment"]["workers"]
    assert set(run["workers"]) <= set(workers)
    assert all(w["uncertainty_s"] >= 0 for w in workers.values())


# -- summary ------------------------------------------------------------------------
def test_summary_adds_up(run):
    s = summarize(run["tr"])
    window = s.stop - s.start
    assert s.measured == pytest.approx(window)
    for rs in s.per_rank:
        assert 0 <= rs.busy <= window + 1e-9
        assert rs.idle == pytest.approx(window - rs.busy)
        assert 0 <= rs.overlap_fraction <= 1
    # per receiver: dask may serve a key from any worker already holding it
    got, want = Counter(), Counter()
    for (_, d), b in s.links.items():
        got[d] += b
    for (_, d), b in s.planned_links.items():
        want[d] += b
    assert dict(got) == pytest.approx(dict(want), abs=SIZEOF_SLACK * run["call"].plan.cost().messages)
    path = s.critical_path
    assert path and path[-1].stop == pytest.approx(s.stop)
    assert path[0].kind == "split"
    assert all(a.stop <= b.start + 1e-6 or b.kind in ("transfer", "gap") for a, b in zip(path, path[1:], strict=False))
    text = str(s)
    assert s.algorithm in text and "critical path" in text
    json.dumps(s.to_dict(), default=str)


def test_straggler_is_the_delayed_rank(client):
    delay = 0.6
    tr, out, rank_worker = _traced(client, "butterfly", 1, delays={2: delay})
    s = summarize(tr)
    assert s.straggler is not None and s.straggler.rank == 2
    assert s.straggler.lag >= delay * 0.8
    waits = {e.rank: e.duration for e in tr.events if e.phase == "wait-for-input"}
    assert max(waits, key=waits.get) == 2 and waits[2] >= delay * 0.8
    assert "straggler: rank 2" in str(s)


def test_summary_compares_the_prediction_for_the_plan_that_ran(run):
    """The summary carries the cost model's prediction for the plan that ran
    (what ``flowreduce.describe`` reports for the call) next to the measured
    time, and the measured time is the call's window in its own events."""
    s = summarize(run["tr"])
    info = flowreduce.describe(run["out"])
    assert s.token == run["call"].token == info.token
    assert (s.algorithm, s.ranks, s.chunks) == (info.plan.algorithm, info.plan.ranks, info.plan.chunks)
    assert s.nbytes == info.nbytes
    assert s.predicted == info.predicted and s.predicted > 0
    # measured: first task start -> last task stop of this call, as in its events and the CSV
    mine = [e for e in run["tr"].iter_events(s.token) if e.phase != "wait-for-input"]
    assert (s.start, s.stop) == (min(e.start for e in mine), max(e.stop for e in mine))
    assert s.measured == pytest.approx(s.stop - s.start) and s.measured > 0
    rows = [r for r in run["rows"] if r["token"] == s.token and r["phase"] != "wait-for-input"]
    csv_window = max(float(r["stop"]) for r in rows) - min(float(r["start"]) for r in rows)
    assert s.measured == pytest.approx(csv_window, abs=1e-6)
    assert run["tr"].origin <= s.start and s.stop <= run["tr"].end  # inside the traced block
    text = str(s)
    assert f"measured {s.measured * 1e3:.1f} ms" in text
    assert f"predicted {s.predicted * 1e3:.1f} ms, measured/predicted {s.measured / s.predicted:.2f}" in text
    d = s.to_dict()
    assert (d["predicted"], d["measured"]) == (s.predicted, s.measured)
    (c,) = run["doc"]["metadata"]["calls"]
    assert c["predicted_s"] == info.predicted


# -- pictures -----------------------------------------------------------------------
def test_pictures(run, tmp_path):
    pytest.importorskip("matplotlib")
    from flowreduce.tracing.plot import plot_timeline

    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    d = plot_timeline(run["tr"], [png, svg])
    assert png.stat().st_size > 1000 and svg.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b"<svg" in svg.read_bytes()[:500]
    assert d.lanes == [f"rank {r}" for r in range(RANKS)]
    assert d.legend == list(PHASES)
    drawn = {r.phase for r in d.rects}
    assert drawn == {e.phase for e in run["tr"].events}
    for r in range(RANKS):
        assert any(x.lane == r and x.phase in ("split", "reduce", "copy") for x in d.rects)
    transfers = [e for e in run["tr"].events if e.phase == "transfer"]
    assert len(d.lines) == len(transfers)
    assert all(ln.src_lane != ln.dst_lane for ln in d.lines)


# -- memory bounds and the registry ----------------------------------------------------
def test_sample_every_keeps_every_kth_call(client):
    with trace(client, sample_every=2) as tr:
        tokens = []
        for _ in range(3):
            xs = _inputs(client)
            out = flowreduce.allreduce(client, xs, algorithm="butterfly", chunks=1)
            tr.add(out, xs)
            tokens.append(keymod.parse(out[0].key)["token"])
            client.gather(out)
    assert list(tr.calls) == [tokens[0], tokens[2]]
    assert {e.token for e in tr.events} - {""} == {tokens[0], tokens[2]}


def test_max_calls_keeps_the_last(client):
    with trace(client, max_calls=1, flush_every=1) as tr:
        for _ in range(2):
            xs = _inputs(client)
            out = flowreduce.allreduce(client, xs, algorithm="reduce-broadcast", chunks=1)
            tr.add(out, xs)
            client.gather(out)
    last = keymod.parse(out[0].key)["token"]
    assert list(tr.calls) == [last]
    assert {e.token for e in tr.events} - {""} == {last}


def test_registry_note_reaches_open_traces(client):
    xs = _inputs(client)
    with trace(client) as tr:
        out = flowreduce.allreduce(client, xs, algorithm="butterfly", chunks=1)
        registry.note(out, xs)
        client.gather(out)
    assert keymod.parse(out[0].key)["token"] in tr.calls
    assert not registry.open_traces()


def test_max_events_bounds_the_trace_and_says_so(client, tmp_path):
    """``max_events`` keeps the newest events only: after two calls (read
    one flush each) the trace holds exactly ``max_events`` events, none of
    the first call, and counts what it dropped in ``lost``, in the exported
    metadata and in a warning."""
    bound = 10
    with pytest.warns(UserWarning, match="events_over_max"), \
            trace(client, max_events=bound, flush_every=1) as tr:
        tokens = []
        for _ in range(2):
            xs = _inputs(client)
            out = flowreduce.allreduce(client, xs, algorithm="butterfly", chunks=1)
            tokens.append(keymod.parse(out[0].key)["token"])
            client.gather(out)
            assert len(tr.events) <= bound
    assert len(tr.events) == bound
    dropped = tr.lost["events_over_max"]
    tasks = flowreduce.plan("butterfly", RANKS).cost().tasks
    assert dropped >= 2 * tasks - bound  # at least every task of both calls was seen
    assert {e.token for e in tr.events} <= {tokens[1], ""}  # the window: the newest only
    assert tokens[1] in {e.token for e in tr.events}
    to_chrome(tr, tmp_path / "t.json")
    with open(tmp_path / "t.json") as f:
        doc = json.load(f)
    assert doc["metadata"]["lost"]["events_over_max"] == dropped
    assert len([e for e in doc["traceEvents"] if e["ph"] == "X"]) == bound


def test_user_task_on_the_same_timeline(client, tmp_path):
    """A training step's own compute and the all-reduce of its result, on
    one aligned timeline: the user's task is one ``user-compute`` event on
    its worker, and it ends before every all-reduce task that depends on it
    starts (on any worker, within the declared clock uncertainty)."""
    workers = sorted(client.nthreads())
    seconds = 0.3
    with trace(client) as tr:
        step = client.submit(train_step, N, 0, seconds, workers=[workers[0]], pure=False,
                             key=f"train-step-{time.time_ns()}")
        xs = [step, *(client.submit(make_input, N, r, workers=[w], pure=False)
                      for r, w in enumerate(workers) if r)]
        out = flowreduce.allreduce(client, xs, algorithm="butterfly", chunks=1, method="tasks")
        client.gather(out)
    call = tr.last_call
    mine = [e for e in tr.events if e.key == repr(step.key) and e.phase != "wait-for-input"]
    assert len(mine) == 1, mine
    (u,) = mine
    assert u.phase == "user-compute" and u.token == "" and u.algorithm == ""
    assert u.worker == workers[0] and u.rank == 0 == call.workers.index(workers[0])
    assert u.duration >= 0.9 * seconds
    assert tr.origin <= u.start and u.stop <= tr.end
    # the worker's clock, aligned, against the scheduler's own: the step ended
    # before the scheduler heard it had (its key's transition to memory)
    in_memory = client.run_on_scheduler(_memory_times, step.key)
    assert in_memory and u.stop <= min(in_memory) + tr.clocks[u.worker].uncertainty + 1e-3, (u.stop, in_memory)
    # the slow step made rank 0 the straggler: its wait for input ends when the step does
    (w,) = [e for e in tr.events if e.key == repr(step.key) and e.phase == "wait-for-input"]
    assert w.rank == 0 and w.token == call.token and w.stop == u.stop
    to_csv(tr, tmp_path / "t.csv")
    with open(tmp_path / "t.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["key"] == repr(step.key)]
    assert sorted((r["phase"], r["worker"]) for r in rows) == [("user-compute", workers[0]),
                                                               ("wait-for-input", workers[0])]

    # every task downstream of rank 0's input (its split tasks, and all they feed)
    from flowreduce.tracing.summary import task_keys

    deps = task_keys(call)
    users = defaultdict(set)
    for k, ds in deps.items():
        for d in ds:
            users[d].add(k)
    todo = [k for k in deps if (i := keymod.parse(ast.literal_eval(k))) and i["phase"] == "split" and i["rank"] == 0]
    assert todo
    downstream = set()
    while todo:
        k = todo.pop()
        if k not in downstream:
            downstream.add(k)
            todo.extend(users[k])
    tasks = {e.key: e for e in tr.iter_events(call.token) if e.phase in COMPUTE_PHASES}
    assert downstream <= set(tasks)
    assert {keymod.output_key("butterfly", call.token, r) for r in range(RANKS)} <= {
        ast.literal_eval(k) for k in downstream}
    unc = {w: c.uncertainty for w, c in tr.clocks.items()}
    for k in downstream:
        e = tasks[k]
        assert u.stop <= e.start + unc[u.worker] + unc[e.worker] + 2e-3, (k, e.worker, u.stop, e.start)


def test_serialise_and_deserialise_on_sender_and_receiver(client, tmp_path):
    """Cross-worker transfers between worker processes yield ``serialise``
    events on the sending worker and ``deserialise`` events on the receiving
    one, marked estimated (apportioned from dask's cumulative metrics), each
    attached to a transfer of the same keys."""
    tr, out, rank_worker = _traced(client, "butterfly", 1)
    token = tr.last_call.token
    transfers = [e for e in tr.iter_events(token) if e.phase == "transfer"]
    assert transfers and all(e.source != e.dest for e in transfers)
    by_keys = defaultdict(list)
    for t in transfers:
        by_keys[t.keys].append(t)
    # a spill to disk or back is serialise/deserialise too, timed exactly (docs: the phase vocabulary)
    spills = [e for e in tr.iter_events(token) if e.detail in ("disk-write", "disk-read")]
    assert all(not e.estimated and e.phase == {"disk-write": "serialise", "disk-read": "deserialise"}[e.detail]
               for e in spills)
    ser = [e for e in tr.iter_events(token) if e.phase == "serialise" and e not in spills]
    des = [e for e in tr.iter_events(token) if e.phase == "deserialise" and e not in spills]
    assert ser and des
    rank_of = {w: r for r, w in enumerate(rank_worker)}
    for e in ser + des:
        assert e.estimated and e.detail.startswith("metric:"), e
        assert e.host == tr.clocks[e.worker].host
        ts = by_keys[e.keys]
        assert ts, e.keys
        if e.phase == "serialise":
            assert e.worker == e.source and any(t.source == e.worker for t in ts), e
        else:
            assert e.worker == e.dest and any(t.dest == e.worker and t.start <= e.start <= e.stop == t.stop
                                              for t in ts), e
        assert e.rank == rank_of[e.worker]
    # every message that was deserialised went to a different worker than it came from
    assert {(e.source, e.dest) for e in des} <= {(t.source, t.dest) for t in transfers}
    to_csv(tr, tmp_path / "t.csv")
    with open(tmp_path / "t.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["token"] == token]
    assert {r["estimated"] for r in rows if r["phase"] in ("serialise", "deserialise")
            and r["detail"].startswith("metric:")} == {"True"}
    assert {r["estimated"] for r in rows if r["phase"] == "transfer"} == {"False"}


def test_a_message_carrying_two_calls_keys_is_split_per_call(client):
    """Dask fetches every key a worker needs from one peer in one message, so
    a message can carry keys of two concurrent all-reduces. Here a user task
    on worker 1 adds rank 0's results of two calls, both held on worker 0:
    one fetch brings both. Each call's trace must show its own key, with its
    own bytes, at the message's time; neither call may claim the other's."""
    workers = sorted(client.nthreads())
    pair = workers[:2]
    with trace(client) as tr:
        calls = []
        for seed, n in ((0, N), (1, 2 * N)):  # different sizes: bytes tell the keys apart
            xs = [client.submit(make_input, n, seed + r, workers=[w], pure=False) for r, w in enumerate(pair)]
            calls.append(flowreduce.allreduce(client, xs, algorithm="reduce-broadcast", method="tasks"))
        a, b = (c[0] for c in calls)
        distributed.wait([a, b])
        assert client.who_has([a, b]) == {a.key: (pair[0],), b.key: (pair[0],)}
        both = client.submit(lambda x, y: x.sum() + y.sum(), a, b, workers=[pair[1]], pure=False)
        both.result()
    fetched = {}
    for out in calls:
        token = flowreduce.describe(out).token
        (mine,) = [e for e in tr.iter_events(token) if e.phase == "transfer" and e.dest == pair[1]
                   and e.source == pair[0] and repr(out[0].key) in e.keys]
        assert mine.keys == (repr(out[0].key),) and mine.token == token
        assert mine.key_bytes == (client.submit(lambda x: x.nbytes, out[0]).result(),) and mine.nbytes == mine.key_bytes[0]
        fetched[token] = mine
    first, second = fetched.values()
    assert (first.start, first.stop) == (second.start, second.stop)  # one message
    assert first.detail == second.detail == "transfer_incoming_log (shared message)"
    del calls, a, b, both


# -- the command ----------------------------------------------------------------------
def test_cli_writes_everything(client, tmp_path):
    pytest.importorskip("matplotlib")
    from flowreduce.cli import trace as cli

    args = cli_args(cli, "--ranks", "4", "--size", "2e4", "--scheduler", client.scheduler.address,
                    "-o", str(tmp_path))
    assert cli.run(args) == 0
    for name in ("trace.json", "trace.csv", "timeline.png", "timeline.svg", "summary.txt", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_cli_passes_algorithm_options(client, tmp_path):
    from flowreduce.cli import trace as cli

    args = cli_args(cli, "--algorithm", "tree:fan_in=3", "--ranks", "4", "--size", "1e3", "--warmup", "0",
                    "--scheduler", client.scheduler.address, "-o", str(tmp_path))
    tr, out = cli.run_traced(client, args)
    assert flowreduce.describe(out).plan.options == {"fan_in": 3}


def test_cli_rejects_a_bad_algorithm_option_before_starting(no_cluster, tmp_path):
    from flowreduce.cli import trace as cli

    with pytest.raises(SystemExit, match="tree takes no option fanin; it takes: fan_in"):
        cli.run(cli_args(cli, "--algorithm", "tree:fanin=3", "-o", str(tmp_path)))


def test_transfer_logs_are_read_by_position_not_time():
    """A worker's log times are shifted by a clock estimate that changes
    between entries: an entry logged before a trace opened may carry a
    later stop than the last one. Reading resumes after the last entry seen."""
    from collections import deque

    from flowreduce.tracing.capture import entries_since, entry_mark

    log = deque([{"start": 1.0, "stop": 2.5, "who": "a", "total": 8},
                 {"start": 1.2, "stop": 2.0, "who": "b", "total": 8}], maxlen=4)  # stops go down
    mark = entry_mark(log[-1])
    assert entries_since(log, mark) == []
    log.append({"start": 2.1, "stop": 2.2, "who": "a", "total": 16})
    assert [e["total"] for e in entries_since(log, mark)] == [16]
    assert entries_since(log, None) == [] and len(entries_since(log, "")) == 3
    for k in range(3):  # the marked entry rotates out of the bounded log: everything left is new
        log.append({"start": 3.0 + k, "stop": 3.5 + k, "who": "c", "total": k})
    assert len(entries_since(log, mark)) == 4


# -- method="p2p": the engine's steps on the same timeline ---------------------------------------------------
def test_p2p_engine_steps_in_the_exported_json(client, tmp_path):
    """A p2p butterfly (4 ranks, 2 chunks, rank 2's input late) traced: from the exported JSON, one reduce
    event per (rank, step, chunk) of every reduction the plan has, on the rank's worker; the messages
    between workers carry exactly the plan's cross-worker edges (each value once per reading worker) and
    their bytes; all of it inside the call's span (first hand-in start to last output stop); the summary
    names a critical path through the engine's nodes and the late rank as the straggler."""
    from flowreduce.tracing.summary import plan_ranks, plan_workers

    delay = 0.3
    with trace(client) as tr:
        xs = _inputs(client, {2: delay})
        out = flowreduce.allreduce(client, xs, algorithm="butterfly", chunks=2, method="p2p")
        tr.add(out, xs)
        results = client.gather(out)
    expected_sum = sum(np.random.default_rng(r).random(N) for r in range(RANKS))
    np.testing.assert_allclose(results[0], expected_sum)
    who = client.who_has(out)
    rank_worker = [sorted(who[f.key])[0] for f in out]
    call = tr.last_call
    assert call.method == "p2p"
    plan = call.plan
    to_chrome(tr, tmp_path / "trace.json")
    with open(tmp_path / "trace.json") as f:
        doc = json.load(f)
    evs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["args"].get("token") == call.token]
    engine = [e for e in evs if e["args"].get("detail", "").startswith("p2p engine")]
    messages = [e for e in evs if e["args"].get("detail", "").startswith("p2p message")]

    # a reduce event per (rank, step, chunk, node) of every reduction, once, on its rank's worker
    ranks = plan_ranks(call)
    want = Counter((ranks[n.rank], n.step, c, n.id) for c in range(plan.chunks) for n in plan.nodes
                   if n.kind == "reduce")
    got = Counter((e["args"]["rank"], e["args"]["step"], e["args"]["chunk"], e["args"]["node"])
                  for e in engine if e["cat"] == "reduce")
    assert want and got == want
    pid_worker = {e["pid"]: e["args"]["name"].rsplit(" · ", 1)[-1] for e in doc["traceEvents"]
                  if e["ph"] == "M" and e["name"] == "process_name"}
    for e in engine:
        assert pid_worker[e["pid"]] == rank_worker[e["args"]["rank"]], e
    # and a copy event per gather (all-gather) node
    assert sum(e["cat"] == "copy" for e in engine) == plan.chunks * sum(n.kind == "gather" for n in plan.nodes)

    # the messages carry the plan's cross-worker edges, each value once per reading worker
    where = plan_workers(call)
    consumers = plan.consumers()
    edges = Counter()
    for c in range(plan.chunks):
        for n in plan.nodes:
            for dest in sorted({where[plan.nodes[m].rank] for m in consumers[n.id]} - {where[n.rank]}):
                edges[(c, n.id, where[n.rank], dest)] += 1
    sent = Counter()
    for e in messages:
        assert e["cat"] == "transfer" and e["args"]["source"] != e["args"]["dest"]
        for k in e["args"]["keys"]:
            info = keymod.parse(ast.literal_eval(k))
            sent[(info["chunk"], info["node"], e["args"]["source"], e["args"]["dest"])] += 1
    assert edges and sent == edges
    s = summarize(tr)
    moved = defaultdict(int)
    for e in messages:
        moved[(e["args"]["source"], e["args"]["dest"])] += e["args"]["nbytes"]
    itemsize = 8
    for link, planned in s.planned_links.items():  # segments of a chunk round to whole elements
        assert abs(moved[link] - planned) <= itemsize * plan.segments * plan.chunks, (link, moved[link], planned)

    # Perfetto draws an arrow into every message that carries a value an engine node made
    made = sum(any(keymod.parse(ast.literal_eval(k))["phase"] != "split" for k in e["args"]["keys"])
               for e in messages)
    assert made and sum(e["ph"] == "f" for e in doc["traceEvents"]) >= made

    # all inside the call's span: its output tasks (rank 2's input was late: the call was placed on arrival,
    # docs/p2p.md; each output runs from its input's arrival), and its barrier if it ran before it was let go
    tasks = [e for e in evs if e["args"].get("detail") == "compute"]
    phases = {keymod.parse(ast.literal_eval(e["args"]["key"]))["phase"] for e in tasks}
    assert "output" in phases and phases <= {"barrier", "output"}, phases
    slack = doc["metadata"]["clock_alignment"]["max_uncertainty_s"] * 1e6 + 1000  # µs
    t0, t1 = min(e["ts"] for e in tasks), max(e["ts"] + e["dur"] for e in tasks)
    for e in engine + messages:
        assert t0 - slack <= e["ts"] and e["ts"] + e["dur"] <= t1 + slack, (e, t0, t1)

    # the summary: a critical path through the engine's nodes, and the late rank
    kinds = {p.kind for p in s.critical_path}
    assert "reduce" in kinds and "transfer" in kinds, s.critical_path
    engine_keys = {e["args"]["key"] for e in engine}
    assert any(p.key in engine_keys for p in s.critical_path)
    assert s.critical_path[-1].stop == pytest.approx(max(ev.stop for ev in tr.iter_events(call.token)))
    assert s.straggler is not None and s.straggler.rank == 2 and s.straggler.lag >= delay * 0.5
    text = str(s)
    assert "critical path:" in text and "straggler: rank 2" in text
    assert tr.lost["engine_log"] == 0


def test_p2p_engine_steps_with_ranks_sharing_workers(client):
    """8 ranks on the 4 workers, p2p: every reduction of the plan the engines ran is an event once, on the
    worker of the rank it carries; the summary has a row per plan rank and a critical path."""
    from flowreduce.tracing.summary import plan_ranks, plan_workers

    workers = sorted(client.nthreads())
    with trace(client) as tr:
        xs = [client.submit(make_input, N, r, workers=[workers[r % RANKS]], pure=False) for r in range(2 * RANKS)]
        out = flowreduce.allreduce(client, xs, algorithm="butterfly", chunks=2, method="p2p")
        tr.add(out, xs)
        client.gather(out)
    call = tr.last_call
    plan, ranks, where = call.plan, plan_ranks(call), plan_workers(call)
    got = Counter((e.rank, e.step, e.chunk, e.node, e.worker) for e in tr.iter_events(call.token)
                  if e.detail.startswith("p2p engine") and e.phase == "reduce")
    want = Counter((ranks[n.rank], n.step, c, n.id, where[n.rank]) for c in range(plan.chunks) for n in plan.nodes
                   if n.kind == "reduce")
    assert want and got == want
    s = summarize(tr)
    assert [r.rank for r in s.per_rank] == ranks and [r.worker for r in s.per_rank] == where
    assert any(p.kind == "reduce" for p in s.critical_path)
