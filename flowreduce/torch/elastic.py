"""Elastic data-parallel PyTorch training (``flowreduce train --framework
torch --elastic``, issue #15): :class:`ElasticTrainer` keeps training when a
rank's worker is lost (the survivors re-shard the data and re-run the
interrupted step) and grows when workers join (they get a copy of rank 0's
model and optimizer), driven by the framework-free membership and commit
logic of :mod:`flowreduce.train.elastic` (as the numpy trainer's
:class:`flowreduce.train.loop.ElasticDataParallel`).

What differs from :class:`flowreduce.torch.Trainer`:

* **A step never changes a committed replica.** Each rank's replica (model
  + optimizer, no data iterator) is the value of one future pinned to its
  worker. Step ``k`` is, per rank, a ``torch-grads`` task (forward and
  backward of ``accumulate`` micro-batches on a *copy* of the replica,
  returning the gradients), ``flowreduce.allreduce(op="mean")`` of them,
  and a ``torch-update`` task returning a *new* replica: a copy after
  ``optimizer.step()``. So a step is a pure function of (committed
  replicas, epoch, offset, rank set) and can be re-run from the last commit;
  the price is two copies of the model and optimizer per step and rank
  (cheap for the small models this is meant for).
* **Data by (progress, rank, ranks)**: every rank's worker holds the
  training set (``data.load()``) and rank r's micro-batch m of the step
  starting at ``offset`` of ``epoch`` is ``data.take(dataset, epoch, offset +
  m × ranks × batch, r)`` (:class:`flowreduce.torch.digits.ElasticShards`:
  the next ``ranks × batch`` samples of the epoch's seeded order). A change
  of the rank set re-cuts the rest of the epoch; there is no iterator to
  copy.
* Every step is waited for and committed (no two steps in flight), and the
  all-reduce is always ``flowreduce.allreduce`` (not the shared-memory step
  graph of the default trainer, whose segments belong to a fixed rank set).
* Module buffers (BatchNorm's running statistics) are not supported yet:
  a model with buffers is refused.

``deterministic`` (the trainer's option, else the dask config key
``flowreduce.deterministic``, read when the trainer is made) goes to every
step's ``flowreduce.allreduce``. With ``"exact"`` a step's average is the
exact sum over the ranks rounded once, divided by the rank count: it
depends on nothing but the ranks' gradients (not on the algorithm, the
placement or how the values are grouped), so a run that loses a rank goes
on with the bits of a run that had the smaller rank count from that step,
on any route (float32 and float64 parameters
only, as :class:`flowreduce.torch.Trainer`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dask.task_spec import Task, TaskRef

import flowreduce
from flowreduce import config
from flowreduce.errors import OptionError
from flowreduce.fusion import DEFAULT_BUCKET_BYTES
from flowreduce.schedule import reproducible as _reproducible
from flowreduce.schedule.placement import gather_pinned
from flowreduce.torch import replica as _replica
from flowreduce.torch.trainer import exact_refused, on_ranks, rank_workers
from flowreduce.train import elastic


class ElasticData(Protocol):
    """The data of an elastic run, sharded by (progress, rank, ranks)."""

    @property
    def batch(self) -> int:
        """Samples per rank and micro-batch."""
        ...

    def size(self) -> int:
        """Samples in the training set (asked on the client)."""
        ...

    def load(self) -> Any:
        """The training set, loaded on every rank's worker."""
        ...

    def take(self, dataset: Any, epoch: int, offset: int, rank: int) -> Any:
        """``(inputs, target)``: rank ``rank``'s batch of the global batch
        starting at ``offset`` of ``epoch``'s order."""
        ...


@dataclass
class ElasticStep:
    """One submitted step: where in the data it started, on how many ranks,
    its all-reduce's bucket tokens, and whether it was abandoned (a rank's
    worker left during it; it was re-run from the last commit)."""

    step: int
    epoch: int
    offset: int
    ranks: int
    tokens: tuple[str, ...] = ()
    failed: bool = False
    submitted: float = 0.0  # perf_counter when its first task was submitted
    seconds: float = 0.0  # from then until it was committed (0: not committed)


