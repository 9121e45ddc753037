"""The client side of :class:`Trainer`: data-parallel PyTorch training on a
Dask cluster, with DistributedDataParallel's semantics and flowreduce's
all-reduce.

Each rank is one worker holding one :class:`~flowreduce.torch.replica.Replica`
(model, optimizer, data) as the value of a future; nothing but scalars
(losses, timestamps) and the gradients' shapes come back to the client.

On this machine Dask costs a few ms per dependent task level (more when every
worker reads every other), so a step is as few levels as the semantics
allow. Step ``k`` submits, without waiting:

1. per rank, one ``torch-step`` task: step ``k-1``'s averaged gradients into
   ``.grad`` and ``optimizer.step()`` (the update, fused in), rank 0's module
   buffers loaded (DDP's ``broadcast_buffers``), then forward and backward of
   ``accumulate`` micro-batches (no communication between them);
2. the all-reduce (mean) of the step's gradients in buckets of
   ``bucket_bytes`` (DDP's 25 MiB), last layers first:

   * every rank on one host (and ``algorithm`` ``"auto"`` or
     ``"shm-direct"``): the step task writes each bucket into shared memory
     (:mod:`flowreduce.torch.direct`). A small bucket has no task of its
     own: the next step's task reads every peer's copy in place and
     averages it itself. A large one gets one level: per worker a task
     reducing its slice over every worker's segment, read in place, whose
     finished slices the next step's task copies out. One or two dependent
     levels per step in all, and no round trip to the scheduler per step
     (the trainer knows its workers);
   * otherwise: ``flowreduce.allreduce(payloads, op="mean", like=template)``
     (placement, any algorithm, any cluster) between the step tasks.

:meth:`train` submits one task per rank for every ``steps_per_task=K``
steps instead (default 10; gradients of float16, float32 or float64): the ranks
of an SPMD job (:mod:`flowreduce.spmd`), whose tasks average each step's gradient
buckets with the job's communicator (one ``comm.allreduce`` per step and dtype: shared memory
inside a host, ``algorithm``'s plan between hosts) and broadcast rank 0's
module buffers before each step's forward, with no scheduler between the
steps. ``steps_per_task=1`` (and :meth:`step`) submits the graph above.

The first step after :meth:`finish` has no update to fuse (a
``torch-backward`` task); :meth:`finish` runs the last step's update alone
(``torch-update``). At most two steps are in flight; the client waits for
the older one.

The all-reduce starts after the whole backward pass: a backward pass is one
task (Dask cannot hand out a task's partial results, and splitting it would
cost a task level per split), so the overlap of early buckets with the rest
of backward that DDP gets is not there; buckets overlap each other, and
steps overlap their submission.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dask
from dask.task_spec import List, Task, TaskRef

import flowreduce
from flowreduce import config, keys
from flowreduce.cost import DEFAULT_MODEL
from flowreduce.errors import OptionError, WorkerLostError
from flowreduce.fusion import DEFAULT_BUCKET_BYTES
from flowreduce.schedule import hosts, routes, transport
from flowreduce.schedule import reproducible as _reproducible
from flowreduce.schedule.extension import ensure_extension
from flowreduce.schedule.placement import departed, gather_pinned, wait_for_a_while, wait_on
from flowreduce.schedule.spmd_watch import rank_key
from flowreduce.shm.host_group import Aborted, stores_ordered
from flowreduce.spmd.job import configured_timeout, directory, layout_of, run_rank
from flowreduce.spmd.layout import Layout
from flowreduce.torch import direct
from flowreduce.torch import replica as _replica

#: Optimizer steps per task by default, where they can be fused (``Trainer.steps_per_task``):
#: the scheduler's ~20-30 ms between tasks, paid once per 10 steps of ~10 ms.
STEPS_PER_TASK = 10
#: Seconds to let the other ranks' fused tasks stop after one failed, to tell the failure from theirs.
ORIGIN_SECONDS = 10.0
#: Seconds of waiting on steps with nothing finishing after which the ranks' workers are checked (a rank whose
#: worker left never finishes: Dask keeps its pinned task in ``no-worker``).
LOST_POLL_SECONDS = 2.0
#: Seconds a fused step's collective waits for its peers when ``flowreduce.timeout`` is not set.
WAIT_SECONDS = 600.0
#: Key prefixes of the trainer's tasks: ``("torch-<phase>-<token>", step, rank)``.
PHASES = ("build", "backward", "step", "update", "buffers")


@dataclass
class StepRecord:
    """One submitted step: its index and its all-reduce's bucket tokens
    (what :func:`flowreduce.trace` and ``flowreduce.describe`` know them by)."""

    step: int
    tokens: tuple[str, ...] = ()


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


def on_ranks(client: Any, workers: list[str], tasks: dict, wanted: list, ranks: dict | None = None) -> list:
    """Submit ``tasks`` (keys ending with their rank, else ``ranks[key]``),
    each pinned to its rank's worker; the futures of ``wanted``."""
    place = {k: workers[k[-1] if ranks is None else ranks[k]] for k in tasks}
    with dask.annotate(workers=place.get, allow_other_workers=False):
        return client.get(tasks, wanted, sync=False)


