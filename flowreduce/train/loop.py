"""Data-parallel training on a Dask cluster, one gradient all-reduce per step.

Every rank is one worker. Its data shard, its weights and momentum buffers
(``state``) live there as futures and never pass through the client. Each
step is three submissions, none of which waits:

1. the rank's forward pass and per-layer backward tasks (last layer first),
   one graph for all ranks, every task pinned to its rank's worker;
2. ``flowreduce.allreduce(..., op="mean", like=template)`` over the
   gradients: with overlap (default) a list of per-layer futures, so each
   bucket of the last layers' gradients is reduced while the earlier layers'
   backward tasks still run; without (``overlap=False``) one future per rank
   that gathers the whole gradient after the backward pass;
3. the SGD-with-momentum update per rank, from the reduced gradients.

At most two steps are in flight. Step times come from when the client
learns that each step's new weights exist (done callbacks); the split into
computation and communication from the scheduler's task stream
(:mod:`flowreduce.train.timing`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dask
from dask.task_spec import List, Task, TaskRef

import flowreduce
from flowreduce.pytree import spec
from flowreduce.schedule.placement import gather_pinned, wait_on
from flowreduce.train import data, elastic, mlp
from flowreduce.train.config import TrainConfig
from flowreduce.train.reference import CLASSES, INPUTS

#: Key prefixes of the training tasks (the task stream groups by them).
PHASES = ("forward", "grad", "delta", "gather", "update")


def forward_step(state: dict, shard: tuple, seed: int, epoch: int, rank: int, step: int, batch: int) -> dict:
    X, y = shard
    idx = data.batch_indices(seed, epoch, rank, step, len(y), batch)
    return mlp.forward(state["params"], X[idx], y[idx])


def grad_step(cache: dict, delta: Any, layer: int, delay: float) -> dict:
    if delay:
        time.sleep(delay)  # the straggler: this rank's backward starts late
    return mlp.layer_grad(cache, delta, layer)


def delta_step(cache: dict, state: dict, delta: Any, layer: int, after: Any = None) -> Any:
    """``after``: the last layer's gradient, only to order the backward pass
    as autograd does (so a straggler's delay comes before all of it)."""
    return mlp.backprop(cache, state["params"], delta, layer)


def gather_grads(*grads: dict) -> list[dict]:
    return list(grads)


def update_step(state: dict, grads: list, lr: float, momentum: float) -> dict:
    return mlp.sgd_momentum(state, list(grads), lr, momentum)


def eval_step(state: dict, sets: dict) -> dict[str, float]:
    out = {}
    for name, (X, y) in sets.items():
        out[f"{name}_loss"], out[f"{name}_acc"] = mlp.evaluate(state["params"], X, y)
    return out


@dataclass
class StepRecord:
    """One step as the client saw it."""

    step: int
    epoch: int
    submitted: float  # perf_counter when its first task was submitted
    done: float = 0.0  # when the client learnt that every rank's new weights exist
    tokens: tuple[str, ...] = ()  # the all-reduce's bucket tokens
    ranks: int = 0  # how many ranks ran it
    failed: bool = False  # abandoned: a rank's worker left during it (elastic runs re-run it)
    _pending: int = 0


@dataclass
class DataParallel:
    """A data-parallel trainer on ``workers`` (one rank each).

    >>> dp = DataParallel(client, TrainConfig(ranks=4), workers)   # doctest: +SKIP
    >>> for epoch in range(dp.config.epochs): dp.run_epoch(epoch)  # doctest: +SKIP
    """

    client: Any
    config: TrainConfig
    workers: list[str]
    steps: list[StepRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        if len(self.workers) != c.ranks:
            raise ValueError(f"{c.ranks} ranks need {c.ranks} workers, got {len(self.workers)}")
        sizes = self._model()
        submit = self.client.submit
        self.shards = [submit(data.load_shard, c.seed, c.ranks, r, c.dtype, workers=[w], pure=False,
                              key=f"train-shard-{self.token}-{r}") for r, w in enumerate(self.workers)]
        self.state = [submit(mlp.init_state, sizes, c.seed, c.dtype, workers=[w], pure=False,
                             key=f"train-init-{self.token}-{r}") for r, w in enumerate(self.workers)]
        self.eval_sets = submit(data.load_eval, c.seed, c.dtype, workers=[self.workers[0]], pure=False,
                                key=f"train-evalset-{self.token}")
        self.shard_len = data.shard_size(len(data.load_digits(c.seed)[1]), c.ranks)
        self.steps_per_epoch = data.steps_per_epoch(self.shard_len, c.batch)
        if self.steps_per_epoch < 1:
            raise ValueError(f"a shard of {self.shard_len} samples holds no batch of {c.batch}")
        self._inflight: list[list[Any]] = []
        self.client.get_task_stream(start=time.time())  # installs the scheduler's task stream: timings need it

    def _model(self) -> list[int]:
        """The run's token and the model's shape; returns the layer sizes."""
        c = self.config
        self.token = uuid.uuid4().hex
        sizes = mlp.layer_sizes(INPUTS, c.hidden, CLASSES)
        self.layers = len(sizes) - 1
        # what a rank's gradient looks like: the all-reduce's template, so it never waits
        self.template = [{"W": spec((m, n), c.dtype), "b": spec(n, c.dtype)} for m, n in zip(sizes[:-1], sizes[1:])]
        return sizes

    def key(self, phase: str, *index: int) -> tuple:
        return (f"train-{phase}-{self.token}", *index)

    # -- one step ----------------------------------------------------------------------
    def step(self, epoch: int, i: int) -> StepRecord:
        """Submit step ``i`` of ``epoch``.

        Returns
        -------
        StepRecord
            Filled in (``done``) when the step's new weights exist. The call
            returns at once, unless two steps are already in flight: then it
            waits for the older one.
        """
        c = self.config
        n = len(self.steps)
        rec = StepRecord(n, epoch, time.perf_counter(), ranks=len(self.workers), _pending=len(self.workers))
        tasks: dict = {}
        place: dict = {}
        grads: list[Any] = []
        for r, w in enumerate(self.workers):
            fwd = self.key("forward", n, r)
            tasks[fwd] = self._forward_task(fwd, r, epoch, i)
            delay = c.straggler[1] if c.straggler and c.straggler[0] == r else 0.0
            delta: Any = None
            mine: list[Any] = [None] * self.layers  # the keys of the layers' gradients
            for layer in reversed(range(self.layers)):
                g = self.key("grad", n, r, layer)
                tasks[g] = Task(g, grad_step, TaskRef(fwd), delta, layer, delay if layer == self.layers - 1 else 0.0)
                mine[layer] = g
                if layer:
                    d = self.key("delta", n, r, layer)
                    after = TaskRef(g) if layer == self.layers - 1 else None
                    tasks[d] = Task(d, delta_step, TaskRef(fwd), TaskRef(self.state[r].key), delta, layer, after)
                    delta = TaskRef(d)
            if not c.overlap:
                gk = self.key("gather", n, r)
                tasks[gk] = Task(gk, gather_grads, *(TaskRef(k) for k in mine))
                mine = [gk]
            grads.append(mine)
            place.update({k: w for k in tasks if k not in place})
        wanted = [k for ks in grads for k in ks]
        with dask.annotate(workers=place.get, allow_other_workers=False):
            futs = self.client.get(tasks, wanted, sync=False)
        per_rank = [futs[r * len(grads[0]):(r + 1) * len(grads[0])] for r in range(len(self.workers))]
        if c.overlap:  # a list of per-layer futures: buckets start as their layers finish
            reduced = flowreduce.allreduce(self.client, per_rank, op="mean", like=self.template,
                                           algorithm=c.algorithm, chunks=c.chunks, bucket_bytes=c.bucket_bytes,
                                           **c.options)
        else:  # one future per rank, ready once the whole backward pass is done
            reduced = flowreduce.allreduce(self.client, [f[0] for f in per_rank], op="mean", like=self.template,
                                           algorithm=c.algorithm, chunks=c.chunks, bucket_bytes=c.bucket_bytes,
                                           **c.options)
        info = flowreduce.describe(reduced)
        rec.tokens = tuple(b.token for b in getattr(info, "buckets", (info,)))
        up_tasks, up_keys = {}, []
        for r in range(len(self.workers)):
            u = self.key("update", n, r)
            mean = List(*reduced[r]) if c.overlap else reduced[r]
            up_tasks[u] = Task(u, update_step, TaskRef(self.state[r].key), mean, c.lr, c.momentum)
            up_keys.append(u)
        with dask.annotate(workers=dict(zip(up_keys, self.workers)).get, allow_other_workers=False):
            new_state = self.client.get(up_tasks, up_keys, sync=False)
        for f in new_state:
            f.add_done_callback(_mark_done(rec))
        self.state = new_state
        self.steps.append(rec)
        self._inflight.append(new_state)
        if len(self._inflight) > 2:
            wait_on(self.client, self._inflight.pop(0))
        return rec

    def _forward_task(self, key: tuple, r: int, epoch: int, i: int) -> Task:
        """Rank ``r``'s forward pass of step ``i`` of ``epoch``, on its own shard."""
        c = self.config
        return Task(key, forward_step, TaskRef(self.state[r].key), TaskRef(self.shards[r].key),
                    c.seed, epoch, r, i, c.batch)

    def run_epoch(self, epoch: int, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        out = []
        for i in range(self.steps_per_epoch):
            out.append(self.step(epoch, i))
            if on_step is not None:
                on_step(out[-1])
        return out

    def finish(self, timeout: float = 30.0) -> None:
        """Wait for every submitted step, and for its record: the done
        callbacks run on the client's callback thread, which may be behind
        when the futures are (a record read then would have no ``done``)."""
        wait_on(self.client, self.state)
        self._inflight.clear()
        deadline = time.monotonic() + timeout
        while any(s._pending for s in self.steps) and time.monotonic() < deadline:
            time.sleep(0.002)

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the training and test sets, from rank 0's weights."""
        f = self.client.submit(eval_step, self.state[0], self.eval_sets, workers=[self.workers[0]],
                               allow_other_workers=False, pure=False, key=f"train-eval-{self.token}-{len(self.steps)}")
        return gather_pinned(self.client, [f], [self.workers[0]], "evaluating rank 0's weights")[0]

    def weights(self, rank: int = 0) -> list[dict]:
        """Rank ``rank``'s current parameters (brought to the client)."""
        f = self.client.submit(lambda s: s["params"], self.state[rank], workers=[self.workers[rank]],
                               allow_other_workers=False, pure=False)
        return gather_pinned(self.client, [f], [self.workers[rank]], f"rank {rank}'s weights")[0]


def elastic_forward_step(state: dict, train: tuple, seed: int, epoch: int, offset: int, rank: int,
                         batch: int) -> dict:
    X, y = train
    idx = data.elastic_batch(seed, epoch, offset, rank, batch, len(y))
    return mlp.forward(state["params"], X[idx], y[idx])


@dataclass
class ElasticDataParallel(DataParallel):
    """:class:`DataParallel` that survives workers leaving and grows when
    workers join (``flowreduce train --elastic``), driven by
    :func:`flowreduce.train.elastic.run`.

    Each step's global batch is the next ``ranks × batch`` samples of the
    epoch's seeded order (:func:`flowreduce.train.data.elastic_batch`), so
    the data is re-sharded over whatever ranks there are. Every step is
    waited for and committed (``epoch``, ``offset`` and each rank's state);
    a step during which a rank's worker left is abandoned and re-run from
    that commit on the survivors. A worker that joins becomes a rank at the
    next step boundary with a copy of rank 0's state (weights and momentum).

    >>> dp = ElasticDataParallel(client, TrainConfig(ranks=4, epochs=4), workers)   # doctest: +SKIP
    >>> dp.train(); dp.evaluate()                                                 # doctest: +SKIP
    """

    max_ranks: int | None = None
    min_ranks: int = 1

    def __post_init__(self) -> None:
        c = self.config
        if not self.workers:
            raise ValueError("an elastic run needs at least one worker to start on")
        sizes = self._model()
        self.membership = elastic.Membership(self.client, self.workers, self.max_ranks, self.min_ranks)
        self.workers = list(self.membership.workers)
        self.n_train = len(data.load_digits(c.seed)[1])
        if self.n_train < len(self.workers) * c.batch:
            raise ValueError(f"{len(self.workers)} ranks x {c.batch} samples exceed the {self.n_train} training samples")
        self.train_sets: dict[str, Any] = {}
        self.state = [self.client.submit(mlp.init_state, sizes, c.seed, c.dtype, workers=[w], allow_other_workers=False,
                                         pure=False, key=f"train-init-{self.token}-{r}")
                      for r, w in enumerate(self.workers)]
        self.epoch, self.offset = 0, 0
        self.committed = elastic.Committed()
        self.committed.commit(self.workers, self.state, epoch=0, offset=0)
        self._inflight = []
        self._eval_on: str | None = None
        self._place_data()
        self.client.get_task_stream(start=time.time())

    def _place_data(self) -> None:
        """The training set on every rank's worker, the evaluation sets on rank 0's."""
        c = self.config
        self.train_sets = {w: self.train_sets.get(w) or self.client.submit(
            data.load_train, c.seed, c.dtype, workers=[w], allow_other_workers=False, pure=False,
            key=f"train-set-{self.token}-{w}") for w in self.workers}
        if self._eval_on != self.workers[0]:
            self._eval_on = self.workers[0]
            self.eval_sets = self.client.submit(data.load_eval, c.seed, c.dtype, workers=[self.workers[0]],
                                                allow_other_workers=False, pure=False,
                                                key=f"train-evalset-{self.token}-{self.workers[0]}")

    def _forward_task(self, key: tuple, r: int, epoch: int, i: int) -> Task:
        c = self.config
        return Task(key, elastic_forward_step, TaskRef(self.state[r].key),
                    TaskRef(self.train_sets[self.workers[r]].key), c.seed, self.epoch, self.offset, r, c.batch)

    def _roll(self) -> None:
        """Start the next epoch when the current one has no whole global batch left."""
        if self.offset + len(self.workers) * self.config.batch > self.n_train:
            self.epoch, self.offset = self.epoch + 1, 0

    # -- what flowreduce.train.elastic.run drives --------------------------------------------
    def finished(self) -> bool:
        return self.epoch >= self.config.epochs

    def resize(self, change: elastic.Change) -> None:
        """Adopt the rank set of ``change`` at a step boundary: survivors keep
        their committed state, joining workers get a copy of rank 0's."""
        restored = self.committed.restore(change.after)
        source = next(x for x in restored if x is not None)
        n = len(self.steps)
        self.workers = list(change.after)
        self.state = [x if x is not None else elastic.replicate(self.client, source, w, f"train-join-{self.token}-{n}-{r}")
                      for r, (w, x) in enumerate(zip(self.workers, restored))]
        self._place_data()
        self.committed.commit(self.workers, self.state, epoch=self.epoch, offset=self.offset)
        self._roll()

    def submit_step(self) -> list[Any]:
        self.step(self.epoch, len(self.steps))
        return self.state

    def commit(self) -> None:
        self.offset += len(self.workers) * self.config.batch
        self.committed.commit(self.workers, self.state, epoch=self.epoch, offset=self.offset)
        self._inflight.clear()
        self._roll()

    def abandon(self, lost: elastic.StepLost) -> None:
        self.steps[-1].failed = True
        # cancelled, not just dropped: the step's done callbacks hold its futures while they are pending
        self.client.cancel(self.state)
        self.state = self.committed.restore(self.workers)
        self._inflight.clear()

    def train(self, on_step: Callable[[StepRecord], None] | None = None) -> None:
        """Train ``config.epochs`` epochs through worker losses and joins."""
        elastic.run(self, self.membership, None if on_step is None else lambda: on_step(self.steps[-1]))
        self.finish()

    def close(self) -> None:
        """Drop every future the run holds (states, data), so its keys leave the scheduler."""
        self.state, self.train_sets, self._inflight = [], {}, []
        self.committed = elastic.Committed()
        self.eval_sets = None
        self._eval_on = None

    def finish(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while any(s._pending for s in self.steps if not s.failed) and time.monotonic() < deadline:
            time.sleep(0.002)


def _mark_done(rec: StepRecord) -> Callable[[Any], None]:
    def done(_future: Any) -> None:
        rec._pending -= 1
        if rec._pending == 0:
            rec.done = time.perf_counter()

    return done
