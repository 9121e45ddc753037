"""Recover a call when a worker holding part of it leaves the cluster (run
on the scheduler by :class:`flowreduce.schedule.guard.PinGuard`).

Every task of an all-reduce is pinned to its rank's worker. When that
worker is gone, Dask alone would leave the rank's tasks in ``no-worker``
forever. Recovery, per call (keys sharing a token) with a task pinned to a
worker that left:

1. **Re-pin.** The tasks pinned to the lost worker are pinned to a running
   worker instead: the one now holding most of their inputs (a graceful
   retirement moved them there), else the one carrying the fewest of the
   call's tasks. Inputs with lineage that died with the worker are
   recomputed by Dask on its own (the call's tasks wait for them).
2. **Run again, on private copies.** Every part of the call that is not a
   finished result is released and runs again, with the same keys (Dask's
   per-run ids make late answers of the old run harmless), and each task now
   works on private copies of its inputs: the shared-memory kernels write
   into blocks their peers read, and under the new placement a rank's tasks
   may share a worker with those peers. (No task writes into a value it
   received, whatever the attempt: any replica of a key may be read again,
   ``call.TASKS_REDUCE_INTO_RECEIVED``.)
3. **Bounded.** A call recovers at most ``attempts`` times (dask config
   ``flowreduce.recovery.attempts``, default 3); one more loss fails its
   pending results with :class:`WorkerLostError`.

The result futures the user holds keep their keys, so they resolve once the
new run finishes. Results already in memory on survivors are kept.
"""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable
from typing import Any

from dask.task_spec import Task

from flowreduce.schedule import p2p

logger = logging.getLogger("flowreduce")


def token_of(key: Hashable) -> str | None:
    """The call token in a flowreduce key, None for anybody else's key."""
    if isinstance(key, tuple) and key and isinstance(key[0], str) and key[0].startswith("flowreduce-"):
        return key[0].rpartition("-")[2]
    return None


