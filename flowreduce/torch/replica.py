"""What runs on a rank's worker: one model replica, its optimizer and its
data, kept in worker memory across steps as the value of one future, and
the tasks that drive it (each pinned to the rank's worker and ordered by
its dependencies, so the replica is only ever touched by one task at a time).

A step is one task per rank: the previous step's averaged gradients into
``.grad``, ``optimizer.step()``, ``zero_grad`` (the update, fused here so
that it costs no task level of its own), rank 0's module buffers loaded (as
DDP's ``broadcast_buffers``), then forward, loss, ``.backward()`` once per
micro-batch (gradients accumulate in ``.grad`` as in plain PyTorch, so the
steps of gradient accumulation need no communication), then this step's
gradients handed to the all-reduce: as a payload for
:func:`flowreduce.allreduce` (``step_payload``) or written into shared
memory (``step_direct``, :mod:`flowreduce.torch.direct`). The last step's
update runs alone when the trainer is asked to finish (``update_*``). Each
replica logs its steps' losses and timestamps; nothing else comes back.

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

from flowreduce.torch import direct


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
    #: every applied step: {"backward": stats, "update": (start, stop)}
    log: list[dict] = field(default_factory=list)
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


def describe(replica: Replica) -> tuple[dict, int]:
    """:func:`template`, and how many module buffers the model has."""
    return template(replica), len(list(replica.model.buffers()))


def _used(params: list, flags: Any = None) -> torch.Tensor:
    """Which parameters a rank used, as 0/1 in the first parameter's dtype:
    the flags join the gradients' bucket (one all-reduce per step, not two);
    their mean is > 0 exactly when some rank used the parameter."""
    dtype = params[0].dtype if params else torch.float32
    return torch.tensor(flags if flags is not None else [0] * len(params), dtype=dtype)


def _micro_batches(replica: Replica, count: int) -> None:
    """``count`` micro-batches: forward, loss, backward; the gradients
    accumulate in ``.grad`` as in plain PyTorch (no communication)."""
    replica.model.train()
    for _ in range(count):
        t0 = time.time()
        inputs, target = replica.next_batch()
        loss = replica.loss(_call(replica.model, inputs), target)
        loss.backward()
        replica.stats.append((float(loss.detach()), t0, time.time()))


def _broadcast(replica: Replica, buffers: list[torch.Tensor] | None) -> None:
    """Rank 0's module buffers (BatchNorm's running statistics) into this
    rank's, as DDP with ``broadcast_buffers=True`` does before the first
    forward of a step."""
    if buffers is not None and replica.rank != 0:
        with torch.no_grad():
            for b, v in zip(replica.model.buffers(), buffers):
                b.copy_(v)


def buffers(replica: Replica, _after: Any = None) -> list[torch.Tensor]:
    """Copies of this rank's module buffers (run on rank 0 after its step)."""
    return [b.detach().clone() for b in replica.model.buffers()]


def buffers_last(replica: Replica, _after: Any = None) -> tuple[list[torch.Tensor]]:
    """:func:`buffers` as the last item of a tuple, where :func:`step_direct` reads rank 0's."""
    return (buffers(replica),)


def _optimizer_step(replica: Replica, grads: list, used: torch.Tensor) -> None:
    """The averaged gradients into ``.grad`` (None where no rank used the
    parameter, so momentum and weight decay skip it, as DDP), one optimizer
    step, gradients cleared."""
    for p, g, u in zip(replica.params(), grads, used.tolist()):
        p.grad = g.view_as(p) if u > 0 else None
    replica.optimizer.step()
    replica.optimizer.zero_grad(set_to_none=True)


def _apply(replica: Replica, grads: list, used: torch.Tensor, t0: float) -> None:
    """:func:`_optimizer_step`, then the step's record (its micro-batches'
    stats and the update's start and stop) logged."""
    _optimizer_step(replica, grads, used)
    stats, replica.stats = replica.stats, []
    replica.log.append({"backward": stats, "update": (t0, time.time())})