def rank_workers(client: Any, ranks: int | None, workers: list[str] | None) -> list[str]:
    """The workers of a trainer's ranks, in rank order: ``workers`` as
    given, else the first ``ranks`` (default: all) of the cluster's workers
    in :func:`~flowreduce.launch.ranked_workers` order."""
    if workers is not None:
        return list(workers)
    from flowreduce.launch import ranked_workers

    ws = ranked_workers(client)
    n = len(ws) if ranks is None else ranks
    if n > len(ws):
        raise ValueError(f"{n} ranks need {n} workers, the cluster has {len(ws)}")
    return ws[:n]


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
        The all-reduce's (see :func:`flowreduce.allreduce`). ``"auto"``
        with every rank on one host: the shared-memory step (see above;
        ``transport="dask"`` in the options turns it off).
        ``deterministic=True`` in the options (default: the dask config key
        ``flowreduce.deterministic``, read when the trainer is made): every
        route (shared memory, in-process, fused steps, any algorithm of
        ``flowreduce.allreduce``) averages each gradient element as
        ``flowreduce.reference_reduce(per-rank gradients, "mean",
        order="tree")``, so a run's parameters are the same bits whatever
        the algorithm and placement of a fixed rank count
        (docs/reproducibility.md). ``deterministic="exact"``: every route
        averages each element as the exact sum over ranks rounded once to
        the dtype, then divided by the rank count in the dtype
        (``flowreduce.reference_reduce(per-rank gradients, "mean")`` of
        ``deterministic="exact"``: the shared-memory step folds the ranks'
        values with :func:`flowreduce.reproducible.exact_fold`,
        ``flowreduce.allreduce`` takes the option), so the parameters are
        the same bits whatever the algorithm and placement: the average
        depends on nothing but the ranks' gradients, so an elastic run
        (:class:`~flowreduce.torch.elastic.ElasticTrainer`) that loses a
        rank goes on with the bits of a run that had the smaller rank count
        from that step, on any route. Float32 and float64
        parameters only (float16 and bfloat16 ones:
        :class:`~flowreduce.errors.OptionError` when the trainer is made).
    threads : int, optional
        ``torch.set_num_threads`` on every rank's worker.
    steps_per_task : int, optional
        :meth:`train` runs this many optimizer steps in one task per rank,
        the ranks of an SPMD job averaging each step's gradients with its
        communicator (:meth:`flowreduce.spmd.comm.Communicator.allreduce`:
        shared memory inside a host, ``algorithm``'s plan between hosts'
        leaders, ``deterministic`` as given) and broadcasting rank 0's
        module buffers (:meth:`~flowreduce.spmd.comm.Communicator.broadcast`),
        with no scheduler round trip between the steps. Default:
        :data:`STEPS_PER_TASK` where steps can be fused (gradients of
        float16, float32 or float64, mixed or not), else 1; ``1``: every step a task of its own on Dask's task
        stream, through the step graph above. :attr:`step_graph` says what runs.
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
    steps_per_task: int | None = None
    steps: list[StepRecord] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 micro-batches per step, got {self.accumulate}")
        if self.steps_per_task is not None and self.steps_per_task < 1:
            raise ValueError(f"steps_per_task must be >= 1, got {self.steps_per_task}")
        asked = self.options.get("deterministic")
        #: ``deterministic`` (False, True or "exact"), as decided when the trainer was made (the config may
        #: change later)
        self._mode: bool | str = _reproducible.mode(config.get("deterministic") if asked is None else asked)
        ws = rank_workers(self.client, self.ranks, self.workers)
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
        described = submit(_after, _replica.describe, self.replicas[0], self._last[0], workers=[self._ws[0]],
                           allow_other_workers=False, pure=False)
        try:  # every rank's replica is built (a rank's worker leaving raises, naming it, rather than waiting forever)
            [(self.template, nbuffers), *_] = gather_pinned(self.client, [described, *self._last],
                                                            [self._ws[0], *self._ws], "building the trainer's replicas")
        except BaseException:
            self.close()
            raise
        if self._mode == "exact":
            refused = exact_refused(self.template)
            if refused is not None:
                self.close()
                raise OptionError(f"deterministic='exact' averages float32 and float64 gradients; got {refused} "
                                  "(float16 and bfloat16 sums would be rounded twice): pass deterministic=True "
                                  "(the same bits for any algorithm and placement of a fixed rank count) or "
                                  "train in float32")
        self._broadcasts = nbuffers > 0 and self._p > 1
        self._flat = self._direct_layout()
        #: how a fused step packs its gradients into the one vector its communicator averages: the
        #: shared-memory step's layout, else the same packing with no shared memory (None: a dtype numpy lacks, bfloat16)
        self._packing = self._flat or self._packing_of()
        self._reduced: list | None = None  # the last submitted step's all-reduce, not applied yet
        self._buffers: Any = None  # rank 0's module buffers after its last forward
        self._inflight: list[list[Any]] = []

    def _direct_layout(self) -> direct.Flat | None:
        """The shared-memory step's layout, when it applies: every rank on
        its own worker, one gradient dtype, an ``algorithm`` that lets
        flowreduce choose (``auto``: the step graph is one or two task
        levels, every plan through ``flowreduce.allreduce`` more), and the
        ``shm-direct`` route applying to the ranks' workers
        (:data:`flowreduce.schedule.routes.SHM_DIRECT_ROUTE`, the registry's
        check: one host, or one process).

        The step is that route's collective fused into the training step's
        tasks (each rank averages its gradients in the task that computed
        them), not a graph :func:`flowreduce.schedule.routes.choose` could
        price against others: the gradients never exist as futures (a
        route's ``Lowering`` starts from them), and the alternative, a
        pytree ``flowreduce.allreduce`` per step, is bucketed and chooses a
        plan per bucket, not a route. So ``auto`` takes this step wherever
        the route applies."""
        how = self.options.get("transport", "auto")
        transport.check(how)
        if self.algorithm not in ("auto", routes.SHM_DIRECT) or len(set(self._ws)) < self._p:
            return None
        domains = transport.memory_domains(self._ws, hosts.worker_places(self.client, self._ws), how)
        site = routes.Site(tuple(self._ws), tuple(domains), [], DEFAULT_MODEL, 0)
        shared = routes.shm_direct_plan(self._p, self._ws)
        if not routes.SHM_DIRECT_ROUTE.applies(shared, site) or not direct.supports(self._specs):
            return None
        share = self._p > 1 and domains[0] != transport.IN_PROCESS
        if share:
            # the pool; and the active memory manager must not drop a shared-memory block from its own worker,
            # where its lease lives, and keep a peer's copy (a handle): the guard's policy keeps it there
            ensure_extension(self.client)
        return self._flat_of(share)

    @property
    def _specs(self) -> list:
        """Every gradient's spec, then the ``used`` flags': what a step averages."""
        return [*self.template["grads"].values(), self.template["used"]]

    def _flat_of(self, share: bool) -> direct.Flat:
        return direct.Flat.of(self._specs, self.bucket_bytes, self._p, share, self._mode is True,
                              self._mode == "exact")

    def _packing_of(self) -> direct.Flat | None:
        return self._flat_of(False) if direct.packs(self._specs) else None

    @property
    def latest_tasks(self) -> list[Any]:
        """Per rank, the future of its latest task (a step, or a block of fused steps): where a failed
        :meth:`train` left each rank."""
        return list(self._last)

    @property
    def step_graph(self) -> dict[str, Any]:
        """How a step averages gradients: ``{"all-reduce": "shared memory"
        | "in-process" | "flowreduce.allreduce", "levels": per bucket, 1 (averaged in
        the step tasks) or 2 (a reduce level); None for flowreduce.allreduce,
        "steps_per_task": how many steps :meth:`train` runs in one task}``."""
        fused = self._block() if self._can_fuse() else 1
        if self._flat is None:
            return {"all-reduce": "flowreduce.allreduce", "levels": None, "steps_per_task": fused}
        return {"all-reduce": "shared memory" if self._flat.share else "in-process", "levels": self._flat.levels,
                "steps_per_task": fused}

    def _can_fuse(self) -> bool:
        """Whether steps can be fused into SPMD jobs: the gradients pack into flat numpy vectors, one
        per dtype (:attr:`_packing`). Any algorithm, placement and module buffers: the job's communicator
        averages each step's vector and broadcasts rank 0's buffers."""
        return self._packing is not None

    def _block(self, asked: int | None = None) -> int:
        """Steps per task asked for (by :meth:`train`, else the trainer), or the default."""
        for k in (asked, self.steps_per_task):
            if k is not None:
                return k
        return STEPS_PER_TASK

    def key(self, phase: str, *index: int) -> tuple:
        return (f"torch-{phase}-{self.token}", *index)

    def _on_ranks(self, tasks: dict, wanted: list, ranks: dict | None = None) -> list:
        return on_ranks(self.client, self._ws, tasks, wanted, ranks)

    # -- training ------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Submit one optimizer step (``accumulate`` micro-batches per rank).
        Returns at once unless two steps are in flight (then it waits for the older)."""
        n, p = len(self.steps), self._p
        phase = "backward" if self._reduced is None else "step"  # with the previous step's update fused in
        step_keys = [self.key(phase, n, r) for r in range(p)]
        buffers = TaskRef(self._buffers.key) if self._buffers is not None else None
        tasks: dict = {}
        if self._flat is not None:
            flat = self._flat
            tokens = tuple(keys.new_token() for _ in flat.buckets)
            written, slices = self._pending_direct()
            for r, k in enumerate(step_keys):
                tasks[k] = Task(k, _replica.step_direct, TaskRef(self.replicas[r].key), TaskRef(self._last[r].key),
                                written, slices, buffers, self.accumulate, flat, tokens, r == 0 and self._broadcasts,
                                repr(k))
            reduce_keys = []
            for b in flat.scattered:
                per_worker = []
                for g, (lo, hi) in enumerate(flat.bounds(b)):
                    k = keys.node_key(routes.SHM_DIRECT, "reduce-scatter", tokens[b], 2, g, 0, g)  # ends with its rank
                    if flat.ordered:  # every rank's segment in rank order, summed in the reference tree's, or exactly
                        tasks[k] = Task(k, direct.reduce_bucket_ordered, p, b, lo, hi,
                                        List(*(TaskRef(s) for s in step_keys)), g, repr(k), flat.exact)
                    else:
                        order = [step_keys[g]] + [s for j, s in enumerate(step_keys) if j != g]  # its own first
                        tasks[k] = Task(k, direct.reduce_bucket, p, b, lo, hi, List(*(TaskRef(s) for s in order)),
                                        repr(k))
                    per_worker.append(k)
                reduce_keys.append(per_worker)
            wanted = step_keys + [k for ks in reduce_keys for k in ks]
            futures = dict(zip(wanted, self._on_ranks(tasks, wanted)))
            # what the next step reads: every rank's buckets, and every worker's slices of the two-level ones
            self._last = [futures[k] for k in step_keys]
            self._reduced = [self._last, [[futures[k] for k in ks] for ks in reduce_keys]]
            waits = [futures[k] for k in wanted]
            if self._broadcasts:
                self._buffers = futures[step_keys[0]]
        else:
            reduced = self._reduced
            for r, k in enumerate(step_keys):
                tasks[k] = Task(k, _replica.step_payload, TaskRef(self.replicas[r].key), TaskRef(self._last[r].key),
                                TaskRef(reduced[r].key) if reduced is not None else None, buffers, self.accumulate)
            wanted = list(step_keys)
            if self._broadcasts:
                wanted.append(self._buffers_task(tasks, n, step_keys[0]))
            futures = dict(zip(wanted, self._on_ranks(tasks, wanted)))
            options = {**self.options, "deterministic": self._mode}  # as decided when the trainer was made
            out = flowreduce.allreduce(self.client, [futures[k] for k in step_keys], op="mean", like=self.template,
                                       algorithm=self.algorithm, bucket_bytes=self.bucket_bytes, **options)
            info = flowreduce.describe(out)
            tokens = tuple(b.token for b in getattr(info, "buckets", (info,)))
            self._reduced = waits = list(out)
            self._last = [futures[k] for k in step_keys]
            if self._broadcasts:
                self._buffers = self._last[0] = futures[wanted[-1]]  # rank 0's next task runs after the copy
        rec = StepRecord(n, tokens)
        self.steps.append(rec)
        self._inflight.append(waits)
        if len(self._inflight) > 2:
            wait_on(self.client, self._inflight.pop(0))
        return rec

    def _buffers_task(self, tasks: dict, n: int, after: Any) -> tuple:
        """Rank 0's module buffers copied after its step ``n`` (the next step's broadcast)."""
        k = self.key("buffers", n, 0)
        tasks[k] = Task(k, _replica.buffers, TaskRef(self.replicas[0].key), TaskRef(after))
        return k

    def _pending_direct(self) -> tuple[Any, Any]:
        """The pending all-reduce as task arguments (shared memory): every
        rank's last step, and per two-level bucket every worker's slice."""
        if self._reduced is None:
            return None, List()
        steps, slices = self._reduced
        return (List(*(TaskRef(f.key) for f in steps)),
                List(*(List(*(TaskRef(f.key) for f in per_worker)) for per_worker in slices)))

    def train(self, steps: int, progress: bool = False, steps_per_task: int | None = None) -> list[StepTiming]:
        """Run ``steps`` optimizer steps and return their timings (in tasks
        of ``steps_per_task`` steps, this call's or the trainer's, when they can be fused)."""
        first = len(self.steps)
        size = self._block(steps_per_task)
        fused = size > 1 and self._can_fuse()
        size = size if fused else 1
        blocks = [min(size, steps - done) for done in range(0, steps, size)]
        run = self.steps_fused if fused else (lambda count: self.step())
        if progress:
            from rich.progress import track

            for count in track(blocks, description="training", transient=True):
                run(count)
        else:
            for count in blocks:
                run(count)
        self.finish()
        return self.timings()[first:]

    def steps_fused(self, count: int) -> list[StepRecord]:
        """Submit ``count`` optimizer steps as one task per rank (see
        ``steps_per_task``); returns at once unless two blocks are in flight."""
        if not self._can_fuse():
            raise ValueError(f"these steps cannot be fused: {self.step_graph}")
        n = len(self.steps)
        ensure_extension(self.client)
        if self._flat is None:  # a pending update of flowreduce.allreduce's step runs first, in a task of its own
            self._submit_update()
        layout = self._block_layout(n)
        written, slices = self._pending_direct()
        tasks, ranks = {}, {}
        for r in range(self._p):
            k = rank_key(layout.run, r)
            # run_rank leaves the worker's thread pool at once: a rank waiting for its peers never holds
            # the slot a task queued on its worker needs
            tasks[k] = Task(k, run_rank, layout, r, _replica.steps_fused, {}, TaskRef(self.replicas[r].key),
                            TaskRef(self._last[r].key), written, slices, self.accumulate, self._packing, count,
                            self._mode, self._broadcasts, self.algorithm, repr(k))
            ranks[k] = r
        self._last = self._on_ranks(tasks, list(tasks), ranks)
        self._reduced = None
        if self._broadcasts:  # a later step() broadcasts rank 0's buffers as they are after the block
            self._buffers = self.client.submit(_after, _replica.buffers if self._flat is None else _replica.buffers_last,
                                               self.replicas[0], self._last[0], workers=[self._ws[0]],
                                               allow_other_workers=False, pure=False)
        recs = [StepRecord(n + i) for i in range(count)]
        self.steps.extend(recs)
        self._inflight.append(list(self._last))
        if len(self._inflight) > 2:
            # a rank that fails fails its peers' collectives: the wait ends
            self._raise_first(self._inflight.pop(0))
        return recs

    def _block_layout(self, first: int) -> Layout:
        """The peer table of the SPMD job running the block of fused steps from step ``first``: every
        rank on its worker, all in one host group (the trainer fuses steps only on one host with shared
        memory, so the averages are in rank order, the bits of one step per task), the collectives'
        timeout ``flowreduce.timeout`` (:data:`WAIT_SECONDS` when unset)."""
        timeout = configured_timeout(None) or WAIT_SECONDS
        job = f"torch-steps-{self.token}-{first}"
        if self._flat is not None and stores_ordered():  # the communicator's shared memory needs ordered stores
            return Layout(job, 0, tuple(self._ws), (0,) * self._p, timeout, directory=directory())
        with dask.config.set(self._spmd_transport()):
            return layout_of(self.client, job, 0, self._ws, timeout)

    def _spmd_transport(self) -> dict:
        """The trainer's ``transport`` option as the SPMD job's (``"dask"``: no shared memory)."""
        return {"flowreduce.spmd.transport": "dask"} if self.options.get("transport") == "dask" else {}

    def _raise_first(self, futures: list) -> None:
        """Wait until ``futures`` are all done or one failed; raise the first failure: the origin
        of a failed block of fused steps, not the peers it failed (:class:`~flowreduce.shm.host_group.Aborted`),
        and a rank whose worker left as :class:`~flowreduce.errors.WorkerLostError`."""
        pending = list(futures)
        while pending:
            waited = wait_for_a_while(self.client, pending, LOST_POLL_SECONDS, return_when="FIRST_COMPLETED")
            # nothing ended for a while: a rank's worker may have left, its task never will
            done = set() if waited is None else waited.done
            if not done or any(f.status == "error" for f in done):
                left = departed(self.client, self._ws)
                lost = [r for r, w in enumerate(self._ws) if w in left]
                if not done and not lost:
                    continue
                if not lost:  # fused ranks stop within moments of a failing peer: raise the failure, not theirs
                    wait_for_a_while(self.client, futures, ORIGIN_SECONDS)
                failed = [f for f in futures if f.status == "error"]
                origin = next((f for f in failed if not isinstance(f.exception(), Aborted)), None)
                if origin is not None:
                    origin.result()
                if lost:  # a lost rank's task never ends (its replica went with its worker)
                    stopped = f"; the other ranks stopped: {failed[0].exception()}" if failed else ""
                    raise WorkerLostError(
                        f"rank {', '.join(map(str, lost))} of the trainer died during its steps (worker "
                        f"{', '.join(self._ws[r] for r in lost)} left the cluster){stopped}")
                failed[0].result()
            pending = [f for f in pending if f not in done]

    def finish(self) -> None:
        """Apply the last submitted step's update and wait until every
        submitted step is done (raises a step's error)."""
        self._submit_update()
        self._inflight.clear()
        self._raise_first(self._last)

    def _submit_update(self) -> None:
        """Submit the last submitted step's update (if its all-reduce is pending), without waiting."""
        if self._reduced is not None:
            n = len(self.steps) - 1
            update_keys = [self.key("update", n, r) for r in range(self._p)]
            tasks = {}
            for r, k in enumerate(update_keys):
                rep, last = TaskRef(self.replicas[r].key), TaskRef(self._last[r].key)
                if self._flat is not None:
                    tasks[k] = Task(k, _replica.update_direct, rep, last, *self._pending_direct(), self._flat, repr(k))
                else:
                    tasks[k] = Task(k, _replica.update_payload, rep, last, TaskRef(self._reduced[r].key))
            self._last = self._on_ranks(tasks, update_keys)
            self._reduced = None

    def timings(self) -> list[StepTiming]:
        """:class:`StepTiming` of every finished step (one gather of each rank's log of small tuples)."""
        logs = [self._run(r, _replica.log, wait=False) for r in range(self._p)]
        per_step = list(zip(*gather_pinned(self.client, logs, self._ws, "the trainer's step logs")))
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
    def _run(self, rank: int, fn: Callable, *args: Any, wait: bool = True) -> Any:
        """``fn(replica, *args)`` on ``rank``'s worker after its last task
        (every submitted step finished first); its result (a future if not ``wait``)."""
        self.finish()
        f = self.client.submit(_after, fn, self.replicas[rank], self._last[rank], *args,
                               workers=[self._ws[rank]], allow_other_workers=False, pure=False)
        return gather_pinned(self.client, [f], [self._ws[rank]], f"rank {rank} of the trainer")[0] if wait else f

    def evaluate(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(model)`` on rank 0's model in eval mode without gradients
        (e.g. accuracy on a test set the function loads); its result."""
        return self._run(0, _replica.evaluate, fn)

    def parameters(self, rank: int = 0) -> Any:
        """An ``OrderedDict`` of copies of rank ``rank``'s parameters."""
        return self._run(rank, _replica.parameters)

    def buffers(self, rank: int = 0) -> Any:
        """An ``OrderedDict`` of copies of rank ``rank``'s module buffers
        (BatchNorm's running statistics: rank 0's of the step before, then
        updated by this rank's own last forward, as with DDP)."""
        return self._run(rank, _replica.named_buffers)

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
        self._buffers = None  # every rank loaded the same buffers
        self.finish()

    def close(self) -> None:
        """Drop the replicas and every future (the workers free them)."""
        self.replicas, self._last, self.steps, self._inflight = [], [], [], []
        self._reduced = self._buffers = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def exact_refused(template: dict) -> str | None:
    """What of a gradient template (:func:`flowreduce.torch.replica.template`)
    ``deterministic="exact"`` cannot average, or None: float tensors other
    than float32 and float64 (a bfloat16 tensor is reduced as float32 and
    would be rounded twice)."""
    import numpy as np

    from flowreduce.reproducible import supported

    for name, spec in [*template["grads"].items(), ("used", template["used"])]:
        dtype = np.dtype(spec.dtype)
        native = getattr(spec.native, "dtype", None)
        if dtype.kind in "fc" and (not supported(dtype) or (native is not None and native != dtype.name)):
            return f"{name!r} of {spec}"
    return None


def _after(fn: Callable, replica: Any, _last: Any, *args: Any) -> Any:
    """``fn(replica, *args)``, ordered after the task whose result is ``_last``."""
    return fn(replica, *args)
