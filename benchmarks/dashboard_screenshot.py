"""Make the screenshot of the /flowreduce dashboard page kept in docs/.

A LocalCluster of 4 workers; a few all-reduces of 8 ranks that finish (ring,
butterfly, tree), one whose rank 3 input fails, then a butterfly of 2
chunks whose rank 5 input is held back (its task waits on a
``distributed.Event``). Headless Chromium opens /flowreduce, waits until the
page shows the held call with rank 5 waiting, and saves the window. The held
input is then released and everything is cleaned up.

    python benchmarks/dashboard_screenshot.py -o docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

#: tests/, for its test helpers (faults.py, browser.py: not part of the library)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _held(name: str, value):
    from distributed import Event

    Event(name).wait()
    return value


def _boom(name: str):
    from distributed import Event

    Event(name).wait()  # fail once the call is submitted
    raise ValueError("rank 3's input failed (on purpose, for the screenshot)")


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default="docs/img/dashboard.png", help="PNG to write")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--size", type=float, default=2e5, help="float64 elements per rank")
    a = ap.parse_args(argv)

    from browser import chromium, wait_for
    from distributed import Client, Event, LocalCluster, wait

    import flowreduce

    n, p, held = int(a.size), a.ranks, 5
    with LocalCluster(n_workers=4, threads_per_worker=2, processes=True, dashboard_address=":0") as cl, \
            Client(cl) as client:
        ws = sorted(client.nthreads())

        def inputs():
            return [client.submit(np.full, n, r + 1.0, workers=[ws[r % len(ws)]], pure=False) for r in range(p)]

        for algorithm in ("ring", "butterfly", "tree"):
            client.gather(flowreduce.allreduce(client, inputs(), algorithm=algorithm))
        xs = inputs()
        boom = Event("flowreduce-screenshot-boom", client=client)
        xs[3] = client.submit(_boom, boom.name, workers=[ws[3 % len(ws)]], pure=False)
        failed = flowreduce.allreduce(client, xs, algorithm="butterfly", like=np.zeros(n))
        boom.set()
        wait(failed)
        del failed
        ev = Event("flowreduce-screenshot-hold", client=client)
        xs = inputs()
        xs[held] = client.submit(_held, ev.name, np.full(n, held + 1.0), workers=[ws[held % len(ws)]], pure=False)
        out = flowreduce.allreduce(client, xs, algorithm="butterfly", chunks=2, like=np.zeros(n))
        token = flowreduce.describe(out).token
        try:
            with chromium(width=1180, height=1130) as browser:
                browser.get(cl.dashboard_link.rsplit("/", 1)[0] + "/flowreduce")
                wait_for(browser, "flowreduce-straggler",
                         lambda d: d["token"] == [token] and d["rank"] == [held])
                wait_for(browser, "flowreduce-grid",
                         lambda g: g["token"][:1] == [token] and "done" in g["state"])
                browser.save_screenshot(a.output)
        finally:
            ev.set()
            client.gather(out)
    print(a.output)
    return a.output


if __name__ == "__main__":
    main()
