"""Step time of unmodified DistributedDataParallel on the ``flowreduce`` torch.distributed backend
against DDP over gloo, side by side in one run (#27 item 4).

Both sides run the same rank function in the same processes: ``--ranks`` ranks of a
``flowreduce.spmd`` job on a LocalCluster of ``--ranks`` single-threaded worker processes on
this host (one rank per process, ``torch.set_num_threads(1)``). The only difference is the
line that forms the default group:

* ``flowreduce``: ``flowreduce.torch.init_process_group(comm)`` (the job's communicator:
  shared memory between the ranks of a host, no port);
* ``gloo``: ``dist.init_process_group("gloo", store=TCPStore(127.0.0.1, port))``, rank 0
  hosting the store on a free port (told to the others through the communicator, once).

Then: ``DistributedDataParallel(model)`` (default buckets, 25 MiB), SGD with momentum,
``--warmup`` steps, a barrier, ``--steps`` timed steps (forward, backward with DDP's
all-reduces, optimizer step), a barrier. Reported per side and repetition: the wall time of
the timed steps over their count on rank 0 (``step_ms``) and the median of rank 0's per-step
times (``median_step_ms``); with ``--repeat N`` the sides alternate N times (flowreduce
first, then gloo, then flowreduce ...) and the medians over repetitions and the ratio
flowreduce/gloo are printed (on a shared machine the load moves between runs: compare the
medians and the ratios of neighbouring runs, not one run).

Models (``--models``): ``digits`` (flowreduce.torch.digits.DigitsCNN, 39k parameters, 16
digits per rank and step) and ``wide`` (an MLP 64-2560-2560-10, 6.75M parameters, ~27 MB of
gradients, 16 random samples per rank and step: benchmarks/train/torch_vs_ddp.py's).

Example (the figures of benchmarks/results/ddp_backend_*)::

    python benchmarks/train/ddp_backend.py --models digits,wide --ranks 4 --steps 100 --repeat 5 \\
        --json benchmarks/results/ddp_backend_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from typing import Any

import torch

from flowreduce.torch import digits


class Wide(torch.nn.Module):
    """64-2560-2560-10 (benchmarks/train/torch_vs_ddp.py's ``wide``): ~27 MB of gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 2560), torch.nn.ReLU(), torch.nn.Linear(2560, 2560),
                                       torch.nn.ReLU(), torch.nn.Linear(2560, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def wide_data(rank: int, ranks: int) -> list:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(8)]


def digits_data(rank: int, ranks: int) -> Any:
    return digits.Shards(16)(rank, ranks)


MODELS = {"digits": (digits.DigitsCNN, digits_data), "wide": (Wide, wide_data)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(comm: Any, backend: str, model: str, warmup: int, steps: int) -> dict[str, Any]:
    """One rank: form the default group on ``backend``, then DDP steps; rank 0's timings."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import flowreduce.torch

    torch.set_num_threads(1)
    if backend == "flowreduce":
        flowreduce.torch.init_process_group(comm)
    else:
        port = int(comm.broadcast(torch.tensor([_free_port() if comm.rank == 0 else 0]), root=0)[0])
        store = dist.TCPStore("127.0.0.1", port, comm.size, is_master=comm.rank == 0)
        dist.init_process_group(backend, rank=comm.rank, world_size=comm.size, store=store)
    try:
        assert dist.get_backend() == backend
        make, data = MODELS[model]
        torch.manual_seed(0)
        ddp = DistributedDataParallel(make())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        batches = data(comm.rank, comm.size)
        it = iter(batches)

        def step() -> None:
            nonlocal it
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(batches)
                x, y = next(it)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        dist.barrier()
        times = []
        t0 = time.perf_counter()
        for _ in range(steps):
            s = time.perf_counter()
            step()
            times.append(time.perf_counter() - s)
        dist.barrier()
        wall = time.perf_counter() - t0
        # flowreduce: the time rank 0 spent inside the communicator's collectives (its events)
        inside = [e for e in getattr(comm, "events", ()) if e.start >= time.time() - wall - 1e-3]
        comm_ms = 1e3 * sum(e.stop - e.start for e in inside) / steps if backend == "flowreduce" else float("nan")
        check = torch.cat([p.detach().reshape(-1)[:4] for p in ddp.parameters()])
        gathered = [torch.empty_like(check) for _ in range(comm.size)]
        dist.all_gather(gathered, check)  # the replicas agree (DDP worked)
        assert all(torch.equal(g, check) for g in gathered), "replicas differ"
        return {"step_ms": 1e3 * wall / steps, "median_step_ms": 1e3 * statistics.median(times),
                "collective_ms": comm_ms}
    finally:
        if backend != "flowreduce":
            # ~ProcessGroupGloo joins gloo's run-loop thread, which may still want the GIL to let go
            # of its last work; destroying at once (holding the GIL) deadlocked a worker here once
            time.sleep(0.2)
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="digits,wide")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--model-steps", default="", help="per-model step counts overriding --steps, e.g. wide=30")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--backends", default="flowreduce,gloo")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from distributed import Client, LocalCluster

    import flowreduce

    per_model = dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in args.model_steps.split(",") if kv)
    backends = args.backends.split(",")
    rows: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with LocalCluster(n_workers=args.ranks, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        for model in args.models.split(","):
            steps = per_model.get(model, args.steps)
            for rep in range(args.repeat):
                for backend in backends:
                    load = os.getloadavg()[0]
                    futures = flowreduce.spmd(client, train_rank, ranks=args.ranks, backend=backend, model=model,
                                              warmup=args.warmup, steps=steps, timeout=600)
                    out = client.gather(futures)[0]  # (spmd's timeout bounds every collective)
                    row = {"model": model, "backend": backend, "repeat": rep, "steps": steps,
                           "load_before": round(load, 2), **{k: round(v, 3) for k, v in out.items()}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = []
    print(f"\n{args.ranks} ranks, one host ({platform.node()}, {os.cpu_count()} cores), torch {torch.__version__}, "
          f"{args.repeat} repetitions alternating, medians:")
    print(f"{'model':8} {'backend':11} {'step ms':>9} {'median step ms':>15}  ratio flowreduce/gloo")
    for model in args.models.split(","):
        med = {}
        for backend in backends:
            mine = [r for r in rows if r["model"] == model and r["backend"] == backend]
            med[backend] = (statistics.median(r["step_ms"] for r in mine),
                            statistics.median(r["median_step_ms"] for r in mine))
        pairs = [a["step_ms"] / b["step_ms"] for a, b in zip(
            [r for r in rows if r["model"] == model and r["backend"] == "flowreduce"],
            [r for r in rows if r["model"] == model and r["backend"] == "gloo"])]
        for backend in backends:
            ratio = f"{statistics.median(pairs):.2f} (runs side by side: " + \
                ", ".join(f"{x:.2f}" for x in pairs) + ")" if backend == "flowreduce" and pairs else ""
            print(f"{model:8} {backend:11} {med[backend][0]:9.2f} {med[backend][1]:15.2f}  {ratio}")
            summary.append({"model": model, "backend": backend, "step_ms": med[backend][0],
                            "median_step_ms": med[backend][1]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"started": started, "argv": argv if argv is not None else os.sys.argv[1:],
                       "ranks": args.ranks, "host": platform.node(), "cores": os.cpu_count(),
                       "torch": torch.__version__, "rows": rows, "medians": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
