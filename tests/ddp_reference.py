"""The reference run of tests/test_torch.py: real DistributedDataParallel
over gloo, one process per rank (started by the test with
``torch.multiprocessing.spawn``), and the model, data and optimizer that the
flowreduce trainer runs too. Imports torch only, so the processes start fast."""

from __future__ import annotations

import contextlib
import os

import torch

STEPS, RANKS = 20, 4


class Net(torch.nn.Module):
    """Conv, LayerNorm, a bias-free head, a block some ranks skip on some
    steps (and every rank on step 5), and a layer nobody ever uses."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.LayerNorm(4 * 8 * 8)
        self.hidden = torch.nn.Linear(4 * 8 * 8, 24)
        self.sometimes = torch.nn.Linear(24, 24)
        self.never = torch.nn.Linear(2, 2)
        self.head = torch.nn.Linear(24, 10, bias=False)

    def forward(self, x, use):
        return self.forward_from(self.conv(x), use)

    def forward_from(self, c, use):
        h = torch.relu(self.norm(c.flatten(1)))
        h = torch.relu(self.hidden(h))
        if use:
            h = h + torch.tanh(self.sometimes(h))
        return self.head(h)


class BatchNormNet(Net):
    """Net with BatchNorm after the convolution: running statistics, which
    DDP broadcasts from rank 0 before a step's first forward."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x, use):
        return super().forward_from(self.bn(self.conv(x)), use)


class MixedNet(Net):
    """Net whose head computes in float64: gradients of two dtypes, which DDP buckets apart."""

    def __init__(self):
        super().__init__()
        self.head = self.head.double()

    def forward_from(self, c, use):
        h = torch.relu(self.norm(c.flatten(1)))
        h = torch.relu(self.hidden(h))
        if use:
            h = h + torch.tanh(self.sometimes(h))
        return self.head(h.double())


class HalfNet(torch.nn.Module):
    """A bfloat16 layer under a float32 head: gradients of two torch dtypes, which the trainer
    averages in one float32 vector (bfloat16 widened, rounded back to nearest even)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 16).to(torch.bfloat16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x.to(torch.bfloat16))).float())


def half_shard(rank, ranks):
    g = torch.Generator().manual_seed(200 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(STEPS)]


MODELS = {"net": Net, "bn": BatchNormNet, "mixed": MixedNet}
#: The DDP runs: (model, micro-batches per step)
RUNS = (("net", 1), ("net", 3), ("bn", 1), ("mixed", 1))


def make_optimizer(params):
    # weight decay and momentum: a parameter given a zero gradient instead of none would move
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2)


def shard(rank, ranks, micro=1):
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(STEPS * micro):
        step = i // micro
        use = step != 5 and (rank + step) % 3 != 0
        out.append(((torch.randn(6, 1, 8, 8, generator=g), use), torch.randint(0, 10, (6,), generator=g)))
    return out


def shard_accumulating(rank, ranks):
    return shard(rank, ranks, micro=3)


def ddp_rank(rank, port, runs, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        for name, micro in runs:
            torch.manual_seed(0)
            model = DistributedDataParallel(MODELS[name](), find_unused_parameters=True)
            opt = make_optimizer(model.parameters())
            batches = iter(shard(rank, RANKS, micro))
            for _ in range(STEPS):
                for m in range(micro):
                    (x, use), y = next(batches)
                    with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                        torch.nn.functional.cross_entropy(model(x, use), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.save(model.module.state_dict(), os.path.join(out_dir, f"{name}-micro{micro}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def gloo_runs(out_dir: str) -> dict:
    """Every run of :data:`RUNS` with :func:`ddp_rank` on :data:`RANKS`
    processes (``torch.multiprocessing.spawn``, 127.0.0.1): ``{(model,
    micro-batches): [final state_dict of rank r]}``. tests/conftest.py's
    ``gloo_ddp_results`` runs it once a session for the modules comparing with it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ddp_rank, args=(port, RUNS, out_dir), nprocs=RANKS, join=True)
    return {(name, micro): [torch.load(os.path.join(out_dir, f"{name}-micro{micro}-rank{r}.pt"), weights_only=True)
                            for r in range(RANKS)] for name, micro in RUNS}

