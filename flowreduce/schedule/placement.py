"""Where each rank runs: the worker holding (or about to hold) its input.

Two ways, one per kind of call:

* :func:`locate` waits until the inputs are in memory and asks the workers,
  in one broadcast, which of them hold which input and what it is (a
  :data:`~flowreduce.schedule.inputs.Meta`), with each worker's
  :class:`~flowreduce.schedule.hosts.Place` (:func:`rank_groups`, public as
  ``flowreduce.rank_groups``, groups the ranks it places by node);
* :func:`place` does not wait: one scheduler call reports every input key's
  state, holders and worker restrictions. An input in memory runs its rank
  where it is held; a pending input pinned to exactly one worker
  (``submit(..., workers=[w])``, the default ``allow_other_workers=False``)
  runs its rank on that worker; any other pending input (unpinned, pinned
  loosely or to several workers) could run anywhere, so it is waited for and
  then placed where it landed.

* :func:`glance` neither waits nor asks the workers: one scheduler call
  reports every input key's state, holders, size and type. When every input
  is a numpy array in memory, that places the ranks and sizes the call, and
  the call's first tasks check what the ranks hold (the one-level ``direct``
  collective does: :mod:`flowreduce.lower.direct`).

All check the futures' status with :func:`check_status` and wait with
:func:`wait_on`, on the client's own event loop.
"""

from __future__ import annotations

import asyncio
import traceback
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

from flowreduce.errors import InputStateError, WorkerLostError
from flowreduce.grouping import GroupKey
from flowreduce.schedule import hosts
from flowreduce.schedule.inputs import Meta, meta_of


def wait_on(client: Any, futures: Sequence[Any], return_when: str = "ALL_COMPLETED", timeout: float | None = None
            ) -> Any:
    """``distributed.wait`` on ``client``'s event loop. ``distributed.wait``
    alone runs on the *default* client's loop: with two clients in one
    process (an in-process cluster beside another), the futures' states
    would be awaited on the wrong loop and fail later on their own."""
    from distributed import wait

    with client.as_current():
        return wait(list(futures), return_when=return_when, timeout=timeout)


#: A worker in one of these states runs no new task: a task pinned to it (``allow_other_workers=False``) never runs
LEAVING = ("closing", "closing_gracefully", "closed", "failed")


def worker_statuses(client: Any) -> dict[str, str]:
    """Address -> status name of every worker the scheduler has (one scheduler call)."""
    return client.run_on_scheduler(_statuses)


def _statuses(dask_scheduler: Any = None) -> dict[str, str]:
    return {w: ws.status.name for w, ws in dask_scheduler.workers.items()}


def departed(client: Any, workers: Sequence[str]) -> set[str]:
    """Those of ``workers`` the scheduler no longer has or that are leaving (:data:`LEAVING`): a task
    pinned to one of them never runs (one scheduler call)."""
    statuses = worker_statuses(client)
    return {w for w in workers if statuses.get(w, "closed") in LEAVING}


def wait_for_a_while(client: Any, futures: Sequence[Any], seconds: float, return_when: str = "ALL_COMPLETED"
                     ) -> Any:
    """:func:`wait_on` for at most ``seconds``: its result, or None when
    the time ran out. The timeout's exception is dropped with its frames
    cleared: distributed keeps it in a reference cycle with the waiting
    frames, whose locals hold the futures, and those would keep their keys
    on the scheduler until the garbage collector ran (a closed trainer's
    replicas stayed there)."""
    try:
        return wait_on(client, futures, return_when=return_when, timeout=seconds)
    except TimeoutError as e:  # distributed.wait's timeout
        chained: BaseException | None = e
        while chained is not None:
            traceback.clear_frames(chained.__traceback__)
            chained.__traceback__, chained = None, chained.__context__
        return None


def gather_pinned(client: Any, futures: Sequence[Any], workers: Sequence[str], what: str, poll: float = 1.0
                  ) -> list[Any]:
    """The results of ``futures``, each pinned to the worker at its position
    in ``workers`` (``allow_other_workers=False``): what
    ``client.gather`` gives, except that a worker leaving before its task
    finished raises :class:`~flowreduce.errors.WorkerLostError` naming
    ``what``, the task and the worker, where ``gather`` would wait forever
    (Dask keeps a task whose only allowed worker is gone in ``no-worker``).
    The workers are checked once per ``poll`` seconds of waiting."""
    futures = list(futures)
    while True:
        if wait_for_a_while(client, futures, poll) is not None:
            return client.gather(futures)
        left = departed(client, workers)
        gone = [(f, w) for f, w in zip(futures, workers) if f.status == "pending" and w in left]
        if gone:
            f, w = gone[0]
            raise WorkerLostError(f"{what}: worker {w} left the cluster before task {f.key!r}, which only it may "
                                  f"run, finished ({len(gone)} such task(s))")


