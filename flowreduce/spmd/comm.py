"""The communicator a rank of an SPMD job calls: ``comm.allreduce(x)`` and friends.

Built once per rank by the job (:func:`flowreduce.spmd.job.run_rank`) from
the job's :class:`~flowreduce.spmd.layout.Layout`; every collective after
that sends nothing to the scheduler and makes no task. The shape of each
collective is hierarchical:

1. inside the host group, through shared memory (:class:`~flowreduce.shm.host_group.HostGroup`;
   nothing to do for a rank alone on its host);
2. between the groups' leaders (each group's lowest rank), over Dask's comm
   worker to worker (:class:`~flowreduce.schedule.spmd_mailbox.Mailbox`): an
   all-reduce runs a plan of :mod:`flowreduce.algorithms` over the leaders
   (:func:`~flowreduce.spmd.planrun.plan_walk`; ``algorithm="auto"``: the
   one :func:`flowreduce.cost.choose` prices lowest), the other collectives
   are walks of their own, run the same way (:meth:`Communicator._between`:
   on the worker's event loop);
3. inside the group again, the leader's result to its peers.

Every collective of a job must be called by every rank of the communicator,
in the same order (as in MPI). Results are new arrays, the same bits on
every rank (each element is combined in one place, or in the same order).

``allreduce(..., deterministic=True | "exact")`` gathers every rank's input
instead (inside the host group through its shared segments, then between
the leaders) and folds it in rank order with flowreduce's reference
(:func:`flowreduce.kernels.dense.tree_fold`): the bits do not depend on the
algorithm nor on the host grouping.
"""

from __future__ import annotations

import itertools
import pickle
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

import numpy as np

from flowreduce.algorithms import ALGORITHMS
from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms.ir import Plan
from flowreduce.cost import CostModel, Link, choose, configured_model
from flowreduce.errors import FlowreduceError, InputError, InputTypeError, OptionError, raised_as
from flowreduce.kernels.dense import tree_fold
from flowreduce.ops import Op, resolve_op
from flowreduce.reproducible import supported, tree_ordered
from flowreduce.schedule.reproducible import exact_op
from flowreduce.schedule.reproducible import mode as deterministic_mode
from flowreduce.schedule.spmd_log import Event, Record
from flowreduce.schedule.spmd_log import event as as_event
from flowreduce.schedule.spmd_mailbox import Mailbox
from flowreduce.shm.host_group import Aborted, HostGroup
from flowreduce.shm.result_buffers import buffers
from flowreduce.spmd import linkprobe
from flowreduce.spmd.layout import Layout
from flowreduce.spmd.planrun import Send, Walk, plan_walk, shared, walk, walk_async

#: Events a communicator keeps (the newest).
EVENTS = 10_000
#: The least time the first collective waits: it also waits for the other ranks' tasks to start.
STARTUP_SECONDS = 60.0


def as_numpy(x: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    """``x`` as a numpy array (no copy for a numpy array or a CPU tensor) and
    the function that turns a result back into ``x``'s kind."""
    if isinstance(x, np.ndarray):
        return x, lambda a: a
    if isinstance(x, (np.generic, int, float, bool, complex)):
        return np.asarray(x), lambda a: a
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"a collective takes numpy arrays and torch tensors, not {type(x).__name__}")
        t = x.detach()
        if t.device.type != "cpu":
            raise InputTypeError(f"a collective takes CPU tensors; this one is on {t.device} (call .cpu() first)")
        dtype = t.dtype
        if dtype == torch.bfloat16:  # numpy has no bfloat16: reduce in float32, round back once
            t = t.float()
        array = t.contiguous().numpy()

        def back(a: np.ndarray) -> Any:
            out = torch.from_numpy(a if a.flags.c_contiguous else a.copy())  # (ascontiguousarray makes 0-d 1-d)
            return out.to(dtype) if out.dtype != dtype and dtype == torch.bfloat16 else out

        return array, back
    raise InputTypeError(f"a collective takes numpy arrays and torch tensors, not {type(x).__name__}")


