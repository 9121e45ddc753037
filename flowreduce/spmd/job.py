"""``flowreduce.spmd(client, fn, ...)``: run ``fn(comm, ...)`` once per rank, as tasks.

The client decides where every rank runs (:func:`place`), which ranks share
a host (:mod:`flowreduce.schedule.hosts`' rule) and so the whole peer
table (:class:`~flowreduce.spmd.layout.Layout`), and submits one task per
rank pinned to its worker (:func:`run_rank`). A rank's task leaves its
worker's thread pool at once (``secede``), so ranks sharing a worker, even a
worker with one thread, all run; it rejoins the pool when ``fn`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed import Future, get_worker, rejoin, secede, wait

from flowreduce.errors import InputError, OptionError, WorkerLostError
from flowreduce.schedule.extension import ensure_extension
from flowreduce.schedule.hosts import worker_places
from flowreduce.schedule.spmd_mailbox import mailbox_of
from flowreduce.schedule.spmd_watch import rank_key
from flowreduce.shm.host_group import stores_ordered, sweep
from flowreduce.spmd.comm import Communicator
from flowreduce.spmd.layout import Layout, prefix, round_robin

logger = logging.getLogger("flowreduce")

#: ``flowreduce.spmd.transport``: ranks of a host share memory (auto), ranks of a worker process only
#: (worker: as if each worker were a host of its own), or none (dask: every rank alone)
TRANSPORTS = ("auto", "worker", "dask")

def run_rank(layout: Layout, rank: int, fn: Callable[..., Any], kwargs: dict[str, Any], *args: Any) -> Any:
    """Task: rank ``rank`` of the job, ``fn(comm, *args, **kwargs)``."""
    worker = get_worker()
    if worker.address != layout.workers[rank]:
        # the job failed with that worker: what its ranks left in shared memory here goes (a worker killed
        # with SIGKILL never sweeps, and with every rank of a host gone nobody else would)
        sweep(layout.directory, layout.prefix())
        raise WorkerLostError(f"rank {rank} of spmd job {layout.run} cannot run: its worker {layout.workers[rank]} "
                              f"left the cluster (the task was moved to {worker.address}); every rank of the job fails")
    mailbox = mailbox_of(worker)
    if mailbox is None:
        raise RuntimeError("the flowreduce spmd mailbox is not installed on this worker "
                           "(flowreduce.schedule.extension.ensure_extension)")
    comm = Communicator(layout, rank, mailbox)
    secede()
    failed = True
    try:
        result = fn(comm, *args, **kwargs)
        failed = False
        return result
    except BaseException as e:
        if not comm.failed:
            comm._fail(f"rank {rank} raised {type(e).__name__}: {e}")
        raise
    finally:
        try:
            comm.close(failed)
        finally:
            rejoin()

#: Seconds a job waits for a first worker when the cluster has none (one that is starting or restarting its
#: workers: a SLURM job's are minutes away, a nanny's restart a second)
WORKERS_SECONDS = 30.0


def configured_timeout(timeout: Any) -> float | None:
    """``timeout=`` in seconds, else the dask config ``flowreduce.timeout`` (None: no limit)."""
    from flowreduce import config

    value = timeout if timeout is not None else config.get("timeout")
    if value is None:
        return None
    seconds = parse_timedelta(value, default="seconds")
    if seconds is None or seconds <= 0:
        raise OptionError(f"timeout must be a positive number of seconds or a time string; got {value!r}")
    return float(seconds)


def place(client: Any, per_rank: Sequence[Sequence[Any]], ranks: int, workers: Sequence[str] | None) -> list[str]:
    """Each rank's worker: where its first future lives, else round-robin over the (sorted) workers."""
    alive = sorted(client.scheduler_info(n_workers=-1)["workers"]) if workers is None else sorted(workers)
    if not alive:  # a cluster still starting its workers (a batch job's), or restarting them: wait a while
        with contextlib.suppress(TimeoutError):
            client.wait_for_workers(1, timeout=WORKERS_SECONDS)
        alive = sorted(client.scheduler_info(n_workers=-1)["workers"])
    if not alive:
        raise OptionError(f"spmd needs at least one worker; the cluster has had none for {WORKERS_SECONDS:g} s")
    spread = round_robin(ranks, alive)
    firsts: dict[int, Future] = {}
    for r in range(ranks):
        first = next((arg[r] for arg in per_rank if isinstance(arg[r], Future)), None)
        if first is not None:
            firsts[r] = first
    if not firsts:
        return spread
    wait(list(firsts.values()))
    holders = client.who_has(list(firsts.values()))
    out = []
    for r in range(ranks):
        f = firsts.get(r)
        held = sorted(holders.get(f.key, ())) if f is not None else []
        mine = [w for w in held if w in alive] or held
        out.append(mine[0] if mine else spread[r])
    return out


