"""SPMD all-reduce plans between hosts compared by hand in one job, configurations alternating per repetition.

    python benchmarks/netem/cluster.py --hosts 4 --workers-per-host 1 --nthreads 1 --rate 1gbit -- \\
        benchmarks/netem/spmd_plans_probe.py 1e5 40 "auto;ring;butterfly:radix=4;ring/2;butterfly/2:radix=4"

Arguments: elements (float64), repetitions, configurations separated by ";":
``NAME`` (an algorithm name as ``comm.allreduce`` takes it), ``NAME[/CHUNKS][:OPTION=VALUE,...]``
(that plan, in CHUNKS chunks, put in the communicator's plan cache for the size: a diagnostic),
``NAME@BYTES`` (auto with ``PIPELINE_BYTES`` = BYTES). Each repetition: a barrier, one
all-reduce; its time the maximum over ranks; the median over the repetitions.
"""
import os
import statistics
import sys


def _rank(comm, n, configs, reps):
    import time

    import numpy as np

    import flowreduce.spmd.comm as C
    from flowreduce.algorithms import plan as mk
    x = np.full(n, comm.rank + 1.0)
    comm.allreduce(x)  # link
    times = {c: [] for c in configs}
    orig = C.PIPELINE_BYTES
    for i in range(reps + 2):
        for cfg in configs:
            alg, pb = cfg.split("@") if "@" in cfg else (cfg, None)
            C.PIPELINE_BYTES = int(float(pb)) if pb else orig
            comm._plans.clear()
            if ":" in alg or "/" in alg:
                name, _, rest = alg.partition(":")
                base, _, ch = name.partition("/")
                opts = dict(kv.split("=") for kv in rest.split(",") if kv)
                p = mk(base, len(comm.leaders), **{k: int(v) for k, v in opts.items()}).with_chunks(int(ch or 1))
                comm._plans[("auto", x.nbytes)] = p
                a = "auto"
            else:
                a = alg
            comm.barrier()
            t = time.perf_counter(); y = comm.allreduce(x, algorithm=a); d = time.perf_counter() - t
            assert y[0] == comm.size * (comm.size + 1) / 2
            if i >= 2: times[cfg].append(d)
    C.PIPELINE_BYTES = orig
    return times
from distributed import Client

import flowreduce

with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as c:
    ws = sorted(c.scheduler_info(n_workers=-1)["workers"])
    n = int(float(sys.argv[1])); reps = int(sys.argv[2]); configs = sys.argv[3].split(";")
    res = c.gather(flowreduce.spmd(c, _rank, ranks=len(ws), workers=ws, timeout=300, n=n, configs=configs, reps=reps))
    for cfg in configs:
        per = [max(r[cfg][i] for r in res) * 1e3 for i in range(reps)]
        print(f"n={n:.0e} {cfg:>36}: median {statistics.median(per):7.2f} ms  p25 {sorted(per)[len(per)//4]:7.2f}")
