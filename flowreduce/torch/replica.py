"""What runs on a rank's worker: one model replica, its optimizer and its
data, kept in worker memory across steps as the value of one future, and
the tasks that drive it (each pinned to the rank's worker and ordered by
its dependencies, so the replica is only ever touched by one task at a time).

A step is ``backward`` once per micro-batch (forward, loss, ``.backward()``;
gradients accumulate in ``.grad`` as in plain PyTorch, so the steps of
gradient accumulation need no communication; the last one returns the
payload the all-reduce averages), then ``update`` (the averaged gradients
into ``.grad``, ``optimizer.step()``, ``zero_grad``; it returns the step's
losses and timestamps, so nothing else of a step comes back).

Unused parameters follow DistributedDataParallel with
``find_unused_parameters=True``: a parameter a rank did not use (its
``.grad`` is still None after the backward passes) contributes zeros to the
average and a 0 to the ``used`` count; a parameter no rank used keeps
``.grad = None``, so the optimizer skips it (no momentum, no weight decay);
one used by some ranks gets the average over all ranks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from dask.sizeof import sizeof


@dataclass
class Replica:
    """A rank's model, optimizer, loss and batches, in its worker's memory."""

    rank: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[..., torch.Tensor]
    batches: Any
    epoch: int = 0
    #: this step's micro-batches so far: (loss, start, stop) each
    stats: list[tuple[float, float, float]] = field(default_factory=list)
    _it: Iterator | None = field(default=None, repr=False)

    def names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def next_batch(self) -> Any:
        """The next batch of this rank's data; a new pass (epoch) when it runs out."""
        if self._it is None:
            self._it = iter(self.batches)
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self._it = iter(self.batches)
            return next(self._it)


@sizeof.register(torch.Tensor)
def _sizeof_tensor(t: torch.Tensor) -> int:  # dask counts ~80 bytes otherwise: a step's gradients would weigh nothing
    return t.numel() * t.element_size()


@sizeof.register(Replica)
def _sizeof_replica(r: Replica) -> int:  # dask's memory accounting: the parameters (optimizer state aside)
    return sum(p.numel() * p.element_size() for p in r.model.parameters())


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def build(rank: int, ranks: int, make_model: Callable, make_optimizer: Callable, loss: Callable,
          data: Callable, seed: int, threads: int | None) -> Replica:
    """Rank ``rank``'s replica, built on its worker. The model is built under
    ``torch.manual_seed(seed)`` on every rank; :func:`load_state` then makes
    every replica rank 0's, as DDP broadcasts rank 0's parameters."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    return Replica(rank, model, optimizer, loss, data(rank, ranks))


def model_state(replica: Replica) -> dict:
    return replica.model.state_dict()


def load_state(replica: Replica, state: dict) -> int:
    replica.model.load_state_dict(state)
    return replica.rank


def template(replica: Replica) -> dict:
    """Shapes and dtypes of :func:`gradients`' payload (the all-reduce's ``like=``)."""
    from flowreduce.pytree import spec_of

    return {"grads": OrderedDict((n, spec_of(p)) for n, p in zip(replica.names(), replica.params())),
            "used": spec_of(_used(replica.params()))}


def _used(params: list, flags: Any = None) -> torch.Tensor:
    """Which parameters a rank used, as 0/1 in the first parameter's dtype:
    the flags join the gradients' bucket (one all-reduce per step, not two);
    their mean is > 0 exactly when some rank used the parameter."""
    dtype = params[0].dtype if params else torch.float32
    return torch.tensor(flags if flags is not None else [0] * len(params), dtype=dtype)


def backward(replica: Replica, after: Any = None, last: bool = True) -> dict | None:
    """One micro-batch: forward, loss, backward (``after``: the previous
    task of this rank, only to order them). The last micro-batch of a step
    returns :func:`gradients`, the payload of the step's all-reduce."""
    t0 = time.time()
    replica.model.train()
    inputs, target = replica.next_batch()
    loss = replica.loss(_call(replica.model, inputs), target)
    loss.backward()
    replica.stats.append((float(loss.detach()), t0, time.time()))
    return gradients(replica) if last else None


def gradients(replica: Replica) -> dict:
    """The payload of the step's all-reduce: every parameter's accumulated
    gradient (zeros where this rank did not use it) in registration order,
    and which parameters it used. The gradients are the ``.grad`` tensors
    themselves: the all-reduce reads them as numpy views."""
    params = replica.params()
    grads = OrderedDict((n, p.grad if p.grad is not None else torch.zeros_like(p))
                        for n, p in zip(replica.names(), params))
    return {"grads": grads, "used": _used(params, [p.grad is not None for p in params])}


def update(replica: Replica, reduced: dict) -> dict:
    """The averaged gradients into ``.grad`` (None where no rank used the
    parameter), one optimizer step, gradients cleared. Returns the step's
    ``backward`` stats (loss, start, stop per micro-batch) and ``update``
    (start, stop)."""
    t0 = time.time()
    used = reduced["used"]
    for p, g, u in zip(replica.params(), reduced["grads"].values(), used.tolist()):
        p.grad = g.view_as(p) if u > 0 else None
    replica.optimizer.step()
    replica.optimizer.zero_grad(set_to_none=True)
    stats, replica.stats = replica.stats, []
    return {"backward": stats, "update": (t0, time.time())}


def evaluate(replica: Replica, fn: Callable[[torch.nn.Module], Any]) -> Any:
    replica.model.eval()
    with torch.no_grad():
        return fn(replica.model)


def parameters(replica: Replica) -> OrderedDict:
    """Copies of the parameters (for comparing ranks)."""
    return OrderedDict((n, p.detach().clone()) for n, p in replica.model.named_parameters())


def save(replica: Replica, path: str, step: int) -> str:
    torch.save({"model": replica.model.state_dict(), "optimizer": replica.optimizer.state_dict(), "step": step,
                "epoch": replica.epoch}, path)
    return path


def load(replica: Replica, path: str) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)
    replica.model.load_state_dict(state["model"])
    replica.optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