def _auto(leaders: int, nbytes: int, model: CostModel) -> Plan:
    """``algorithm="auto"`` between the host groups' leaders: the plan the cost model prices lowest
    as this communicator runs it. The leaders are on different hosts, so every transfer crosses a
    host link (``groups``: one leader per host), and a plan runs without tasks nor a call to the
    scheduler: each dependent step costs a message (``model.message``), as for the p2p engine
    (:meth:`~flowreduce.cost.CostModel.p2p_time`). (Priced as tasks on one host, a plan's levels
    outweighed its bytes: 4 leaders took recursive doubling of radix 4, three whole vectors sent
    per leader, up to 8 MB; between 4 hosts on 1 Gbit/s links that was 1.7x butterfly at 8 MB.)
    ``model``'s inter-host link is the configured model's, else the one the communicator measured
    (:mod:`flowreduce.spmd.linkprobe`): with the default 10 Gbit/s link, 800 kB between 4 hosts on
    1 Gbit/s went to recursive doubling of radix 4 (3.2x gloo's time); on the measured link (α 6-8 ms
    a step and 98-126 MB/s under load 10) it goes to butterfly of radix 4 (2.6x the same hour, where
    main's recursive doubling took 3.2x), 1e3 and 1e4 still to recursive doubling (one step), 2026-11-28."""
    engine = replace(model, call=0.0, task=0.0, level=model.message)
    groups = [[g] for g in range(leaders)]
    plan = choose(leaders, nbytes, chunks=1, groups=groups, model=engine)
    # in chunks of PIPELINE_BYTES (at most MAX_PIPELINE): a chunk is reduced while the next is on the
    # wire. Each message costs ~1.5-2 ms of Python besides its bytes, which the model does not see: on 4
    # emulated hosts at 1 Gbit/s, 1e7 float64 took 1.54x gloo's time in one chunk, 1.28x in 10 of 8 MiB,
    # 1.26x in 16 of 5 MB, 1.45x in 40 of 2 MiB (2026-11-28)
    chunks = min(MAX_PIPELINE, nbytes // PIPELINE_BYTES)
    if chunks < 2:
        return plan
    # In chunks, a ring (one flow into and out of each host) beat butterfly of radix 4 (three flows into
    # each host at every step) on the same chunks, which the model prices as equal bytes and fewer
    # steps: so the ring, unless the model prices it RING_MARGIN over the best (many hosts: its 2(h-1) steps).
    # 4 emulated hosts, 1 Gbit/s, one job each: 1e6 in 3 chunks 129-150 ms against 139-161, 1e7 in 16
    # chunks 1191-1384 ms against 1373-1818 (2026-11-28); 1e7 ring in 16 chunks: 1.14x gloo under load 10
    ring = make_plan("ring", leaders).with_chunks(chunks)
    plan = plan.with_chunks(chunks)
    return ring if engine.predict(ring, nbytes, groups) <= RING_MARGIN * engine.predict(plan, nbytes, groups) else plan


#: Bytes of a vector per chunk of a plan between hosts, and the most chunks (:func:`_auto`).
PIPELINE_BYTES, MAX_PIPELINE = 2 << 20, 16
#: How much slower than the best plan the model may price the ring in chunks and still have it (:func:`_auto`).
#: 4 hosts price the ring 1.07x radix-4 butterfly at 1e6 on a link of alpha 2 ms, 1.21x at 6 ms, 1.27x at 8 ms
#: (what the probe measures under load 4-10), yet the ring was ahead in every comparison by hand: 1e6 in 3-4
#: chunks 110-115 ms against 126-131 (2026-11-28, loads 1-8). At 1.15 a loaded job's probe (alpha > 4.2 ms)
#: flipped auto to butterfly from run to run; 8 hosts still take butterfly from alpha ~3 ms at 8 MB, 16 hosts always.
RING_MARGIN = 1.3


class Communicator:
    """A rank's handle on its job's collectives (see the module).

    Attributes
    ----------
    rank, size : int
        This rank, and the number of ranks.
    attempt : int
        0, then one more at each restart of the job (``spmd(..., restarts=k)``).
    events : deque of Event
        The collectives this rank ran, newest last (:data:`EVENTS` at most; made from its worker's log at
        each read).
    """

    #: whether an exchange between hosts (a plan, a broadcast, an all-gather, a barrier, the link's probe) runs
    #: on the worker's event loop (:meth:`_between`) or on the rank's thread
    plan_on_loop = True

    def __init__(self, layout: Layout, rank: int, mailbox: Mailbox, parents: Sequence[Communicator] = ()):
        self.layout, self.rank, self.size = layout, rank, layout.size
        self.attempt = layout.attempt
        self.mailbox = mailbox
        self.run = layout.run
        self.parents = tuple(parents)
        self.runs = (self.run, *(p.run for p in self.parents))
        #: the job's rank of each of this communicator's ranks (a subgroup's are not its job's)
        self.members: tuple[int, ...] = tuple(range(self.size))
        self.group = layout.groups[layout.group_of[rank]]
        self.leader = self.group[0] == rank
        self.leaders = layout.leaders
        self.me = layout.group_of[rank]
        #: one host, several ranks: an all-reduce is the host group's alone
        self.one_host = len(self.leaders) == 1 and len(self.group) > 1
        self.host: HostGroup | None = None
        self.seq = 0
        #: the record of this rank's newest collective (None before the first), in its worker's log
        self.last: Record | None = None
        self.failed = False
        self.closed = False
        self._plans: dict[tuple[str, int], Plan] = {}
        #: the link between hosts as the first all-reduce with ``algorithm="auto"`` between hosts measured
        #: it (:mod:`flowreduce.spmd.linkprobe`); None before, on one host, or when the configured cost
        #: model names its own inter-host link
        self.link: Link | None = None
        self._resolved: dict[tuple[Any, np.dtype], tuple[Op, np.dtype]] = {}
        self._subs: dict[tuple[int, ...], itertools.count] = {}
        self._children: list[Communicator] = []
        mailbox.open(self.run, (layout.directory, layout.prefix()), rank, self)

    def __repr__(self) -> str:
        return f"<flowreduce.spmd.Communicator rank {self.rank} of {self.size}, job {self.run}>"

    # -- plumbing -----------------------------------------------------------------
    def _why(self) -> str | None:
        for run in self.runs:
            why = self.mailbox.why(run)
            if why is not None:
                return why
        return None

    def _shm(self) -> HostGroup | None:
        if self.host is None and len(self.group) > 1:
            layout = self.layout
            self.host = HostGroup(layout.directory, f"{layout.prefix()}g{layout.group_of[self.rank]}", self.group,
                                  self.rank, self._why)
        return self.host

    def _begin(self, name: str) -> tuple[str, float | None, float]:
        if self.closed or self.mailbox.failed:  # (some job failed on this worker: this one?)
            self._refuse(name)
        self.seq = seq = self.seq + 1
        timeout = self.layout.timeout
        # the first collective also waits for every rank's task to start, which Dask may delay on a busy worker
        deadline = None if timeout is None else time.monotonic() + (max(timeout, STARTUP_SECONDS) if seq <= 1 else timeout)
        return f"{name} #{seq} of job {self.run}", deadline, time.time()

    def _refuse(self, name: str) -> None:
        """Raise if this communicator is closed, or its job failed."""
        if self.closed:
            raise FlowreduceError(f"{name} on rank {self.rank}: the communicator of job {self.run} is closed "
                                  "(its rank's function returned)")
        why = self._why()
        if why is not None:
            raise Aborted(f"{name} #{self.seq + 1} on rank {self.rank}: {why}")

    def _fail(self, why: str) -> None:
        """Fail the job: every rank's pending and next collective raises ``why``."""
        for c in (self, *self.parents):  # a subgroup's failure is its job's: tell every worker of the job too
            c.failed = True
            if c.host is not None:
                c.host.abort(why)
            c.mailbox.tell(c.layout.workers, c.run, why)

    def _collective(self, what: str, body: Callable[[], Any]) -> Any:
        try:
            return body()
        except Exception as e:
            self._raised(what, e)
            raise

    def _raised(self, what: str, e: Exception) -> None:
        """``what`` raised ``e`` here: the job failed elsewhere (:class:`Aborted`), or here (a timeout,
        inputs that disagree...), and then the other ranks are told."""
        if isinstance(e, Aborted):
            self.failed = True
        else:
            self._fail(f"rank {self.rank} failed in {what}: {type(e).__name__}: {e}")

    def _send(self, rank: int, key: str, value: Any) -> None:
        """Send ``value`` as it is, from this rank's thread: a value nobody changes once sent (a walk's own
        temporaries, or the copies :meth:`_copies` made of what the rank keeps)."""
        self.mailbox.send(self.layout.workers[rank], self.run, f"{key}:{self.rank}>{rank}", value)

    def _run_plan(self, plan: Plan, x: np.ndarray, op: Op, out: np.ndarray, what: str,
                  deadline: float | None) -> tuple[np.ndarray, int, int]:
        """This leader's part of ``plan`` over ``x`` (:func:`~flowreduce.spmd.planrun.run_plan`'s walk) into
        ``out``, where :meth:`_between` runs it."""
        leaders, members, workers = self.leaders, self.members, self.layout.workers
        here = [workers[leaders[d]] == workers[self.rank] for d in range(len(leaders))]

        def who(r: int) -> int:
            return members[leaders[r]]

        def steps(send: Send) -> Walk:  # a value for a leader on this worker goes read-only: the walk writes over its own
            return plan_walk(plan, self.me, x, op, lambda d, k, v: send(d, k, shared(v) if here[d] else v), who, out,
                             write_received=True)

        return self._between(steps, f"a{self.seq}.", what, deadline)

    def _between(self, steps: Callable[[Send], Walk], tag: str, what: str, deadline: float | None) -> Any:
        """Run a walk between the host groups' leaders (:func:`~flowreduce.spmd.planrun.walk`: ``steps(send)``
        yields the (leader index, key) of each value it waits for, and sends with ``send(leader index, key,
        value)``, uncopied: values nobody changes once sent) and return its result. Every exchange between
        hosts is one: a plan, a broadcast, an all-gather, a barrier, the link's probe. With
        :attr:`plan_on_loop`, the walk runs on the worker's event loop, where the messages arrive and leave:
        a step's message is written as soon as the value it needs is read, with no thread to wake on either
        side (on 4 emulated hosts, a thread hand-over each way cost a message 0.1-3 ms on a loaded 2-core
        machine), and this rank's thread waits once for its end; else on this rank's thread."""
        leaders = self.leaders
        if self.plan_on_loop:
            return self.mailbox.call(walk_async(
                steps(lambda dest, key, v: self._post(leaders[dest], f"{tag}{key}", v)),
                lambda src, key: self._take_async(leaders[src], f"{tag}{key}", what, deadline)))
        return walk(steps(lambda dest, key, v: self._send(leaders[dest], f"{tag}{key}", v)),
                    lambda src, key: self._take(leaders[src], f"{tag}{key}", what, deadline))

    def _copies(self, value: Any, dests: Sequence[int]) -> list[Any]:
        """What leader ``dests[i]`` (a leader index) is sent of ``value``, which this rank keeps (or returns):
        one copy for every leader on another worker (serialised there, read only), a copy each for the
        leaders on this worker (handed over as they are, and theirs to change). Made on the rank's thread,
        before a walk on the event loop sends them."""
        def copy(v: Any) -> Any:
            if isinstance(v, np.ndarray):
                return v.copy()
            return [copy(e) for e in v] if isinstance(v, list) else v

        workers, here = self.layout.workers, self.layout.workers[self.rank]
        remote: list[Any] = []
        out = []
        for d in dests:
            if workers[self.leaders[d]] == here:
                out.append(copy(value))
            else:
                if not remote:
                    remote.append(copy(value))
                out.append(remote[0])
        return out

    def _post(self, rank: int, key: str, value: Any) -> None:
        """:meth:`_send` (uncopied) from the worker's event loop."""
        self.mailbox.post(self.layout.workers[rank], self.run, f"{key}:{self.rank}>{rank}", value)

    async def _take_async(self, rank: int, key: str, what: str, deadline: float | None) -> Any:
        return await self.mailbox.take_async(self.run, f"{key}:{rank}>{self.rank}", deadline=deadline, what=what,
                                             rank=self.rank, source=rank, also=self.runs[1:])

    def _take(self, rank: int, key: str, what: str, deadline: float | None) -> Any:
        return self.mailbox.take(self.run, f"{key}:{rank}>{self.rank}", deadline=deadline, what=what, rank=self.rank,
                                 source=rank, also=self.runs[1:])

    def _record(self, name: str, start: float, nbytes: int, sent: int, received: int, algorithm: str = "") -> None:
        """One record in the worker's log (:class:`~flowreduce.schedule.spmd_log.Log`): no Event made, no
        entry appended anywhere else (read back as events by :attr:`events`, ``collect``, traces)."""
        peers, path, rank = self._route
        self.last = self.mailbox.log.add(self.run, rank, name, self.seq, start, time.time(), nbytes, sent, received,
                                         peers, path, algorithm)

    @property
    def events(self) -> deque[Event]:
        """This rank's collectives, newest last: those its worker's log still holds (the newest
        :data:`~flowreduce.schedule.spmd_log.LOGGED` of all the worker's ranks), at most :data:`EVENTS`.
        Made from the log's records at each read."""
        run, rank = self.run, self._route[2]
        return deque((e for _, _, e in self.mailbox.log.entries(lambda r, k: k == rank and r == run)), maxlen=EVENTS)

    @cached_property
    def _route(self) -> tuple[tuple[int, ...], str, int]:
        """What every event of this rank says: its peers and its rank (the job's: a subgroup's collective
        lies on its rank's timeline) and the path (set once ``members`` is)."""
        path = ("shm" if len(self.group) > 1 else "") + ("+dask" if len(self.leaders) > 1 else "")
        peers = tuple(r for r in self.group if r != self.rank)
        if self.leader and len(self.leaders) > 1:
            peers += tuple(r for r in self.leaders if r != self.rank)
        return tuple(self.members[r] for r in peers), path.lstrip("+") or "local", self.members[self.rank]

    def _resolve(self, op: Any, dtype: np.dtype) -> tuple[Op, np.dtype]:
        """``op`` resolved, and the dtype it accumulates ``dtype`` in: remembered for an op named by a
        string or a ufunc (one lookup per call: at 1e3 a call's own Python is most of its time)."""
        key = (op, dtype) if type(op) is str or isinstance(op, np.ufunc) else None
        found = self._resolved.get(key) if key is not None else None
        if found is None:
            with raised_as(OptionError):
                resolved = resolve_op(op)
            found = (resolved, resolved.accumulator(dtype) or dtype)
            if key is not None:
                self._resolved[key] = found
        return found

    def plan_for(self, algorithm: str, nbytes: int) -> Plan | None:
        """The plan an all-reduce of ``nbytes`` runs between the host groups' leaders (None: one group)."""
        if algorithm not in ALGORITHMS:
            raise OptionError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
        h = len(self.leaders)
        if h < 2:
            return None
        key = (algorithm, nbytes if algorithm == "auto" else 0)
        found = self._plans.get(key)
        if found is None:
            with raised_as(OptionError):
                found = _auto(h, nbytes, self._model()) if algorithm == "auto" else make_plan(algorithm, h)
            self._plans[key] = found
        return found

    def _model(self) -> CostModel:
        """The cost model ``auto`` prices plans between hosts with: the configured one
        (``flowreduce.cost-model``), on the link this communicator measured (:attr:`link`)
        unless the configured model names its own."""
        model = configured_model()
        return replace(model, inter=self.link) if model.inter is None and self.link is not None else model

    def _learn_link(self, host: HostGroup | None, what: str, deadline: float | None) -> None:
        """Measure the link between hosts (every rank calls it, in the same collective): the leaders
        time steps between them, leader 0 round trips to leader 1, and leader 0 tells every leader
        what it found, each leader its host group (:mod:`flowreduce.spmd.linkprobe`)."""
        value: np.ndarray | None = None
        if self.leader:
            me, n = self.me, len(self.leaders)

            def steps(send: Send) -> Walk:
                link = yield from linkprobe.measure(me, n, send)
                if link is None:
                    return (yield 0, "link")
                found = linkprobe.as_array(link)  # leader 0 decides
                for i in range(1, n):
                    send(i, "link", found)
                return found

            value = self._between(steps, f"l{self.seq}.", what, deadline)
        if host is not None:
            value = host.broadcast(value if self.leader else None, 0, what, deadline)
        self.link = linkprobe.from_array(value)
        self._plans.clear()

    # -- collectives ----------------------------------------------------------------
    def allreduce(self, x: Any, op: Any = "sum", algorithm: str = "auto", deterministic: bool | str = False) -> Any:
        """``op`` over every rank's ``x``, a new array (or tensor) of ``x``'s kind on every rank.

        ``x``: a numpy array or CPU tensor, the same shape and dtype on every
        rank. ``op``: ``sum prod min max mean``, a binary numpy ufunc (or its
        name), or a callable ``f(a, b)`` (associative and commutative).
        ``algorithm``: the plan between hosts (``flowreduce.ALGORITHMS``;
        ``auto``: the cost model's choice); inside a host the exchange is
        always through shared memory.

        ``deterministic``: every rank gets the same bits in every mode.

        * ``False``: the fastest order (ranks of a host in rank order, then
          the plan's between hosts): the bits may change with the algorithm
          and with how the ranks are grouped on hosts.
        * ``True``: floats combined in the reference tree's order over the
          ranks, ``flowreduce.reference_reduce(xs, op, order="tree")``.
        * ``"exact"``: float32 and float64 sums and means are the exact sum
          rounded once (a mean: then divided by the rank count),
          ``flowreduce.reference_reduce(xs, op)``; other float ops and dtypes
          (and bfloat16 tensors, reduced in float32) raise
          :class:`~flowreduce.errors.OptionError`.

        With ``True`` and ``"exact"`` the bits are the same whatever the
        algorithm and host grouping, and equal to ``flowreduce.allreduce(...,
        deterministic=...)``'s: every rank's input is gathered and folded in
        rank order (integers, booleans, min and max are exact in any order:
        they take the ordinary route).
        """
        mode = deterministic_mode(deterministic) if deterministic is not False else False
        # the arguments are checked before the job's state: every rank that passes a wrong one raises it as
        # itself, not as the job's failure a faster peer's same error may already have caused
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            self.plan_for(algorithm, 0)  # raises
        a, back = (x, None) if type(x) is np.ndarray else as_numpy(x)
        resolved, acc = self._resolve(op, a.dtype)
        fold = self._ordered_op(resolved, mode, a.dtype, x) if mode else None
        what, deadline, start = self._begin("allreduce")
        if fold is None and self.one_host:
            # one host, several ranks: the host group's all-reduce is the whole collective, and no more
            # Python than it needs around it (at 1e3 the Python on each rank, four ranks on two cores,
            # is most of a call's time)
            host = self.host or self._shm()
            assert host is not None
            try:
                part = host.allreduce(a if a.ndim == 1 else a.reshape(-1), resolved, acc, what, deadline)  # new, in acc
            except Exception as e:
                self._raised(what, e)
                raise
            out = resolved.finish(part, self.size, owned=True) if resolved.mean else part
            self._record("allreduce", start, a.nbytes, 0, 0)
            out = out if a.ndim == 1 else out.reshape(a.shape)
            return out if back is None else back(out)
        flat = a if a.ndim == 1 and a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)
        nbytes = flat.size * acc.itemsize
        plan = self.plan_for(algorithm, nbytes) if fold is None else None

        def body() -> tuple[np.ndarray, int, int]:
            nonlocal plan
            if fold is not None:
                return self._gather_fold(flat, fold, what, deadline)
            sent = received = 0
            host = self._shm()
            if plan is not None and algorithm == "auto" and self.link is None and configured_model().inter is None:
                self._learn_link(host, what, deadline)  # the first "auto" between hosts: once
                plan = self.plan_for(algorithm, nbytes)
            part = host.allreduce(flat, resolved, acc, what, deadline) if host is not None else flat
            if plan is not None:
                if self.leader:
                    part, sent, received = self._run_plan(plan, np.asarray(part, dtype=acc), resolved,
                                                          buffers().empty(flat.size, acc), what, deadline)
                if host is not None:
                    part = host.broadcast(part if self.leader else None, 0, what, deadline)
            return part, sent, received

        part, sent, received = self._collective(what, body)
        # a result is the caller's own: never the input itself nor a view of it (a plan's final may be
        # one; what the host group returns is always new)
        fresh = part.dtype == acc and (self.host is not None or (part is not flat and not np.may_share_memory(part, flat)))
        if not fresh:
            out = buffers().empty(part.size, acc)
            np.copyto(out, part, casting="unsafe")
            part = out
        out = part if fold is not None else resolved.finish(part, self.size, owned=True)  # the fold divided a mean
        how = ("exact" if fold.exact else "tree") if fold is not None else plan.algorithm if plan is not None else ""
        self._record("allreduce", start, a.nbytes, sent, received, how)
        out = out if a.ndim == 1 else out.reshape(a.shape)
        return out if back is None else back(out)

    def _ordered_op(self, op: Op, mode: bool | str, dtype: np.dtype, x: Any) -> Op | None:
        """What ``deterministic=mode`` folds every rank's input with (None: any order gives the same bits)."""
        if not tree_ordered(op.name, dtype):
            return None
        if mode != "exact":
            return op
        exact_op(op, dtype)
        if not supported(dtype) or "bfloat16" in str(getattr(x, "dtype", "")):
            raise OptionError(f"deterministic='exact' sums float32 and float64 exactly, not {getattr(x, 'dtype', dtype)}"
                              " (a bfloat16 or float16 sum would be rounded twice); pass deterministic=True or False")
        return op.exactly()

    def _gather_fold(self, flat: np.ndarray, fold_op: Op, what: str,
                     deadline: float | None) -> tuple[np.ndarray, int, int]:
        """Every rank's ``flat`` folded in rank order by :func:`tree_fold` (mean's division included):
        on one host, each rank folds its slice of the group's inputs read in place; across hosts,
        the leaders gather every input, fold it, and hand the result to their group."""
        size, host = self.size, self._shm()

        def fold(parts: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
            return tree_fold(fold_op, size, parts, out)

        if len(self.leaders) == 1:  # the host group is every rank, in rank order
            if host is None:
                return fold([flat], buffers().empty(flat.size, flat.dtype)), 0, 0
            return host.allreduce(flat, fold_op, flat.dtype, what, deadline, fold=fold), 0, 0
        mine = host.allgather(flat, what, deadline) if host is not None else [flat]
        out: np.ndarray | None = None
        sent = received = 0
        if self.leader:
            parts, sent, received = self._between_leaders(mine, f"o{self.seq}", what, deadline)
            bad = [r for r in range(size) if parts[r].size != flat.size or parts[r].dtype != flat.dtype]
            if bad:
                theirs = ", ".join(f"rank {r} gave {parts[r].size} x {parts[r].dtype.str!r}" for r in bad)
                raise InputError(f"{what}: {theirs}, rank {self.rank} {flat.size} x {flat.dtype.str!r}: every rank "
                                 "must give the same shape and dtype")
            out = fold([parts[r] for r in range(size)], buffers().empty(flat.size, flat.dtype))
        if host is not None:
            out = host.broadcast(out if self.leader else None, 0, what, deadline)
        assert out is not None
        return out, sent, received

    def _between_leaders(self, mine: list[np.ndarray], tag: str, what: str,
                         deadline: float | None) -> tuple[dict[int, np.ndarray], int, int]:
        """On a leader: its group's arrays (``mine``, in group order) sent to every other leader and
        theirs taken; every rank's array by rank, and the bytes sent and received."""
        others = [i for i in range(len(self.leaders)) if i != self.me]
        copies = self._copies(mine, others)
        groups = self.layout.groups

        def steps(send: Send) -> Walk:
            parts: dict[int, np.ndarray] = dict(zip(self.group, mine))
            sent = received = 0
            for i, v in zip(others, copies):
                send(i, "", v)
                sent += sum(m.nbytes for m in mine)
            for i in others:
                theirs = yield i, ""
                received += sum(t.nbytes for t in theirs)
                parts.update(zip(groups[i], theirs))
            return parts, sent, received

        return self._between(steps, tag, what, deadline)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``x``, a new array on every rank (others' ``x`` only tells the kind
        to return, and may be None)."""
        if not 0 <= root < self.size:
            raise OptionError(f"root {root} is not a rank of this communicator (0..{self.size - 1})")
        what, deadline, start = self._begin("broadcast")
        a, back = as_numpy(x) if x is not None else (None, lambda v: v)
        if self.rank == root and a is None:
            raise InputTypeError(f"{what}: the root (rank {root}) gives None")
        group_of = self.layout.group_of
        root_group = group_of[root]
        tag = f"b{self.seq}"

        def body() -> tuple[np.ndarray, int, int]:
            host, value, sent, received = self._shm(), None, 0, 0
            if self.me == root_group:
                if host is not None:
                    value = host.broadcast(a if self.rank == root else None, self.group.index(root), what, deadline)
                else:
                    value = np.array(a, copy=True)
            if len(self.leaders) > 1 and self.leader:
                if self.me == root_group:
                    others = [i for i in range(len(self.leaders)) if i != root_group]
                    sent = value.nbytes * len(others)  # type: ignore[union-attr]
                    copies = self._copies(value, others)

                    def steps(send: Send) -> Walk:
                        for i, v in zip(others, copies):
                            send(i, "", v)
                        return value
                        yield  # a walk that waits for nothing
                else:
                    def steps(send: Send) -> Walk:
                        return (yield root_group, "")

                value = self._between(steps, tag, what, deadline)
                received = 0 if self.me == root_group else value.nbytes
            if len(self.leaders) > 1:
                if self.me != root_group and host is not None:
                    value = host.broadcast(value if self.leader else None, 0, what, deadline)
            return value, sent, received  # type: ignore[return-value]

        value, sent, received = self._collective(what, body)
        self._record("broadcast", start, value.nbytes, sent, received)
        return back(value)

    def allgather(self, x: Any) -> list[Any]:
        """Every rank's ``x`` (shapes and dtypes may differ), a list of new arrays in rank order."""
        what, deadline, start = self._begin("allgather")
        a, back = as_numpy(x)
        a = a if a.flags.c_contiguous else a.copy()  # (ascontiguousarray makes 0-d 1-d)
        tag = f"g{self.seq}"

        def body() -> tuple[list[np.ndarray], int, int]:
            host, sent, received = self._shm(), 0, 0
            mine = host.allgather(a, what, deadline) if host is not None else [a.copy()]
            if len(self.leaders) <= 1:
                return mine, 0, 0
            blob: np.ndarray | None = None
            if self.leader:
                parts, sent, received = self._between_leaders(mine, tag, what, deadline)
                everything = [parts[r] for r in range(self.size)]
                if host is None:
                    return everything, sent, received
                blob = np.frombuffer(pickle.dumps(everything, protocol=5), np.uint8)
            assert host is not None
            blob = host.broadcast(blob, 0, what, deadline)
            return (everything if self.leader else pickle.loads(blob.tobytes())), sent, received

        values, sent, received = self._collective(what, body)
        self._record("allgather", start, a.nbytes, sent, received)
        return [back(v) for v in values]

    def barrier(self) -> None:
        """Return once every rank has called it."""
        what, deadline, start = self._begin("barrier")
        if len(self.leaders) == 1 and self.host is not None:  # one host: the host group's barrier, nothing around it
            try:
                self.host.barrier(what, deadline)
            except Exception as e:
                self._raised(what, e)
                raise
            self._record("barrier", start, 0, 0, 0)
            return
        tag = f"z{self.seq}" if len(self.leaders) > 1 else ""

        def body() -> None:
            host = self._shm()
            if host is not None:
                host.barrier(what, deadline)
            if len(self.leaders) > 1:
                if self.leader:
                    others = [i for i in range(len(self.leaders)) if i != self.me]

                    def steps(send: Send) -> Walk:
                        for i in others:
                            send(i, "", 0)
                        for i in others:
                            yield i, ""

                    self._between(steps, tag, what, deadline)
                if host is not None:
                    host.barrier(what, deadline)

        self._collective(what, body)
        self._record("barrier", start, 0, 0, 0)

    def subgroup(self, ranks: Sequence[int]) -> Communicator | None:
        """A communicator over ``ranks`` of this one (its rank ``i`` is ``ranks[i]``), or None on
        a rank not in ``ranks`` (as ``torch.distributed.new_group``). Local: no message; the
        ranks of ``ranks`` must create their subgroups in the same order. A failure of the
        subgroup fails the job, and the job's failure fails the subgroup."""
        members = tuple(int(r) for r in ranks)
        if not members or len(set(members)) != len(members) or not all(0 <= r < self.size for r in members):
            raise OptionError(f"a subgroup takes distinct ranks of 0..{self.size - 1}; got {list(ranks)}")
        n = next(self._subs.setdefault(members, itertools.count()))
        if self.rank not in members:
            return None
        tag = f"{self.layout.sub}s{'_'.join(map(str, members))}n{n}"
        if len(tag) > 120:
            tag = f"{self.layout.sub}s{abs(hash(members)):x}n{n}"
        sub = Layout(self.layout.job, self.layout.attempt, tuple(self.layout.workers[r] for r in members),
                     tuple(self.layout.hosts[r] for r in members), self.layout.timeout, self.layout.directory,
                     sub=tag.replace("-", "_"))
        child = Communicator(sub, members.index(self.rank), self.mailbox, parents=(self, *self.parents))
        child.members = tuple(self.members[r] for r in members)
        self._children.append(child)
        return child

    split = subgroup

    def last_collective(self) -> tuple[str, Event] | None:
        """This rank's newest collective, its subgroups' included (None before the first), and its
        name as the dashboard lists it: ``allreduce``, or ``allreduce in subgroup 0,2`` (job ranks)."""
        newest: tuple[str, Event] | None = None
        for c in self._family():
            e = None if c.last is None else as_event(c.last)
            if e is not None and (newest is None or e.start > newest[1].start):
                name = f"{e.collective} in subgroup {','.join(map(str, c.members))}" if c.parents else e.collective
                newest = (name, e)
        return newest

    def _family(self) -> Iterator[Communicator]:
        yield self
        for child in list(self._children):
            yield from child._family()

    # -- the end ----------------------------------------------------------------------
    def close(self, failed: bool = False) -> None:
        """End this rank's part: unless the job failed, wait for the ranks of its host (they may
        still read its segments: a collective ``finalize``, as MPI's); then drop its segments."""
        if self.closed:
            return
        for child in self._children:
            child.close(failed)
        failed = failed or self.failed or self._why() is not None
        try:
            if self.host is not None and not failed:
                what = f"finalize of job {self.run}"
                try:  # no deadline: a peer may still be working (saving a checkpoint...); its failure still ends this
                    self.host.barrier(what, None)
                except Exception:
                    failed = True
                    raise
        finally:
            self.closed = True
            if self.host is not None:
                self.host.close(failed)
            self.mailbox.close(self.run, self.rank)
