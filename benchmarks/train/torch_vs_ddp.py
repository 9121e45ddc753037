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
"""

from __future__ import annotations

import argparse
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
def _ddp_rank(rank: int, ranks: int, port: int, model: str, warmup: int, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
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


# -- flowreduce -------------------------------------------------------------------------------
def run_flowreduce(client: Any, model: str, algorithm: str, warmup: int, steps: int) -> dict[str, float]:
    from flowreduce.torch import Trainer

    make, data = MODELS[model]
    with Trainer(client, model=make, optimizer=sgd, loss=torch.nn.functional.cross_entropy, data=data,
                 algorithm=algorithm, threads=1) as trainer:
        trainer.train(warmup)
        t0 = time.perf_counter()
        ts = trainer.train(steps)
        seconds = (time.perf_counter() - t0) / steps
    return {"seconds": seconds, "compute": statistics.median(t.compute for t in ts),
            "comm": statistics.median(t.comm for t in ts)}


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
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    with LocalCluster(n_workers=args.ranks, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        for model in args.models.split(","):
            runs = []
            for _ in range(args.repeat):
                ddp = run_ddp(model, args.ranks, args.warmup, args.steps)
                fr = run_flowreduce(client, model, args.algorithm, args.warmup, args.steps)
                runs.append({"ddp_ms": ddp * 1e3, "flowreduce_ms": fr["seconds"] * 1e3,
                             "compute_ms": fr["compute"] * 1e3, "comm_ms": fr["comm"] * 1e3,
                             "ratio": fr["seconds"] / ddp, "load": os.getloadavg()[0]})
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append({"model": model, "ranks": args.ranks, "algorithm": args.algorithm, **med, "runs": runs})
    print(f"| model | ranks | DDP/gloo ms/step | flowreduce.torch ms/step ({args.algorithm}) | of which compute / comm "
          "(median, slowest rank) | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ranks']} | {r['ddp_ms']:.1f} | {r['flowreduce_ms']:.1f} | "
              f"{r['compute_ms']:.1f} / {r['comm_ms']:.1f} | {r['ratio']:.2f}x |")
    if args.repeat > 1:
        print("\nper run (DDP ms, flowreduce ms, ratio, 1-min load average after the pair):")
        for r in rows:
            print(f"  {r['model']}: " + "; ".join(f"{x['ddp_ms']:.1f} / {x['flowreduce_ms']:.1f} = {x['ratio']:.2f}x "
                                                 f"(load {x['load']:.1f})" for x in r["runs"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
