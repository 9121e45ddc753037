"""method="p2p": the plan executed by a worker extension, not as a task per
step and chunk (as ``distributed.shuffle`` moves a shuffle's data outside
the graph). docs/p2p.md tells the whole story.

* :class:`Engine` (:func:`engine_of` a worker: :class:`P2PWorkerPlugin`'s,
  a part of flowreduce's worker extension, :mod:`flowreduce.schedule.extension`)
  keeps one :class:`Run` per run id
  (``"<call token>.<attempt>"``) while the run lasts on that worker.
* The graph (:func:`flowreduce.lower.p2p.lower_p2p`) hands each rank's input
  in (:func:`hand_in`), waits for all of them (:func:`barrier`, which has a
  hand-in holding another run's value run again) and takes
  each rank's result out (:func:`take_out`, a coroutine: it waits on the
  worker's event loop without holding its thread).
* A node's value goes once to each other worker reading it, in one message
  per destination for everything ready meanwhile (handler :data:`RECEIVE`,
  on the worker's connection pool); ranks of one worker read each other's
  values in process. Chunks run independently; reductions of at least
  :data:`OFFLOAD_BYTES` run on the worker's executor.
* Failures: an error on one worker fails the run there and is told to the
  run's other workers (handler :data:`FAIL`); :class:`P2PSchedulerPlugin`
  tells the survivors when a worker of a run leaves and when a run's tasks
  err or are forgotten before its end. Every output then raises. A run's
  state is dropped when its worker's outputs are taken and its messages
  sent, or when it fails (its error is kept, :data:`FAILED_KEPT` runs at
  most, to fail late tasks of it with the same error).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import pickle
import threading
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, replace
from functools import partial
from typing import Any, cast

import numpy as np
from dask.task_spec import Task
from distributed import get_worker
from distributed.comm.addressing import get_address_host
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.exceptions import Reschedule
from distributed.protocol import to_serialize

from flowreduce import arrays
from flowreduce.algorithms.ir import REDUCE
from flowreduce.algorithms.shm_direct import NAME as SHM_DIRECT
from flowreduce.dashboard.record import EXTENSION
from flowreduce.dashboard.store import store_of
from flowreduce.errors import InputError, InputStateError, InputTypeError, WorkerLostError, refused
from flowreduce.kernels import dense as _kernels
from flowreduce.keys import barrier_key, new_token, parse
from flowreduce.lower import p2p as _lower
from flowreduce.lower.graph import Graph
from flowreduce.lower.p2p import Program, Spec, lower_p2p, program, roles
from flowreduce.ops import resolve_op
from flowreduce.phases import ARRIVE, BARRIER, HAND_IN, OUTPUT
from flowreduce.pytree import flatten, leaves_as, unflatten
from flowreduce.schedule import hosts
from flowreduce.schedule.engine_log import EngineLog, engine_steps_handler
from flowreduce.schedule.engine_log import now as _now
from flowreduce.schedule.inputs import ArrayMeta, OtherMeta, meta_of
from flowreduce.schedule.peer_reads import leave_slot
from flowreduce.shm import pool as _shm_pool
from flowreduce.shm.host_group import HostGroup, Pooled, fold_into, stores_ordered
from flowreduce.shm.lease import NUMERIC, Handle, Lease, layout, peer_dtype
from flowreduce.shm.result_buffers import buffers

logger = logging.getLogger("flowreduce")

RECEIVE = "flowreduce_p2p_receive"
FAIL = "flowreduce_p2p_fail"
#: Worker handler: a GatherRun's values for its first worker, or its result from there.
OBJECTS = "flowreduce_p2p_objects"
#: Worker handler: a peer of a run has every paced value it receives of the plan's steps before ``step``.
READY = "flowreduce_p2p_ready"
#: Stream message from an arrive task to the scheduler: where its rank arrived and what it holds.
ARRIVED = "flowreduce-p2p-arrived"
#: Stream message from the scheduler: a call placed on arrival begins as a run (the scheduler chose its plan
#: when its last rank arrived).
BEGUN = "flowreduce-p2p-begun"
#: Stream message from the scheduler: such a call ended, its inputs kept since they arrived are let go.
DROP = "flowreduce-p2p-drop"
#: Stream message from a barrier to the scheduler: these hand-ins hold another run's value, run them again.
STALE = "flowreduce-p2p-stale"
#: stream message, scheduler to workers: inputs of calls on futures placed on arrival (``keys``: ``[key, token,
#: rank]`` each), kept in the engine as they go to memory there (:meth:`Engine.await_keys`)
AWAIT = "flowreduce-p2p-await"
#: States of a result that no run computes any more: in memory, or failed
SETTLED = ("memory", "erred")
#: Scheduler handler: what such a call ran, once it began (for :func:`flowreduce.describe`).
RECORD = "flowreduce_p2p_record"
#: Reductions of at least this many bytes run on the worker's executor: a
#: hop to a thread costs ~50 µs, about what numpy takes to add 256 KiB, and
#: the event loop keeps moving other chunks' messages meanwhile.
OFFLOAD_BYTES = 256 << 10
#: Failed runs whose error is kept, to fail their late tasks with it.
FAILED_KEPT = 256
#: Most items one message may carry (a plan's nodes times its chunks is far less).
MAX_ITEMS = 1 << 20
#: *Paced* values: in a one-chunk run, a value of at least this many bytes for a worker of another host
#: goes once that worker has every paced value it receives of the plan's earlier steps (it says so:
#: :data:`READY`; its first paced step's values go at once). Pushed as soon as made, a step's bytes
#: would share the receiver's link with the previous step's still coming from another peer: a radix-2
#: butterfly on 8 hosts at 100 Mbit/s had a step's 10 MB take 1.6-1.8 s instead of 0.8 (docs/p2p.md).
#: A task graph orders its transfers so by itself: a task's inputs are fetched once they all exist.
PACED_BYTES = 1 << 20
#: Values smaller than this travel packed with the others of their message in one buffer: Dask's comm
#: makes each array a frame of its own (~40 µs to read each, measured), and a butterfly over 256 ranks
#: sends thousands of values of a few elements; bigger values keep their own frames (no copy).
PACK_BYTES = 64 << 10

Item = tuple[int, int, tuple[np.ndarray, ...]]  # (chunk, node, pieces)


def run_id(token: str, attempt: int = 0) -> str:
    """A run's id: the call's token and the attempt (0, then one more at each restart after a worker loss)."""
    return f"{token}.{attempt}"


class Run:
    """One run on one worker: the values of its nodes here, what waits for
    what, the messages to send, and a future per local rank's result."""

    def __init__(self, engine: Engine, run: str, spec: Spec):
        self.engine, self.id, self.spec = engine, run, spec
        self.prog: Program = program(spec, engine.address)
        engine.log.begin(run, self.prog)
        loop = asyncio.get_running_loop()
        #: the call's ranks on this worker -> their results
        self.results: dict[int, asyncio.Future] = {r: loop.create_future() for r in self.prog.outputs}
        self.inputs: dict[int, Any] = {}  # plan rank -> its input here (its members combined)
        self.handed: dict[int, list[Any]] = {}  # plan rank -> its members' inputs as handed in (never returned)
        self.values: dict[tuple[int, int], Any] = {}
        self.uses: dict[tuple[int, int], int] = {}
        self.missing: dict[tuple[int, int], int] = {}
        self.finals: dict[int, dict[int, Any]] = defaultdict(dict)
        self.ready: deque[tuple[int, int]] = deque()
        self.left = len(self.prog.local_nodes) * spec.chunks  # local nodes not computed yet
        self.offloaded = 0
        self.outbox: dict[str, list[Item]] = defaultdict(list)
        self.sending: dict[str, asyncio.Task] = {}
        self.told: set[str] = set()  # workers sent the spec already
        self.taken: set[int] = set()
        #: the big values of a message written into a segment, by their (chunk, node)s, while peers of this
        #: host read them: the same values for several peers (a broadcast) are written once
        self.written: dict[tuple[tuple[int, int], ...], Written] = {}
        #: the run is one collective of the host group of its workers (:func:`through_host`), no message
        self.through_host = through_host(spec)
        #: that collective's host group while a thread here waits in it (a failure aborts it: :meth:`fail`)
        self.group: HostGroup | None = None
        #: paced values (:data:`PACED_BYTES`): a worker -> the nodes it receives paced, and their steps in order
        self._paced: dict[str, tuple[frozenset[int], tuple[int, ...]]] = {}
        #: a peer -> my values for it that wait for it to be ready for their step, with that step
        self.held: dict[str, list[tuple[int, Item]]] = defaultdict(list)
        #: a peer -> the highest step it said it is ready for (it may say so before the run starts here)
        self.cleared: dict[str, int] = engine.early_ready.pop(run, {})
        #: my paced steps' values still to come (step -> count), and which of my paced steps I receive now
        self.expected: dict[int, int] | None = None
        self.receiving = 0

    # -- data in --------------------------------------------------------------
    async def hand_in(self, index: int, xs: Sequence[Any]) -> None:
        """This worker's ranks' inputs (``spec.members(index)``, in rank order),
        checked and combined into the plan rank ``index``'s input."""
        members = self.prog.members.get(index, ())
        if len(xs) != len(members) or not members:
            raise WorkerLostError(f"worker {index}'s ranks were handed in on {self.engine.address}, not their "
                                  f"worker in run {self.id} ({self.spec.addresses[index]}): a worker left and "
                                  "the call is being re-run elsewhere")
        if index in self.handed:  # Dask ran the hand-in again (a task may run more than once): the same values
            return
        for rank, x in zip(members, xs):
            if isinstance(x, np.generic):  # a numpy scalar is a 0-d array here too
                x = np.asarray(x)
            if not isinstance(x, np.ndarray) or x.shape != self.spec.shape or x.dtype.str != self.spec.dtype:
                got = f"{type(x).__name__} {getattr(x, 'shape', '')} {getattr(x, 'dtype', '')}".strip()
                raise InputError(f"rank {rank}'s input is {got}, not the {self.spec.shape} "
                                 f"{np.dtype(self.spec.dtype)} array every rank was checked to hold")
        xs = self.handed[index] = [np.asarray(x) for x in xs]
        if self.spec.published is not None:
            await self.read_published(index, xs)
            return
        cast = self.prog.accumulate
        if len(xs) > 1:  # ranks sharing this worker: combined here, in rank order, before the plan moves anything
            work = partial(_combine, self.prog.op, xs, cast)
            if xs[0].size * self.prog.itemsize * (len(xs) - 1) >= OFFLOAD_BYTES:
                x = await asyncio.get_running_loop().run_in_executor(self.engine.executor, work)
            else:
                x = work()
            cast = None
        else:
            x = xs[0]
        if self.engine.runs.get(self.id) is not self:  # failed meanwhile
            return
        self.inputs[index] = x
        if self.through_host:
            await self._through_host(index, x, cast)
            return
        for c in range(self.spec.chunks):
            for n in self.prog.views[index]:
                s = self.prog.site(c, n)
                self._available(c, n, _kernels.split(x, s.start, s.stop, cast), here=True)
        self._drain()
        self._maybe_done()

    async def _through_host(self, index: int, x: np.ndarray, cast: np.dtype | None) -> None:
        """This worker's part of a run through shared memory: one all-reduce of the host group of the
        run's workers (:class:`~flowreduce.shm.host_group.HostGroup`, as an SPMD job's ranks do), in
        a thread of its own, since it waits for its peers (the worker's executor may be busy). The
        group is made for the run and taken down after it; the run failing anywhere (a peer, a lost
        worker, the scheduler) ends its wait within milliseconds."""
        spec, prog = self.spec, self.prog
        flat = np.ascontiguousarray(x).reshape(-1)
        acc = cast if cast is not None else flat.dtype
        what = f"all-reduce run {self.id} (worker {index} of {len(spec.addresses)}, through shared memory)"
        base = f"{HOST_GROUP_PREFIX}{self.id}"
        directory = str(_shm_pool.config()["directory"])

        def failed() -> str | None:
            exc = self.engine.failed.get(self.id)
            return None if exc is None else f"{type(exc).__name__}: {exc}"

        def collective() -> np.ndarray:
            group = self.group = HostGroup(directory, base, range(len(spec.addresses)), index, failed,
                                           HOST_GROUP_YIELD, Pooled(directory, self.id))
            try:
                out = group.allreduce(flat, prog.op, acc, what, None)
                if group.mine:  # peers may still read my segment: the pool leases it again once they are done
                    group.barrier(what, None)
            except BaseException as e:
                group.abort(f"{what} failed on {self.engine.address}: {type(e).__name__}: {e}")
                group.close(failed=True)
                raise
            finally:
                self.group = None
            group.close(failed=False)
            return out

        t0 = _now()
        self.offloaded += 1
        try:
            out = await _in_thread(collective, f"flowreduce-{self.id}")
        except Exception as e:
            if self.engine.runs.get(self.id) is self:
                self.engine.fail(self.id, e, tell=True)
            return
        finally:
            self.offloaded -= 1
        self._reduced_here(index, out, t0)

    async def read_published(self, index: int, xs: Sequence[np.ndarray]) -> None:
        """This worker's part of a run whose ranks' inputs were published when they arrived
        (``spec.published``, :func:`publish`): every rank's input folded from its segment, in rank
        order, into this worker's result. The same fold on every worker gives every rank the same
        bits; no worker waits for another (the scheduler began the run once every rank arrived, so
        every segment is written), and the segments are given back when the call ends (``DROP``)."""
        spec, prog = self.spec, self.prog
        dtype, size = np.dtype(spec.dtype), spec.size
        mine = dict(zip(prog.members[index], xs))
        assert spec.published is not None

        def fold() -> np.ndarray:
            read = {r: _published_view(h, dtype, size) for r, h in enumerate(spec.published or ()) if r not in mine}
            parts = [mine[r].reshape(-1) if r in mine else read[r][0] for r in range(len(spec.published or ()))]
            out = fold_into(prog.op, parts, buffers().empty(size, prog.accumulate or dtype))
            for _, handle, seg in read.values():
                handle.check(seg)
            return out

        t0 = _now()
        try:
            if size * dtype.itemsize * spec.ranks <= FOLD_INLINE_BYTES:
                out = fold()
            else:
                self.offloaded += 1
                try:
                    out = await _in_thread(fold, f"flowreduce-{self.id}")
                finally:
                    self.offloaded -= 1
        except Exception as e:
            if self.engine.runs.get(self.id) is self:
                self.engine.fail(self.id, e, tell=True)
            return
        self.engine.published_runs += 1
        self._reduced_here(index, out, t0)

    def _reduced_here(self, index: int, out: np.ndarray, t0: float) -> None:
        """The run's whole result ``out`` (unfinished: a mean is not divided yet) was made on this
        worker from ``t0``, for its ranks: recorded, handed out, and the run ends here."""
        if self.engine.runs.get(self.id) is not self:  # failed meanwhile
            return
        spec, prog = self.spec, self.prog
        self.engine.host_runs += 1
        nbytes = out.size * prog.itemsize
        for m in prog.local_nodes:
            self.engine.log.node(self.id, 0, m, t0, nbytes, 1)
        self.finals[index] = {c: (prog.op.finish(out, spec.ranks, owned=True),) if c == 0 else ()
                              for c in range(spec.chunks)}
        self._finish(index)
        self.left = 0
        self._maybe_done()

    def deliver(self, items: Sequence[Item]) -> None:
        for c, n, pieces in items:
            self._available(c, n, pieces, here=False)
        self._drain()
        self._maybe_done()  # a worker none of whose ranks' results is wanted ends with its last value

    # -- the work -------------------------------------------------------------
    def _available(self, c: int, n: int, value: Any, here: bool) -> None:
        prog = self.prog
        if here:
            self.left -= 1
            for dest in prog.sends[n]:
                step = self._held_until(dest, n)
                if step is not None:
                    self.held[dest].append((step, (c, n, tuple(value))))
                    continue
                self.outbox[dest].append((c, n, tuple(value)))
                if dest not in self.sending:
                    self.sending[dest] = asyncio.ensure_future(self._send(dest))
        elif n in self.paced(self.engine.address)[0]:
            self._received_paced(n)
        rank = prog.final_of.get(n)
        if rank is not None:
            self.finals[rank][c] = value
            if len(self.finals[rank]) == self.spec.chunks:
                self._finish(rank)
        readers = prog.readers[n]
        if readers:
            self.values[c, n] = value
            self.uses[c, n] = len(readers)
        for m in readers:
            k = (c, m)
            left = self.missing.get(k, len(prog.plan.nodes[m].inputs)) - 1
            self.missing[k] = left
            if left == 0:
                del self.missing[k]
                self.ready.append(k)

    # -- paced values ---------------------------------------------------------
    def paced(self, address: str) -> tuple[frozenset[int], tuple[int, ...]]:
        """The nodes worker ``address`` receives paced (:data:`PACED_BYTES`: one chunk, at least that many
        bytes, from another host's worker), and their plan steps in order; the same on every worker."""
        found = self._paced.get(address)
        if found is None:
            nodes: frozenset[int] = frozenset()
            spec, prog = self.spec, self.prog
            if spec.chunks == 1 and spec.size * prog.itemsize >= PACED_BYTES:  # else none is
                there = roles(spec.algorithm, spec.options, spec.addresses, spec.in_place, address, spec.ordered)
                nodes = frozenset(i for i in there.received
                                  if not self._one_host(address, spec.addresses[prog.plan.nodes[i].rank])
                                  and prog.expected(0, i) * prog.itemsize >= PACED_BYTES)
            found = self._paced[address] = (nodes, tuple(sorted({prog.plan.nodes[i].step for i in nodes})))
        return found

    def _one_host(self, a: str, b: str) -> bool:
        """Whether workers ``a`` and ``b`` are on one host: they share a memory domain, or (no shared
        memory in this run) their addresses name one host."""
        return self._share_memory(a, b) or _host_of(a) == _host_of(b)

    def _held_until(self, dest: str, n: int) -> int | None:
        """The step ``dest`` must be ready for before my node ``n``'s value goes to it (None: it goes now)."""
        nodes, steps = self.paced(dest)
        if n not in nodes:
            return None
        step = self.prog.plan.nodes[n].step
        return None if step == steps[0] or self.cleared.get(dest, -1) >= step else step

    def _received_paced(self, n: int) -> None:
        """A paced value for this worker came: once every one of the step it belongs to is here, the
        workers sending the next paced step's values are told they may (:data:`READY`)."""
        nodes, steps = self.paced(self.engine.address)
        plan = self.prog.plan
        if self.expected is None:
            self.expected = defaultdict(int)
            for i in nodes:
                self.expected[plan.nodes[i].step] += 1
        self.expected[plan.nodes[n].step] -= 1
        while self.receiving < len(steps) and not self.expected[steps[self.receiving]]:
            self.receiving += 1
            if self.receiving < len(steps):
                step = steps[self.receiving]
                for peer in sorted({self.spec.addresses[plan.nodes[i].rank] for i in nodes if plan.nodes[i].step == step}):
                    asyncio.ensure_future(self._ready(peer, step))

    async def _ready(self, peer: str, step: int) -> None:
        try:
            await self.engine.worker.rpc(peer).flowreduce_p2p_ready(run=self.id, step=step, peer=self.engine.address)
        except Exception as e:  # gone: the run fails as the scheduler says the worker left
            logger.debug("flowreduce: run %s could not tell %s it is ready for step %d: %r", self.id, peer, step, e)

    def clear(self, peer: str, step: int) -> None:
        """``peer`` is ready for ``step``: my values for it of that step and before go."""
        self.cleared[peer] = max(step, self.cleared.get(peer, -1))
        held = self.held.get(peer)
        if not held:
            return
        go = [item for s, item in held if s <= self.cleared[peer]]
        self.held[peer] = [(s, item) for s, item in held if s > self.cleared[peer]]
        if go:
            self.outbox[peer].extend(go)
            if peer not in self.sending:
                self.sending[peer] = asyncio.ensure_future(self._send(peer))

    def _drain(self) -> None:
        """Compute every node whose inputs are here (a queue, not recursion: a
        ring's chain is 2 * ranks nodes long)."""
        prog = self.prog
        while self.ready:
            c, m = self.ready.popleft()
            node = prog.plan.nodes[m]
            s = prog.site(c, m)
            inputs = [self.values[c, i] for i in node.inputs]
            for i in node.inputs:  # a value read by nobody else here is let go
                self.uses[c, i] -= 1
                if not self.uses[c, i]:
                    del self.uses[c, i], self.values[c, i]
            t0 = _now()
            if node.kind == REDUCE:
                if s.nodes is not None:  # deterministic=True: partial sums of the reference tree, added as siblings
                    work = partial(_kernels.reduce_ordered, prog.op, self.spec.ranks, prog.count[m] == prog.plan.ranks,
                                   None, inputs, s.picks, prog.owned[m], s.nodes)
                else:
                    work = partial(_kernels.reduce, prog.op, self.spec.ranks, prog.count[m] == prog.plan.ranks, None,
                                   inputs, s.picks, prog.owned[m])
                if (s.stop - s.start) * prog.itemsize >= OFFLOAD_BYTES:
                    self.offloaded += 1
                    asyncio.ensure_future(self._offload(c, m, work))
                    continue
                value = work()
            else:
                value = _kernels.gather(None, inputs, s.picks)
            self.engine.log.node(self.id, c, m, t0, (s.stop - s.start) * prog.itemsize)
            self._available(c, m, value, here=True)

    async def _offload(self, c: int, m: int, work: Any) -> None:
        t0 = _now()
        try:
            value = await asyncio.get_running_loop().run_in_executor(self.engine.executor, work)
        except Exception as e:
            self.engine.fail(self.id, e, tell=True)
            return
        finally:
            self.offloaded -= 1
        self.engine.log.node(self.id, c, m, t0, (self.prog.site(c, m).stop - self.prog.site(c, m).start) * self.prog.itemsize, 1)
        if self.engine.runs.get(self.id) is self:
            self._available(c, m, value, here=True)
            self._drain()
            self._maybe_done()

    async def _send(self, dest: str) -> None:
        """Send what waits for ``dest``, one message at a time: whatever became
        ready during a send goes in the next one."""
        lease: Written | None = None
        try:
            while self.outbox.get(dest):
                index, packed, large = _pack(self.outbox.pop(dest))
                spec = None if dest in self.told else to_serialize(self.spec)
                self.told.add(dest)
                t0 = _now()
                sent, shared = large, None
                if large and self._same_host(dest):
                    lease, shared, large = await self._into_segment(large)
                reply = await self.engine.worker.rpc(dest).flowreduce_p2p_receive(
                    run=self.id, index=index, packed=to_serialize(packed), items=to_serialize(large), spec=spec,
                    shared=shared)
                if lease is not None:  # the peer copied its values out before answering
                    lease.release(failed=False)
                    lease = None
                self.engine.log.send(self.id, dest, t0, index, packed, sent)
                if isinstance(reply, dict) and isinstance(reply.get("error"), BaseException):
                    raise _Failed(reply["error"])  # the run failed there first: fail here with its error
                if not isinstance(reply, dict) or reply.get("status") != "OK":
                    why = reply.get("message") if isinstance(reply, dict) else reply
                    raise RuntimeError(f"worker {dest} refused run {self.id}'s values: {why}")
        except _Failed as e:
            self.engine.fail(self.id, e.error, tell=False)
        except Exception as e:
            if self.engine.runs.get(self.id) is self:
                lost = [r for r in range(self.spec.ranks) if self.spec.worker(r) == dest]
                exc = e if isinstance(e, RuntimeError) and not isinstance(e, OSError) else WorkerLostError(
                    f"all-reduce run {self.id}: sending to worker {dest} (ranks {_ranks(lost)}) failed: {e!r}")
                self.engine.fail(self.id, exc, tell=True)
        finally:
            self.sending.pop(dest, None)
            if lease is not None:  # the send failed: the peer may still be reading it, so it is not reused
                lease.release(failed=True)
        self._maybe_done()

    def _same_host(self, dest: str) -> bool:
        """Whether values for ``dest`` go through a shared segment: it shares this worker's memory domain."""
        return self._share_memory(self.engine.address, dest)

    def _share_memory(self, a: str, b: str) -> bool:
        """Whether workers ``a`` and ``b`` share a memory domain in this run."""
        domains, addresses = self.spec.domains, self.spec.addresses
        if not domains:
            return False
        da = domains[addresses.index(a)]
        return da is not None and da == domains[addresses.index(b)]

    async def _into_segment(self, items: list[Item]) -> tuple[Written | None, dict[str, Any] | None, list[Item]]:
        """The values of at least ``flowreduce.shm.min-bytes`` written into one leased segment of
        this worker's pool, and the message a peer reads them by; the rest stay as they are (all of
        them when no segment can be had: shared memory off, full or at its bound). Values already
        written for another peer that is still reading them are not written again: that peer's
        send holds the same lease."""
        big = [it for it in items if sum(a.nbytes for a in it[2]) >= self.engine.shm_min_bytes]
        if not big:
            return None, None, items
        rest = [it for it in items if sum(a.nbytes for a in it[2]) < self.engine.shm_min_bytes]
        which = tuple((c, n) for c, n, _ in big)
        written = self.written.get(which)
        writer = written is None
        if written is None:
            written = self._lease(which, big)
            if written is None:
                return None, None, items
            self.written[which] = written
        else:
            written.lease.hold()
        try:
            await (written.copy(big) if writer else written.copied.wait())
        except BaseException:  # this send ends here: it lets go of the lease
            written.release(failed=True)
            raise
        if not written.complete:  # the copy was cut short: its bytes are not the values
            written.release(failed=True)
            return None, None, items
        return written, written.message, rest

    def _lease(self, which: tuple[tuple[int, int], ...], big: list[Item]) -> Written | None:
        """A lease for ``big``'s values (each 64-byte aligned) and the message naming them: the
        segment's :class:`~flowreduce.shm.lease.Handle` and each value's ``[chunk, node, pieces]``
        (None: no segment to be had)."""
        where, at = layout([a for _, _, values in big for a in values], align=64)
        try:
            lease = Lease.take(at, owner=self.id)
        except _shm_pool.Unavailable:
            return None
        handle = lease.handle(where)
        return Written(self, which, lease, handle, at,
                       {"handle": handle.wire(), "values": [[c, n, len(values)] for c, n, values in big]})

    def _finish(self, index: int) -> None:
        """The plan rank ``index`` has its result: each member rank gets its own array."""
        chunks = self.finals.pop(index)
        pieces = [a for c in range(self.spec.chunks) for a in chunks[c]]
        out = _kernels.output([tuple(pieces)], self.spec.shape)
        handed = self.handed.get(index, ())
        wanted = [r for r in self.prog.members[index] if r in self.results]
        for i, rank in enumerate(wanted):
            mine = out if i == 0 and not any(np.may_share_memory(out, x) for x in handed) else out.copy()
            if not self.results[rank].done():  # never hand back a view of the user's input, nor one array twice
                self.results[rank].set_result(arrays.from_numpy(mine, self.spec.native))

    def _maybe_done(self) -> None:
        """Drop the run here once its outputs are taken, its nodes computed and its messages sent."""
        if (len(self.taken) == len(self.results) and not self.left and not self.offloaded and not self.sending
                and not any(self.held.values())):
            self.engine.ended(self)

    def fail(self, exc: BaseException) -> None:
        group = self.group
        if group is not None:  # its ranks asleep in a step wake at once
            group.abort(f"run {self.id} failed: {type(exc).__name__}: {exc}")
        _fail_all(self.results, exc)
        self.values.clear()
        self.inputs.clear()
        self.handed.clear()
        self.outbox.clear()
        self.held.clear()


