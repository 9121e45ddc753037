"""A ``torch.distributed`` backend named ``flowreduce``: unmodified DDP on an SPMD job's communicator.

Inside a rank of :func:`flowreduce.spmd`::

    def train(comm, shard):
        flowreduce.torch.init_process_group(comm)      # backend "flowreduce", rank and size from comm
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        ...                                             # plain torch: dist.all_reduce, new_group, barrier

:func:`init_process_group` registers the backend once per process
(``torch.distributed.Backend.register_backend("flowreduce", ..., devices=["cpu"])``)
and calls ``torch.distributed.init_process_group(backend="flowreduce",
rank=comm.rank, world_size=comm.size, store=HashStore())``: an in-process
store, no port, no address, no rendezvous (the communicator already knows
its peers). The group (:class:`FlowreduceProcessGroup`) is a Python
``torch.distributed.ProcessGroup``, the route torch's own
``test/distributed/test_c10d_pypg.py`` takes. Collectives are asynchronous
as c10d backends' are: each is checked on the caller's thread, queued on a
thread of the group's own (:class:`_Lane`, one per group, started with its
first collective: the collectives of a group run in the order they were
issued, the same on every rank) and returns a :class:`CollectiveWork` at
once; ``wait()`` and ``get_future()`` (a ``torch.futures.Future``, what DDP's
reducer waits on) complete when it has run, with the tensors it was given
updated in place, or raise its :class:`CollectiveError` naming the rank and
the collective. A synchronous call (``async_op=False``) is the same plus
torch's ``wait()``. So DDP's bucket all-reduces run while backward computes
the next buckets. The communicator is called from the group's thread only
(``new_group``'s ``comm.subgroup`` too, queued on the default group's);
``destroy_process_group`` (torch's calls :meth:`FlowreduceProcessGroup.shutdown`)
runs what was issued (in a failed job each fails at once), refuses more and
ends the thread.
``dist.new_group(ranks)`` gives a group on ``comm.subgroup(ranks)``.

Ranks that share a worker share a process: torch keeps its groups in
process globals (``distributed_c10d._world`` and the C++ group registry),
so, as torch's threaded test harness does (``MultiThreadedTestCase``),
the first call in a process gives each thread its own world
(:class:`_ThreadWorlds`; threads that never call it keep the process's)
and turns on c10d's thread isolation (``_set_thread_isolation_mode``: the
C++ registry of group names, used by functional collectives, becomes per
thread). The rank's groups are destroyed when its function returns (or
by ``torch.distributed.destroy_process_group()`` before).

Supported: ``all_reduce`` (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR; not
PREMUL_SUM), ``all_reduce_coalesced``, ``broadcast``, ``all_gather``,
``all_gather_into_tensor``, their coalesced forms, ``reduce_scatter``,
``reduce_scatter_tensor``, ``barrier``, ``new_group``; CPU tensors.
Not: ``send``/``recv`` (the communicator has no point-to-point),
``all_to_all``. In processes that are not ranks of an SPMD job (torchrun,
``torch.multiprocessing``), ``dist.init_process_group("flowreduce", ...)``
runs the group on the c10d store it is given
(:class:`~flowreduce.torch.storecomm.StoreComm`: correct, not fast).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from flowreduce.errors import FlowreduceError, OptionError

logger = logging.getLogger("flowreduce")
_C10D: Any = torch._C._distributed_c10d  # its private helpers have no stubs

#: The backend's name in ``torch.distributed``.
BACKEND = "flowreduce"

_install_lock = threading.Lock()
_installed = False
_local = threading.local()  # .comm: the communicator of the rank running on this thread

_OPS: dict[Any, str] = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max", dist.ReduceOp.AVG: "mean", dist.ReduceOp.BAND: "bitwise_and",
    dist.ReduceOp.BOR: "bitwise_or", dist.ReduceOp.BXOR: "bitwise_xor",
}


class _RankWorld(c10d._World):
    """A world of a rank's own: torch's ``_World`` keeps its maps in module globals; these are
    the instance's (what torch's threaded test harness' ``ThreadLocalWorld`` holds)."""

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[str, Any] = {name: {} for name in (
            "pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag")}
        self._count = 0

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value


class _ThreadWorlds:
    """``distributed_c10d._world`` with one world per rank thread: the threads that called
    :func:`init_process_group` each get a fresh :class:`_RankWorld`; every other thread reads and
    writes the world the process had (so torch.distributed outside ranks is unchanged)."""

    def __init__(self, shared: Any) -> None:
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_local", threading.local())

    def _get(self) -> Any:
        return getattr(self._local, "world", None) or self._shared

    def _own(self) -> Any:
        """This thread's own world (a fresh one the first time)."""
        world = getattr(self._local, "world", None)
        if world is None:
            world = self._local.world = _RankWorld()
        return world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)


