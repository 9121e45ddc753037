"""The CPU an SPMD all-reduce between hosts costs each worker, back to back: the plan on the event loop or on the rank's thread.

    python benchmarks/netem/cluster.py --hosts 4 --workers-per-host 1 --nthreads 1 --rate 1gbit -- \\
        benchmarks/netem/spmd_cpu_probe.py

Runs inside the head namespace; one rank per worker; per size and variant, the
wall time per collective (the slowest rank) and each worker process's user and
system CPU and context switches per collective (getrusage).
"""
import os
import time


def _rank(comm, sizes, reps, variants):
    import resource

    import numpy as np
    out = []
    for n in sizes:
        x = np.full(n, comm.rank + 1.0)
        for v in variants:
            comm.plan_on_loop = v == "loop"
            for _ in range(3): comm.allreduce(x)
            comm.barrier()
            r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
            for _ in range(reps[n]): comm.allreduce(x)
            t1 = time.perf_counter(); r1 = resource.getrusage(resource.RUSAGE_SELF)
            out.append((n, v, (t1 - t0) / reps[n] * 1e3, (r1.ru_utime - r0.ru_utime) / reps[n] * 1e3,
                        (r1.ru_stime - r0.ru_stime) / reps[n] * 1e3, (r1.ru_nvcsw - r0.ru_nvcsw) / reps[n],
                        (r1.ru_nivcsw - r0.ru_nivcsw) / reps[n]))
    return out
from distributed import Client

import flowreduce

with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as c:
    ws = sorted(c.scheduler_info(n_workers=-1)["workers"])
    sizes = [1000, 100000, 1000000]
    reps = {1000: 200, 100000: 60, 1000000: 15}
    res = c.gather(flowreduce.spmd(c, _rank, ranks=len(ws), workers=ws, timeout=300, sizes=sizes, reps=reps, variants=["loop", "thread"]))
    for k in range(len(res[0])):
        n, v = res[0][k][:2]
        print(f"{n:>8} {v:>6} wall/coll {max(r[k][2] for r in res):7.2f} ms  user/coll/proc " + " ".join(f"{r[k][3]:5.2f}" for r in res)
              + "  sys " + " ".join(f"{r[k][4]:5.2f}" for r in res) + "  vcsw " + " ".join(f"{r[k][5]:5.1f}" for r in res) + "  ivcsw " + " ".join(f"{r[k][6]:5.1f}" for r in res))