@dataclass
class ElasticTrainer:
    """Elastic data-parallel training of a PyTorch model on a Dask cluster.

    Parameters as :class:`flowreduce.torch.Trainer`'s, except:

    data : ElasticData
        The training set and how a step's batch is cut from it by (epoch,
        offset, rank) for the current number of ranks, e.g.
        :class:`flowreduce.torch.digits.ElasticShards`.
    epochs : int
        :meth:`train` runs until this many passes over the training set are
        done (an epoch ends when fewer than a global batch of samples are left).
    max_ranks, min_ranks : int
        Never grow past ``max_ranks`` ranks (default: every worker that
        joins); fewer than ``min_ranks`` left is an error (default 1).

    >>> t = ElasticTrainer(client, model=DigitsCNN, optimizer=SGD(), loss=cross_entropy,   # doctest: +SKIP
    ...                    data=ElasticShards(16), epochs=5, algorithm="butterfly")
    >>> t.train(); t.evaluate(Accuracy())                                                # doctest: +SKIP
    """

    client: Any
    model: Callable[[], Any]
    optimizer: Callable[[Any], Any]
    loss: Callable[..., Any]
    data: ElasticData
    epochs: int = 1
    ranks: int | None = None
    workers: list[str] | None = None
    max_ranks: int | None = None
    min_ranks: int = 1
    accumulate: int = 1
    algorithm: str = "auto"
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    seed: int = 0
    threads: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    steps: list[ElasticStep] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 micro-batches per step, got {self.accumulate}")
        asked = self.options.get("deterministic")
        #: ``deterministic`` as decided when the trainer was made (every step's all-reduce gets it)
        self._mode: bool | str = _reproducible.mode(config.get("deterministic") if asked is None else asked)
        ws = rank_workers(self.client, self.ranks, self.workers)
        self.membership = elastic.Membership(self.client, ws, self.max_ranks, self.min_ranks)
        self.workers = list(self.membership.workers)
        self.ranks = len(self.workers)
        self.n_train = self.data.size()
        if self.n_train < self._global_batch():
            raise ValueError(f"{self.ranks} ranks x {self.accumulate} x {self.data.batch} samples exceed the "
                             f"{self.n_train} training samples")
        self.token = uuid.uuid4().hex
        w0 = self.workers[0]
        first = self.client.submit(_replica.build_elastic, self.model, self.optimizer, self.loss, self.seed,
                                   self.threads, workers=[w0], allow_other_workers=False, pure=False,
                                   key=f"torch-build-{self.token}")
        described = self.client.submit(_replica.describe, first, workers=[w0], allow_other_workers=False, pure=False)
        [(self.template, nbuffers)] = gather_pinned(self.client, [described], [w0], "building rank 0's replica")
        if self._mode == "exact" and (refused := exact_refused(self.template)) is not None:
            raise OptionError(f"deterministic='exact' averages float32 and float64 gradients; got {refused} "
                              "(float16 and bfloat16 sums would be rounded twice)")
        if nbuffers:
            raise ValueError(f"the model has {nbuffers} module buffers (e.g. BatchNorm's running statistics): "
                             "elastic runs do not broadcast buffers yet")
        # as DDP broadcasts rank 0's parameters: every rank starts from a copy of one replica
        self.replicas = [first] + [elastic.replicate(self.client, first, w, f"torch-join-{self.token}-0-{r}")
                                   for r, w in enumerate(self.workers[1:], 1)]
        self.epoch, self.offset = 0, 0
        self.train_sets: dict[str, Any] = {}
        self._place_data()
        self.committed = elastic.Committed()
        self.committed.commit(self.workers, self.replicas, epoch=0, offset=0)
        self._step: list[Any] = []  # the running step's gradients and all-reduce outputs
        self._new: list[Any] = []  # its new replicas (cancelled if it is abandoned)

    def _global_batch(self) -> int:
        return len(self.workers or ()) * self.accumulate * self.data.batch

    def _place_data(self) -> None:
        """The training set on every rank's worker (kept for workers that stay)."""
        self.train_sets = {w: self.train_sets.get(w) or self.client.submit(
            self.data.load, workers=[w], allow_other_workers=False, pure=False,
            key=f"torch-trainset-{self.token}-{w}") for w in self.workers or ()}

    def _roll(self) -> None:
        """Start the next epoch when the current one has no whole global batch left."""
        if self.offset + self._global_batch() > self.n_train:
            self.epoch, self.offset = self.epoch + 1, 0

    # -- what flowreduce.train.elastic.run drives --------------------------------------------
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    def resize(self, change: elastic.Change) -> None:
        """Adopt the rank set of ``change`` at a step boundary: survivors keep
        their committed replicas, joining workers get a copy of rank 0's (model
        and optimizer state); the training set is loaded on joining workers and
        the rest of the epoch is cut for the new rank count."""
        restored = self.committed.restore(change.after)
        source = next(x for x in restored if x is not None)
        n = len(self.steps)
        self.workers = list(change.after)
        self.ranks = len(self.workers)
        self.replicas = [x if x is not None else
                         elastic.replicate(self.client, source, w, f"torch-join-{self.token}-{n}-{r}")
                         for r, (w, x) in enumerate(zip(self.workers, restored))]
        self._place_data()
        self.committed.commit(self.workers, self.replicas, epoch=self.epoch, offset=self.offset)
        self._roll()

    def submit_step(self) -> list[Any]:
        """Submit one step from the committed replicas; returns its new replicas."""
        ws = self.workers or []
        n, p = len(self.steps), len(ws)
        rec = ElasticStep(n, self.epoch, self.offset, p, submitted=time.perf_counter())
        grad_keys = [(f"torch-grads-{self.token}", n, r) for r in range(p)]
        tasks = {k: Task(k, _replica.grads_elastic, TaskRef(self.replicas[r].key),
                         TaskRef(self.train_sets[ws[r]].key), self.data, self.epoch, self.offset, r, p,
                         self.accumulate, self.threads) for r, k in enumerate(grad_keys)}
        grads = on_ranks(self.client, ws, tasks, grad_keys)
        options = {**self.options, "deterministic": self._mode}  # as decided when the trainer was made
        reduced = flowreduce.allreduce(self.client, grads, op="mean", like=self.template, algorithm=self.algorithm,
                                       bucket_bytes=self.bucket_bytes, **options)
        info = flowreduce.describe(reduced)
        rec.tokens = tuple(b.token for b in getattr(info, "buckets", (info,)))
        update_keys = [(f"torch-update-{self.token}", n, r) for r in range(p)]
        tasks = {k: Task(k, _replica.update_elastic, TaskRef(self.replicas[r].key), TaskRef(reduced[r].key))
                 for r, k in enumerate(update_keys)}
        self._new = on_ranks(self.client, ws, tasks, update_keys)
        self._step = [*grads, *reduced]
        self.steps.append(rec)
        return self._new

    def commit(self) -> None:
        self.steps[-1].seconds = time.perf_counter() - self.steps[-1].submitted
        self.offset += self._global_batch()
        self.replicas, self._new, self._step = self._new, [], []
        self.committed.commit(self.workers or [], self.replicas, epoch=self.epoch, offset=self.offset)
        self._roll()

    def abandon(self, lost: elastic.StepLost) -> None:
        self.steps[-1].failed = True
        # its new replicas cancelled (the tasks that led to them, pinned to a lost worker, would wait forever);
        # the rest of the step (gradients, the all-reduce's outputs) dropped: the all-reduce's own futures are
        # flowreduce's to release
        self.client.cancel(self._new)
        self._new, self._step = [], []
        self.replicas = self.committed.restore(self.workers or [])

    # -- the run ------------------------------------------------------------------------------
    def train(self, on_step: Callable[[ElasticStep], None] | None = None) -> None:
        """Train until ``epochs`` epochs are done, through worker losses and
        joins; ``on_step(record)`` after every committed step."""
        elastic.run(self, self.membership, None if on_step is None else lambda: on_step(self.steps[-1]))

    @property
    def committed_steps(self) -> int:
        return sum(not s.failed for s in self.steps)

    def _on(self, ranks: list[int], fn: Callable, *args: Any) -> list[Any]:
        """``fn(replica, *args)`` on each of ``ranks``' workers; the results (a rank's worker leaving raises)."""
        ws = self.workers or []
        futures = [self.client.submit(fn, self.replicas[r], *args, workers=[ws[r]], allow_other_workers=False,
                                      pure=False) for r in ranks]
        return gather_pinned(self.client, futures, [ws[r] for r in ranks], f"{fn.__name__} on ranks {ranks}")

    def evaluate(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(model)`` on rank 0's committed model in eval mode without gradients; its result."""
        return self._on([0], _replica.evaluate, fn)[0]

    def state_dicts(self) -> list[dict]:
        """Every rank's ``{"model": state_dict, "optimizer": state_dict}`` (copies, brought to the client)."""
        return self._on(list(range(len(self.replicas))), _replica.state_dicts)

    def save(self, path: str) -> str:
        """``torch.save`` rank 0's model and optimizer ``state_dict()`` (see :meth:`flowreduce.torch.Trainer.save`)."""
        return self._on([0], _replica.save, path, self.committed_steps)[0]

    def close(self) -> None:
        """Drop every future the run holds (replicas, data), so their keys leave the scheduler."""
        self.replicas, self._new, self._step, self.train_sets = [], [], [], {}
        self.committed = elastic.Committed()

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
