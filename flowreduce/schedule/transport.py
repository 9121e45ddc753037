"""How bytes move between a call's workers: the one place that decides
between shared memory and Dask's comm, per rank and per plan.

``transport="auto"`` (the default) moves the payload of every edge between
two worker processes of one host through shared memory, and lets ``auto``
choose the one-level intra-host collective (``shm-direct``) when all ranks
share a host; across hosts, ``hierarchical`` runs that collective inside
each host (``inner="shm-direct"``) and its outer algorithm between hosts,
and ``auto`` may choose it; ``"dask"`` turns all of it off (every byte through Dask's
comm, as before); ``"shm"`` is ``auto`` that says so.

A worker's memory domain is its node and machine (its
:class:`flowreduce.schedule.hosts.Place`: emulated hosts in network
namespaces stay apart); in-process workers (``inproc://``) hand objects
over by reference and need no shared memory.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms.hierarchical import DIRECT as DIRECT_INNER
from flowreduce.algorithms.ir import Plan
from flowreduce.cost import CostModel, tune
from flowreduce.lower import shm_direct, shm_edges, shm_hierarchical
from flowreduce.lower.graph import Graph, build_graph
from flowreduce.ops import Op
from flowreduce.shm import pool as shm_pool

TRANSPORTS = ("auto", "shm", "dask")
DIRECT = "shm-direct"
#: The one-level plan whose tasks read their peers' inputs (:mod:`flowreduce.algorithms.direct`).
READ_DIRECT = "direct"
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


def one_host(workers: Sequence[str], domains: Sequence[Any]) -> bool:
    """All ranks can reach each other through shared memory, or share one
    process (one worker, or an in-process cluster)."""
    return len(set(workers)) == 1 or (None not in domains and len(set(domains)) == 1)


def direct_plan(p: int, workers: Sequence[str]) -> Plan:
    """The ``shm-direct`` plan for these ranks' workers."""
    groups = shm_direct.worker_groups(workers)
    options: dict[str, Any] = {"groups": groups} if len(groups) < p else {}
    return make_plan(DIRECT, p, **options)


def direct_options(options: dict, workers: Sequence[str]) -> dict:
    """A named ``shm-direct`` call's options with the workers' groups filled in."""
    if "groups" in options:
        return options
    groups = shm_direct.worker_groups(workers)
    return {**options, **({"groups": groups} if len(groups) < len(workers) else {})}


def prefer_direct(plan: Plan, model: CostModel, nbytes: int, workers: Sequence[str],
                  domains: Sequence[Any], hosts: Any = None) -> Plan:
    """``auto``'s pick, ``shm-direct``, or ``direct`` reading its peers
    through shared memory, whichever the model predicts fastest, when all
    ranks share a host (each priced as it will be lowered: :func:`predict`)."""
    if not one_host(workers, domains):
        return plan
    return min([plan, fastest_gathering(plan.ranks, model, nbytes, workers, domains, hosts)],
               key=lambda q: predict(q, model, nbytes, workers, domains, hosts))


def fastest_gathering(p: int, model: CostModel, nbytes: int, workers: Sequence[str], domains: Sequence[Any],
                      hosts: Any = None) -> Plan:
    """Of the plans that bring every rank's own values to where they are
    reduced (so ``deterministic="exact"`` folds them there), the one the
    model predicts fastest, each priced as it will be lowered: on one host
    ``shm-direct``, and ``direct`` reading its peers through shared memory;
    across hosts ``direct`` and a reduce-scatter by direct sends then an
    allgather (``butterfly`` of radix p: the default's bytes, two levels)."""
    if one_host(workers, domains):
        options = [direct_plan(p, workers)]
        if direct_reads_shared(workers, domains, nbytes):
            options.append(make_plan(READ_DIRECT, p))
    else:
        options = [make_plan(READ_DIRECT, p)] + ([make_plan("butterfly", p, radix=p)] if p > 2 else [])
    return min(options, key=lambda q: predict(q, model, nbytes, workers, domains, hosts))


def predict(plan: Plan, model: CostModel, nbytes: int, workers: Sequence[str], domains: Sequence[Any],
            hosts: Any = None) -> float:
    """The model's seconds for ``plan`` as this call lowers it: ``direct``
    whose peers share its host reads them through shared memory."""
    if plan.algorithm == READ_DIRECT and plan.chunks == 1 and one_host(workers, domains) and \
            direct_reads_shared(workers, domains, nbytes):
        return model.direct_shm_time(plan, nbytes, len(set(workers)))
    return model.predict(plan, nbytes, hosts)


def hosts_share_memory(hosts: Sequence[Sequence[int]], domains: Sequence[Any]) -> bool:
    """Every host's ranks share one memory domain, and there are several
    domains: hierarchical's inner phases can go through shared memory."""
    doms = [{domains[r] for r in g} for g in hosts]
    return (len(hosts) > 1 and all(len(d) == 1 and None not in d and IN_PROCESS not in d for d in doms)
            and len({next(iter(d)) for d in doms}) > 1)


def direct_hierarchical(p: int, nbytes: int, model: CostModel, workers: Sequence[str],
                        hosts: Sequence[Sequence[int]], **options: Any) -> Plan:
    """``hierarchical`` with the one-level shared-memory collective inside
    each host, its outer algorithm (unless in ``options``) chosen by the model."""
    groups = shm_direct.worker_groups(workers)
    extra = {"workers": groups} if len(groups) < p else {}
    return tune("hierarchical", p, nbytes, model=model, chunks=1, hosts=hosts,
                **{**options, "groups": [list(g) for g in hosts], "inner": DIRECT_INNER, **extra})


