"""The client side of :class:`Trainer`: data-parallel PyTorch training on a
Dask cluster, with DistributedDataParallel's semantics and flowreduce's
all-reduce.

Each rank is one worker holding one :class:`~flowreduce.torch.replica.Replica`
(model, optimizer, data) as the value of a future; nothing but scalars
(losses, timestamps) and the gradients' shapes come back to the client. A
step submits, without waiting:

1. per rank, ``accumulate`` backward tasks (forward + backward of one
   micro-batch each; gradients accumulate locally, no communication); the
   last returns the payload: every gradient, and which parameters the rank
   used;
2. ``flowreduce.allreduce(payloads, op="mean", like=template)``: fused into
   buckets of ``bucket_bytes`` (DDP's 25 MiB), last layers first, one plan per
   bucket;
3. per rank, an ``update`` task: averaged gradients into ``.grad``,
   ``optimizer.step()``, ``zero_grad(set_to_none=True)``.

At most two steps are in flight; the client waits for the older one. The
all-reduce starts after the whole backward pass (a backward pass is one
task: Dask cannot hand out a task's partial results), so the overlap of
early buckets with the rest of backward that DDP gets is not there; buckets
still overlap each other and the next step's submission.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dask
from dask.task_spec import Task, TaskRef

import flowreduce
from flowreduce.fusion import DEFAULT_BUCKET_BYTES
from flowreduce.schedule.placement import wait_on
from flowreduce.torch import replica as _replica

#: Key prefixes of the trainer's tasks: ``("torch-<phase>-<token>", step[, micro], rank)``.
PHASES = ("build", "backward", "update")


@dataclass
class StepRecord:
    """One step's futures: per rank, its update (small values: the step's
    losses and worker timestamps, see :func:`flowreduce.torch.replica.update`)."""

    step: int
    update: list[Any]
    tokens: tuple[str, ...] = ()  # the all-reduce's bucket tokens


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went, from the workers' clocks: ``seconds``
    from the previous step's last update to this one's (the first step: from
    its first backward); ``compute`` the slowest rank's backward passes plus
    update; ``comm`` the slowest rank's wait between its last backward pass
    and its update (gradient payload, all-reduce, waiting for other ranks)."""

    step: int
    loss: float
    seconds: float
    compute: float
    comm: float