# -- a step through flowreduce.allreduce (any cluster) -----------------------------------------
def apply_payload(replica: Replica, reduced: dict | None) -> None:
    if reduced is not None:
        t0 = time.time()
        _apply(replica, list(reduced["grads"].values()), reduced["used"], t0)


def step_payload(replica: Replica, after: Any, reduced: dict | None, buffers: list | None,
                 micro: int) -> dict:
    """The previous step's update (``reduced``: its all-reduce's output),
    then ``micro`` micro-batches; returns :func:`gradients`, the payload of
    this step's all-reduce (``after``: the rank's previous task, to order them)."""
    apply_payload(replica, reduced)
    _broadcast(replica, buffers)
    _micro_batches(replica, micro)
    return gradients(replica)


def update_payload(replica: Replica, after: Any, reduced: dict) -> int:
    """The last submitted step's update alone."""
    apply_payload(replica, reduced)
    return len(replica.log)


def gradients(replica: Replica) -> dict:
    """The payload of the step's all-reduce: every parameter's accumulated
    gradient (zeros where this rank did not use it) in registration order,
    and which parameters it used. The gradients are the ``.grad`` tensors
    themselves: the all-reduce reads them as numpy views."""
    params = replica.params()
    grads = OrderedDict((n, p.grad if p.grad is not None else torch.zeros_like(p))
                        for n, p in zip(replica.names(), params))
    return {"grads": grads, "used": _used(params, [p.grad is not None for p in params])}


# -- a step through shared memory (every rank on one host) -------------------------------------
def apply_direct(replica: Replica, flat: direct.Flat, written: list | None, slices: list, key: str = "") -> None:
    if written is not None:
        t0 = time.time()
        tensors = direct.average(flat, written, slices, key)
        _apply(replica, tensors[:-1], tensors[-1], t0)


def step_direct(replica: Replica, after: Any, written: list | None, slices: list, rank0: tuple | None, micro: int,
                flat: direct.Flat, tokens: tuple[str, ...], broadcast: bool, key: str = "") -> tuple:
    """The previous step's update (``written``: every rank's previous
    :func:`step_direct`, ``slices``: every worker's reduced slice of each
    two-level bucket; read in place, see :func:`direct.average`), rank 0's
    buffers loaded (``rank0``: its last step, also after :meth:`finish`), then ``micro`` micro-batches,
    then each bucket of this step's gradients written into shared memory
    (:func:`direct.write`). Returns the buckets and, if ``broadcast``, a copy
    of this rank's buffers (rank 0's, for the next step)."""
    apply_direct(replica, flat, written, slices, key)
    _broadcast(replica, rank0[-1] if rank0 is not None else None)
    _micro_batches(replica, micro)
    params = replica.params()
    out = direct.write(flat, [p.grad for p in params] + [_used(params, [p.grad is not None for p in params])], tokens)
    return (*out, buffers(replica) if broadcast else None)


def update_direct(replica: Replica, after: Any, written: list, slices: list, flat: direct.Flat, key: str = "") -> int:
    """The last submitted step's update alone."""
    apply_direct(replica, flat, written, slices, key)
    return len(replica.log)


def steps_fused(comm: Any, replica: Replica, after: Any, written: list | None, slices: list, micro: int,
                flat: direct.Flat, count: int, deterministic: bool | str, broadcast: bool = False,
                algorithm: str = "auto", key: str = "") -> int:
    """``count`` whole optimizer steps in one task (the trainer's ``steps_per_task``), a rank of an
    SPMD job (``comm``: its :class:`~flowreduce.spmd.comm.Communicator`): a pending update first
    (as :func:`update_direct`), then per step ``micro`` micro-batches, the gradients (every bucket,
    the ``used`` flags in the first, in one vector per dtype: one collective per step for a model of
    one dtype) averaged over the ranks
    by ``comm.allreduce`` (op mean, the trainer's ``deterministic``: elementwise, so the bits of
    :func:`direct.average`; ``algorithm``: the plan between hosts) and applied; with ``broadcast``,
    rank 0's module buffers broadcast into every rank's before each step's first forward (DDP's
    ``broadcast_buffers``). The other ranks' tasks run at the same time, each on its worker; nothing
    goes through the scheduler between the steps."""
    apply_direct(replica, flat, written, slices, key)
    for _ in range(count):
        if broadcast:
            _broadcast(replica, [comm.broadcast(b.detach(), root=0) for b in replica.model.buffers()])
        _micro_batches(replica, micro)
        params = replica.params()
        grads = [p.grad for p in params] + [_used(params, [p.grad is not None for p in params])]
        tensors = direct.unpack(flat, [comm.allreduce(v, op="mean", algorithm=algorithm, deterministic=deterministic)
                                       for v in direct.pack(flat, grads)])
        _apply(replica, tensors[:-1], tensors[-1], time.time())
    return len(replica.log)