def prefer_hierarchical(plan: Plan, algorithm: str, options: Mapping[str, Any], chunks: int | None,
                        model: CostModel, nbytes: int, workers: Sequence[str], domains: Sequence[Any],
                        levels: Sequence[Sequence[Sequence[int]]]) -> Plan:
    """Across hosts whose workers share memory: a named ``hierarchical``
    that leaves its inner algorithm and groups open runs ``shm-direct``
    inside each host; ``auto`` takes that plan when the model predicts it
    faster than its pick. Anything else: ``plan`` as chosen."""
    if len(levels) != 1 or chunks not in (None, 1) or not hosts_share_memory(levels[0], domains):
        return plan
    if algorithm == "hierarchical" and not {"inner", "groups", "group_size", "levels", "workers"} & set(options):
        return direct_hierarchical(plan.ranks, nbytes, model, workers, levels[0], **options)
    if algorithm == "auto" and chunks is None:
        direct = direct_hierarchical(plan.ranks, nbytes, model, workers, levels[0])
        if model.predict(direct, nbytes, levels[0]) < model.predict(plan, nbytes, levels[0]):
            return direct
    return plan


def uses_shm_hierarchical(plan: Plan, workers: Sequence[str], domains: Sequence[Any]) -> bool:
    """Whether ``plan`` is lowered as hierarchical over shared memory inside hosts."""
    return (plan.algorithm == "hierarchical" and plan.options.get("inner") == DIRECT_INNER and plan.chunks == 1
            and hosts_share_memory(plan.options["groups"], domains))


def uses_shm(plan: Plan, workers: Sequence[str], domains: Sequence[Any]) -> bool:
    """Whether ``plan`` is lowered as the shared-memory collective."""
    return plan.algorithm == DIRECT and plan.chunks == 1 and one_host(workers, domains)


#: Per link, how it moved bytes: ``(source worker, destination worker, transport)``.
Links = tuple[tuple[str, str, str], ...]


def direct_reads_shared(workers: Sequence[str], domains: Sequence[Any], nbytes: int) -> bool:
    """Whether ``direct``'s peers read each other through shared memory (:func:`direct_reads`)."""
    return bool(_sharing(workers, domains, nbytes))


def _sharing(workers: Sequence[str], domains: Sequence[Any], nbytes: int) -> tuple[tuple[str, Any], ...]:
    """``(worker, domain)`` of the workers sharing a host with another (none
    for empty inputs). Whatever the size: a post costs no message at all,
    so unlike an edge's handle it is never dearer than what it replaces."""
    if nbytes <= 0:
        return ()
    shared = {w: d for w, d in zip(workers, domains) if d is not None and d != IN_PROCESS}
    hosts: dict[Any, set[str]] = {}
    for w, d in shared.items():
        hosts.setdefault(d, set()).add(w)
    return tuple(sorted((w, d) for w, d in shared.items() if len(hosts[d]) > 1))


def direct_reads(plan: Plan, workers: Sequence[str], domains: Sequence[Any], nbytes: int
                 ) -> tuple[tuple[tuple[str, Any], ...], str, Links]:
    """How the ``direct`` plan's tasks read their peers: the ``(worker,
    memory domain)`` pairs of workers sharing a host with another (there
    they read each other's posts: :func:`flowreduce.schedule.peer_reads.reading`),
    empty when no two workers share memory; the word for :func:`describe`;
    and per link its transport."""
    pairs = _sharing(workers, domains, nbytes)
    found = links(plan, workers, domains if pairs else [None] * len(workers), nbytes, direct=True, posts=True)
    kinds = {k for _, _, k in found}
    how = ("dask" if "shared memory" not in kinds else
           "shared memory within hosts, dask across" if "dask" in kinds else "shared memory")
    return pairs, how, found


def lower(plan: Plan, inputs: Sequence[Any], workers: Sequence[str], domains: Sequence[Any], *, size: int,
          shape: tuple[int, ...], dtype: np.dtype, op: Op, in_place: bool, accumulate: Any,
          ordered: bool = False) -> tuple[Graph, str, Links]:
    """The graph of ``plan``, with shared memory where it applies, a word
    for :func:`describe` saying how its links moved bytes, and per link
    (pair of workers) which transport it used. ``ordered``: ``deterministic=True``
    (float sums and means in the reference tree's order); hierarchical over
    shared memory is then lowered as any plan, its edges through shared memory."""
    nbytes = size * np.dtype(accumulate or dtype).itemsize
    if uses_shm(plan, workers, domains):
        graph = shm_direct.build_direct(plan, inputs, workers, size=size, shape=shape, dtype=dtype, op=op,
                                        accumulate=accumulate, ordered=ordered)
        how = ("same worker" if len(set(workers)) == 1 else
               "in-process" if domains[0] == IN_PROCESS else "shared memory")
        return graph, how, links(plan, workers, domains, nbytes, direct=True)
    if uses_shm_hierarchical(plan, workers, domains) and not ordered:
        graph = shm_hierarchical.build_hierarchical(plan, inputs, workers, size=size, shape=shape, dtype=dtype,
                                                    op=op, in_place=in_place, accumulate=accumulate)
        return graph, "shared memory within hosts, dask across", links(plan, workers, domains, nbytes, direct=True)
    graph = build_graph(plan, inputs, workers, size=size, shape=shape, op=op, in_place=in_place,
                        accumulate=accumulate, ordered=ordered)
    shared = shm_edges.published_nodes(plan, workers, [None if d == IN_PROCESS else d for d in domains])
    found = links(plan, workers, domains, nbytes, published=shared)
    if not shared:
        return graph, "dask", found
    return shm_edges.publish(graph, shared), "shared memory within hosts, dask across", found


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