def check_status(ranks: Sequence[Sequence[Any]]) -> None:
    """An error naming the rank of the first input future that failed, was
    cancelled or lost (a pending or finished one is fine)."""
    for r, fs in enumerate(ranks):
        for f in fs:
            if f.status == "error":
                raise InputStateError(f"input of rank {r} failed: {f.exception()!r}") from f.exception()
            if f.status == "cancelled":
                raise InputStateError(f"input of rank {r} was cancelled (key {f.key!r}); nothing to reduce")
            if f.status == "lost":
                raise InputStateError(f"input of rank {r} is lost (key {f.key!r}); nothing to reduce")


def locate(client: Any, ranks: Sequence[Sequence[Any]], timeout: float | None = None
           ) -> tuple[list[list[str]], list[list[Meta]]]:
    """For each rank's futures, once all are in memory, the worker holding
    each and what it holds there; the workers' places are kept
    (:func:`flowreduce.schedule.hosts.remember`). One broadcast.

    Raises
    ------
    InputStateError
        An input that failed, was cancelled or whose data was lost.
    AllreduceTimeoutError
        Inputs still not in memory after ``timeout`` s (None: wait for ever).
    """
    check_status(ranks)  # before waiting: wait() would raise a CancelledError that names no rank
    flat = [f for fs in ranks for f in fs]
    if timeout is None:
        wait_on(client, flat)
    else:  # past it, an AllreduceTimeoutError says which inputs are still computing, where
        from flowreduce.schedule.guard import wait_inputs

        wait_inputs(client, ranks, timeout)
    check_status(ranks)
    keys = list(dict.fromkeys(f.key for f in flat))
    holders: dict[Hashable, list[str]] = {}
    meta: dict[Hashable, Meta] = {}
    places: dict[str, hosts.Place] = {}
    for worker, (held, place) in sorted(client.run(_held, keys).items()):
        places[worker] = place
        for k, m in held.items():
            holders.setdefault(k, []).append(worker)
            meta.setdefault(k, m)
    hosts.remember(client, places)
    for r, fs in enumerate(ranks):
        for f in fs:
            if f.key not in holders:
                raise InputStateError(f"input of rank {r} (key {f.key!r}) is held by no worker: its data was lost")
    # A replicated input (fetched earlier by some other task) may sit on
    # several workers: keep it where its submitter pinned it if that is one of
    # them, else spread ranks over the holders, sole holders first.
    replicated = [k for k in keys if len(holders[k]) > 1]
    if replicated:
        pinned = client.run_on_scheduler(_restrictions, replicated)
        for k in replicated:
            holders[k] = [w for w in holders[k] if w in pinned.get(k, ())] or holders[k]
    return _spread(ranks, holders), [[meta[f.key] for f in fs] for fs in ranks]


def _spread(ranks: Sequence[Sequence[Any]], holders: dict[Hashable, list[str]]) -> list[list[str]]:
    """The worker of each rank's futures among their holders: sole holders
    first, then the least loaded holder."""
    load: Counter[str] = Counter()
    chosen: dict[tuple[int, int], str] = {}
    order = sorted(((r, j) for r, fs in enumerate(ranks) for j in range(len(fs))),
                   key=lambda rj: len(holders[ranks[rj[0]][rj[1]].key]))
    for r, j in order:
        w = min(holders[ranks[r][j].key], key=lambda w: load[w])
        chosen[r, j] = w
        load[w] += 1
    return [[chosen[r, j] for j in range(len(fs))] for r, fs in enumerate(ranks)]


#: What the scheduler calls a numpy array's type (``ts.type``; None for scattered data).
NDARRAY = "numpy.ndarray"


def rank_groups(client: Any, inputs: Sequence[Any], *, key: GroupKey | None = None) -> list[list[int]]:
    """``groups=`` for an all-reduce of the futures ``inputs``: ranks placed
    where ``allreduce`` would place them (the worker holding each input,
    once in memory: :func:`locate`), grouped by node (the rule of
    :mod:`~flowreduce.schedule.hosts`) or by ``key``. Public as
    ``flowreduce.rank_groups``."""
    located, _ = locate(client, [[f] for f in inputs])
    rank_workers = [ws[0] for ws in located]
    if key is None:
        return hosts.host_groups(rank_workers, hosts.worker_places(client, rank_workers))
    return hosts.topology(client, sorted(set(rank_workers)), key=key).for_ranks(rank_workers)