#: The start of the names of a run's host group segments (with the run's id).
HOST_GROUP_PREFIX = "frp2p-"
#: Seconds a run's host group keeps yielding its core while it waits for its peers, before it sleeps
#: between polls (an SPMD rank yields for 50 ms: here the worker's event loop shares the process and
#: waits for the GIL the polling thread keeps taking back).
HOST_GROUP_YIELD = 1e-3


def through_host(spec: Spec) -> bool:
    """Whether run ``spec`` is one all-reduce of a host group (:meth:`Run._through_host`)."""
    return host_group_route(spec.algorithm, spec.domains, spec.ordered)


#: An input at most this big is copied into a shared segment when it arrives (:func:`publish`): if the
#: call runs through one host's shared memory, each worker then folds every rank's input from there,
#: with no wait for its peers (:meth:`Run.read_published`), instead of a host group's two steps and
#: its closing barrier. Above it, each worker folding every rank's input costs more than those waits
#: (with 4 ranks, 3 vectors read per worker where the group reads 3/4 of one).
PUBLISH_BYTES = 2 << 20
#: A fold of published inputs up to this many bytes runs on the event loop (under a millisecond).
FOLD_INLINE_BYTES = 4 << 20


def publish(token: str, x: Any) -> Handle | None:
    """Call ``token``'s input ``x`` here copied into a segment of this worker's pool (leased by the
    call until it ends: :meth:`Engine.drop_arrived` gives back its owner's leases); its handle, or
    None when ``x`` is not a numeric array of 1 to :data:`PUBLISH_BYTES` bytes or shared memory is
    off or full."""
    if not (isinstance(x, np.ndarray) and x.dtype.kind in "biufc" and 0 < x.nbytes <= PUBLISH_BYTES):
        return None
    if not _shm_pool.enabled():
        return None
    try:
        lease = Lease.take(x.nbytes, owner=published_owner(token))
    except _shm_pool.Unavailable:
        return None
    np.copyto(lease.view(x.dtype, x.size).reshape(x.shape), x)
    return lease.handle([(x.dtype, 0, x.size)])


