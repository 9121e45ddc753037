"""Paired A/B of this branch's two SPMD message changes, in one job, alternating per repetition.

    python benchmarks/netem/cluster.py --hosts 4 --workers-per-host 1 --nthreads 1 --rate 1gbit -- \\
        benchmarks/netem/spmd_ab_probe.py 1e3,1e4,1e5,1e6 150,150,80,24

Runs inside the head namespace; one rank per worker (host). ``new``: the code as it is; ``old``: every
array sent as Dask-serialised frames (``spmd_mailbox.INLINE_BYTES = -1``) and a fresh array for every
reduce (``plan_walk(..., write_received=False)``), both switched on every rank before each repetition (a
diagnostic: module globals). Each repetition: a barrier, one ``auto`` all-reduce, its time the maximum
over ranks; the two variants alternate (order swapped every other repetition), so the machine's load
falls on both.
"""
import os, sys, json, statistics
from distributed import Client
import flowreduce

def _rank(comm, sizes, reps):
    import time, numpy as np
    import flowreduce.spmd.comm as C
    import flowreduce.schedule.spmd_mailbox as M
    from flowreduce.spmd import planrun
    orig, inline = planrun.plan_walk, M.INLINE_BYTES
    def off(*a, **k):
        k["write_received"] = False
        return orig(*a, **k)
    def setv(v):
        C.plan_walk = orig if v == "new" else off
        M.INLINE_BYTES = inline if v == "new" else -1
    out = {}
    for n, r in zip(sizes, reps):
        x = np.full(n, comm.rank + 1.0)
        for _ in range(3): comm.allreduce(x)
        ts = {"new": [], "old": []}
        for i in range(r):
            for v in (("new", "old") if i % 2 == 0 else ("old", "new")):
                setv(v)
                comm.barrier()
                t = time.perf_counter(); y = comm.allreduce(x); ts[v].append(time.perf_counter() - t)
                assert (y == comm.size * (comm.size + 1) / 2).all()
        setv("new")
        out[n] = {v: np.max(np.stack(comm.allgather(np.array(t))), axis=0).tolist() for v, t in ts.items()}
        out[n]["plan"] = str(comm.plan_for("auto", x.nbytes))
    return out

with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as c:
    ws = sorted(c.scheduler_info(n_workers=-1)["workers"])
    res = c.gather(flowreduce.spmd(c, _rank, ranks=len(ws), workers=ws, timeout=600, sizes=[int(float(s)) for s in sys.argv[1].split(",")], reps=[int(r) for r in sys.argv[2].split(",")]))[0]
    for n, d in res.items():
        q = lambda t: statistics.quantiles(t, n=4)
        print(f"n={n:.0e} {d['plan'][:40]}: new median {statistics.median(d['new'])*1e3:.2f} ms p25 {q(d['new'])[0]*1e3:.2f} | old median {statistics.median(d['old'])*1e3:.2f} ms p25 {q(d['old'])[0]*1e3:.2f}  ({len(d['new'])} each)")
