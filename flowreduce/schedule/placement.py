"""Place an all-reduce whose inputs may not be computed yet, without
waiting for them (schedule layer: it talks to the scheduler through the
client).

One scheduler call reports every input key's state, holders and worker
restrictions. An input in memory runs its rank where it is held; a pending
input pinned to exactly one worker (``submit(..., workers=[w])``, the
default ``allow_other_workers=False``) runs its rank on that worker; any
other pending input (unpinned, pinned loosely or to several workers) could
run anywhere, so it is waited for and then placed where it landed.

Each worker's host and usable CPUs (for the cost model) are asked of the
workers once per client and kept, so a training loop calling ``allreduce``
every step does not broadcast to the workers every step.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter
from typing import Any


async def _input_states(keys: list, timeout: float, dask_scheduler: Any = None) -> dict:
    """On the scheduler: ``key -> (state, holders, restrictions, loose)``.

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
        return [w for w in holders if w in pinned] or holders
    if len(pinned) == 1 and not loose and pinned[0] in alive:
        return pinned
    return None


def place(client: Any, ranks: list[list[Any]], *, timeout: float = 10.0) -> list[str]:
    """The worker of each rank, from the futures of each rank.

    A rank whose futures sit (or will sit) on several workers runs on the
    one most of them name; the others are fetched there.

    Raises
    ------
    RuntimeError
        An input that failed, was cancelled, or that the scheduler does not know.
    """
    _check_status(ranks)
    keys = list(dict.fromkeys(f.key for fs in ranks for f in fs))
    waited = False
    while True:
        states = client.run_on_scheduler(_input_states, keys, timeout)
        where: dict[Any, list[str] | None] = {}
        for r, fs in enumerate(ranks):
            for f in fs:
                st = states.get(f.key)
                if st is None:
                    raise RuntimeError(f"input of rank {r} (key {f.key!r}) is unknown to the scheduler "
                                       f"after {timeout:g} s; was it released?")
                if st[0] == "erred":
                    exc = f.exception()
                    raise RuntimeError(f"input of rank {r} failed: {exc!r}") from exc
                where[f.key] = _candidates(st)
        unknown = [f for fs in ranks for f in fs if where[f.key] is None]
        if not unknown or waited:
            break
        wait_on(client, unknown)  # unpinned and pending: only where it ran says where it is
        _check_status(ranks)
        waited = True
    load: Counter = Counter()
    out = []
    for r, fs in enumerate(ranks):
        votes = Counter()
        for f in fs:
            cands = where[f.key] or []
            if cands:
                votes[min(cands, key=lambda w: load[w])] += 1
        if not votes:
            raise RuntimeError(f"input of rank {r} has no worker: its data was lost")
        w = votes.most_common(1)[0][0]
        load[w] += 1
        out.append(w)
    return out


def wait_on(client: Any, futures: list[Any]) -> None:
    """``distributed.wait`` on ``client``'s event loop. ``distributed.wait``
    alone runs on the *default* client's loop: with two clients in one
    process (an in-process cluster beside another), the futures' states
    would be awaited on the wrong loop and fail later on their own."""
    from distributed import wait

    with client.as_current():
        wait(futures)


def _check_status(ranks: list[list[Any]]) -> None:
    for r, fs in enumerate(ranks):
        for f in fs:
            if f.status == "error":
                raise RuntimeError(f"input of rank {r} failed: {f.exception()!r}") from f.exception()
            if f.status in ("cancelled", "lost"):
                raise RuntimeError(f"input of rank {r} is {f.status} (key {f.key!r}); nothing to reduce")


_PLACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def worker_places(client: Any, workers: list[str]) -> dict[str, tuple]:
    """``worker -> (node, cpus, job, hostname)`` for ``workers``, asked of
    the workers not seen before (one broadcast to those only)."""
    from flowreduce.schedule.call import worker_place

    known = _PLACES.setdefault(client, {})
    missing = sorted(set(workers) - set(known))
    if missing:
        known.update(client.run(worker_place, workers=missing))
    return {w: known[w] for w in workers}


def remember_places(client: Any, places: dict[str, tuple]) -> None:
    """Keep places learnt some other way (the in-memory path's broadcast)."""
    _PLACES.setdefault(client, {}).update(places)
