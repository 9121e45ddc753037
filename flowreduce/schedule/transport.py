"""Which workers of a call share memory: the memory domain of each rank's
worker, and what that says of every link between two workers.

``transport="auto"`` (the default) lets the routes of
:mod:`flowreduce.schedule.routes` move bytes between worker processes of one
host through shared memory (which route a plan takes is decided there,
once); ``"dask"`` turns all of it off (every byte through Dask's comm, as
before); ``"shm"`` is ``auto`` that says so.

A worker's memory domain is its node and machine (its
:class:`flowreduce.schedule.hosts.Place`: emulated hosts in network
namespaces stay apart); in-process workers (``inproc://``) hand objects
over by reference and need no shared memory.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from flowreduce.algorithms.ir import Plan
from flowreduce.shm import pool as shm_pool

TRANSPORTS = ("auto", "shm", "dask")
#: The memory domain of in-process workers: nothing to publish between them.
IN_PROCESS = "in-process"


def check(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; valid: {', '.join(TRANSPORTS)}")


def memory_domains(workers: Sequence[str], places: Mapping[str, Any], transport: str) -> list[Any]:
    """Per rank, the memory domain its worker shares with the others (None:
    no shared memory for it)."""
    if transport == "dask":
        return [None] * len(workers)
    out: list[Any] = []
    for w in workers:
        if w.startswith("inproc://"):  # one process: the collective's values are handed over by reference
            out.append(IN_PROCESS)
            continue
        place = places.get(w)
        out.append((place.node, place.machine) if place is not None else (w, w))
    return out


def through_segments(domains: Sequence[Any]) -> tuple[Any, ...]:
    """Per rank, the memory domain whose segments carry its values to the
    others of its host; None where they go through Dask's comm, or are
    handed over by reference already (in one process)."""
    return tuple(None if d == IN_PROCESS else d for d in domains)


def one_host(workers: Sequence[str], domains: Sequence[Any]) -> bool:
    """All ranks can reach each other through shared memory, or share one
    process (one worker, or an in-process cluster)."""
    return len(set(workers)) == 1 or (None not in domains and len(set(domains)) == 1)


def hosts_share_memory(hosts: Sequence[Sequence[int]], domains: Sequence[Any]) -> bool:
    """Every host's ranks share one memory domain, and there are several
    domains: hierarchical's inner phases can go through shared memory."""
    doms = [{domains[r] for r in g} for g in hosts]
    return (len(hosts) > 1 and all(len(d) == 1 and None not in d and IN_PROCESS not in d for d in doms)
            and len({next(iter(d)) for d in doms}) > 1)


#: Per link, how it moved bytes: ``(source worker, destination worker, transport)``.
Links = tuple[tuple[str, str, str], ...]


def sharing(workers: Sequence[str], domains: Sequence[Any], nbytes: int) -> tuple[tuple[str, Any], ...]:
    """``(worker, domain)`` of the workers sharing a host with another (none
    for empty inputs): where ``direct``'s tasks read their peers' posts
    (:func:`flowreduce.schedule.peer_reads.reading`). Whatever the size: a
    post costs no message at all, so unlike an edge's handle it is never
    dearer than what it replaces."""
    if nbytes <= 0:
        return ()
    shared = {w: d for w, d in zip(workers, domains) if d is not None and d != IN_PROCESS}
    hosts: dict[Any, set[str]] = {}
    for w, d in shared.items():
        hosts.setdefault(d, set()).add(w)
    return tuple(sorted((w, d) for w, d in shared.items() if len(hosts[d]) > 1))


def links(plan: Plan, workers: Sequence[str], domains: Sequence[Any], nbytes: float, *, direct: bool = False,
          published: Collection[int] = (), posts: bool = False) -> Links:
    """Which transport each pair of workers exchanging values used:
    ``same worker``, ``in-process``, ``shared memory`` (a lowering over
    segments, ``direct``, or a ``published`` node), else ``dask``. Values
    under ``flowreduce.shm.min-bytes`` (the client's setting) go by Dask,
    except ``posts`` (``direct``'s, which are read where they lie at any size)."""
    small = 1 if posts else shm_pool.config()["min-bytes"]
    unit = nbytes / plan.segments / plan.chunks if plan.segments else 0.0
    found: dict[tuple[str, str], set[str]] = {}
    for t in plan.transfers():
        a, b = workers[t.source], workers[t.dest]
        same_host = domains[t.source] is not None and domains[t.source] == domains[t.dest]
        if a == b:
            kind = "same worker"
        elif same_host and domains[t.source] == IN_PROCESS:
            kind = "in-process"
        elif same_host and direct and nbytes >= small:
            kind = "shared memory"
        elif same_host and t.src in published and (t.hi - t.lo) * unit >= small:
            kind = "shared memory"
        else:
            kind = "dask"
        found.setdefault((a, b), set()).add(kind)
    return tuple((a, b, " and ".join(sorted(k))) for (a, b), k in sorted(found.items()))