def layout_of(client: Any, job: str, attempt: int, where: Sequence[str], timeout: float | None) -> Layout:
    """The attempt's peer table: ranks grouped by node (by worker, or each alone: ``flowreduce.spmd.transport``)."""
    from flowreduce import config

    transport = dask.config.get("flowreduce.spmd.transport", default="auto")
    if transport not in TRANSPORTS:
        raise OptionError(f"flowreduce.spmd.transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if transport == "dask" or not config.get("shm.enabled") or not stores_ordered():
        hosts = tuple(range(len(where)))
    elif transport == "worker":
        distinct = sorted(set(where))
        hosts = tuple(distinct.index(w) for w in where)
    else:
        places = worker_places(client, sorted(set(where)))
        nodes = sorted({places[w].node for w in where})
        hosts = tuple(nodes.index(places[w].node) for w in where)
    return Layout(job, attempt, tuple(where), hosts, timeout, directory=directory())


def directory() -> str:
    """Where the jobs' segments live (``flowreduce.shm.directory``)."""
    from flowreduce import config

    return str(config.get("shm.directory"))


def spmd(client: Any, fn: Callable[..., Any], *per_rank_args: Sequence[Any], ranks: int | None = None,
         workers: Sequence[str] | None = None, restarts: int = 0, timeout: Any = None,
         **kwargs: Any) -> list[Future]:
    """Run ``fn(comm, *rank_args, **kwargs)`` once per rank, each a task; the futures of their results.

    Parameters
    ----------
    client : distributed.Client
    fn : callable
        ``fn(comm, *args, **kwargs)``; ``comm`` is the rank's
        :class:`~flowreduce.spmd.comm.Communicator` (``comm.rank``,
        ``comm.size``, ``comm.allreduce`` ...).
    *per_rank_args : lists, one entry per rank
        Rank ``r`` gets ``arg[r]`` of each; futures are passed as their values.
    ranks : int, optional
        The rank count when there are no per-rank arguments (else it must agree).
    workers : list of str, optional
        The workers to spread ranks over (default: all, sorted by address).
        A rank whose first per-rank argument is a future runs where it lives.
    restarts : int
        Run the whole job again (a new attempt, ``comm.attempt`` one more, on
        the workers there are then) up to this many times after a failure,
        as torchrun restarts; with ``restarts > 0`` the call waits for the job.
    timeout : float or str, optional
        Longest a collective may wait for its peers (default: the dask config
        ``flowreduce.timeout``; None: no limit).
    **kwargs
        Passed to every rank's ``fn``.

    Returns
    -------
    list of distributed.Future
        One per rank: ``fn``'s return value, or its error. When a rank fails
        (raises, times out, loses its worker) every rank's pending collective
        raises and every future errs, naming the rank and the collective.

    Raises
    ------
    OptionError
        For a rank count that disagrees with the per-rank arguments, a bad
        ``restarts`` or ``timeout``.
    """
    lengths = {len(a) for a in per_rank_args}
    if len(lengths) > 1:
        raise InputError(f"every per-rank argument needs one entry per rank; got lengths {sorted(lengths)}")
    size = lengths.pop() if lengths else ranks
    if size is None:
        raise OptionError("spmd needs ranks= when there are no per-rank arguments")
    if ranks is not None and ranks != size:
        raise OptionError(f"ranks={ranks} disagrees with the per-rank arguments' {size} entries")
    if size < 1:
        raise OptionError(f"spmd needs at least one rank; got {size}")
    if not isinstance(restarts, int) or restarts < 0:
        raise OptionError(f"restarts must be an integer >= 0; got {restarts!r}")
    seconds = configured_timeout(timeout)
    ensure_extension(client)  # the mailboxes, the scheduler's watch and the page listing live jobs
    job = uuid.uuid4().hex[:16]
    for attempt in range(restarts + 1):
        futures = _submit(client, fn, per_rank_args, size, workers, job, attempt, seconds, kwargs)
        if restarts == 0:
            return futures
        wait(futures)
        if all(f.status == "finished" for f in futures):
            return futures
        failed = next(f for f in futures if f.status != "finished")
        logger.warning("flowreduce: spmd job %s attempt %d failed (%s)%s", job, attempt, failed.exception(),
                       "; restarting" if attempt < restarts else "; no restarts left")
        client.run(sweep, directory(), prefix(job, attempt))
    return futures


def _submit(client: Any, fn: Callable[..., Any], per_rank: Sequence[Sequence[Any]], size: int,
            workers: Sequence[str] | None, job: str, attempt: int, timeout: float | None,
            kwargs: dict[str, Any]) -> list[Future]:
    where = place(client, per_rank, size, workers)
    layout = layout_of(client, job, attempt, where, timeout)
    return [client.submit(run_rank, layout, r, fn, kwargs, *(arg[r] for arg in per_rank), key=rank_key(layout.run, r),
                          workers=[where[r]], allow_other_workers=False, pure=False, retries=0)
            for r in range(size)]