def glance(client: Any, ranks: Sequence[Any]) -> tuple[list[str], int] | None:
    """The worker of each rank's future and the bytes of each input, from one
    scheduler call, when every input is a numpy array in memory of one size
    (its shape and dtype are not known here: the call's tasks check them).
    None otherwise (pending, scattered, other types, sizes that disagree): the
    caller waits for the inputs and asks the workers (:func:`locate`).

    Raises
    ------
    InputStateError
        An input that failed, was cancelled or lost.
    """
    # the guard imports distributed: not at import time (flowreduce.train imports wait_on without it)
    from flowreduce.schedule import guard
    from flowreduce.schedule.extension import ensure_extension

    check_status([[f] for f in ranks])
    keys = list(dict.fromkeys(f.key for f in ranks))
    ensure_extension(client)
    found = client.sync(getattr(client.scheduler, guard.STATES), keys=keys)
    states = dict(zip(keys, found)) if isinstance(found, (list, tuple)) else None  # None: unknown key, or refused
    if states is None or len({st[3] for st in states.values()}) != 1:
        return None
    holders: dict[Hashable, list[str]] = {}
    for k, (state, held, pinned, _, kind) in states.items():
        if state != "memory" or kind != NDARRAY or not held:
            return None
        holders[k] = [w for w in held if w in pinned] or list(held)
    workers = _spread([[f] for f in ranks], holders)
    return [ws[0] for ws in workers], next(iter(states.values()))[3]


def _held(keys: list[Hashable], dask_worker: Any = None) -> tuple[dict[Hashable, Meta], hosts.Place]:
    """On each worker: what it holds of ``keys``, and where it runs."""
    held = {k: meta_of(dask_worker.data[k]) for k in keys if k in dask_worker.data}
    return held, hosts.worker_place(dask_worker)


def _restrictions(keys: list[Hashable], dask_scheduler: Any = None) -> dict[Hashable, list[str]]:
    tasks = dask_scheduler.tasks
    return {k: sorted(tasks[k].worker_restrictions or ()) for k in keys if k in tasks}


async def _input_states(keys: list[Hashable], timeout: float, dask_scheduler: Any = None) -> dict[Hashable, tuple]:
    """On the scheduler: ``key -> (state, holders, restrictions, loose, alive workers)``.

    A future submitted just before this call may not have reached the
    scheduler yet (the client's task stream and this RPC travel on different
    connections), so wait, bounded, until every key is known."""
    s = dask_scheduler
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(k not in s.tasks for k in keys) and loop.time() < deadline:
        await asyncio.sleep(0.002)
    out = {}
    for k in keys:
        ts = s.tasks.get(k)
        if ts is None:
            continue
        out[k] = (ts.state, sorted(ws.address for ws in ts.who_has or ()), sorted(ts.worker_restrictions or ()),
                  bool(ts.loose_restrictions), sorted(s.workers))
    return out


def _candidates(state: tuple) -> list[str] | None:
    """Workers the key is (or will be) on, or None if that is unknowable yet."""
    status, holders, pinned, loose, alive = state
    if status == "memory":
        return [w for w in holders if w in pinned] or list(holders)
    if len(pinned) == 1 and not loose and pinned[0] in alive:
        return list(pinned)
    return None


def place(client: Any, ranks: Sequence[Sequence[Any]], *, timeout: float = 10.0) -> list[str]:
    """The worker of each rank, from the futures of each rank, without
    waiting for pinned ones. A rank whose futures sit (or will sit) on
    several workers runs on the one most of them name; the others are
    fetched there.

    Raises
    ------
    InputStateError
        An input that failed, was cancelled, or that the scheduler does not know.
    """
    check_status(ranks)
    keys = list(dict.fromkeys(f.key for fs in ranks for f in fs))
    waited = False
    while True:
        states = client.run_on_scheduler(_input_states, keys, timeout)
        where: dict[Hashable, list[str] | None] = {}
        for r, fs in enumerate(ranks):
            for f in fs:
                st = states.get(f.key)
                if st is None:
                    raise InputStateError(f"input of rank {r} (key {f.key!r}) is unknown to the scheduler "
                                          f"after {timeout:g} s; was it released?")
                if st[0] == "erred":
                    exc = f.exception()
                    raise InputStateError(f"input of rank {r} failed: {exc!r}") from exc
                where[f.key] = _candidates(st)
        unknown = [f for fs in ranks for f in fs if where[f.key] is None]
        if not unknown or waited:
            break
        wait_on(client, unknown)  # unpinned and pending: only where it ran says where it is
        check_status(ranks)
        waited = True
    load: Counter[str] = Counter()
    out = []
    for r, fs in enumerate(ranks):
        votes: Counter[str] = Counter()
        for f in fs:
            cands = where[f.key] or []
            if cands:
                votes[min(cands, key=lambda w: load[w])] += 1
        if not votes:
            raise InputStateError(f"input of rank {r} has no worker: its data was lost")
        w = votes.most_common(1)[0][0]
        load[w] += 1
        out.append(w)
    return out
