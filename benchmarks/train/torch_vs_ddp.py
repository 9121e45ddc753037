"""Step time of flowreduce.torch against PyTorch DistributedDataParallel over
gloo, same model, data and ranks, in one run.

Models (``--models``):

``digits``
    the CNN of ``flowreduce train --framework torch`` (39k parameters,
    153 kB of gradients), 16 digits per rank and step;
``wide``
    an MLP 64-2560-2560-10 (6.75M parameters, ~27 MB of gradients, so
    about one DDP bucket of 25 MiB), 16 random samples per rank and step.

Each side runs ``--ranks`` processes with one thread each on this host:
DDP as ``torch.multiprocessing.spawn`` processes rendezvousing over TCP on
127.0.0.1, flowreduce as the workers of a LocalCluster. Each side runs
``--warmup`` steps, then ``--steps`` timed steps; the step time is the
wall time of the timed steps divided by their number (DDP: between two
barriers on rank 0; flowreduce: from the first timed step's submission to
the last step's completion, steps pipelined as the trainer does). The
ratio is flowreduce's over DDP's; with ``--repeat N`` the two alternate N
times per model and the medians are reported (ratios of runs side by side:
on a shared machine the load moves between runs).

Expected: a step of the small CNN is dominated by per-task scheduling
(a few ms per dependent task hop through the Dask scheduler), so
flowreduce is a few times slower than DDP there; with ~27 MB of gradients
the time goes into moving and adding bytes and the two come closer.

Example::

    python benchmarks/train/torch_vs_ddp.py --models digits,wide --steps 30 --json out.json

On the emulated network (``--netem``, as root, inside the head namespace of
``benchmarks/netem/cluster.py``, one worker per emulated host)::

    python benchmarks/netem/cluster.py --hosts 4 --workers-per-host 1 --rate 1gbit --no-nanny -- \\
        benchmarks/train/torch_vs_ddp.py --netem --rate 1gbit --models digits,wide --repeat 3

There DDP runs one process per emulated host (``ip netns exec fr-h{i}``,
rendezvous on host 0's address, gloo bound to the host's interface
``fr-eth{i}`` by ``GLOO_SOCKET_IFNAME``) and flowreduce uses the cluster's
workers through ``DASK_SCHEDULER_ADDRESS``; the bytes each side sent
through the hosts' tbf qdiscs are recorded per run (``link_mb_per_step``:
the busiest host link direction, MB per step; the whole run, setup and warm-up
included, over warm-up + timed steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch

from flowreduce.torch import digits


class Wide(torch.nn.Module):
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


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


# -- DDP ------------------------------------------------------------------------------------
def _ddp_rank(rank: int, ranks: int, port: int, model: str, warmup: int, steps: int, out: str,
              master: str = "127.0.0.1") -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=ranks)
    make, data = MODELS[model]
    torch.manual_seed(0)
    ddp = DistributedDataParallel(make())
    opt = sgd(ddp.parameters())
    batches = data(rank, ranks)
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
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": (time.perf_counter() - t0) / steps}, f)
    dist.destroy_process_group()


def run_ddp(model: str, ranks: int, warmup: int, steps: int) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ddp.json")
        mp.spawn(_ddp_rank, args=(ranks, port, model, warmup, steps, out), nprocs=ranks, join=True)
        with open(out) as f:
            return json.load(f)["seconds"]


def run_ddp_netem(model: str, ranks: int, warmup: int, steps: int, timeout: float = 1800) -> float:
    """DDP with rank ``i`` on emulated host ``i`` (``ip netns exec fr-h{i}``): this script again with
    ``--ddp-rank i``, rendezvous on host 0's address, gloo on the host's interface ``fr-eth{i}``.
    Must run in host 0's namespace (the rendezvous port is picked there)."""
    import subprocess
    import sys

    from cluster import host_ip, host_ns  # benchmarks/netem/cluster.py

    master = host_ip(0)
    with socket.socket() as s:
        s.bind((master, 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ddp.json")
        procs = []
        try:
            for i in range(ranks):
                env = {**os.environ, "GLOO_SOCKET_IFNAME": f"fr-eth{i}", "TORCH_CPP_LOG_LEVEL": "ERROR",
                       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", host_ns(i), sys.executable, os.path.abspath(__file__),
                     "--ddp-rank", str(i), "--ranks", str(ranks), "--ddp-port", str(port), "--ddp-master", master,
                     "--models", model, "--warmup", str(warmup), "--steps", str(steps), "--ddp-out", out],
                    env=env, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout
            for i, p in enumerate(procs):
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc:
                    raise RuntimeError(f"DDP rank {i} (in {host_ns(i)}) exited with rc={rc}")
        finally:
            for p in procs:  # only on failure or timeout: the ranks that are still running
                if p.poll() is None:
                    p.kill()
                    p.wait()
        with open(out) as f:
            return json.load(f)["seconds"]


def link_counters() -> dict[str, int]:
    """Bytes sent so far through each emulated host link direction's tbf qdisc (``netem_train``'s)."""
    from netem_train import qdisc_counters  # benchmarks/train/netem_train.py

    return {k: v["bytes"] for k, v in qdisc_counters().items()}


def busiest_link_mb(before: dict[str, int], steps: int) -> float:
    after = link_counters()
    return max((after[k] - before.get(k, 0) for k in after), default=0) / steps / 1e6


# -- flowreduce -------------------------------------------------------------------------------
def run_flowreduce(client: Any, model: str, algorithm: str, warmup: int, steps: int,
                   steps_per_task: int = 1) -> dict[str, float]:
    from flowreduce.torch import Trainer

    make, data = MODELS[model]
    with Trainer(client, model=make, optimizer=sgd, loss=torch.nn.functional.cross_entropy, data=data,
                 algorithm=algorithm, threads=1, steps_per_task=steps_per_task) as trainer:
        if trainer.step_graph["steps_per_task"] != steps_per_task:
            print(f"# {model}: steps are not fused here ({trainer.step_graph})", flush=True)
        trainer.train(warmup)
        t0 = time.perf_counter()
        ts = trainer.train(steps)
        seconds = (time.perf_counter() - t0) / steps
        plans = last_plans(trainer.steps[-1].tokens if trainer.steps else ())
    return {"seconds": seconds, "compute": statistics.median(t.compute for t in ts),
            "comm": statistics.median(t.comm for t in ts), "plans": plans}


def last_plans(tokens: tuple[str, ...]) -> str:
    """What one step's bucket all-reduces ran (``ALGORITHM x CHUNKS, LEVELS levels, BYTES``), from the
    schedule's record of recent calls; empty on one host (the shared-memory step has no calls)."""
    from dask.utils import format_bytes

    from flowreduce.tracing.registry import lookup

    calls = [c for c in map(lookup, tokens) if c is not None]
    return "; ".join(f"{c.plan.algorithm} x{c.plan.chunks}, {c.plan.depth} levels, {format_bytes(c.nbytes)}"
                     for c in calls)


def main(argv: list[str] | None = None) -> int:
    from distributed import Client, LocalCluster

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="digits,wide")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--algorithm", default="auto")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeat", type=int, default=1,
                   help="alternate DDP and flowreduce this many times per model and report the medians "
                        "(on a machine whose load changes, runs side by side are what compare)")
    p.add_argument("--steps-per-task", default="1",
                   help="the trainer's steps_per_task, or several (1,10): each timed against the same DDP run")
    p.add_argument("--json", default=None)
    p.add_argument("--netem", action="store_true",
                   help="run on the emulated cluster this script runs in (benchmarks/netem/cluster.py, "
                        "DASK_SCHEDULER_ADDRESS): DDP one process per emulated host, flowreduce on its workers")
    p.add_argument("--rate", default=None, help="the emulated links' rate (recorded only)")
    p.add_argument("--steps-for", default="",
                   help="per-model step counts overriding --steps, e.g. wide=10 (warm-up stays --warmup)")
    # one DDP rank of --netem, started by run_ddp_netem in an emulated host's namespace
    p.add_argument("--ddp-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ddp-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ddp-master", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ddp-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ddp_rank is not None:
        _ddp_rank(args.ddp_rank, args.ranks, args.ddp_port, args.models, args.warmup, args.steps, args.ddp_out,
                  master=args.ddp_master)
        return 0
    steps_for = {m: int(n) for m, _, n in (x.partition("=") for x in args.steps_for.split(",") if x)}
    rows = []
    with contextlib.ExitStack() as stack:
        if args.netem:
            import sys

            sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "netem")]
            client = stack.enter_context(Client(os.environ["DASK_SCHEDULER_ADDRESS"]))
            n = len(client.scheduler_info(n_workers=-1)["workers"])
            if n != args.ranks:
                p.error(f"--netem: the cluster has {n} workers, --ranks is {args.ranks} (one worker per host)")
            ddp_run = run_ddp_netem
        else:
            cluster = stack.enter_context(LocalCluster(n_workers=args.ranks, threads_per_worker=1, processes=True,
                                                       dashboard_address=None))
            client = stack.enter_context(Client(cluster))
            ddp_run = run_ddp
        fused = [int(k) for k in args.steps_per_task.split(",")]
        for model in args.models.split(","):
            steps = steps_for.get(model, args.steps)
            runs: dict[int, list[dict]] = {k: [] for k in fused}
            for _ in range(args.repeat):
                links = link_counters() if args.netem else None
                ddp = ddp_run(model, args.ranks, args.warmup, steps)
                ddp_link = busiest_link_mb(links, args.warmup + steps) if links is not None else None
                for k in fused:  # every variant against the same DDP run, back to back
                    run: dict[str, float] = {}
                    if ddp_link is not None:
                        run["ddp_link_mb_per_step"] = ddp_link
                        links = link_counters()
                    fr = run_flowreduce(client, model, args.algorithm, args.warmup, steps, k)
                    if links is not None:
                        run["flowreduce_link_mb_per_step"] = busiest_link_mb(links, args.warmup + steps)
                    runs[k].append({"ddp_ms": ddp * 1e3, "flowreduce_ms": fr["seconds"] * 1e3,
                                    "compute_ms": fr["compute"] * 1e3, "comm_ms": fr["comm"] * 1e3,
                                    "ratio": fr["seconds"] / ddp, "load": os.getloadavg()[0], **run,
                                    **({"plans": fr["plans"]} if fr["plans"] else {})})
                    print(f"# {model} steps/task {k} run {len(runs[k])}: DDP {ddp * 1e3:.1f} ms, flowreduce "
                          f"{fr['seconds'] * 1e3:.1f} ms, {runs[k][-1]['ratio']:.2f}x, load {runs[k][-1]['load']:.1f} "
                          f"{run or ''} {fr['plans']}", flush=True)
            for k in fused:
                med = {key: statistics.median(r[key] for r in runs[k]) for key in runs[k][0] if key != "plans"}
                rows.append({"model": model, "ranks": args.ranks, "algorithm": args.algorithm, "steps": steps,
                             "steps_per_task": k, "warmup": args.warmup, "netem": args.netem, "rate": args.rate,
                             **med, "runs": runs[k]})
    print(f"| model | ranks | steps per task | DDP/gloo ms/step | flowreduce.torch ms/step ({args.algorithm}) | "
          "of which compute / comm (median, slowest rank) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ranks']} | {r['steps_per_task']} | {r['ddp_ms']:.1f} | {r['flowreduce_ms']:.1f} | "
              f"{r['compute_ms']:.1f} / {r['comm_ms']:.1f} | {r['ratio']:.2f}x |")
    if args.repeat > 1:
        print("\nper run (DDP ms, flowreduce ms, ratio, 1-min load average after the pair):")
        for r in rows:
            print(f"  {r['model']} ({r['steps_per_task']} steps/task): " + "; ".join(
                f"{x['ddp_ms']:.1f} / {x['flowreduce_ms']:.1f} = {x['ratio']:.2f}x (load {x['load']:.1f})"
                for x in r["runs"]))
    if args.netem:
        print(f"\nbusiest host link direction, MB per step (median; tbf qdisc bytes, warm-up included; {args.rate}):")
        for r in rows:
            print(f"  {r['model']}: DDP {r['ddp_link_mb_per_step']:.2f}, flowreduce {r['flowreduce_link_mb_per_step']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