def register() -> None:
    """Register the ``flowreduce`` backend with ``torch.distributed`` (once per process; done when
    :mod:`flowreduce.torch` is imported)."""
    with _install_lock:
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def _install() -> _ThreadWorlds:
    """Once per process: register the backend, give rank threads worlds of their own."""
    global _installed
    register()
    with _install_lock:
        if not _installed:
            if not isinstance(c10d._world, _ThreadWorlds):
                c10d._world = _ThreadWorlds(c10d._world)  # type: ignore[assignment]
            _C10D._set_thread_isolation_mode(True)
            _installed = True
    assert isinstance(c10d._world, _ThreadWorlds)
    return c10d._world


def _create(options: Any, backend_options: Any = None) -> FlowreduceProcessGroup:
    """The backend's creator (``extended_api``): the group of the calling rank's communicator
    over ``options.global_ranks_in_group`` (all: the communicator itself); on a thread that is
    not a rank of an SPMD job, a :class:`~flowreduce.torch.storecomm.StoreComm` on the group's
    c10d store (torchrun, ``torch.multiprocessing``: correct, not fast)."""
    comm = getattr(_local, "comm", None)
    if comm is None:
        from flowreduce.torch.storecomm import StoreComm

        return FlowreduceProcessGroup(StoreComm(options.store, options.group_rank, options.group_size))
    ranks = [int(r) for r in (options.global_ranks_in_group or ())]
    if ranks and ranks != list(range(comm.size)):
        world, parent = c10d._get_default_group(), comm  # the rank's: its communicator is called on its thread only
        sub = world.call("new_group", lambda: parent.subgroup(ranks)) if isinstance(world, FlowreduceProcessGroup) \
            else comm.subgroup(ranks)
        if sub is None:  # torch asks only the members; a non-member here is torch's or our bug
            raise RuntimeError(f"rank {comm.rank} is not in the new group {ranks}")
        comm = sub
    if comm.rank != options.group_rank or comm.size != options.group_size:
        raise RuntimeError(f"torch asks for rank {options.group_rank} of {options.group_size}; the flowreduce "
                           f"communicator is rank {comm.rank} of {comm.size}")
    return FlowreduceProcessGroup(comm)


def _op(opts: Any) -> str:
    op = opts.reduceOp
    for key, name in _OPS.items():
        if op == key:
            return name
    raise ValueError(f"the flowreduce backend does not support {op} (supported: SUM, PRODUCT, MIN, MAX, AVG, "
                     "BAND, BOR, BXOR)")


def _check(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"the flowreduce backend takes CPU tensors; this one is on {t.device}")


class CollectiveError(FlowreduceError, RuntimeError):
    """A collective of the ``flowreduce`` backend failed: raised by its work's ``wait()`` and its
    future's, naming the rank, the collective and what it raised (torch's errors are RuntimeErrors)."""


#: torch's stubs type Work's and ProcessGroup's methods for their callers; the trampolines call them
#: with the arguments these take (PyProcessGroup.hpp), so the bases are untyped here
_Work: Any = dist.Work
_ProcessGroup: Any = dist.ProcessGroup