def published_owner(token: str) -> str:
    """The owner of the segments call ``token``'s inputs are published in (given back together)."""
    return f"arrived-{token}"


def with_published(spec: Spec, handles: Sequence[Handle | None]) -> Spec:
    """``spec`` reading its ranks' published inputs (``handles``, per rank: :func:`publish`) when it
    is one all-reduce of a host group (:func:`through_host`) and every rank's input was published."""
    if not through_host(spec) or any(h is None for h in handles) or len(handles) != spec.ranks:
        return spec
    return replace(spec, published=tuple(cast(Handle, h) for h in handles))


def _published_view(handle: Handle, dtype: np.dtype, size: int) -> tuple[np.ndarray, Handle, _shm_pool.Segment]:
    """A published input (:func:`publish`) of ``size`` items of ``dtype``, read in place, with its
    handle and segment to check once read. Its segment gone means its worker died: the run restarts
    (WorkerLostError)."""
    try:
        seg = handle.segment()
    except RuntimeError as e:
        raise WorkerLostError(f"a rank's published input is gone: {e}") from None
    view = handle.arrays(seg)[0]
    if view.dtype != dtype or view.size != size:
        raise ValueError(f"a rank's published input is {view.size} items of {view.dtype}, not {size} of {dtype}")
    return view, handle, seg


def host_group_route(algorithm: str, domains: Sequence[Any], ordered: bool) -> bool:
    """Whether a run of ``algorithm`` over workers of memory ``domains`` (per worker; None: no shared
    memory) is one all-reduce of a host group: ``shm-direct`` over two or more workers that all share
    one host's memory, shared memory on (``flowreduce.shm.enabled``) on a machine whose stores are
    seen in order (:func:`~flowreduce.shm.host_group.stores_ordered`), and no partial sums of
    ``deterministic=True`` (``ordered``; the group folds the workers in order, as the plan does).
    The client prices the route by it, and each worker runs it by it."""
    return (algorithm == SHM_DIRECT and len(domains) > 1 and None not in domains and len(set(domains)) == 1
            and not ordered and _shm_pool.enabled() and stores_ordered())


