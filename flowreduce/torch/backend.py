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
``test/distributed/test_c10d_pypg.py`` takes: every collective calls the
communicator and returns a completed ``Work`` (a set
``torch.futures.Future`` wrapped by ``_create_work_from_future``), with the
tensors it was given updated in place, as DDP's reducer expects.
``async_op=True`` is accepted and returns that completed work (the
collective ran during the call; there is no overlap with the caller).
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
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from flowreduce.errors import OptionError

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
        sub = comm.subgroup(ranks)
        if sub is None:  # torch asks only the members; a non-member here is torch's or our bug
            raise RuntimeError(f"rank {comm.rank} is not in the new group {ranks}")
        comm = sub
    if comm.rank != options.group_rank or comm.size != options.group_size:
        raise RuntimeError(f"torch asks for rank {options.group_rank} of {options.group_size}; the flowreduce "
                           f"communicator is rank {comm.rank} of {comm.size}")
    return FlowreduceProcessGroup(comm)


def _done(result: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _C10D._create_work_from_future(fut)


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


#: torch's stubs type ProcessGroup's collectives for its callers; the trampoline calls them with
#: the arguments these take (PyProcessGroup.hpp), so the base is untyped here
_ProcessGroup: Any = dist.ProcessGroup


class FlowreduceProcessGroup(_ProcessGroup):
    """A ``torch.distributed`` group whose collectives run on a flowreduce communicator
    (:class:`flowreduce.spmd.Communicator`). Each returns a completed work; the tensors
    passed are updated in place."""

    def __init__(self, comm: Any) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return BACKEND

    def __repr__(self) -> str:
        return f"<FlowreduceProcessGroup rank {self.comm.rank} of {self.comm.size}>"

    # -- reductions -------------------------------------------------------------------
    def _allreduce_into(self, tensors: list[torch.Tensor], op: str) -> None:
        """One collective for every tensor of ``tensors`` (same dtype: flattened into one)."""
        for t in tensors:
            _check(t)
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

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._allreduce_into(list(tensors), _op(opts) if opts is not None else "sum")
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._allreduce_into(list(tensors), _op(opts) if opts is not None else "sum")
        return _done(tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        op = _op(opts) if opts is not None else "sum"
        for out, inputs in zip(output_tensors, input_tensors):
            _check(out)
            summed = self.comm.allreduce(torch.stack([i.detach() for i in inputs]), op=op)
            out.detach().copy_(summed[self.comm.rank].view(out.shape))
        return _done(output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        _check(output)
        summed = self.comm.allreduce(input.detach(), op=_op(opts) if opts is not None else "sum")
        output.detach().copy_(torch.chunk(summed, self.comm.size)[self.comm.rank].view(output.shape))
        return _done(output)

    _reduce_scatter_base = reduce_scatter_single

    # -- broadcast and gathers ----------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            _check(t)
            value = self.comm.broadcast(t.detach(), root=root)
            if self.comm.rank != root:
                t.detach().copy_(value.view(t.shape))
        return _done(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        for outs, inp in zip(output_tensors, input_tensors):
            _check(inp)
            for out, value in zip(outs, self.comm.allgather(inp.detach())):
                out.detach().copy_(value.view(out.shape))
        return _done(output_tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        _check(input)
        values = self.comm.allgather(input.detach())
        for chunk, value in zip(torch.chunk(output.detach(), self.comm.size), values):
            chunk.copy_(value.view(chunk.shape))
        return _done(output)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp, opts)
        return _done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def barrier(self, opts: Any = None) -> Any:
        self.comm.barrier()
        return _done(None)


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