class CollectiveWork(_Work):
    """What every collective of :class:`FlowreduceProcessGroup` returns: the collective is queued on
    its group's thread; ``wait()`` (and ``get_future().wait()``, which DDP's reducer waits on)
    returns once it has run, with the tensors updated in place, or raises its
    :class:`CollectiveError`; ``is_completed()`` says whether it has run."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.future: torch.futures.Future = torch.futures.Future()
        self.done = threading.Event()

    def __repr__(self) -> str:
        return f"<flowreduce work: {self.what}{', done' if self.future.done() else ''}>"

    def wait(self, timeout: Any = None) -> bool:
        """Wait until the collective has run (``timeout``, a ``timedelta``: at most that long, then
        :class:`TimeoutError`; the communicator's own ``timeout=`` bounds every collective anyway)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds and not self.done.wait(seconds):
            raise TimeoutError(f"{self.what}: not done after {seconds:g} s")
        self.future.wait()  # raises the collective's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def finish(self, result: Any) -> None:
        self.future.set_result(result)
        self.done.set()

    def fail(self, e: BaseException) -> None:
        error = CollectiveError(f"{self.what} failed: {type(e).__name__}: {e}")
        error.__cause__ = e
        self.future.set_exception(error)
        self.done.set()


class _Lane:
    """A group's collectives in the order they were issued, on one thread of the group's own
    (started with the first): the order is the program's, the same on every rank, as MPI's and
    gloo's rely on; the communicator is only ever called from this thread while the group lives."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: queue.SimpleQueue[tuple[CollectiveWork, Callable[[], Any]] | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.ended: str | None = None

    def issue(self, work: CollectiveWork, body: Callable[[], Any]) -> CollectiveWork:
        with self.lock:
            if self.ended is not None:
                raise CollectiveError(f"{work.what}: {self.ended}")
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
            self.jobs.put((work, body))
        return work

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            work, body = job
            try:
                result = body()
            except BaseException as e:  # noqa: BLE001  (every error goes to the work's waiter)
                work.fail(e)
            else:
                work.finish(result)

    def end(self, why: str) -> None:
        """Refuse new collectives (``why``), run those issued (a failed job fails each at once,
        naming its rank), and join the thread."""
        with self.lock:
            first, self.ended = self.ended is None, self.ended or why
            thread = self.thread
            if first and thread is not None:
                self.jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()


class FlowreduceProcessGroup(_ProcessGroup):
    """A ``torch.distributed`` group whose collectives run on a flowreduce communicator
    (:class:`flowreduce.spmd.Communicator`, or a :class:`~flowreduce.torch.storecomm.StoreComm`).
    Each collective is checked on the caller's thread, queued on the group's thread and returns
    a :class:`CollectiveWork` at once; the tensors passed are updated in place when it has run."""

    def __init__(self, comm: Any) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self.issued = 0
        self.lane = _Lane(f"flowreduce-torch-rank{comm.rank}-of{comm.size}")

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return BACKEND

    def __repr__(self) -> str:
        return f"<FlowreduceProcessGroup rank {self.comm.rank} of {self.comm.size}>"

    def _issue(self, name: str, body: Callable[[], Any]) -> CollectiveWork:
        """``body`` (which returns the future's value) queued on the group's thread."""
        self.issued += 1
        work = CollectiveWork(f"{name} #{self.issued} on rank {self.comm.rank} of a flowreduce group of "
                              f"{self.comm.size}")
        return self.lane.issue(work, body)

    def call(self, name: str, body: Callable[[], Any]) -> Any:
        """``body()`` on the group's thread after the collectives issued before; its value (not a
        collective: not counted, since only some ranks may call it, as ``new_group``'s members)."""
        work = self.lane.issue(CollectiveWork(f"{name} on rank {self.comm.rank} of a flowreduce group of "
                                              f"{self.comm.size}"), body)
        work.wait()
        return work.future.value()

    def shutdown(self) -> None:
        """torch's ``destroy_process_group`` calls it: the collectives issued run (or fail at once if
        the job failed), later ones raise, the group's thread ends."""
        self.lane.end(f"rank {self.comm.rank}'s flowreduce group was destroyed")

    # -- reductions -------------------------------------------------------------------
    def _allreduce_into(self, tensors: list[torch.Tensor], op: str) -> None:
        """One collective for every tensor of ``tensors`` (same dtype: flattened into one)."""
        if len(tensors) == 1:
            t = tensors[0]
            out = self.comm.allreduce(t.detach(), op=op)
            t.detach().copy_(out.view(t.shape) if out.shape != t.shape else out)
            return
        if len({t.dtype for t in tensors}) > 1:
            for t in tensors:
                self._allreduce_into([t], op)
            return
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        out = self.comm.allreduce(flat, op=op)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.detach().copy_(out[offset:offset + n].view(t.shape))
            offset += n

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CollectiveWork:
        tensors = list(tensors)
        for t in tensors:
            _check(t)
        op = _op(opts) if opts is not None else "sum"

        def body() -> list[torch.Tensor]:
            self._allreduce_into(tensors, op)
            return tensors

        return self._issue("all_reduce", body)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> CollectiveWork:
        return self.allreduce(tensors, opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> CollectiveWork:
        op = _op(opts) if opts is not None else "sum"
        for out in output_tensors:
            _check(out)

        def body() -> list[torch.Tensor]:
            for out, inputs in zip(output_tensors, input_tensors):
                summed = self.comm.allreduce(torch.stack([i.detach() for i in inputs]), op=op)
                out.detach().copy_(summed[self.comm.rank].view(out.shape))
            return output_tensors

        return self._issue("reduce_scatter", body)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CollectiveWork:
        _check(output)
        op = _op(opts) if opts is not None else "sum"

        def body() -> torch.Tensor:
            summed = self.comm.allreduce(input.detach(), op=op)
            output.detach().copy_(torch.chunk(summed, self.comm.size)[self.comm.rank].view(output.shape))
            return output

        return self._issue("reduce_scatter_tensor", body)

    _reduce_scatter_base = reduce_scatter_single

    # -- broadcast and gathers ----------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> CollectiveWork:
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            _check(t)

        def body() -> list[torch.Tensor]:
            for t in tensors:
                value = self.comm.broadcast(t.detach(), root=root)
                if self.comm.rank != root:
                    t.detach().copy_(value.view(t.shape))
            return tensors

        return self._issue("broadcast", body)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> CollectiveWork:
        for inp in input_tensors:
            _check(inp)

        def body() -> list[list[torch.Tensor]]:
            for outs, inp in zip(output_tensors, input_tensors):
                for out, value in zip(outs, self.comm.allgather(inp.detach())):
                    out.detach().copy_(value.view(out.shape))
            return output_tensors

        return self._issue("all_gather", body)

    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        values = self.comm.allgather(input.detach())
        for chunk, value in zip(torch.chunk(output.detach(), self.comm.size), values):
            chunk.copy_(value.view(chunk.shape))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CollectiveWork:
        _check(input)

        def body() -> torch.Tensor:
            self._gather_into(output, input)
            return output

        return self._issue("all_gather_into_tensor", body)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> CollectiveWork:
        for inp in inputs:
            _check(inp)

        def body() -> list[torch.Tensor]:
            for out, inp in zip(outputs, inputs):
                self._gather_into(out, inp)
            return outputs

        return self._issue("all_gather_into_tensor_coalesced", body)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def barrier(self, opts: Any = None) -> CollectiveWork:
        return self._issue("barrier", lambda: self.comm.barrier())


def _destroy_on_close(comm: Any) -> None:
    """Make ``comm.close`` (run on the rank's thread when its function returns) destroy the
    rank's torch groups first, so the thread, reused by a later job, starts clean."""
    close = comm.close
    if getattr(close, "_flowreduce_torch", False):
        return

    @functools.wraps(close)
    def closing(*args: Any, **kwargs: Any) -> Any:
        try:
            destroy_process_group()
        except Exception:  # the communicator must close whatever torch says
            logger.warning("flowreduce: destroying rank %d's torch.distributed groups failed", comm.rank,
                           exc_info=True)
        return close(*args, **kwargs)

    closing._flowreduce_torch = True  # type: ignore[attr-defined]
    comm.close = closing


def destroy_process_group() -> None:
    """Destroy this rank thread's torch groups (nothing if it has none)."""
    world = c10d._world
    if not isinstance(world, _ThreadWorlds) or getattr(world._local, "world", None) is None:
        return
    try:
        if world._local.world.default_pg is not None:
            dist.destroy_process_group()
    finally:
        world._local.world = None
        _local.comm = None


def init_process_group(comm: Any, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """Make ``comm`` (an SPMD job's communicator) this rank's default ``torch.distributed`` group,
    on the ``flowreduce`` backend; returns the group.

    Call it once in each rank of the job, inside the rank's function. Afterwards plain
    ``torch.distributed`` works: ``DistributedDataParallel``, ``dist.all_reduce`` (sync or
    ``async_op=True``), ``broadcast``, ``all_gather``, ``barrier``, ``dist.new_group(ranks)``.
    The groups are destroyed when the rank's function returns (or by
    ``torch.distributed.destroy_process_group()``). ``timeout`` is torch's (unused:
    the communicator's own, ``flowreduce.spmd(..., timeout=)``, bounds every wait).
    """
    from flowreduce.spmd import Communicator

    if not isinstance(comm, Communicator):
        raise OptionError(f"init_process_group takes a flowreduce.spmd communicator (the comm an SPMD job's "
                          f"function gets); got {type(comm).__name__}")
    rank = comm.rank
    worlds = _install()
    stale = getattr(worlds._local, "world", None)
    if stale is not None and stale.default_pg is not None:
        if getattr(_local, "comm", None) is comm:
            raise RuntimeError(f"rank {rank}: init_process_group was already called with this communicator")
        destroy_process_group()  # a finished job's groups left on this thread
    worlds._own()
    _local.comm = comm
    try:
        dist.init_process_group(backend=BACKEND, rank=comm.rank, world_size=comm.size, store=dist.HashStore(),
                                timeout=timeout)
    except BaseException:
        worlds._local.world = None
        _local.comm = None
        raise
    _destroy_on_close(comm)
    return c10d._get_default_group()


register()