@dataclass
class Trainer:
    """Data-parallel training of a PyTorch model on a Dask cluster.

    Parameters
    ----------
    client : distributed.Client
    model : callable
        ``model() -> torch.nn.Module``, run on every rank under
        ``torch.manual_seed(seed)``; rank 0's parameters are then copied to
        every rank (as DDP does).
    optimizer : callable
        ``optimizer(parameters) -> torch.optim.Optimizer``.
    loss : callable
        ``loss(output, target) -> scalar tensor``.
    data : callable
        ``data(rank, ranks) -> iterable of (inputs, target)``, run on the
        rank's worker: its shard, e.g. a ``DataLoader`` over its part of the
        data set. ``inputs`` may be a tuple (``model(*inputs)``). When it
        runs out, it is iterated again (the next epoch).
    ranks : int, optional
        How many ranks (one per worker, in :func:`flowreduce.launch.ranked_workers`
        order); default: every worker. ``workers=`` names them instead.
    accumulate : int
        Micro-batches per optimizer step (gradient accumulation: the
        gradients of all micro-batches are summed locally, then averaged
        over ranks once).
    algorithm, bucket_bytes, **options
        The all-reduce's (see :func:`flowreduce.allreduce`).
    threads : int, optional
        ``torch.set_num_threads`` on every rank's worker.
    """

    client: Any
    model: Callable[[], Any]
    optimizer: Callable[[Any], Any]
    loss: Callable[..., Any]
    data: Callable[[int, int], Any]
    ranks: int | None = None
    workers: list[str] | None = None
    accumulate: int = 1
    algorithm: str = "auto"
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    seed: int = 0
    threads: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 micro-batches per step, got {self.accumulate}")
        if self.workers is None:
            from flowreduce.launch import ranked_workers

            ws = ranked_workers(self.client)
            n = len(ws) if self.ranks is None else self.ranks
            if n > len(ws):
                raise ValueError(f"{n} ranks need {n} workers, the cluster has {len(ws)}")
            ws = ws[:n]
        else:
            ws = list(self.workers)
        # the workers and rank count as decided (typed, never None), and the fields for the caller
        self._ws: list[str] = ws
        self._p = len(ws)
        self.workers, self.ranks = ws, len(ws)
        self.token = uuid.uuid4().hex
        submit = self.client.submit
        self.replicas = [submit(_replica.build, r, self._p, self.model, self.optimizer, self.loss, self.data,
                                self.seed, self.threads, workers=[w], allow_other_workers=False, pure=False,
                                key=self.key("build", r)) for r, w in enumerate(self._ws)]
        state0 = submit(_replica.model_state, self.replicas[0], workers=[self._ws[0]], pure=False)
        # the last task of each rank: the next one depends on it, so tasks on a replica never overlap
        self._last = [submit(_replica.load_state, rep, state0, workers=[w], allow_other_workers=False, pure=False)
                      for rep, w in zip(self.replicas, self._ws)]
        self.template = submit(_after, _replica.template, self.replicas[0], self._last[0],
                               workers=[self._ws[0]], pure=False).result()
        self._inflight: list[list[Any]] = []

    def key(self, phase: str, *index: int) -> tuple:
        return (f"torch-{phase}-{self.token}", *index)

    def _on_ranks(self, tasks: dict, wanted: list) -> list:
        place = {k: self._ws[k[-1]] for k in tasks}  # every key ends with its rank
        with dask.annotate(workers=place.get, allow_other_workers=False):
            return self.client.get(tasks, wanted, sync=False)

    # -- training ------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Submit one optimizer step (``accumulate`` micro-batches per rank).
        Returns at once unless two steps are in flight (then it waits for the older)."""
        n, p, k = len(self.steps), self._p, self.accumulate
        tasks: dict = {}
        payload_keys = []
        for r in range(p):
            rep = TaskRef(self.replicas[r].key)
            prev: Any = TaskRef(self._last[r].key)
            for m in range(k):
                b = self.key("backward", n, m, r)
                tasks[b] = Task(b, _replica.backward, rep, prev, m == k - 1)
                prev = TaskRef(b)
            payload_keys.append(b)
        payloads = self._on_ranks(tasks, payload_keys)
        reduced = flowreduce.allreduce(self.client, payloads, op="mean", like=self.template,
                                       algorithm=self.algorithm, bucket_bytes=self.bucket_bytes, **self.options)
        info = flowreduce.describe(reduced)
        up = {self.key("update", n, r): Task(self.key("update", n, r), _replica.update,
                                              TaskRef(self.replicas[r].key), TaskRef(reduced[r].key))
              for r in range(p)}
        update = self._on_ranks(up, list(up))
        self._last = update
        rec = StepRecord(n, update, tuple(b.token for b in getattr(info, "buckets", (info,))))
        self.steps.append(rec)
        self._inflight.append(update)
        if len(self._inflight) > 2:
            wait_on(self.client, self._inflight.pop(0))
        return rec

    def train(self, steps: int, progress: bool = False) -> list[StepTiming]:
        """Run ``steps`` optimizer steps and return their timings."""
        first = len(self.steps)
        if progress:
            from rich.progress import track

            for _ in track(range(steps), description="training", transient=True):
                self.step()
        else:
            for _ in range(steps):
                self.step()
        self.finish()
        return self.timings()[first:]

    def finish(self) -> None:
        """Wait until every submitted step is done (raises a step's error)."""
        wait_on(self.client, self._last)
        self._inflight.clear()
        for f in self._last:
            if f.status == "error":
                f.result()

    def timings(self) -> list[StepTiming]:
        """:class:`StepTiming` of every finished step (one gather of small tuples)."""
        per_step = self.client.gather([r.update for r in self.steps])
        out, prev = [], None
        for s, ranks in enumerate(per_step):
            bw = [u["backward"] for u in ranks]
            uw = [u["update"] for u in ranks]
            end = max(u[1] for u in uw)
            start = prev if prev is not None else min(b[0][1] for b in bw)
            compute = max(sum(t1 - t0 for _, t0, t1 in bs) + (u[1] - u[0]) for bs, u in zip(bw, uw))
            comm = max(u[0] - bs[-1][2] for bs, u in zip(bw, uw))
            loss = sum(b[0] for bs in bw for b in bs) / sum(len(bs) for bs in bw)
            out.append(StepTiming(s, loss, end - start, compute, comm))
            prev = end
        return out

    # -- state ----------------------------------------------------------------------------------
    def _run(self, rank: int, fn: Callable, *args: Any) -> Any:
        """``fn(replica, *args)`` on ``rank``'s worker after its last task; the result."""
        self.finish()
        f = self.client.submit(_after, fn, self.replicas[rank], self._last[rank], *args,
                               workers=[self._ws[rank]], allow_other_workers=False, pure=False)
        return f.result()

    def evaluate(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(model)`` on rank 0's model in eval mode without gradients
        (e.g. accuracy on a test set the function loads); its result."""
        return self._run(0, _replica.evaluate, fn)

    def parameters(self, rank: int = 0) -> Any:
        """An ``OrderedDict`` of copies of rank ``rank``'s parameters."""
        return self._run(rank, _replica.parameters)

    def save(self, path: str) -> str:
        """``torch.save`` rank 0's model and optimizer ``state_dict()`` to
        ``path`` (a path on rank 0's worker: a shared file system on a real
        cluster)."""
        return self._run(0, _replica.save, path, len(self.steps))

    def load(self, path: str) -> None:
        """Load a :meth:`save` file into every rank's model and optimizer
        (every worker reads ``path``). The data iterators are not rewound."""
        self.finish()
        self._last = [self.client.submit(_after, _replica.load, rep, last, path, workers=[w],
                                         allow_other_workers=False, pure=False)
                      for rep, last, w in zip(self.replicas, self._last, self._ws)]
        self.finish()

    def close(self) -> None:
        """Drop the replicas and every future (the workers free them)."""
        self.replicas, self._last, self.steps, self._inflight = [], [], [], []

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _after(fn: Callable, replica: Any, _last: Any, *args: Any) -> Any:
    """``fn(replica, *args)``, ordered after the task whose result is ``_last``."""
    return fn(replica, *args)
