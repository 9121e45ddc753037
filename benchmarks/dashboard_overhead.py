"""What the /flowreduce dashboard page costs: all-reduce time with the page
open in a browser vs closed, at 100 calls per minute, in interleaved blocks.

Protocol (docs/dashboard.md, "Overhead"):

* a LocalCluster of ``--ranks`` single-threaded worker processes with the
  dashboard on (and the flowreduce page, installed by the first call);
  unused Bokeh sessions are dropped after 1 s so that "closed" is closed;
* one rank per worker, ``--size`` float64 elements per rank (default 1e6,
  8 MB), ``--algorithm`` (default butterfly);
* one headless Chromium (Debian's, driven by selenium), its processes at
  niceness ``--browser-nice`` (default 19: a user's browser runs on their
  own machine, not on the cluster's cores; here it takes only idle CPU,
  and ``--browser-nice 0`` measures it competing with the cluster). A block is
  ``--calls`` calls, one started every ``60 / --rate`` s (default 100 per
  minute); in an *open* block the browser shows /flowreduce (refreshing every
  500 ms, the page's data loaded before the block starts), in a *closed* block
  it shows about:blank and the scheduler has no session of the page left;
* a *paused* block is an open one whose browser processes are stopped
  (SIGSTOP) for the block: the page's sessions stay connected and the
  scheduler keeps refreshing them and sending their updates, but nothing
  draws them here. It is what the cluster pays when the browser runs on
  another machine (a user's laptop), which two shared cores cannot
  otherwise emulate: a browser at any niceness still takes their cycles;
* ``--pairs`` rounds of one block of each variant, in rotating order, after
  ``--warmup`` untimed rounds; each call gets fresh inputs,
  made and waited for before its clock starts; the clock covers
  ``allreduce`` + ``wait`` for the outputs;
* CPU seconds per block of this process (the client and the scheduler,
  whose event loop runs the page's refreshes) and of the browser's processes:
  on a shared, loaded machine wall time is noisy, CPU time much less so;
* the scheduler-side cost of one page refresh (build the page's data for the
  calls in the store) is timed on its own, on the scheduler.

Reported: the median call time of each variant, the ratios open/closed and
paused/closed of the medians with bootstrap 95% intervals (resampling calls), the median CPU
seconds per block of each variant (this process; the browser), and the refresh time.
``--json FILE`` writes every raw timing.

    python benchmarks/dashboard_overhead.py --json dashboard-overhead.json   # the real run
    python benchmarks/dashboard_overhead.py --size 1e4 --pairs 2 --calls 3   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

#: tests/, for its test helpers (faults.py, browser.py: not part of the library)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = ("open", "paused", "closed")


def _make(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(n)


def _browser_cpu(driver) -> float:
    """CPU seconds used so far by the browser's processes (chromedriver and its children)."""
    import psutil

    root = psutil.Process(driver.service.process.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _browser_processes(driver) -> list:
    import psutil

    root = psutil.Process(driver.service.process.pid)
    return [root, *root.children(recursive=True)]


def _signal_browser(driver, sig: int) -> None:
    """Stop (SIGSTOP) or resume (SIGCONT) every process of the browser."""
    import psutil

    for proc in _browser_processes(driver):
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _renice(driver, niceness: int) -> None:
    """Give the browser's processes (and so the renderers they start later) this niceness."""
    import psutil

    root = psutil.Process(driver.service.process.pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            proc.nice(niceness)
        except psutil.NoSuchProcess:
            pass


def _sessions(dask_scheduler=None) -> int:
    """Open Bokeh sessions of the /flowreduce page on the scheduler."""
    from bokeh.server.server import BokehTornado

    apps = getattr(dask_scheduler.http_application, "applications", ())
    return sum(len(a.get_sessions("/flowreduce")) for a in apps
               if isinstance(a, BokehTornado) and "/flowreduce" in a.app_paths)


def _in_store(dask_scheduler=None) -> int:
    from flowreduce.dashboard.store import store_of

    return len(store_of(dask_scheduler).listing())


def _refresh_seconds(repeat: int, dask_scheduler=None) -> float:
    """Median seconds of one page refresh on the scheduler (a fresh page each time: all data sent)."""
    from flowreduce.dashboard.page import FlowreducePage

    times = []
    for _ in range(repeat):
        page = FlowreducePage(dask_scheduler)
        t0 = time.perf_counter()
        page.update()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ratio_interval(open_: list[float], closed: list[float], resamples: int = 10_000,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of median(open) / median(closed)."""
    rng = np.random.default_rng(seed)
    o, c = np.asarray(open_), np.asarray(closed)
    mo = np.median(o[rng.integers(0, len(o), (resamples, len(o)))], axis=1)
    mc = np.median(c[rng.integers(0, len(c), (resamples, len(c)))], axis=1)
    lo, hi = np.quantile(mo / mc, [0.025, 0.975])
    return float(lo), float(hi)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=1e6, help="float64 elements per rank (default 1e6)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks = single-threaded worker processes (default 4)")
    ap.add_argument("--pairs", type=int, default=8,
                    help="timed rounds of one (open, paused, closed) block each (default 8)")
    ap.add_argument("--calls", type=int, default=8, help="calls per block (default 8)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--rate", type=float, default=100.0, help="calls started per minute (default 100)")
    ap.add_argument("--algorithm", default="butterfly", help="default butterfly")
    ap.add_argument("--browser-nice", type=int, default=19,
                    help="niceness of the browser's processes (default 19: a user's browser runs on their own "
                         "machine, so here it takes only idle CPU; 0: it competes with the cluster)")
    ap.add_argument("--json", metavar="FILE", help="write the configuration and every raw timing")
    a = ap.parse_args(argv)

    import dask
    import distributed
    from browser import chromium, read_source
    from distributed import Client, LocalCluster, wait

    import flowreduce

    n = int(a.size)
    period = 60.0 / a.rate
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    blocks: list[dict] = []
    lifetime = {"distributed.scheduler.dashboard.bokeh-application.unused_session_lifetime_milliseconds": 1000}
    with dask.config.set(lifetime), \
            LocalCluster(n_workers=a.ranks, threads_per_worker=1, processes=True, dashboard_address=":0") as cl, \
            Client(cl) as client, chromium() as browser:
        workers = sorted(client.nthreads())
        seeds = iter(range(10**6))
        page = cl.dashboard_link.rsplit("/", 1)[0] + "/flowreduce"

        def call() -> float:
            base = next(seeds) * a.ranks
            xs = [client.submit(_make, n, base + r, workers=[w], pure=False) for r, w in enumerate(workers)]
            wait(xs)
            t0 = time.perf_counter()
            out = flowreduce.allreduce(client, xs, algorithm=a.algorithm)
            wait(out)
            return time.perf_counter() - t0

        def show(open_: bool) -> None:
            deadline = time.monotonic() + 30
            _renice(browser, a.browser_nice)
            if open_:
                browser.get(page)
                while read_source(browser, "flowreduce-calls") is None and time.monotonic() < deadline:
                    time.sleep(0.1)
            else:
                browser.get("about:blank")
                while client.run_on_scheduler(_sessions) and time.monotonic() < deadline:
                    time.sleep(0.1)

        def block(variant: str) -> dict:
            show(variant != "closed")
            if variant == "paused":
                _signal_browser(browser, signal.SIGSTOP)
            times = []
            cpu0, browser0 = time.process_time(), _browser_cpu(browser)
            try:
                for _ in range(a.calls):
                    t0 = time.monotonic()
                    times.append(call())
                    time.sleep(max(0.0, period - (time.monotonic() - t0)))
            finally:
                if variant == "paused":
                    _signal_browser(browser, signal.SIGCONT)
            return {"seconds": times, "process_cpu": time.process_time() - cpu0,
                    "browser_cpu": _browser_cpu(browser) - browser0}

        call()  # installs the dashboard plugin and the page
        for i in range(a.warmup + a.pairs):
            order = VARIANTS[i % 3:] + VARIANTS[:i % 3]
            pair = {v: block(v) for v in order}
            if i >= a.warmup:
                blocks.append({"pair": i - a.warmup, "first": order[0], **pair})
                print(f"round {i - a.warmup + 1}/{a.pairs}: " + "; ".join(
                    f"{v} median {statistics.median(pair[v]['seconds']):.4f} s, CPU {pair[v]['process_cpu']:.2f}"
                    f" + browser {pair[v]['browser_cpu']:.2f} s" for v in VARIANTS), file=sys.stderr, flush=True)
        show(False)
        refresh = client.run_on_scheduler(_refresh_seconds, 20)
        in_store = client.run_on_scheduler(_in_store)

    opened = [t for b in blocks for t in b["open"]["seconds"]]
    paused = [t for b in blocks for t in b["paused"]["seconds"]]
    closed = [t for b in blocks for t in b["closed"]["seconds"]]
    lo, hi = ratio_interval(opened, closed)
    plo, phi = ratio_interval(paused, closed)

    def cpu(variant: str, what: str) -> float:
        return statistics.median(b[variant][what] for b in blocks)

    summary = {"open_median": statistics.median(opened), "closed_median": statistics.median(closed),
               "paused_median": statistics.median(paused),
               "ratio_open_over_closed": statistics.median(opened) / statistics.median(closed),
               "ratio_paused_over_closed": statistics.median(paused) / statistics.median(closed),
               "ratio_paused_ci95": [plo, phi], "process_cpu_paused": cpu("paused", "process_cpu"),
               "process_cpu_open": cpu("open", "process_cpu"), "process_cpu_closed": cpu("closed", "process_cpu"),
               "browser_cpu_open": cpu("open", "browser_cpu"), "browser_cpu_closed": cpu("closed", "browser_cpu"),
               "block_seconds": a.calls * period,
               "ratio_ci95": [lo, hi], "refresh_seconds": refresh, "calls_in_store": in_store}
    doc = {
        "benchmark": "dashboard_overhead",
        "config": {"size": n, "bytes_per_rank": n * 8, "ranks": a.ranks, "pairs": a.pairs, "calls": a.calls,
                   "warmup": a.warmup, "rate_per_minute": a.rate, "algorithm": a.algorithm,
                   "browser_nice": a.browser_nice,
                   "order": "rounds of open, paused, closed blocks in rotating order"},
        "machine": {"started": started, "host": platform.node(), "cpus": os.cpu_count(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "python": platform.python_version(), "distributed": distributed.__version__},
        "summary": summary,
        "blocks": blocks,
    }
    print(report(doc))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"raw timings: {a.json}")
    return doc


def report(doc: dict) -> str:
    c, s, m = doc["config"], doc["summary"], doc["machine"]
    return "\n".join([
        f"{c['algorithm']}, {c['ranks']} ranks x {c['size']:.3g} float64 ({c['bytes_per_rank'] / 1e6:.3g} MB) per "
        f"rank, {c['rate_per_minute']:.0f} calls/min; {c['pairs']} rotating rounds of {c['calls']}-call blocks "
        f"after {c['warmup']} warm-up; browser niceness {c['browser_nice']}; load average {m['loadavg_before'][0]:.1f} before, "
        f"{m['loadavg_after'][0]:.1f} after",
        f"page open     median {s['open_median'] * 1e3:8.1f} ms",
        f"page open, browser paused median {s['paused_median'] * 1e3:8.1f} ms",
        f"page closed   median {s['closed_median'] * 1e3:8.1f} ms",
        f"open / closed {s['ratio_open_over_closed']:.3f}  (95% CI {s['ratio_ci95'][0]:.3f}-{s['ratio_ci95'][1]:.3f})"
        "  (the browser on the cluster's own cores)",
        f"paused / closed {s['ratio_paused_over_closed']:.3f}  (95% CI {s['ratio_paused_ci95'][0]:.3f}-"
        f"{s['ratio_paused_ci95'][1]:.3f})  (the cluster's side: refreshes and updates sent, nothing drawn here)",
        f"CPU per {s['block_seconds']:.1f} s block (median): client+scheduler process {s['process_cpu_open']:.2f} s open, "
        f"{s['process_cpu_paused']:.2f} s paused, {s['process_cpu_closed']:.2f} s closed; browser {s['browser_cpu_open']:.2f} s open, "
        f"{s['browser_cpu_closed']:.2f} s closed",
        f"one page refresh on the scheduler: {s['refresh_seconds'] * 1e3:.2f} ms "
        f"({s['calls_in_store']} calls in the store)",
    ])


if __name__ == "__main__":
    main()
