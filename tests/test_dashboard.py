"""The /flowreduce dashboard page: the store on a real scheduler (preload,
failed call, a client that publishes nothing or garbage), its bounds over
10,000 calls, and the page in a real headless Chromium showing a held-back
rank as waiting, then done."""

from __future__ import annotations

import gc
import sys
import threading
import time
import types
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
from distributed import Client, Event, LocalCluster, wait
from utils import assert_clean, wait_until

import flowreduce
import flowreduce.dashboard
from flowreduce import keys
from flowreduce.dashboard import views
from flowreduce.dashboard.store import NAME, OP, DashboardStore, store_of

N = 64


@pytest.fixture(scope="module")
def dash():
    """A cluster whose scheduler serves the dashboard, with the page preloaded."""
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0",
                      scheduler_kwargs={"preload": ["flowreduce.dashboard"]}) as cluster:
        with Client(cluster) as client:
            yield cluster, client


def _store_view(dask_scheduler, token=None):
    """What the page would show, computed on the scheduler's loop (as the page is)."""
    store = store_of(dask_scheduler)
    now = time.time()
    call = store.find(token) if token else views.default_selection(store)
    cells = views.grid(call, dask_scheduler) if call else []
    return {"malformed": store.malformed, "rows": views.calls_table(store, now),
            "state": call.state if call else None, "error": call.error if call else "",
            "record": call.record is not None if call else None,
            "cells": [(c.rank, c.column, c.state) for c in cells],
            "links": views.links(call, dask_scheduler, now) if call else [],
            "straggler": views.straggler(call, cells, dask_scheduler, now) if call else None}


def _page_text(dask_scheduler):
    """Build the page's Bokeh component on the scheduler and refresh it once."""
    from flowreduce.dashboard.page import FlowreducePage

    page = FlowreducePage(dask_scheduler)
    page.update()
    return {"straggler": page.straggler.text, "title": page.title.text, "grid": dict(page.cells.data)}


def _ranks(client, n=N, p=4):
    ws = sorted(client.nthreads())
    return [client.submit(np.full, n, r + 1.0, workers=[ws[r % len(ws)]], pure=False) for r in range(p)], ws


def _boom(name):
    Event(name).wait()  # fail once the call is submitted
    raise ValueError("rank input exploded on purpose")


def _held(name, value):
    Event(name).wait()
    return value


def _url(cluster, page):
    return cluster.dashboard_link.rsplit("/", 1)[0] + "/" + page


def test_preloaded_page_is_served_and_listed_before_any_call():
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0",
                      scheduler_kwargs={"preload": ["flowreduce.dashboard"]}) as cluster, Client(cluster) as client:
        assert client.run_on_scheduler(lambda dask_scheduler: store_of(dask_scheduler).listing()) == []
        with urllib.request.urlopen(_url(cluster, "flowreduce")) as r:
            assert r.status == 200
        with urllib.request.urlopen(_url(cluster, "status")) as r:
            assert 'href="flowreduce"' in r.read().decode()


@pytest.mark.parametrize("plugins,says", [({}, "flowreduce has not run on this cluster yet"),
                                          ({NAME: DashboardStore()}, "no flowreduce call yet")],
                         ids=["no-plugin", "no-call"])
def test_page_renders_with_nothing_to_show(plugins, says):
    page = _page_text(SimpleNamespace(plugins=plugins, tasks={}))
    assert page["straggler"] == says and page["grid"]["state"] == []


def test_a_failed_call_is_shown_failed_with_its_error(dash):
    cluster, client = dash
    xs, ws = _ranks(client)
    ev = Event("flowreduce-dashboard-test-boom", client=client)
    xs[1] = client.submit(_boom, ev.name, workers=[ws[1]], pure=False)
    out = flowreduce.allreduce(client, xs, algorithm="butterfly", like=np.zeros(N))
    token = flowreduce.describe(out).token
    ev.set()
    wait(out)
    assert all(f.status == "error" for f in out)
    seen = client.run_on_scheduler(_store_view, token=token)
    assert seen["state"] == "failed"
    assert "rank input exploded on purpose" in seen["error"]
    assert any(state == "erred" for *_, state in seen["cells"])
    page = client.run_on_scheduler(lambda dask_scheduler: _page_text(dask_scheduler))
    row = next(r for r in seen["rows"] if r["token"] == token)
    assert row["state"] == "failed" and "exploded" in row["error"]
    assert page["grid"]["state"]  # the page renders a call (the failed one, or a later one)
    del out, xs
    gc.collect()  # the failed futures' exceptions hold tracebacks in cycles that keep the futures alive
    assert_clean(client)