def private_copies(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``func`` on deep copies of its (resolved) arguments: a task run
    again after a worker loss never writes into a value another task reads."""
    return func(*copy.deepcopy(args), **copy.deepcopy(kwargs))


async def private_copies_async(func: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`private_copies` of a coroutine function (a task the worker runs
    on its event loop; the copies are made off it: the inputs may be large)."""
    import asyncio

    args, kwargs = await asyncio.get_running_loop().run_in_executor(None, copy.deepcopy, (args, kwargs))
    return await func(*args, **kwargs)


def _on_private_copies(spec: Any) -> Any:
    if not isinstance(spec, Task) or spec.func in (private_copies, private_copies_async):
        return spec
    wrap = private_copies_async if inspect.iscoroutinefunction(spec.func) else private_copies
    return Task(spec.key, wrap, spec.func, *spec.args, **spec.kwargs)


def _raise_lost(key: Hashable, ranks: tuple[int, ...], message: str) -> None:
    from flowreduce.errors import WorkerLostError

    raise WorkerLostError(message)


def lost_input_spec(key: Hashable, ranks: list[int]) -> Task:
    """The run_spec given to a scattered input while a call reads it: if
    its only copy dies, "recomputing" it fails the call naming the rank and
    the key (Dask would otherwise forget it and cancel the results)."""
    which = ", ".join(map(str, sorted(set(ranks))))
    message = (f"input of rank {which} (key {key!r}) was lost: its only copy was on a worker that left the "
               "cluster, and it was scattered data, which Dask cannot recompute: scatter this rank's data "
               "again and call allreduce again.")
    return Task(key, _raise_lost, key, tuple(sorted(set(ranks))), message)


def is_lost_input_spec(spec: Any) -> bool:
    return isinstance(spec, Task) and spec.func is _raise_lost


def fail(s: Any, keys: Iterable[Hashable], exc: BaseException, stimulus_id: str) -> None:
    """Fail tasks ``keys`` (and so everything downstream) with ``exc``,
    whatever state they wait in."""
    payload = pickle.dumps(exc)
    for key in keys:
        ts = s.tasks.get(key)
        if ts is None or ts.state in ("memory", "erred", "forgotten"):
            continue
        if ts.state == "no-worker":
            recs = s.transition(key, "erred", exception=payload, cause=key, stimulus_id=stimulus_id)
        else:
            if ts.state != "released":
                recs = s.transition(key, "released", stimulus_id=stimulus_id)
                recs.pop(key, None)  # it would wait again for its client
                s.transitions(recs, stimulus_id=stimulus_id)
            ts.exception, ts.traceback, ts.exception_blame = payload, None, ts
            ts.exception_text, ts.traceback_text = f"{type(exc).__name__}: {exc}", ""
            recs = s.transition(key, "erred", stimulus_id=stimulus_id)
        s.transitions(recs, stimulus_id=stimulus_id)


def _calls_on(s: Any, gone: set[str]) -> dict[str, list[Any]]:
    """The tasks, by call token, of every call with a task pinned to a worker in ``gone``."""
    by_token: dict[str, list[Any]] = defaultdict(list)
    hit = set()
    for key, ts in s.tasks.items():
        token = token_of(key)
        if token is None:
            continue
        by_token[token].append(ts)
        if ts.worker_restrictions and not ts.worker_restrictions.isdisjoint(gone):
            hit.add(token)
    return {t: by_token[t] for t in hit}


def _replacement(s: Any, tasks: list[Any], lost: str) -> str | None:
    """A running worker for the tasks pinned to ``lost``: where most of their
    inputs now are, else the one with the fewest of the call's tasks."""
    running = {ws.address for ws in s.running}
    if not running:
        return None
    held: Counter[str] = Counter()
    for ts in tasks:
        if ts.worker_restrictions == {lost}:
            for dts in ts.dependencies:
                if token_of(dts.key) is None:
                    held.update(ws.address for ws in dts.who_has or () if ws.address in running)
    if held:
        return held.most_common(1)[0][0]
    load = Counter({w: 0 for w in running})
    for ts in tasks:
        for w in ts.worker_restrictions or ():
            if w in load:
                load[w] += 1
    return min(sorted(load), key=lambda w: load[w])


def settle_lost(s: Any, gone: set[str], stimulus_id: str) -> None:
    """Fail the flowreduce tasks a loss left waiting on a task that has
    erred: Dask neither re-runs nor fails a lost result one of whose
    dependencies erred (``memory -> released`` recommends nothing then), so
    its future would stay ``lost`` forever. That happens when an earlier loss
    failed an input that cannot be recomputed, which this result needs too."""
    from flowreduce.errors import WorkerLostError
    from flowreduce.keys import parse

    doomed = []
    for key, ts in s.tasks.items():
        if ts.state not in ("released", "waiting") or not (ts.who_wants or ts.waiters) or token_of(key) is None:
            continue
        blame = next((d.exception_blame or d for d in ts.dependencies if d.state == "erred"), None)
        if blame is not None:
            doomed.append((key, blame))
    for key, blame in doomed:
        info = parse(key)
        what = "result" if info is not None and info["phase"] == "output" else "task"
        who = f"{what} of rank {info['rank']}" if info is not None else "task"
        why = blame.exception_text or f"task {blame.key!r} failed"
        exc = WorkerLostError(f"{who} (key {key!r}) was lost with worker {', '.join(sorted(gone))} (died "
                              f"or was retired) and cannot be computed again: it needs {blame.key!r}, which "
                              f"failed: {why}")
        fail(s, [key], exc, stimulus_id)


def recover(guard: Any, gone: set[str], stimulus_id: str) -> None:
    """Re-pin and re-run every call with tasks pinned to workers ``gone``;
    then fail what can no longer run (:func:`settle_lost`)."""
    s = guard.scheduler
    gone = {w for w in gone if w not in s.workers}
    if not gone:
        return
    _rerun(guard, gone, stimulus_id)
    settle_lost(s, gone, stimulus_id)


def _rerun(guard: Any, gone: set[str], stimulus_id: str) -> None:
    from flowreduce.errors import WorkerLostError

    s = guard.scheduler
    for token, tasks in _calls_on(s, gone).items():
        live = [ts for ts in tasks if ts.state in ("waiting", "processing", "no-worker", "queued")]
        moves = {}
        for lost in sorted(gone):
            if any(ts.worker_restrictions == {lost} for ts in tasks):
                moves[lost] = _replacement(s, tasks, lost)
        if p2p.placed_on_arrival(tasks):  # no task pinned but its results: released, the ranks arrive again
            if live and guard.attempt(token) > guard.attempts:
                exc = WorkerLostError(f"all-reduce {token}: worker {', '.join(sorted(gone))} left the cluster "
                                      f"(died or was retired) and the call cannot recover: it already recovered "
                                      f"{guard.attempts} times (dask config flowreduce.recovery.attempts).")
                fail(s, [ts.key for ts in live if ts.who_wants] or [ts.key for ts in live], exc, stimulus_id)
            elif live:
                p2p.restart_on_arrival(s, token, tasks, gone, stimulus_id)
            continue
        # a p2p call whose result died with a worker after its run ended must run again too
        p2p_lost = p2p.is_p2p(tasks) and any(p2p.lost_output(ts) for ts in tasks)
        if live or p2p_lost:
            n = guard.attempt(token)
            stuck = [w for w, to in moves.items() if to is None]
            if n > guard.attempts or stuck:
                why = (f"no worker is left to take over from {', '.join(stuck)}" if stuck else
                       f"it already recovered {guard.attempts} times (dask config flowreduce.recovery.attempts)")
                exc = WorkerLostError(f"all-reduce {token}: worker {', '.join(sorted(gone))} left the cluster "
                                      f"(died or was retired) and the call cannot recover: {why}.")
                pending = live or [ts for ts in tasks if p2p.lost_output(ts)]
                wanted = [ts.key for ts in pending if ts.who_wants]
                fail(s, wanted or [ts.key for ts in pending], exc, stimulus_id)
                continue
            logger.warning("flowreduce: all-reduce %s lost worker(s) %s; attempt %d re-runs it with %s", token,
                           ", ".join(sorted(gone)), n + 1, ", ".join(f"{a} -> {b}" for a, b in moves.items()))
        for ts in tasks:
            if ts.worker_restrictions and len(ts.worker_restrictions) == 1:
                (w,) = ts.worker_restrictions
                if w in moves and moves[w] is not None:
                    s.set_restrictions({ts.key: [moves[w]]})
        # the engine never writes into a task's inputs: its tasks keep plain run_specs, with the new run id
        rewritten = p2p.restart(s, token, tasks, {w: to for w, to in moves.items() if to is not None}, n) if (
            live or p2p_lost) else set()
        for ts in tasks:
            if ts.key not in rewritten:
                ts.run_spec = _on_private_copies(ts.run_spec)
        if not (live or p2p_lost):
            continue  # a finished call: re-pinned, so a lost result recomputes where it can
        recs = {}
        for ts in tasks:
            if ts.state in ("processing", "no-worker", "queued") or (ts.state == "memory" and not ts.who_wants):
                recs[ts.key] = "released"
        s.transitions(recs, stimulus_id=stimulus_id)