async def _in_thread(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` on a new thread (not a pool's: runs waiting for each other must not wait for a slot)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(value)

    def target() -> None:
        try:
            value, error = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the worker's loop closed meanwhile: nobody awaits it
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await done


class Written:
    """A message's big values in one leased segment, read by one peer of the host or, when several
    are sent the same values (a broadcast), by each of them: every such send holds the lease, so
    the segment goes back to the pool once the last peer has copied the values out, and is
    discarded (never reused) if a send failed while a peer may read it."""

    def __init__(self, run: Run, which: tuple[tuple[int, int], ...], lease: Lease, handle: Handle, nbytes: int,
                 message: dict[str, Any]):
        self.run, self.which, self.lease, self.handle, self.message = run, which, lease, handle, message
        self.nbytes = nbytes  # the values' bytes as laid out in the segment
        self.copied = asyncio.Event()  # set once the copy ended, whether or not it completed
        self.complete = False

    async def copy(self, big: list[Item]) -> None:
        """``big``'s values into the segment (off the event loop when large); the sends waiting for
        them go on once it ends, whether or not it completed."""
        pieces = [a for _, _, values in big for a in values]

        def write() -> None:
            for a, view in zip(pieces, self.handle.arrays(self.lease.segment)):
                view[:] = a.reshape(-1)

        engine = self.run.engine
        try:
            if self.nbytes >= OFFLOAD_BYTES:
                await asyncio.get_running_loop().run_in_executor(engine.executor, write)
            else:
                write()
            self.complete = True
            engine.shared_sends += 1
        finally:
            self.copied.set()

    def release(self, failed: bool) -> None:
        """One send is done with the values (``failed``: the peer may still be reading them)."""
        if self.lease.holders == 1 and self.run.written.get(self.which) is self:
            del self.run.written[self.which]  # first: no later send may hold a lease given back
        self.lease.release(failed)


@dataclass(frozen=True)
class GatherSpec:
    """A call placed on arrival whose ranks hold pytrees (of numpy arrays or
    tensors, one future each): the engine's plans move one array, so every
    worker sends its ranks' values to the first worker, which reduces them
    leaf by leaf in rank order (the task path's kernels: accumulating dtype,
    the mean's division) and sends the result back to every worker."""

    op: str
    ranks: int
    addresses: tuple[str, ...]
    where: tuple[int, ...]
    outputs: tuple[int, ...] | None = None

    def members(self, index: int) -> tuple[int, ...]:
        return tuple(r for r, i in enumerate(self.where) if i == index)

    def worker(self, rank: int) -> str:
        return self.addresses[self.where[rank]]


class GatherRun:
    """One :class:`GatherSpec` run on one worker (the same face as :class:`Run` to the tasks and the engine)."""

    def __init__(self, engine: Engine, run: str, spec: GatherSpec):
        self.engine, self.id, self.spec = engine, run, spec
        loop = asyncio.get_running_loop()
        mine = spec.members(spec.addresses.index(engine.address))
        self.results: dict[int, asyncio.Future] = {r: loop.create_future() for r in mine
                                                    if spec.outputs is None or r in spec.outputs}
        self.root = spec.addresses[0] == engine.address
        self.values: dict[int, Any] = {}
        self.taken: set[int] = set()
        self.sent = not self.root  # the first worker is done once every worker has the result

    async def hand_in(self, index: int, xs: Sequence[Any]) -> None:
        values = dict(zip(self.spec.members(index), xs))
        if self.root:
            self.deliver_values(values)
            return
        reply = await self.engine.worker.rpc(self.spec.addresses[0]).flowreduce_p2p_objects(
            run=self.id, spec=to_serialize(self.spec), values=to_serialize(values))
        _check_reply(reply, self.spec.addresses[0], self.id)

    def deliver_values(self, values: Mapping[int, Any]) -> None:
        if not self.root:
            raise ValueError(f"run {self.id}'s values go to {self.spec.addresses[0]}, not {self.engine.address}")
        self.values.update(values)
        if len(self.values) == self.spec.ranks:
            asyncio.ensure_future(self._reduce_and_send())

    async def _reduce_and_send(self) -> None:
        try:
            ordered = [self.values.pop(r) for r in range(self.spec.ranks)]
            total = await asyncio.get_running_loop().run_in_executor(
                self.engine.executor, reduce_trees, self.spec.op, ordered)
            others = [a for a in self.spec.addresses if a != self.engine.address]
            replies = await asyncio.gather(*(self.engine.worker.rpc(a).flowreduce_p2p_objects(
                run=self.id, spec=to_serialize(self.spec), result=to_serialize(total)) for a in others))
            for a, reply in zip(others, replies):
                _check_reply(reply, a, self.id)
            self.deliver_result(total)
        except _Failed as e:
            self.engine.fail(self.id, e.error, tell=False)
            return
        except Exception as e:
            self.engine.fail(self.id, e, tell=True)
            return
        self.sent = True
        self._maybe_done()

    def deliver_result(self, total: Any) -> None:
        for i, rank in enumerate(sorted(self.results)):  # each rank its own copy
            if not self.results[rank].done():
                self.results[rank].set_result(total if i == 0 else copy.deepcopy(total))
        self._maybe_done()

    def _maybe_done(self) -> None:
        if len(self.taken) == len(self.results) and self.sent:
            self.engine.ended(self)

    def fail(self, exc: BaseException) -> None:
        _fail_all(self.results, exc)
        self.values.clear()


def _host_of(address: str) -> str:
    """The host an address names (an in-process worker's: its process's, as distributed says)."""
    try:
        return str(get_address_host(address))
    except ValueError:  # an in-process address of another process: not this host's to say
        return address


def _check_reply(reply: Any, address: str, run: str) -> None:
    if isinstance(reply, dict) and isinstance(reply.get("error"), BaseException):
        raise _Failed(reply["error"])
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        raise RuntimeError(f"worker {address} refused run {run}'s values: {reply!r}"[:300])


def reduce_trees(op_name: str, values: Sequence[Any]) -> Any:
    """The ranks' pytrees (in rank order) reduced leaf by leaf as the task path's kernels reduce one
    array: in the op's accumulating dtype, then its finish (a mean's division); each leaf given back in
    its library."""
    op = resolve_op(op_name)
    if type(values[0]).__module__.startswith("scipy.sparse"):
        return _reduce_sparse(op_name, values)
    tree = flatten(values[0])[1]
    flats = [leaves_as(v, tree) for v in values]  # dicts built in another order agree, leaf by leaf
    out = []
    for i, first in enumerate(flats[0]):
        xs = [arrays.to_numpy(f[i]) for f in flats]
        shape = np.shape(xs[0])
        acc = _combine(op, xs, op.accumulator(xs[0].dtype))
        acc = op.finish(acc, len(xs), owned=True).reshape(shape)
        out.append(arrays.from_numpy(acc, arrays.describe(first)[2]))
    return unflatten(tree, out)


def _reduce_sparse(op_name: str, values: Sequence[Any]) -> Any:
    """scipy.sparse inputs (one format and container, checked) reduced in rank order, in the first's format."""
    combine = {"sum": lambda a, b: a + b, "mean": lambda a, b: a + b, "max": lambda a, b: a.maximum(b),
               "min": lambda a, b: a.minimum(b), "prod": lambda a, b: a.multiply(b)}.get(op_name)
    if combine is None:
        raise InputTypeError(f"op {op_name!r} on scipy.sparse inputs that a call placed on arrival gathers: "
                             "sum, mean, max, min or prod (wait for the inputs to use the sparse algorithms)")
    total = values[0]
    for v in values[1:]:
        total = combine(total, v)
    if op_name == "mean":
        total = total / len(values)
    return total.asformat(values[0].format)


class _Failed(Exception):
    """A peer's reply: the run failed there, with ``error``."""

    def __init__(self, error: BaseException):
        self.error = error


def _pack(items: list[Item]) -> tuple[list[Any], np.ndarray, list[Item]]:
    """A message's values: ``[chunk, node, [[dtype, size], ...]]`` of the small
    ones, their bytes in one buffer, and the big ones as they are."""
    index: list[Any] = []
    small: list[np.ndarray] = []
    large: list[Item] = []
    for c, n, pieces in items:
        if sum(a.nbytes for a in pieces) < PACK_BYTES:
            index.append([c, n, [[a.dtype.str, a.size] for a in pieces]])
            small.extend(np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in pieces)
        else:
            large.append((c, n, pieces))
    return index, (np.concatenate(small) if small else np.empty(0, np.uint8)), large


def _unpack(index: Any, packed: Any) -> list[Item] | str:
    """The small values of a message, views of its buffer; or why it is not one :func:`_pack` makes."""
    if not isinstance(index, (list, tuple)) or len(index) > MAX_ITEMS:
        return f"index must be a list, got {type(index).__name__}"
    if not (isinstance(packed, np.ndarray) and packed.dtype == np.uint8 and packed.ndim == 1):
        return "packed must be a 1-D uint8 array"
    out: list[Item] = []
    at = 0
    for entry in index:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and type(entry[0]) is int
                and type(entry[1]) is int and isinstance(entry[2], (list, tuple))):
            return "an index entry is not [chunk, node, pieces]"
        pieces = []
        for piece in entry[2]:
            if not (isinstance(piece, (list, tuple)) and len(piece) == 2 and isinstance(piece[0], str)
                    and len(piece[0]) <= 8 and type(piece[1]) is int and piece[1] >= 0):
                return "a piece is not [dtype, size]"
            dtype = peer_dtype(piece[0])
            if isinstance(dtype, str):
                return dtype
            nbytes = dtype.itemsize * piece[1]
            if at + nbytes > packed.size:
                return "pieces overrun the packed buffer"
            pieces.append(packed[at:at + nbytes].view(dtype))
            at += nbytes
        out.append((entry[0], entry[1], tuple(pieces)))
    if at != packed.size:
        return "the packed buffer is longer than its pieces"
    return out


def _combine(op: Any, xs: Sequence[np.ndarray], dtype: np.dtype | None) -> np.ndarray:
    """Ranks' inputs combined in rank order into a new flat array (in ``dtype`` when the op accumulates wider)."""
    acc = np.array(xs[0].reshape(-1), dtype=dtype, copy=True)
    for x in xs[1:]:
        op.combine(acc, x.reshape(-1), out=acc)
    return acc


def _fail_all(results: Mapping[int, asyncio.Future], exc: BaseException) -> None:
    """Every result not set yet raises ``exc``."""
    for fut in results.values():
        if not fut.done():
            fut.set_exception(exc)
            fut.add_done_callback(_retrieved)


def _retrieved(fut: asyncio.Future) -> None:
    fut.exception()  # nobody may await it: do not log "exception never retrieved"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (", ..." if len(ranks) > 20 else "")


class Engine:
    """The worker extension: the runs in progress on this worker."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.runs: dict[str, Any] = {}  # Run or GatherRun
        self.failed: OrderedDict[str, BaseException] = OrderedDict()
        #: runs that ended here (FAILED_KEPT at most): a task of one that Dask runs again does nothing
        self.done: OrderedDict[str, None] = OrderedDict()
        #: run -> peer -> the step it is ready for, said before the run started here (:meth:`ready`)
        self.early_ready: OrderedDict[str, dict[str, int]] = OrderedDict()
        #: values for a worker of this host at least this big go through a shared segment
        self.shm_min_bytes = int(_shm_pool.config()["min-bytes"])
        self.shared_sends = 0  # messages whose big values went through a segment (tests read it)
        self.host_runs = 0  # runs done here as one collective of a host group (tests read it)
        self.published_runs = 0  # of those, runs that folded their ranks' published inputs (tests read it)
        self.ready_heard = 0  # peers' word that they are ready for a step (paced values: tests read it)
        #: call token -> rank -> its input, kept from its arrive task until the scheduler says the call ended
        self.arrived: dict[str, dict[int, np.ndarray]] = {}
        #: call token -> its latest run here, for its results waiting since their rank arrived
        self.begun: dict[str, Begun] = {}
        #: calls placed on arrival refused or failed before they began (FAILED_KEPT at most): a result of
        #: one that starts late raises this (until a rank of it arrives again: computed again)
        self.ended_calls: OrderedDict[str, BaseException] = OrderedDict()
        #: inputs of calls on futures placed on arrival, kept when they go to memory here (the worker plugin's
        #: transition hook): key -> [(token, rank), ...], and token -> those keys, until the call ends
        self.awaited: dict[Hashable, list[tuple[str, int]]] = {}
        self.awaited_by_token: dict[str, list[Hashable]] = {}
        self._place: tuple[Any, ...] | None = None
        self.log = EngineLog(worker)  # what the runs did, for traces and the dashboard (engine_log.py)

    @property
    def address(self) -> str:
        return str(self.worker.address)

    @property
    def executor(self) -> Any:
        return self.worker.executors.get("default")

    def run(self, run: str, spec: Spec | GatherSpec) -> Any:
        """The run ``run`` here, started if new (a peer's message may start it before the rank's hand-in)."""
        if run in self.failed:
            raise self.failed[run].with_traceback(None)
        if run in self.done:
            raise ValueError(f"run {run} has ended here")
        found = self.runs.get(run)
        if found is None:
            if self.address not in spec.addresses:
                raise ValueError(f"run {run} has no rank on worker {self.address}")
            found = self.runs[run] = Run(self, run, spec) if isinstance(spec, Spec) else GatherRun(self, run, spec)
        elif found.spec != spec:
            raise ValueError(f"run {run} is already running here with another spec")
        return found

    @property
    def place(self) -> tuple[Any, ...]:
        """This worker's :class:`~flowreduce.schedule.hosts.Place`, as a tuple (asked once)."""
        if self._place is None:
            self._place = astuple(hosts.worker_place(self.worker))
        return self._place

    def await_keys(self, keys: Any = None, **other: Any) -> None:
        """Stream message from :class:`P2PSchedulerPlugin`: the inputs of
        calls on futures placed on arrival (``[key, token, rank]`` each): each
        arrives when it goes to memory here (:meth:`in_memory`), or now if it
        is here already."""
        if other or not isinstance(keys, (list, tuple)) or not all(
                isinstance(k, (list, tuple)) and len(k) == 3 for k in keys):
            logger.error("flowreduce: %s refused a stream message: keys %r, others %s", AWAIT, type(keys).__name__,
                         sorted(other)[:5])
            return
        state = self.worker.state.tasks
        for key, token, rank in keys:
            key = _as_key(key)
            if not isinstance(token, str) or type(rank) is not int or not isinstance(key, (str, bytes, int, tuple)):
                continue
            try:
                hash(key)
            except TypeError:  # a tuple holding something unhashable: no task's key
                continue
            ts = state.get(key)
            if ts is not None and ts.state == "memory" and key in self.worker.data:
                self._arrive_awaited(token, rank, self.worker.data[key])
            else:
                self.awaited.setdefault(key, []).append((token, rank))
                self.awaited_by_token.setdefault(token, []).append(key)

    def in_memory(self, key: Hashable) -> None:
        """Task ``key`` went to memory here: the ranks awaiting it arrive."""
        found = self.awaited.pop(key, None)
        if found is None or key not in self.worker.data:
            return
        for token, rank in found:
            self._arrive_awaited(token, rank, self.worker.data[key])

    def _arrive_awaited(self, token: str, rank: int, x: Any) -> None:
        if token in self.ended_calls:
            return  # failed before it began
        try:
            arrive_value(self, token, rank, x)
        except Exception as e:  # noqa: BLE001 - the result task arrives it again, and fails with this
            logger.warning("flowreduce: rank %d of all-reduce %s could not arrive on %s: %r", rank, token,
                           self.address, e)

    def forget_awaited(self, key: Hashable) -> None:
        """Task ``key`` was forgotten here: no rank arrives from it (it arrives again if computed again)."""
        self.awaited.pop(key, None)

    def begun_by_scheduler(self, run: Any = None, token: Any = None, spec: Any = None, **other: Any) -> None:
        """Stream message from :class:`P2PSchedulerPlugin`: call ``token``
        begins as ``run`` with ``spec``: this worker's ranks' inputs, kept
        since they arrived, are handed in (the run goes on in the
        background). A worker that cannot begin fails the run on every
        worker of it."""
        if other or not isinstance(run, str) or not isinstance(token, str) or not isinstance(spec, (Spec, GatherSpec)):
            logger.error("flowreduce: %s refused a stream message: run %r, token %r, spec %r, others %s", BEGUN,
                         type(run).__name__, type(token).__name__, type(spec).__name__, sorted(other)[:5])
            return
        try:
            index = spec.addresses.index(self.address)
            here = self.arrived.get(token, {})
            members = spec.members(index)
            missing = [r for r in members if r not in here]
            if missing:
                raise WorkerLostError(f"the inputs of ranks {_ranks(missing)} of all-reduce {token} are no longer "
                                      f"on worker {self.address}")
            found = self.run(run, spec)
        except Exception as e:
            exc = RuntimeError(f"all-reduce {token}: worker {self.address} could not begin run {run}: {e!r}"[:500])
            logger.warning("flowreduce: %s", exc)
            self.fail(run, exc, tell=True, spec=spec)
            self.begun.setdefault(token, Begun()).set(run=run)  # its results here raise
            return
        self.begun.setdefault(token, Begun()).set(run=run)
        asyncio.ensure_future(self._hand_in(found, index, [here[r] for r in members]))

    async def objects(self, run: Any = None, spec: Any = None, values: Any = None, result: Any = None,
                      **other: Any) -> dict[str, Any]:
        """Handler: a :class:`GatherRun`'s ranks' values (``{rank: value}``,
        for the run's first worker) or its result (from there)."""
        if (other or not isinstance(run, str) or not isinstance(spec, GatherSpec)
                or (values is None) == (result is None) or (values is not None and not (
                    isinstance(values, dict) and all(type(r) is int and 0 <= r < spec.ranks for r in values)))):
            return refused(OBJECTS, f"bad arguments: run {type(run).__name__}, spec {type(spec).__name__}, "
                                    f"values {type(values).__name__}, others {sorted(map(str, other))[:5]}")
        if run in self.failed:
            return {"status": "error", "message": "failed", "error": to_serialize(self.failed[run])}
        try:
            found = self.runs.get(run) or self.run(run, spec)
            if values is not None:
                found.deliver_values(values)
            else:
                found.deliver_result(result)
        except Exception as e:
            self.fail(run, e, tell=True)
            return {"status": "error", "message": f"{e!r}"[:300]}
        return {"status": "OK"}

    def drop_arrived(self, token: Any = None, error: Any = None, **other: Any) -> None:
        """Stream message from :class:`P2PSchedulerPlugin`: call ``token``
        ended, or was abandoned, or its barrier failed with ``error`` (its
        results still waiting here raise it)."""
        if other or not isinstance(token, str):
            logger.error("flowreduce: %s refused a stream message: token %r, others %s", DROP, type(token).__name__,
                         sorted(other)[:5])
            return
        self.arrived.pop(token, None)
        pool = _shm_pool.current()
        if pool is not None:  # every worker's fold of them is done: the call ended
            pool.release_owner(published_owner(token))
        for key in self.awaited_by_token.pop(token, ()):
            left = [a for a in self.awaited.get(key, ()) if a[0] != token]
            if left:
                self.awaited[key] = left
            else:
                self.awaited.pop(key, None)
        exc = _exception(error) if error is not None else RuntimeError(
            f"all-reduce {token} ended before this rank's result was taken")
        if error is not None:  # a result that starts after this raises it too
            self.ended_calls[token] = exc
            while len(self.ended_calls) > FAILED_KEPT:
                self.ended_calls.popitem(last=False)
        begun = self.begun.pop(token, None)
        if begun is not None:
            begun.set(error=exc)

    async def _hand_in(self, found: Any, index: int, xs: list[Any]) -> None:
        try:
            await found.hand_in(index, xs)
        except _Failed as e:  # it failed there first: fail here with its error
            self.fail(found.id, e.error, tell=False)
        except Exception as e:
            self.fail(found.id, e, tell=True)

    def ended(self, found: Any) -> None:
        """Drop run ``found`` (a :class:`Run` or :class:`GatherRun`) here: it
        ended; a task of it that Dask runs again does nothing."""
        run = found.id
        if self.runs.get(run) is found:
            del self.runs[run]
            self.done[run] = None
            while len(self.done) > FAILED_KEPT:
                self.done.popitem(last=False)

    def fail(self, run: str, exc: BaseException, tell: bool, spec: Spec | GatherSpec | None = None) -> None:
        """Fail ``run`` here (its outputs raise ``exc``), drop its state, and
        if ``tell``, tell the run's other workers (those of ``spec`` if the
        run never started here)."""
        found = self.runs.pop(run, None)
        if run not in self.failed:
            self.failed[run] = exc
            while len(self.failed) > FAILED_KEPT:
                self.failed.popitem(last=False)
        if found is not None:
            found.fail(exc)
            logger.info("flowreduce: p2p run %s failed on %s: %s", run, self.address, exc)
            spec = found.spec
        if tell and spec is not None:
            for address in spec.addresses:
                if address != self.address:
                    asyncio.ensure_future(self._tell(address, run, exc))

    async def _tell(self, address: str, run: str, exc: BaseException) -> None:
        try:
            await self.worker.rpc(address).flowreduce_p2p_fail(run=run, error=to_serialize(exc))
        except Exception as e:  # the peer is gone too: the scheduler tells the others
            logger.debug("flowreduce: could not tell %s that run %s failed: %r", address, run, e)

    # -- handlers ---------------------------------------------------------------
    async def receive(self, run: Any = None, index: Any = None, packed: Any = None, items: Any = None,
                      spec: Any = None, shared: Any = None, **other: Any) -> dict[str, Any]:
        """A peer's values for ``run`` (:func:`_pack`'s three parts, and the
        handle of a segment on this host holding the big ones, copied out
        here before answering). Anything but what :meth:`Run._send` sends
        (unknown arguments or run, a buffer that does not match its index, a
        segment that is not a flowreduce one of that generation or too small,
        items that are not this run's nodes for this worker or not of their
        size) is refused with a logged error."""
        why = f"unknown arguments {sorted(map(str, other))[:10]}" if other else None
        small = _unpack(index, packed) if why is None else []
        if isinstance(small, str):
            why = small
        elif why is None and shared is not None:
            mapped = await self._from_segment(shared)
            if isinstance(mapped, str):
                why = mapped
            elif isinstance(items, list):
                items = items + mapped
        if why is None and not isinstance(small, str):
            items = small + items if isinstance(items, list) else items
            why = _refusal(self, run, items, spec)
        if why is not None:
            if why == "failed":
                return {"status": "error", "message": "failed", "error": to_serialize(self.failed[run])}
            return refused(RECEIVE, why)
        self.log.receive(run, items)
        try:
            found = self.runs.get(run) or self.run(run, spec)
            found.deliver(items)
        except Exception as e:
            self.fail(run, e, tell=True)
            return {"status": "error", "message": f"{e!r}"[:300]}
        return {"status": "OK"}

    async def _from_segment(self, shared: Any) -> list[Item] | str:
        """Private copies of the values a peer wrote into its segment (:meth:`Run._into_segment`),
        or why the handle is refused."""
        if not (isinstance(shared, dict) and set(shared) == {"handle", "values"}
                and isinstance(shared["values"], (list, tuple)) and len(shared["values"]) <= MAX_ITEMS):
            return "shared must be a segment handle and its values {handle, values}"
        try:
            handle = Handle.from_wire(shared["handle"])
            seg = handle.segment()
            if not handle.current(seg):
                return f"segment {seg.name} holds another lease than the one sent"
            views = handle.arrays(seg, kinds=NUMERIC)
        except (_shm_pool.Refused, _shm_pool.Unavailable, RuntimeError) as e:
            return f"segment {str(shared['handle'])[:80]}: {e}"[:300]
        where: list[tuple[int, int, list[np.ndarray]]] = []
        at = 0  # the first piece of the next value
        for entry in shared["values"]:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(type(e) is int for e in entry)
                    and entry[2] >= 0):
                return "a shared value is not [chunk, node, pieces]"
            if at + entry[2] > len(views):
                return f"the values of segment {seg.name} name more than its {len(views)} pieces"
            where.append((entry[0], entry[1], views[at:at + entry[2]]))
            at += entry[2]
        if at != len(views):
            return f"the values of segment {seg.name} do not name its {len(views)} pieces"

        def copy() -> list[Item]:
            return [(c, n, tuple(np.array(v) for v in pieces)) for c, n, pieces in where]

        nbytes = sum(v.nbytes for v in views)
        if nbytes >= OFFLOAD_BYTES:
            return await asyncio.get_running_loop().run_in_executor(self.executor, copy)
        return copy()

    def ready(self, run: Any = None, step: Any = None, peer: Any = None, **other: Any) -> dict[str, str]:
        """Handler: worker ``peer`` of ``run`` has every paced value it receives of the steps before
        ``step`` (:data:`PACED_BYTES`): my values for it of that step go. Said before the run started
        here, it is kept until it does."""
        if (other or not isinstance(run, str) or len(run) > 100 or type(step) is not int or step < 0
                or not isinstance(peer, str) or len(peer) > 300):
            why = (f"bad arguments: run {type(run).__name__}, step {type(step).__name__}, peer {type(peer).__name__}, "
                   f"others {sorted(map(str, other))[:5]}")
            return refused(READY, why)
        self.ready_heard += 1
        if run in self.failed or run in self.done:
            return {"status": "OK"}
        found = self.runs.get(run)
        if isinstance(found, Run):
            found.clear(peer, step)
        elif found is None:
            early = self.early_ready.setdefault(run, {})
            early[peer] = max(step, early.get(peer, -1))
            while len(self.early_ready) > FAILED_KEPT:
                self.early_ready.popitem(last=False)
        return {"status": "OK"}

    def failed_elsewhere(self, run: Any = None, error: Any = None, **other: Any) -> dict[str, str]:
        """A peer (or the scheduler) says ``run`` failed: fail it here too."""
        if other or not isinstance(run, str) or not isinstance(error, BaseException):
            why = f"bad arguments: run {type(run).__name__}, error {type(error).__name__}, others {sorted(other)[:5]}"
            return refused(FAIL, why)
        self.fail(run, error, tell=False)
        return {"status": "OK"}

    def scheduler_says(self, run: Any = None, message: Any = None, lost: Any = False, **other: Any) -> None:
        """Stream message from :class:`P2PSchedulerPlugin`: ``run`` cannot finish."""
        if other or not isinstance(run, str) or not isinstance(message, str):
            logger.error("flowreduce: %s refused a stream message: run %r, others %s", FAIL, type(run).__name__,
                         sorted(other)[:5])
            return
        self.fail(run, (WorkerLostError if lost else RuntimeError)(message), tell=False)


def _refusal(engine: Engine, run: Any, items: Any, spec: Any) -> str | None:
    """Why a :data:`RECEIVE` request's values are not ones a peer's run sends, or None."""
    if not isinstance(run, str) or len(run) > 100:
        return f"run must be a run id, got {type(run).__name__}"
    if run in engine.failed:
        return "failed"
    if run in engine.done:
        return f"run {run!r} has ended here"
    found = engine.runs.get(run)
    if found is None:
        if not isinstance(spec, Spec):
            return f"unknown run {run!r} (and no spec to start it)"
        if engine.address not in spec.addresses:
            return f"run {run!r} has no rank on this worker"
        try:
            prog = program(spec, engine.address)
        except Exception as e:
            return f"run {run!r}'s spec does not plan: {e!r}"[:300]
    else:
        prog = found.prog
    if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS:
        return f"items must be a non-empty list, got {type(items).__name__}"
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], int) and isinstance(item[1], int)
                and isinstance(item[2], tuple)):
            return "an item is not (chunk, node, pieces)"
        c, n, pieces = item
        if not 0 <= c < prog.spec.chunks or n not in prog.received:
            return f"run {run!r} has no value {c, n} for this worker"
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 for a in pieces):
            return f"value {c, n} is not 1-D arrays"
        if sum(a.size for a in pieces) != prog.expected(c, n):
            return f"value {c, n} has {sum(a.size for a in pieces)} elements, not {prog.expected(c, n)}"
    return None


class P2PWorkerPlugin(WorkerPlugin):
    """The engine's part of flowreduce's worker extension: an :class:`Engine` on every worker."""

    engine: Engine | None = None

    def setup(self, worker: Any) -> None:
        self.engine = Engine(worker)

    def handlers(self) -> dict[str, Callable[..., Any]]:
        engine = self.engine
        assert engine is not None  # set up
        return {RECEIVE: engine.receive, FAIL: engine.failed_elsewhere, OBJECTS: engine.objects, READY: engine.ready}

    def stream_handlers(self) -> dict[str, Callable[..., Any]]:
        engine = self.engine
        assert engine is not None  # set up
        return {FAIL: engine.scheduler_says, DROP: engine.drop_arrived, BEGUN: engine.begun_by_scheduler,
                AWAIT: engine.await_keys}

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        """Every task's transition on this worker: an input of a call on
        futures placed on arrival arrives as it goes to memory, before the
        scheduler hears of it (its message goes first on the same stream).
        Nothing else is done while no input is awaited here."""
        engine = self.engine
        if engine is None or not engine.awaited or key not in engine.awaited:
            return
        if finish == "memory":
            engine.in_memory(key)
        elif finish == "forgotten":
            engine.forget_awaited(key)



class P2PSchedulerPlugin(SchedulerPlugin):
    """The p2p runs' part of flowreduce's scheduler extension. Tells a run's
    workers when it cannot finish: one of them left, or its tasks erred or
    were forgotten before every output was computed."""

    def __init__(self) -> None:
        self.scheduler: Any = None
        #: call token -> (worker -> its ranks, outputs not yet in memory)
        self.active: dict[str, tuple[dict[str, list[int]], set[Hashable]]] = {}
        #: call token -> its current run id, once restarted (else attempt 0's)
        self.runs: dict[str, str] = {}
        #: calls placed when their inputs arrived: token -> the attempts begun so far
        self.begun: OrderedDict[str, int] = OrderedDict()
        #: token -> what such a call ran (a pickled CallRecord, for describe)
        self.records: OrderedDict[str, bytes] = OrderedDict()
        self.record_waiters: dict[str, asyncio.Event] = {}
        #: calls placed on arrival some of whose ranks arrived: every worker is told when one ends (a
        #: rank's arrive task may have run, and kept its input, on a worker its key no longer lists)
        self.keeping: set[str] = set()
        #: call token -> rank -> where it arrived and what it holds (pickled), until the call begins
        self.arrivals: OrderedDict[str, dict[int, bytes]] = OrderedDict()
        #: calls placed on arrival begun (or refused) and not ended: their ranks arriving again change nothing
        self.started: set[str] = set()
        #: calls placed on arrival that lost a worker: they begin again when every rank has arrived again
        self.restarting: set[str] = set()
        #: the decision of each call placed on arrival that began (its ``decide`` and results' keys), for its
        #: next attempt after its barrier task is gone (the newest 4096 calls)
        self.decisions: OrderedDict[str, tuple[Any, tuple[Hashable, ...]]] = OrderedDict()
        #: calls placed on arrival that failed before they began (an input failed, or was refused): token ->
        #: the error their results raise, also those of ranks arriving later (the newest 4096 calls)
        self.doomed: OrderedDict[str, Any] = OrderedDict()
        #: calls on futures or collections placed on arrival, not ended: token -> their decision (``decide``,
        #: the results' keys), taken from their results as the first waits to run
        self.pending: dict[str, tuple[Any, tuple[Hashable, ...]]] = {}
        #: per call of ``pending``, each rank's input key (None: not known), kept wanted until computed
        self.inputs: dict[str, tuple[Hashable | None, ...]] = {}
        #: results of such calls let go while their run goes on: token -> their keys (their workers drop the
        #: run when the others are in memory: those results are never taken there)
        self.let_go: dict[str, set[Hashable]] = {}

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {RECORD: self.record}

    def stream_handlers(self) -> dict[str, Callable[..., Any]]:
        # the engines' steps, for the dashboard's grid
        return {ARRIVED: self.arrived, STALE: self.stale, **engine_steps_handler(self.scheduler)}

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if not (isinstance(key, tuple) and isinstance(key[0], str) and key[0].startswith("flowreduce-")):
            return
        # every transition of every key passes here: no parsing but of a p2p call's barrier
        token = key[0].rpartition("-")[2]
        if token not in self.active and finish == "waiting" and f"-{BARRIER}-" in key[0] and token not in self.begun:
            ts = self.scheduler.tasks[key]
            where: dict[str, list[int]] = defaultdict(list)
            for dts in ts.dependents:  # the outputs, one per rank, pinned to its worker
                rank = parse(dts.key)["rank"]  # type: ignore[index]
                for w in dts.worker_restrictions or ():
                    where[w].append(rank)
            if where:  # else a call placed when its inputs arrive: it is followed from its begin
                self.active[token] = (dict(where), {d.key for d in ts.dependents})
            return
        if finish == "waiting" and token not in self.pending and token not in self.doomed and f"-{OUTPUT}-" in key[0]:
            spec = self.scheduler.tasks[key].run_spec
            if isinstance(spec, Task) and spec.func is take_out_arrived and len(spec.args) == 6:
                self._keep_collection(token, spec.args[4], spec.args[5].keys)  # on futures, or collections computed together
        if f"-{ARRIVE}-" in key[0]:
            if finish == "memory" and token in self.doomed:  # its result, sent there next, raises the error
                bs = self.scheduler.stream_comms.get(next(iter(self.scheduler.tasks[key].who_has)).address)
                if bs is not None:
                    bs.send({"op": DROP, "token": token, "error": self.doomed[token]})
            elif finish == "memory":
                self.keeping.add(token)
                self._pin_result(key)
                self._begin_if_arrived(token, _barrier_of(key))
            return
        if token not in self.active:
            if token not in self.pending and not self._placed_on_arrival(key):
                return
            if finish == "erred" and (token not in self.started or token in self.restarting) \
                    and token not in self.doomed:
                ts = self.scheduler.tasks.get(key)  # an input failed before the call began (or began again)
                self._doom(token, getattr((ts.exception_blame or ts) if ts is not None else None, "exception", None))
                asyncio.get_running_loop().call_soon(self._let_go, _barrier_of(key))
            elif f"-{BARRIER}-" in key[0]:
                if finish == "forgotten" and token not in self.started and token not in self.pending:
                    self._end(token)  # it never began, and never will (if doomed, ranks arriving late are told still)
            elif finish in ("erred", "forgotten") and token in self.pending and token not in self.started:
                self._end_if_settled(token, key)  # every result let go before the call began: it never will
            elif finish in ("erred", "forgotten") and token in self.started and token in self.decisions:
                self._end_if_settled(token, key)  # a result failed or was let go while the call began again
            return
        outputs = self.active[token][1]
        if finish == "forgotten" and key in outputs and token in self.pending:
            outputs.discard(key)  # a result of a call on futures let go while it runs: the others go on
            self.let_go.setdefault(token, set()).add(key)
            if not outputs:
                self._done(token)
        elif finish == "erred" or (finish == "forgotten" and key in outputs):  # failed, or cancelled
            what = "erred" if finish == "erred" else "was cancelled"
            ts = self.scheduler.tasks.get(key)
            why = f" ({(ts.exception_blame or ts).exception_text})" if finish == "erred" and ts is not None else ""
            self._fail(token, f"all-reduce {token}: task {key!r} {what} before every rank's result was "
                              f"computed{why}"[:2000], lost=False)
        elif finish == "memory" and key in outputs:
            outputs.discard(key)
            if not outputs:
                self._done(token)

    def _done(self, token: str) -> None:
        """Every result of call ``token`` still wanted is in memory: it ends.
        The workers of results let go drop the run (never taken there)."""
        where, _ = self.active.pop(token)
        restarted = self.runs.pop(token, None)
        if restarted is not None and token not in self.begun:  # a result the old run finished is not taken
            self.tell(where, restarted, f"run {restarted} ended: every result is in memory", lost=False)
        let_go = {(parse(k) or {}).get("rank") for k in self.let_go.pop(token, ())}
        if let_go and restarted is not None:
            self.tell([w for w, ranks in where.items() if let_go & set(ranks)], restarted,
                      f"run {restarted} ended: every result is in memory or was let go", lost=False)
        self._end(token)

    def arrived(self, token: Any = None, rank: Any = None, arrival: Any = None, worker: Any = None,
                **other: Any) -> None:
        """Stream message from an engine (:func:`arrive_value`): rank ``rank`` of call ``token`` arrived on ``worker``."""
        if other or not isinstance(token, str) or type(rank) is not int or not isinstance(arrival, bytes):
            logger.error("flowreduce: %s refused a stream message: token %r, rank %r, others %s", ARRIVED,
                         type(token).__name__, type(rank).__name__, sorted(other)[:5])
            return
        if token in self.doomed:  # its result there raises the error (the rank arrived late, or again)
            bs = self.scheduler.stream_comms.get(worker)
            if bs is not None:
                bs.send({"op": DROP, "token": token, "error": self.doomed[token]})
            return
        if token in self.pending:
            self._arrived_on_futures(token, rank, arrival, worker)
            return
        self.arrivals.setdefault(token, {})[rank] = arrival
        while len(self.arrivals) > 4096:
            self.arrivals.popitem(last=False)

    def not_arrived(self, token: str) -> list[int] | None:
        """The ranks of call ``token`` placed on arrival that have not arrived yet (None: it is not
        waiting for its ranks: not such a call, or it began)."""
        if token not in self.pending or (token in self.started and token not in self.restarting):
            return None
        found = self.arrivals.get(token, {})
        return [r for r in range(len(self.pending[token][1])) if r not in found]

    def _input_keys(self, decide: Any, outputs: Sequence[Hashable]) -> tuple[Hashable | None, ...]:
        """Each rank's input key: a call on futures' (its decision has them), else the rank's result's
        only dependency (None while that result is not on the scheduler)."""
        given = tuple(getattr(decide, "input_keys", ()))
        if given:
            return given
        tasks = self.scheduler.tasks
        return tuple(next(iter(ts.dependencies)).key if ts is not None and len(ts.dependencies) == 1 else None
                     for ts in map(tasks.get, outputs))

    def _keep_collection(self, token: str, decide: Any, outputs: tuple[Hashable, ...]) -> None:
        """The graph of call ``token`` on futures, or on Dask collections
        every result computed together (:func:`lower_collection`), came in (a
        result is waiting): its decision, which each result carries, is kept
        here until the last rank arrived. Every input still being computed
        (a call on futures', or the only dependency of each result of a
        collection's) is wanted until it is (as ``fire_and_forget`` does:
        every rank arrives even if the caller lets go of some results, and of
        the inputs: ``client.compute(out)[0]``). The workers that hold or compute each input (the
        result's only dependency) are told to keep it in their engine as it
        goes to memory. Results the graph left out (only some computed, with
        Dask's optimisation off: the others' inputs are not computed either)
        fail every result, naming their ranks."""
        self.pending[token] = (decide, outputs)
        self.keeping.add(token)  # the workers told to await its inputs let go of them when it ends
        s = self.scheduler
        on_futures = bool(getattr(decide, "input_keys", ()))
        # a collection's inputs: each result's only dependency, there now for every result asked for
        self.inputs[token] = inputs = self._input_keys(decide, outputs)
        guard = getattr(s.plugins.get(EXTENSION), "guard", None)  # the extension's guard (not imported: a cycle)
        if guard is not None:
            # its results are watched from here (the call's timeout, inputs lost) as its graph comes: a
            # collection's graph is the user's compute, and a call on futures sends nothing but its graph
            timeout = getattr(getattr(decide, "settings", None), "timeout", None)
            guard.watch(token=token, outputs=list(outputs), inputs=[[k] if k is not None else [] for k in inputs],
                        timeout=timeout)
        forgotten = s.clients.get("fire-and-forget")
        # a collection's inputs are still released as its first result waits (Dask makes them waiting next)
        settled = (*SETTLED, "released", "forgotten") if on_futures else (*SETTLED, "forgotten")
        for k in inputs:
            its = s.tasks.get(k) if k is not None else None
            if forgotten is not None and its is not None and its.state not in settled:
                if its.who_wants is None:
                    its.who_wants = set()
                its.who_wants.add(forgotten)
                forgotten.wants_what.add(its)
        self._await(token, range(len(outputs)))
        # once the graph's every task has had its transition (the other results are waiting, or not asked for)
        asyncio.get_running_loop().call_soon(self._check_collection, token, outputs)

    def _check_collection(self, token: str, outputs: tuple[Hashable, ...]) -> None:
        """Every rank of call ``token`` on collections, just registered, will
        arrive: its result is to be computed (it arrives its input when it runs,
        if the worker plugin did not first), or its input is (or is in memory:
        a result lost with a worker, computed again). A rank neither is (only
        some asked for with Dask's optimisation off, or a graph of the same
        keys culled for some results that came while this one's tasks were
        still there: Dask kept those) arrives through the arrive tasks and
        barrier of the culled graph, if they came, made wanted here; else the
        call fails, its results naming the ranks."""
        s = self.scheduler
        if self.pending.get(token, (None, None))[1] is not outputs or token in self.started:
            return
        found = self.arrivals.get(token, {})
        computing = ("waiting", "processing", "queued", "no-worker")
        inputs = self.inputs.get(token, ())  # wanted here until computed (_keep_collection)

        def coming(r: int, k: Hashable) -> bool:  # computed (it arrives its input), or its input is (awaited)
            ts = s.tasks.get(k)
            if r < len(inputs) and inputs[r] is not None and inputs[r] in s.tasks:
                return s.tasks[inputs[r]].state in (*computing, "memory")
            return ts is not None and (ts.state in computing or (len(ts.dependencies) == 1 and next(
                iter(ts.dependencies)).state in (*computing, "memory")))

        missing = [r for r, k in enumerate(outputs) if r not in found and not coming(r, k)
                   and not self._compute_input_again(token, k, inputs[r] if r < len(inputs) else None)]
        if not missing:
            return
        gate = _barrier_of(outputs[0])
        ts = s.tasks.get(gate)
        if ts is not None and isinstance(ts.run_spec, Task) and ts.run_spec.func is hold_decision and ts.dependencies:
            self._compute_for_the_call(gate, f"flowreduce-arrive-{token}-{_now()}")
            return
        self._doom(token, to_serialize(InputStateError(
            f"all-reduce {token} on Dask collections: the results of ranks {missing[:20]} are not being computed, "
            "and so neither are their inputs: compute every rank's result together, or let Dask optimise the "
            "graph (it then computes every rank's input for the results asked for)")))

    def _compute_input_again(self, token: str, output: Hashable, key: Hashable | None) -> bool:
        """A rank's result is still in memory (a future of an earlier compute
        of the same keys holds it) but its input was let go: the other ranks'
        results, computed again, need that input. Whether it is wanted
        (until computed) and computed again here, where it arrives as any
        input does; the run leaves the kept result as it is."""
        s = self.scheduler
        out, its = s.tasks.get(output), s.tasks.get(key) if key is not None else None
        forgotten = s.clients.get("fire-and-forget")
        if out is None or out.state != "memory" or its is None or its.state != "released" or its.run_spec is None \
                or forgotten is None:
            return False
        self._compute_for_the_call(key, f"flowreduce-input-again-{token}-{_now()}")
        return True

    def _compute_for_the_call(self, key: Hashable, stimulus_id: str) -> None:
        """Task ``key`` is computed for a call whether or not a caller wants it: Dask's
        fire-and-forget client wants it until it is, and it starts now if it was released."""
        s = self.scheduler
        s.client_desires_keys(keys=[key], client="fire-and-forget")
        if s.tasks[key].state == "released":
            s.transitions({key: "waiting"}, stimulus_id=stimulus_id)

    def _await(self, token: str, ranks: Iterable[int]) -> None:
        """Tell the workers holding, computing or bound to the inputs of
        ``ranks`` of call ``token`` (every worker for an input that is none
        of these yet) to keep each in their engine as it goes to memory."""
        s = self.scheduler
        inputs = self._input_keys(*self.pending[token])
        by_worker: dict[str, list[list[Any]]] = defaultdict(list)
        for r in ranks:
            key = inputs[r]
            if key is None:
                continue
            its = s.tasks.get(key)
            where: set[str] = set()
            if its is not None:
                where |= {ws.address for ws in its.who_has or ()}
                if its.processing_on is not None:
                    where.add(its.processing_on.address)
                where |= set(its.worker_restrictions or ())
            for address in where or s.stream_comms:
                by_worker[address].append([key, token, r])
        for address, found in by_worker.items():
            bs = s.stream_comms.get(address)
            if bs is not None:
                bs.send({"op": AWAIT, "keys": found})

    def _arrived_on_futures(self, token: str, rank: int, arrival: bytes, worker: Any) -> None:
        """Rank ``rank`` of call ``token`` on futures arrived on ``worker``:
        its result is pinned there before Dask places it (the worker's message
        comes before its input's completion), and the call begins if it was
        the last. An arrival elsewhere than where that result already runs
        (a copy of the input) is not the rank's: that result arrives the rank
        where it runs."""
        s = self.scheduler
        if token in self.started and token not in self.restarting:
            return
        outputs = self.pending[token][1]
        if not 0 <= rank < len(outputs):
            return
        ts = s.tasks.get(outputs[rank])
        found = self.arrivals.setdefault(token, {})
        if ts is not None and ts.processing_on is not None:
            if ts.processing_on.address != worker:
                return
        elif rank in found:
            return  # the first arrival of the rank, where its result is pinned, is the one
        found[rank] = arrival
        while len(self.arrivals) > 4096:
            self.arrivals.popitem(last=False)
        if ts is not None and ts.state in ("released", "waiting", "no-worker"):
            ts.worker_restrictions, ts.loose_restrictions = {worker}, False
        self._begin_if_arrived(token, barrier_key("auto", token))

    def stale(self, run: Any = None, keys: Any = None, worker: Any = None, **other: Any) -> None:
        """Stream message from a barrier (:func:`barrier`): hand-ins ``keys``
        of ``run`` are in memory with another run's value. Those whose task
        still hands in to ``run`` are released, so they run again (and the
        barrier waits for them)."""
        if other or not isinstance(run, str) or not isinstance(keys, (list, tuple)) or len(keys) > MAX_ITEMS:
            logger.error("flowreduce: %s refused a stream message: run %r, keys %r, others %s", STALE,
                         type(run).__name__, type(keys).__name__, sorted(other)[:5])
            return
        s = self.scheduler
        recs: dict[Hashable, str] = {}
        for key in keys:
            key = _as_key(key)
            hand_in_like = isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and type(key[1]) is int
            ts = s.tasks.get(key) if hand_in_like else None
            spec = ts.run_spec if ts is not None else None
            if (ts is not None and ts.state == "memory" and f"-{HAND_IN}-" in key[0] and isinstance(spec, Task)
                    and spec.func is hand_in and spec.args[:1] == (run,)):
                recs[key] = "released"
        if recs:
            s.transitions(recs, stimulus_id=f"flowreduce-stale-hand-in-{_now()}")

    def _begin_if_arrived(self, token: str, gate: Hashable) -> None:
        """Call ``token`` begins (or begins again after a lost worker) as
        soon as its last rank arrived, here: its decision (``decide``, made
        by the front door with the call's settings and the cost model, the
        argument of its barrier task ``gate``) checks what the ranks
        hold and chooses the plan from where they arrived; the results are
        pinned and the workers told by stream. No task and no round trip
        lie between the arrivals and the run. A refused call's results
        raise the decision's error (naming the ranks)."""
        if token in self.started and token not in self.restarting:
            return
        s = self.scheduler
        ts = s.tasks.get(gate)
        if token in self.pending:  # a call on futures
            decision = self.pending[token]
        elif ts is not None and ts.run_spec is not None:
            _, decide, named, *_ = ts.run_spec.args
            decision = decide, named.keys
        elif token in self.decisions:  # the barrier is gone: a call that began, beginning again
            decision = self.decisions[token]
        else:
            return
        decide, outputs = decision
        found = self.arrivals.get(token, {})
        ranks = range(len(outputs))
        if any(r not in found for r in ranks):
            return
        if not any(k in s.tasks and s.tasks[k].state not in SETTLED for k in outputs):
            self._end(token)  # arrived again with every result computed or failed: nothing to run
            return
        try:
            arrivals = [pickle.loads(found[r]) for r in ranks]
        except Exception as e:  # noqa: BLE001 - a worker's message that does not load
            self._doom(token, to_serialize(e))
            return
        for r, k in enumerate(outputs if token in self.pending else ()):
            out = s.tasks.get(k)  # a result of a call on futures running elsewhere than its rank arrived arrives it there
            if out is not None and out.processing_on is not None and out.processing_on.address != arrivals[r][0]:
                return
        try:
            spec, record, shown = decide(arrivals)
        except Exception as e:  # noqa: BLE001 - the call's own error (an input refused), for its results
            self._doom(token, to_serialize(e))
            return
        self.restarting.discard(token)
        self.started.add(token)
        self.decisions[token] = decision
        self.decisions.move_to_end(token)
        while len(self.decisions) > 4096:
            self.decisions.popitem(last=False)
        reply = self._begin(token, [a[0] for a in arrivals], list(outputs), record, shown)
        message = {"op": BEGUN, "run": run_id(token, reply["attempt"]), "token": token,
                   "spec": to_serialize(replace(spec, outputs=tuple(reply["pending"])))}
        for address in spec.addresses:
            bs = s.stream_comms.get(address)
            if bs is not None:
                bs.send(message)
                _flush(bs)

    def _begin(self, token: str, workers: Sequence[str], outputs: Sequence[Any], record: bytes,
               dashboard: Any) -> dict[str, Any]:
        """Call ``token`` begins its next attempt, rank ``r`` on
        ``workers[r]``: each result ``outputs[r]`` not in memory yet is
        pinned there, and the call is followed like any p2p run. The attempt
        (0, then one more each time it begins again: a worker was lost) and
        those pending ranks."""
        s = self.scheduler
        attempt = self.begun.pop(token, -1) + 1
        self.begun[token] = attempt
        while len(self.begun) > 4096:
            self.begun.popitem(last=False)
        outputs = [_as_key(k) for k in outputs]
        pending = [r for r, k in enumerate(outputs) if k in s.tasks and s.tasks[k].state not in SETTLED]
        s.set_restrictions({outputs[r]: [workers[r]] for r in pending})
        where: dict[str, list[int]] = defaultdict(list)
        for r in pending:
            where[workers[r]].append(r)
        previous = self.active.pop(token, None)
        if previous is not None and attempt:  # the run before this one: dropped where it still is
            self.tell(previous[0], run_id(token, attempt - 1), f"run {run_id(token, attempt - 1)} restarts", True)
        if pending:
            self.active[token] = (dict(where), {outputs[r] for r in pending})
            self.runs[token] = run_id(token, attempt)
        self.records[token] = record
        while len(self.records) > 4096:
            self.records.popitem(last=False)
        waiter = self.record_waiters.pop(token, None)
        if waiter is not None:
            waiter.set()
        shown = store_of(s)
        if shown is not None and isinstance(dashboard, dict):  # the page draws the plan once it is chosen
            shown.publish(record=dashboard)
        return {"status": "OK", "attempt": attempt, "pending": pending}

    async def record(self, token: Any = None, timeout: Any = None, **other: Any) -> Any:
        """Handler: the pickled record of call ``token`` once it began
        (waiting up to ``timeout`` s for it), else None."""
        if other or not isinstance(token, str) or not isinstance(timeout, (int, float)):
            return None
        if token not in self.records:
            waiter = self.record_waiters.setdefault(token, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), timeout)
            except asyncio.TimeoutError:
                self.record_waiters.pop(token, None)
        return self.records.get(token)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """Nothing here: the guard's recovery owns what a lost worker means for
        a call (:func:`restart` the run on the survivors, or fail it)."""

    def _fail(self, token: str, message: str, lost: bool) -> None:
        where, _ = self.active.pop(token)
        self.tell(where, self.runs.pop(token, run_id(token)), message, lost)
        self._end(token)

    def _placed_on_arrival(self, key: Hashable) -> bool:
        """Whether task ``key`` is an arrive task, or a barrier or result of a call placed on arrival (a
        result of a call on futures is known by its function: its input may fail, and fail it, before the
        barrier's transition registered the call)."""
        ts = self.scheduler.tasks.get(key)
        return f"-{ARRIVE}-" in key[0] or (  # type: ignore[index]
            ts is not None and (_on_futures(ts) or any(f"-{ARRIVE}-" in d.key[0] for d in ts.dependencies)))

    def _pin_result(self, key: Hashable) -> None:
        """Rank's arrive task ``key`` is in memory: its result, which depends
        on it alone, is pinned to the worker it arrived on, before Dask
        places it (the hook runs before the transition's consequences)."""
        ts = self.scheduler.tasks.get(key)
        if ts is None or not ts.who_has:
            return
        where = sorted(ws.address for ws in ts.who_has)[:1]
        for dts in ts.dependents:
            if dts.state in ("released", "waiting") and f"-{OUTPUT}-" in dts.key[0]:
                dts.worker_restrictions, dts.loose_restrictions = set(where), False

    def _let_go(self, gate: Hashable) -> None:
        """The caller asked Dask to run barrier ``gate`` whatever happens to
        the results (``fire_and_forget``); Dask lets go of such a task when it
        is computed or fails, not when a dependency failed first: let go."""
        s = self.scheduler
        ts = s.tasks.get(gate)
        forgotten = s.clients.get("fire-and-forget")
        if ts is not None and forgotten is not None and ts in forgotten.wants_what:
            s.client_releases_keys(keys=[gate], client="fire-and-forget", stimulus_id=f"flowreduce-let-go-{_now()}")

    def _doom(self, token: str, error: Any) -> None:
        """Call ``token`` failed before it began: every worker lets go of
        its inputs, and its results there raise ``error`` (those that start
        later too: a rank arriving later is told again)."""
        self.doomed[token] = error
        while len(self.doomed) > 4096:
            self.doomed.popitem(last=False)
        self.keeping.add(token)
        self._end(token, error=error)

    def _end_if_settled(self, token: str, key: Hashable) -> None:
        """A result of call ``token`` (placed on arrival, between attempts)
        failed or was let go: when none is left to compute, the call is over
        and the workers let go of its inputs (else they would keep them, and
        the memory, for good)."""
        outputs = (self.pending.get(token) or self.decisions[token])[1]
        if key not in outputs:
            return
        tasks = self.scheduler.tasks
        if all(k == key or k not in tasks or tasks[k].state in SETTLED for k in outputs):
            self._end(token)
            # the barrier the caller fired and forgot would keep the ranks arriving again for nothing
            asyncio.get_running_loop().call_soon(self._let_go, _barrier_of(key))

    def _end(self, token: str, error: Any = None) -> None:
        """Tell the workers to let go of the inputs of call ``token`` kept
        since they arrived (and its results waiting there to raise ``error``)."""
        self.arrivals.pop(token, None)
        self.restarting.discard(token)
        self.started.discard(token)
        self.pending.pop(token, None)
        self.inputs.pop(token, None)
        self.let_go.pop(token, None)
        if token not in self.keeping:
            return
        self.keeping.discard(token)
        message = {"op": DROP, "token": token} if error is None else {"op": DROP, "token": token, "error": error}
        for bs in self.scheduler.stream_comms.values():
            bs.send(message)

    def tell(self, workers: Iterable[str], run: str, message: str, lost: bool) -> None:
        """Tell ``workers`` that ``run`` cannot finish (their engines drop it and fail its outputs)."""
        for w in workers:
            bs = self.scheduler.stream_comms.get(w)
            if bs is not None:
                bs.send({"op": FAIL, "run": run, "message": message, "lost": lost})


def _flush(bs: Any) -> None:
    """Send what batched stream ``bs`` holds now, not at its next tick (distributed's ``BatchedSend``
    waits its interval, 5 ms by default, after a send)."""
    if hasattr(bs, "next_deadline") and hasattr(bs, "waker"):
        bs.next_deadline = None
        bs.waker.set()


def _barrier_of(key: Hashable) -> Hashable:
    """The barrier's key of the call placed on arrival that task ``key`` belongs to."""
    info = parse(key)
    assert info is not None
    return barrier_key(info["algorithm"], info["token"])


def is_p2p(tasks: Iterable[Any]) -> bool:
    """Whether these scheduler tasks of one call are a p2p call's (it has hand-ins)."""
    return any(f"-{HAND_IN}-" in ts.key[0] for ts in tasks)


def placed_on_arrival(tasks: Iterable[Any]) -> bool:
    """Whether these scheduler tasks of one call are a call placed when its inputs arrived (it has arrive
    tasks, or results taken out on arrival)."""
    return any(f"-{ARRIVE}-" in ts.key[0] or _on_futures(ts) for ts in tasks)


def _on_futures(ts: Any) -> bool:
    """Whether scheduler task ``ts`` is a result of a call on futures placed on arrival."""
    return isinstance(ts.run_spec, Task) and ts.run_spec.func is take_out_arrived


def restart_on_arrival(s: Any, token: str, tasks: Sequence[Any], gone: Iterable[str], stimulus_id: str) -> None:
    """Run a call placed on arrival again after workers ``gone`` left (by
    :func:`flowreduce.schedule.recovery.recover`): the old run is dropped
    where it still is; the ranks that were on ``gone`` arrive again where
    their inputs now are (Dask recomputes lost inputs from their lineage; a
    collection's arrive tasks run again, a call on futures' inputs arrive as
    they go to memory again, or where their results run), and when the last
    has, the next attempt begins
    (:meth:`P2PSchedulerPlugin._begin_if_arrived`), pinning the pending
    results anew. The results still waiting on other workers wait for it."""
    gone = set(gone)
    for ts in tasks:
        if ts.worker_restrictions and not ts.worker_restrictions.isdisjoint(gone):
            ts.worker_restrictions = None  # pinned again when its rank arrives again
    plugin = p2p_of(s)
    if plugin is None:
        return
    on_futures = any(_on_futures(ts) for ts in tasks)
    ended = token not in plugin.started and not (on_futures and token in plugin.pending)
    if on_futures and token not in plugin.pending:  # it had ended: its decision is the one it began with
        if token not in plugin.decisions:
            return
        plugin.pending[token] = plugin.decisions[token]
        plugin.keeping.add(token)
    plugin.restarting.add(token)
    if ended:  # it had ended, and the engines let go of its inputs: every rank arrives again
        plugin.arrivals.pop(token, None)
        s.transitions({ts.key: "waiting" for ts in tasks if f"-{ARRIVE}-" in ts.key[0] and ts.state == "released"},
                      stimulus_id=stimulus_id)
    arrived = plugin.arrivals.get(token, {})
    redo = [r for r, a in arrived.items() if pickle.loads(a)[0] in gone]
    for r in redo:
        del arrived[r]
    if on_futures:  # every rank not arrived (on a worker still here) arrives as its input goes to memory again
        outputs = plugin.pending[token][1]
        plugin._await(token, [r for r in range(len(outputs)) if r not in arrived])
    # such a rank's arrive task may still be in memory elsewhere (a copy the barrier's worker fetched),
    # while its input was kept by the engine of the worker that left: it must run again, where its
    # input is now, or the call waits for it for good
    again = {ts.key: "released" for ts in tasks if f"-{ARRIVE}-" in ts.key[0] and ts.state == "memory"
             and (parse(ts.key) or {}).get("rank") in redo}
    if again:
        s.transitions(again, stimulus_id=stimulus_id)
    previous = plugin.active.pop(token, None)
    run = plugin.runs.pop(token, None)
    if previous is not None and run is not None:
        plugin.tell([w for w in previous[0] if w in s.workers], run, f"run {run} restarts: worker "
                    f"{', '.join(sorted(gone))} left", lost=True)
    logger.info("flowreduce: all-reduce %s placed on arrival runs again (worker %s left)", token,
                ", ".join(sorted(gone)))
    gate = next((ts.key for ts in tasks if f"-{BARRIER}-" in ts.key[0]), None)
    if on_futures:
        gate = barrier_key("auto", token)  # its barrier is gone: the decision is the plugin's
    if gate is not None:  # no rank was on the workers that left: it begins again now
        plugin._begin_if_arrived(token, gate)


def lost_output(ts: Any) -> bool:
    """Whether a p2p call's task is a result that was computed and is gone (a client still wants it)."""
    return f"-{OUTPUT}-" in ts.key[0] and ts.state in ("released", "waiting", "no-worker") and bool(ts.who_wants)


def restart(s: Any, token: str, tasks: Sequence[Any], moves: Mapping[str, str], attempt: int) -> set[Hashable]:
    """Run p2p call ``token`` again as attempt ``attempt``, its lost workers'
    part moved as ``moves`` says (by :func:`flowreduce.schedule.recovery.recover`,
    which re-pinned its tasks and releases them next). Every hand-in, the
    barrier and every output get the new run id; the new spec runs the same
    plan with the lost workers' plan ranks on their replacements (a worker
    may hold two) and hands out only the results not already in memory. The old run is dropped
    on every worker still there. The keys rewritten (none if ``token`` is
    not a p2p call)."""
    hand_ins = [ts for ts in tasks if f"-{HAND_IN}-" in ts.key[0]]
    if not hand_ins:
        return set()
    outputs = [ts for ts in tasks if f"-{OUTPUT}-" in ts.key[0]]
    pending = tuple(sorted(ts.key[1] for ts in outputs if ts.state != "memory"))
    new = run_id(token, attempt)
    old = None
    for ts in hand_ins:
        run, index, spec, *xs = ts.run_spec.args
        old = run
        domains = tuple(None if a in moves else d for a, d in zip(spec.addresses, spec.domains))  # not known here
        spec = replace(spec, addresses=tuple(moves.get(a, a) for a in spec.addresses), outputs=pending,
                       domains=domains if any(d is not None for d in domains) else ())
        ts.run_spec = Task(ts.key, ts.run_spec.func, new, index, spec, *xs)
    for ts in outputs:
        gate, _, rank = ts.run_spec.args
        ts.run_spec = Task(ts.key, ts.run_spec.func, gate, new, rank)
    barriers = [ts for ts in tasks if f"-{BARRIER}-" in ts.key[0]]
    for ts in barriers:
        _, named, handed = ts.run_spec.args
        ts.run_spec = Task(ts.key, ts.run_spec.func, new, named, handed)
    plugin = p2p_of(s)
    if plugin is not None:
        found = plugin.active.get(token)
        if found is not None:
            where: dict[str, list[int]] = defaultdict(list)
            for w, ranks in found[0].items():
                where[moves.get(w, w)].extend(ranks)
            plugin.active[token] = (dict(where), {ts.key for ts in outputs if ts.state != "memory"})
        plugin.runs[token] = new
        if old is not None:
            plugin.tell([w for w in s.workers if w not in moves], old, f"run {old} restarts as {new}", lost=True)
    logger.info("flowreduce: p2p run %s restarts as %s (%s)", old, new, ", ".join(f"{a} -> {b}" for a, b in moves.items()))
    return {ts.key for ts in [*hand_ins, *barriers, *outputs]}


def p2p_of(scheduler: Any) -> P2PSchedulerPlugin | None:
    """The p2p part of the scheduler's extension (None before it is installed)."""
    return getattr(scheduler.plugins.get(EXTENSION), "p2p", None)


def engine_of(worker: Any) -> Engine | None:
    """The worker's engine (None before the extension is installed there)."""
    return getattr(getattr(worker.plugins.get(EXTENSION), "p2p", None), "engine", None)


def _engine() -> Engine:
    engine = engine_of(get_worker())
    if engine is None:
        raise RuntimeError("the flowreduce p2p engine is not installed on this worker "
                           "(flowreduce.schedule.extension.ensure_extension)")
    return engine


async def hand_in(run: str, index: int, spec: Spec, *xs: Any) -> str:
    """Task: hand the ranks' inputs ``xs`` of the run's ``index``-th worker to
    this worker's engine, starting the run here if needed; the run handed in to
    (what :func:`barrier` checks)."""
    engine = _engine()
    if run in engine.done:  # Dask ran it again after the run ended here
        return run
    try:
        await engine.run(run, spec).hand_in(index, xs)
    except Exception as e:
        engine.fail(run, e, tell=True)
        raise
    return run


async def barrier(run: str, hand_ins: _lower.Named, handed: list[Any]) -> str:
    """Task: every rank has handed its input in to ``run`` (``handed``: the
    values of the hand-ins ``hand_ins.keys``)."""
    # A hand-in's value in memory does not prove that its task ran for this run: when a worker is
    # retired, Dask copies its hand-in's value (the old run's) to a survivor, and a survivor still
    # fetching it when the run restarts takes the copy as the restarted task's result (the worker
    # "resumes" the fetch). That worker's engine never got the ranks' inputs, and the run would wait
    # for them for good. So, as distributed's shuffle barrier checks its transfers' run ids, the
    # barrier asks the scheduler to run such hand-ins again (it releases them, and so this task) and
    # reschedules itself.
    stale = [key for key, got in zip(hand_ins.keys, handed) if got != run]
    if stale:
        logger.info("flowreduce: run %s: hand-ins %s hold another run's value; they run again", run, stale)
        _engine().worker.batched_stream.send({"op": STALE, "run": run, "keys": stale})
        raise Reschedule()
    return run


#: (worker, its Place as a tuple, what the rank holds: a Meta, where its input was published or None)
Arrival = tuple[str, tuple[Any, ...], Any, "Handle | None"]


async def arrive(token: str, rank: int, x: Any) -> Arrival:
    """Task of a call on Dask collections placed when its inputs arrive:
    rank ``rank``'s input kept by this worker's engine (:func:`arrive_value`).
    A coroutine: no hop to a thread for a few microseconds of work."""
    return arrive_value(_engine(), token, rank, x)


def arrive_value(engine: Engine, token: str, rank: int, x: Any) -> Arrival:
    """Rank ``rank`` of call ``token`` arrives on ``engine``'s worker: its
    input ``x`` is kept there (numpy arrays; anything else is only
    described, for the decision to refuse naming the rank), and the
    scheduler is told where it is and what it holds; returns the same."""
    meta = meta_of(x)
    if arrays.is_foreign(x):  # a torch tensor, an array API array...: reduced as numpy, given back as it came
        try:
            meta = ArrayMeta(*arrays.describe(x))
        except TypeError as e:
            meta = OtherMeta(f"{type(x).__name__} ({e})")
        else:
            try:
                x = arrays.to_numpy(x)
            except Exception:  # no data here (a meta tensor): described, for the barrier to name it, not kept
                x = None
    if isinstance(x, np.generic):
        x = np.asarray(x)
    engine.ended_calls.pop(token, None)  # a collection computed again: a new call of the same keys
    if x is not None and not isinstance(meta, OtherMeta):  # arrays, and the pytrees a GatherRun reduces
        engine.arrived.setdefault(token, {})[rank] = x
    handle = publish(token, x) if x is not None and not isinstance(meta, OtherMeta) else None
    arrival = (engine.address, engine.place, meta, handle)
    # before the task's own message on the same stream: the scheduler has it when the task is in memory;
    # sent now, not at the stream's next tick (the call begins when its last rank's message is read)
    bs = engine.worker.batched_stream
    bs.send({"op": ARRIVED, "token": token, "rank": rank, "arrival": pickle.dumps(arrival)})
    _flush(bs)
    return arrival


def hold_decision(token: str, decide: Decide, outputs: _lower.Named, *arrivals: Arrival) -> str:
    """Task, the barrier of a call placed on arrival: it carries the call's
    decision (``decide``, with the results' keys) in its arguments, for the
    scheduler plugin, which begins the call when its last rank arrived
    (:meth:`P2PSchedulerPlugin._begin_if_arrived`). It depends on every
    rank's arrive task of a collection culled for some results and keeps
    them wanted while any result is."""
    return token


async def take_out(gate: Any, run: str, rank: int) -> Any:
    """Task: rank's result, once the engine has it (waits on the event loop);
    ``gate``: the barrier's value, the run every hand-in handed in to."""
    engine = _engine()
    # Only the run the barrier vouches for is waited on. A result task keeps its worker's thread slot
    # while it waits (a coroutine task counts as executing), and a cancelled one keeps waiting: when a
    # run restarts, Dask can start a result with the new run's id against the old run's barrier (still
    # in memory until the restart releases it) and cancel it next; waiting on the new run, it would
    # hold the slot of a one-thread worker whose hand-in of that run then never runs.
    if gate != run:
        raise RuntimeError(f"rank {rank}'s result of run {run} was asked for after the barrier of run {gate}: "
                           "a task of another attempt")
    if run in engine.failed:
        raise engine.failed[run].with_traceback(None)
    return await _result(engine, run, rank)


async def _result(engine: Engine, run: str, rank: int) -> Any:
    """Rank's result of ``run`` here, once the run has it; the run ends here when its results are taken."""
    found = engine.runs.get(run)
    if found is None or rank not in found.results:
        raise RuntimeError(f"rank {rank} of run {run} is not running on worker {engine.address}")
    value = await asyncio.shield(found.results[rank])
    found.taken.add(rank)
    found._maybe_done()
    return value


async def take_out_begun(arrival: Any, token: str, rank: int, named: _lower.Named, *barrier: Any) -> Any:
    """Task of a call placed on arrival: rank's result, waiting (on the
    event loop, not counted against the worker's threads: the other ranks'
    inputs may need them) from the moment the rank arrived until the call
    began here and the run has the result. A run dropped because a worker
    left is followed by the next attempt's."""
    engine = _engine()
    if token in engine.ended_calls:
        raise engine.ended_calls[token].with_traceback(None)
    begun = engine.begun.setdefault(token, Begun())
    after = None
    while True:
        if begun.run is None or after is not None:  # a wait for a run ahead (the first, or the next attempt)
            # the wait may be long: another rank's input on this worker may need the thread first (an
            # input computed again after a worker left, before the next attempt can begin)
            task = engine.worker.state.tasks.get(named.keys[0])
            if task is not None and task.state == "executing":  # not already long-running
                leave_slot(engine.worker, named.keys[0])
        run = await begun.next(after)
        after = run
        if run in engine.failed:
            if isinstance(engine.failed[run], WorkerLostError):
                continue
            raise engine.failed[run].with_traceback(None)
        found = engine.runs.get(run)
        if found is not None and rank not in found.results and found.spec.worker(rank) != engine.address:
            # this task reached this worker before the call began and pinned it where its rank arrived
            # (Dask places a task that waits on a busy worker's input elsewhere, or moves it while it
            # is queued): the scheduler runs it again there, where the run has its result
            raise Reschedule()
        try:
            return await _result(engine, run, rank)
        except WorkerLostError:
            continue  # the run restarts: the next attempt's result


class Begun:
    """What an engine knows of a call placed on arrival: its latest run here, or why it ended."""

    def __init__(self) -> None:
        self.run: str | None = None
        self.error: BaseException | None = None
        self._changed = asyncio.Event()

    def set(self, run: str | None = None, error: BaseException | None = None) -> None:
        self.run, self.error = run or self.run, error
        self._changed.set()
        self._changed = asyncio.Event()

    async def next(self, after: str | None) -> str:
        """A run other than ``after`` (waiting for it), or the call's error."""
        while self.error is None and self.run in (None, after):
            await self._changed.wait()
        if self.error is not None:
            raise self.error.with_traceback(None)
        assert self.run is not None
        return self.run


def _exception(error: Any) -> BaseException:
    """An exception forwarded by the scheduler, as the worker received it."""
    if isinstance(error, BaseException):
        return error
    try:
        from distributed.protocol import deserialize

        got = deserialize(error.header, error.frames) if hasattr(error, "frames") else pickle.loads(error)
    except Exception as e:  # noqa: BLE001 - whatever came, the results must raise something that says so
        return RuntimeError(f"the all-reduce's barrier failed (its error could not be read here: {e!r})")
    return got if isinstance(got, BaseException) else RuntimeError(f"the all-reduce's barrier failed: {got!r}")


def lower(spec: Spec, inputs: Sequence[Any]) -> Graph:
    """A new call's graph: 2 tasks per rank and a barrier."""
    token = new_token()
    return lower_p2p(spec, inputs, token=token, run=run_id(token), hand_in=hand_in, barrier=barrier,
                     take_out=take_out)


#: A barrier's decision (:class:`flowreduce.schedule.call.OnArrival`): from the ranks' arrivals, the
#: run's spec, the call's pickled record and its dashboard message.
Decide = Callable[[Sequence[Arrival]], tuple["Spec | GatherSpec", bytes, dict[str, Any]]]


def lower_arrivals(inputs: Sequence[Any], algorithm: str, decide: Decide,
                   output_keys: Sequence[Hashable] | None = None, token: str | None = None) -> Graph:
    """A new call's graph on Dask collections placed when its inputs arrive: an arrive task per rank, a
    barrier, an output per rank."""
    return _lower.lower_arrivals(inputs, algorithm=algorithm, token=token or new_token(), arrive=arrive,
                                 begin=hold_decision,
                                 take_out=take_out_begun, decide=decide, output_keys=output_keys)


def lower_collection(inputs: Sequence[Any], algorithm: str, decide: Decide,
                     output_keys: Sequence[Hashable] | None = None, token: str | None = None) -> Graph:
    """A new call's graph on Dask collections whose every result is computed together: an output per rank
    depending on its input alone, each carrying the decision (the scheduler plugin registers the call from
    the first to wait, as it does a call on futures from its barrier)."""
    return _lower.lower_collection(inputs, algorithm=algorithm, token=token or new_token(),
                                   take_out=take_out_arrived, decide=decide, output_keys=output_keys)


async def take_out_arrived(x: Any, token: str, rank: int, named: _lower.Named, decide: Any = None,
                           outputs: Any = None) -> Any:
    """Task of a call on futures (or on Dask collections computed together:
    then ``decide`` and ``outputs``, the call's decision and results' keys,
    are the scheduler plugin's) placed on arrival: rank's result, on the
    worker its input ``x`` is on (:func:`take_out_begun`). The worker plugin
    kept the input in the engine as it went to memory; if it did not (Dask
    runs this on a worker holding a copy, or the input was computed again
    there after a worker left), the rank arrives here now."""
    engine = _engine()
    if token in engine.ended_calls:
        raise engine.ended_calls[token].with_traceback(None)
    if rank not in engine.arrived.get(token, {}):
        arrive_value(engine, token, rank, x)
    return await take_out_begun(None, token, rank, named)


def _as_key(key: Any) -> Any:
    """A task key as sent, its tuples made lists by msgpack, as a key again."""
    return tuple(_as_key(k) for k in key) if isinstance(key, list) else key


def arrivals_held(dask_worker: Any = None) -> dict[str, list[int]]:
    """The ranks whose inputs an engine keeps now, per call (for tests: ``client.run(arrivals_held)``)."""
    engine = engine_of(dask_worker)
    return {t: sorted(rs) for t, rs in engine.arrived.items()} if engine is not None else {}


def awaited_held(dask_worker: Any = None) -> list[str]:
    """The input keys an engine awaits now for calls on futures placed on arrival, and the calls it keeps
    them for (for tests: ``client.run(awaited_held)``)."""
    engine = engine_of(dask_worker)
    if engine is None:
        return []
    return sorted(map(str, engine.awaited)) + [f"call {token}" for token in engine.awaited_by_token]


def runs_held(dask_worker: Any = None) -> list[str]:
    """The runs (and their values) an engine holds now, the calls whose ranks' inputs it keeps since
    they arrived, and the inputs it awaits (for tests: ``client.run(runs_held)``)."""
    engine = engine_of(dask_worker)
    if engine is None:
        return []
    return sorted(engine.runs) + [f"arrived {token}" for token in engine.arrived] + [
        f"awaits {held}" for held in awaited_held(dask_worker)]