def test_a_client_that_publishes_nothing_or_garbage_breaks_nothing(dash, monkeypatch):
    """An older flowreduce sends no record: the call shows from its keys. A
    record the scheduler cannot read is counted and dropped."""
    cluster, client = dash
    monkeypatch.setattr(flowreduce.dashboard, "publish", lambda *a, **k: None)
    xs, _ = _ranks(client)
    out = flowreduce.allreduce(client, xs, algorithm="butterfly", method="tasks")  # a task per plan node
    token = flowreduce.describe(out).token
    np.testing.assert_array_equal(client.gather(out)[0], np.full(N, 10.0))
    assert wait_until(lambda: client.run_on_scheduler(_store_view, token=token)["state"] == "done", 10)
    seen = client.run_on_scheduler(_store_view, token=token)
    assert seen["record"] is False
    row = next(r for r in seen["rows"] if r["token"] == token)
    assert (row["algorithm"], row["ranks"], row["transport"]) == ("butterfly", 4, "?")
    plan = flowreduce.plan("butterfly", 4)
    assert {r for r, _, _ in seen["cells"]} == set(range(4))
    assert len({c for _, c, _ in seen["cells"]}) == plan.depth
    assert all(state == "done" for *_, state in seen["cells"])
    before = seen["malformed"]
    for garbage in ({"token": 5}, "not a record", {"token": "x", "ranks": "many"}):
        client._send_to_scheduler({"op": OP, "record": garbage})
    assert wait_until(lambda: client.run_on_scheduler(_store_view)["malformed"] == before + 3, 10)
    monkeypatch.undo()
    out2 = flowreduce.allreduce(client, xs, algorithm="ring")  # the client's stream still works
    np.testing.assert_array_equal(client.gather(out2)[1], np.full(N, 10.0))
    del out, out2, xs
    gc.collect()  # futures held by reference cycles (exceptions, frames) go first
    assert_clean(client)


def test_link_bytes_match_the_plans_transfers(dash):
    cluster, client = dash
    xs, _ = _ranks(client, n=4096)
    out = flowreduce.allreduce(client, xs, algorithm="ring", method="tasks")  # bytes from the tasks' transfers
    token = flowreduce.describe(out).token
    client.gather(out)
    assert wait_until(lambda: client.run_on_scheduler(_store_view, token=token)["state"] == "done", 10)
    seen = client.run_on_scheduler(_store_view, token=token)
    info = flowreduce.describe(out)
    # every message of the plan counted once, with the bytes the plan says it carries
    expected: dict = {}
    for t in info.plan.transfers():
        link = (t.source, t.dest)
        expected[link] = expected.get(link, 0) + (t.hi - t.lo) * info.nbytes / info.plan.segments
    assert {(r["source"], r["dest"]): r["bytes"] for r in seen["links"]} == expected
    assert sum(expected.values()) == info.bytes_on_wire
    del out, xs


# -- bounds: 10,000 calls through the store's hooks -----------------------------------------------------------

def _fake_call(store, scheduler, i: int) -> None:
    """One 2-rank call through the hooks distributed calls: update_graph, then each task to memory."""
    token = f"{i:032x}"
    ks = [keys.node_key("ring", "split", token, 0, r, 0, r) for r in range(2)]
    ks += [keys.output_key("ring", token, r) for r in range(2)]
    deps = {ks[2]: [ks[0], ks[1]], ks[3]: [ks[0], ks[1]]}
    for k in ks:
        scheduler.tasks[k] = SimpleNamespace(key=k, state="waiting", nbytes=100, dependencies=[])
    for k, ds in deps.items():
        scheduler.tasks[k].dependencies = [scheduler.tasks[d] for d in ds]
    store.update_graph(scheduler, keys=set(ks[2:]), tasks=ks)
    store.publish(record={"token": token, "algorithm": "ring", "ranks": 2, "nbytes": 800, "chunks": 1})
    for k in ks:
        scheduler.tasks[k].state = "memory"
        store.transition(k, "processing", "memory")
    for k in ks:
        store.transition(k, "memory", "forgotten")
        del scheduler.tasks[k]