def log(replica: Replica, _after: Any = None) -> list[dict]:
    """Every applied step's record: its micro-batches (loss, start, stop)
    and its update (start, stop)."""
    return list(replica.log)


def evaluate(replica: Replica, fn: Callable[[torch.nn.Module], Any]) -> Any:
    replica.model.eval()
    with torch.no_grad():
        return fn(replica.model)


def parameters(replica: Replica) -> OrderedDict:
    """Copies of the parameters (for comparing ranks)."""
    return OrderedDict((n, p.detach().clone()) for n, p in replica.model.named_parameters())


def named_buffers(replica: Replica) -> OrderedDict:
    return OrderedDict((n, b.detach().clone()) for n, b in replica.model.named_buffers())


def save(replica: Replica, path: str, step: int) -> str:
    torch.save({"model": replica.model.state_dict(), "optimizer": replica.optimizer.state_dict(), "step": step,
                "epoch": replica.epoch}, path)
    return path


def load(replica: Replica, path: str) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)
    replica.model.load_state_dict(state["model"])
    replica.optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


# -- elastic runs (flowreduce.torch.elastic): every step makes new replicas, the committed ones stay as they were --
def build_elastic(make_model: Callable, make_optimizer: Callable, loss: Callable, seed: int,
                  threads: int | None) -> Replica:
    """The run's one initial replica (built on rank 0's worker under
    ``torch.manual_seed(seed)``; the other ranks get copies of it). It holds
    no data: an elastic run cuts each step's batches from the training set
    by (progress, rank, ranks)."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = make_model()
    return Replica(0, model, make_optimizer(model.parameters()), loss, None)


def _copy(replica: Replica) -> Replica:
    """A deep copy of the model and its optimizer together (the optimizer's
    state keyed by the copy's own parameters)."""
    import copy

    return copy.deepcopy(replica)


def grads_elastic(replica: Replica, dataset: Any, data: Any, epoch: int, offset: int, rank: int, ranks: int,
                  micro: int, threads: int | None) -> dict:
    """Rank ``rank``'s gradients of the step that starts at ``offset`` of
    ``epoch`` on ``ranks`` ranks (:func:`gradients`' payload): ``micro``
    micro-batches, micro-batch m being ``data.take(dataset, epoch, offset + m
    * ranks * data.batch, rank)``. On a copy of the replica: the committed
    replica is not touched, so an abandoned step can be re-run from it."""
    if threads:
        torch.set_num_threads(threads)
    work = _copy(replica)
    work.model.train()
    for m in range(micro):
        inputs, target = data.take(dataset, epoch, offset + m * ranks * data.batch, rank)
        work.loss(_call(work.model, inputs), target).backward()
    return gradients(work)


def update_elastic(replica: Replica, reduced: dict) -> Replica:
    """A new replica: a copy of ``replica`` after one optimizer step with
    the averaged gradients (``reduced``: the all-reduce's output)."""
    new = _copy(replica)
    _optimizer_step(new, list(reduced["grads"].values()), reduced["used"])
    return new


def state_dicts(replica: Replica) -> dict:
    """Copies of the model's and the optimizer's ``state_dict()`` (for comparing ranks)."""
    import copy

    return {"model": OrderedDict((k, v.detach().clone()) for k, v in replica.model.state_dict().items()),
            "optimizer": copy.deepcopy(replica.optimizer.state_dict())}