def _reachable_bytes(root, skip) -> int:
    """Bytes of every object reachable from ``root`` (classes, modules, functions and ``skip`` excluded)."""
    seen, stack, total = {id(skip)}, [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def test_store_is_bounded_and_flat_after_10000_calls():
    scheduler = SimpleNamespace(tasks={})
    store = DashboardStore(history=100)
    store.scheduler = scheduler
    for i in range(2000):
        _fake_call(store, scheduler, i)
    at_2000 = _reachable_bytes(store, scheduler)
    for i in range(2000, 10_000):
        _fake_call(store, scheduler, i)
    at_10000 = _reachable_bytes(store, scheduler)
    assert at_10000 <= at_2000 * 1.02, f"the store grew from {at_2000} to {at_10000} bytes over 8,000 calls"
    assert len(store.history) == 100 and not store.calls
    assert [c.token for c in store.listing()][0] == f"{9999:032x}"  # newest first
    assert all(c.state == "done" and not c.cells for c in store.history)
    assert at_10000 - at_2000 < 64 * 1024, f"the store grew by {at_10000 - at_2000} bytes over 8,000 calls"
    rows = views.calls_table(store, time.time())
    assert len(rows) == 100
    cells = views.grid(store.history[-1], scheduler)
    assert [(c.rank, c.column, c.state) for c in cells] == [(0, 0, "done"), (0, 1, "done"), (1, 0, "done"),
                                                            (1, 1, "done")]


def test_a_failed_fake_call_keeps_its_blame():
    scheduler = SimpleNamespace(tasks={})
    store = DashboardStore()
    store.scheduler = scheduler
    token = "f" * 32
    ks = [keys.node_key("tree", "reduce", token, 1, 0, 0, 3), keys.output_key("tree", token, 0)]
    blame = SimpleNamespace(key="input-0", exception_text="ValueError('bad input')", exception=None,
                            exception_blame=None)
    for k in ks:
        scheduler.tasks[k] = SimpleNamespace(key=k, state="waiting", nbytes=0, dependencies=[],
                                             exception_blame=blame, exception_text="", exception=None)
    store.update_graph(scheduler, keys={ks[1]}, tasks=ks)
    store.transition(ks[0], "waiting", "erred")
    (call,) = store.history
    assert (call.state, call.error, call.blame) == ("failed", "ValueError('bad input')", "input-0")
    assert [c.state for c in views.grid(call, scheduler)] == ["erred", "waiting"]


# -- the page in a real browser ---------------------------------------------------------------------------------

def _cells(grid):
    return {(r, c): s for r, c, s in zip(grid["rank"], grid["column"], grid["state"])}


def test_browser_shows_the_held_back_rank_waiting_then_done(dash):
    from browser import chromium, read_source, table_text, wait_for

    cluster, client = dash
    xs, ws = _ranks(client)
    np.testing.assert_array_equal(client.gather(flowreduce.allreduce(client, xs))[0], np.full(N, 10.0))
    held = 2
    ev = Event("flowreduce-dashboard-test-hold", client=client)
    xs[held] = client.submit(_held, ev.name, np.full(N, held + 1.0), workers=[ws[held % len(ws)]], pure=False)
    out = flowreduce.allreduce(client, xs, algorithm="butterfly", like=np.zeros(N))
    token = flowreduce.describe(out).token
    with chromium() as driver:
        driver.get(_url(cluster, "flowreduce"))

        def held_back(grid):
            cells = _cells(grid)
            first = min(c for _, c in cells) if cells else None
            return (grid["token"][:1] == [token] and
                    all(s == "waiting" for (r, _), s in cells.items() if r == held) and
                    all(cells.get((r, first)) == "done" for r in range(4) if r != held))

        grid = wait_for(driver, "flowreduce-grid", held_back)
        first = min(grid["column"])
        lag = read_source(driver, "flowreduce-straggler")
        assert (lag["token"], lag["rank"], lag["column"]) == ([token], [held], [first])
        calls = read_source(driver, "flowreduce-calls")
        assert calls["state"][calls["token"].index(token[:8])] == "running"

        ev.set()
        np.testing.assert_array_equal(client.gather(out)[held], np.full(N, 10.0))
        grid = wait_for(driver, "flowreduce-grid",
                        lambda g: g["token"][:1] == [token] and all(s == "done" for s in g["state"]))
        assert {r for r in grid["rank"]} == set(range(4))
        calls = wait_for(driver, "flowreduce-calls", lambda d: d["state"][d["token"].index(token[:8])] == "done")
        # and the table as drawn says so too (a source the browser holds but does not redraw would not)
        deadline = time.monotonic() + 30
        while (drawn := table_text(driver)) and time.monotonic() < deadline:
            row = drawn.index(token[:8]) if token[:8] in drawn else None
            if row is not None and "done" in drawn[row:row + 10]:
                break
            time.sleep(0.2)
        assert token[:8] in drawn and "done" in drawn[drawn.index(token[:8]):drawn.index(token[:8]) + 10], drawn
        errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors  # the page rendered: Bokeh logs rendering failures here
    del out, xs
    gc.collect()  # futures held by reference cycles (exceptions, frames) go first
    assert_clean(client)


def _engine_cells(grid, token):
    """(rank, column) -> (state, done, tasks) of the grid's engine steps (between the barrier and the outputs)."""
    from flowreduce.dashboard.record import ENGINE_COLUMN

    if grid["token"][:1] != [token]:
        return {}
    last = max(grid["column"], default=0)
    return {(r, c): (s, d, n) for r, c, s, d, n in zip(grid["rank"], grid["column"], grid["state"], grid["done"],
                                                      grid["tasks"], strict=True) if ENGINE_COLUMN <= c < last}


#: p2p hand-ins on this worker wait until the event is set (the cluster is in-process: one module, one event)
_HOLD_WORKER: list[str] = []
_RELEASE = threading.Event()


async def _held_hand_in(*args, **kwargs):
    import asyncio

    from distributed import get_worker

    while get_worker().address in _HOLD_WORKER and not _RELEASE.is_set():
        await asyncio.sleep(0.05)
    return await _HAND_IN[0](*args, **kwargs)


_HAND_IN: list = []


def test_browser_shows_the_engine_steps_of_a_p2p_call_held_back_on_one_rank(dash, monkeypatch):
    """method="p2p": the plan's steps are no tasks, the engines report them. While the hand-in on the
    held rank's worker waits, the page shows the call running with engine steps on the grid, none done
    where they need the held rank and the held rank's output waiting; once released, every engine cell
    has all its nodes done. (A p2p call cannot be submitted with an input still being computed: the
    engine needs its shape first, so the hand-in is what is held back.)"""
    from browser import chromium, read_source, wait_for

    from flowreduce.schedule import p2p

    cluster, client = dash
    xs, ws = _ranks(client)
    client.gather(xs)
    held = 2
    _HAND_IN[:] = [p2p.hand_in]
    _HOLD_WORKER[:] = [ws[held % len(ws)]]
    _RELEASE.clear()
    monkeypatch.setattr(p2p, "hand_in", _held_hand_in)
    try:
        out = flowreduce.allreduce(client, xs, algorithm="butterfly", method="p2p")
        token = flowreduce.describe(out).token
        with chromium() as driver:
            driver.get(_url(cluster, "flowreduce"))

            def held_back(grid):
                cells = _cells(grid) if grid["token"][:1] == [token] else {}
                engine = _engine_cells(grid, token)
                outputs = {r: s for (r, c), s in cells.items() if c == max(grid["column"])}
                return bool(engine) and outputs.get(held) == "waiting" and all(
                    s != "done" for s, _, _ in engine.values())

            wait_for(driver, "flowreduce-grid", held_back)
            time.sleep(0.5)  # the engines report every 100 ms: still held back after several reports
            grid = read_source(driver, "flowreduce-grid")
            assert held_back(grid), grid
            calls = read_source(driver, "flowreduce-calls")
            assert calls["state"][calls["token"].index(token[:8])] == "running"

            _RELEASE.set()
            np.testing.assert_array_equal(client.gather(out)[held], np.full(N, 10.0))
            grid = wait_for(driver, "flowreduce-grid",
                            lambda g: g["token"][:1] == [token] and all(s == "done" for s in g["state"])
                            and bool(_engine_cells(g, token))
                            and all(d == n for _, d, n in _engine_cells(g, token).values()))
            assert {r for r, _ in _engine_cells(grid, token)} >= {0, 1}
            # the links table: the bytes the engines sent, between the workers' lowest ranks, as planned
            from flowreduce.tracing.summary import plan_ranks, plan_workers

            info = flowreduce.describe(out)
            ranks, where = plan_ranks(info), plan_workers(info)
            expected: dict = {}
            for t in info.plan.transfers():
                if where[t.source] != where[t.dest]:  # values between ranks of one worker stay in process
                    link = (ranks[t.source], ranks[t.dest])
                    expected[link] = expected.get(link, 0) + (t.hi - t.lo) * info.nbytes / info.plan.segments
            assert wait_until(lambda: {(r["source"], r["dest"]) for r in client.run_on_scheduler(
                _store_view, token=token)["links"]} == set(expected), 10)
            for r in client.run_on_scheduler(_store_view, token=token)["links"]:
                assert abs(r["bytes"] - expected[r["source"], r["dest"]]) <= 8 * info.plan.segments, r
            errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors
    finally:
        _RELEASE.set()
        _HOLD_WORKER.clear()
    del out, xs
    gc.collect()
    assert_clean(client)
