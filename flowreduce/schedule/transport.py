"""How bytes move between a call's workers: the one place that decides
between shared memory and Dask's comm, per rank and per plan.

``transport="auto"`` (the default) moves the payload of every edge between
two worker processes of one host through shared memory, and lets ``auto``
choose the one-level intra-host collective (``shm-direct``) when all ranks
share a host; ``"dask"`` turns all of it off (every byte through Dask's
comm, as before); ``"shm"`` is ``auto`` that says so.

A worker's memory domain is its node and machine (its
:class:`flowreduce.schedule.hosts.Place`: emulated hosts in network
namespaces stay apart); in-process workers (``inproc://``) hand objects
over by reference and need no shared memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms.ir import Plan
from flowreduce.build import shm_direct, shm_edges
from flowreduce.build.graph import Graph, build_graph
from flowreduce.cost import CostModel
from flowreduce.ops import Op

TRANSPORTS = ("auto", "shm", "dask")
DIRECT = "shm-direct"
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
    """``auto``'s pick, or ``shm-direct`` when all ranks share a host and the
    model predicts it faster (priced with the shared-memory link)."""
    if not one_host(workers, domains):
        return plan
    direct = direct_plan(plan.ranks, workers)
    if model.predict(direct, nbytes, hosts) < model.predict(plan, nbytes, hosts):
        return direct
    return plan


def uses_shm(plan: Plan, workers: Sequence[str], domains: Sequence[Any]) -> bool:
    """Whether ``plan`` is lowered as the shared-memory collective."""
    return plan.algorithm == DIRECT and plan.chunks == 1 and one_host(workers, domains)


def lower(plan: Plan, inputs: Sequence[Any], workers: Sequence[str], domains: Sequence[Any], *, size: int,
          shape: tuple[int, ...], dtype: np.dtype, op: Op, in_place: bool, accumulate: Any) -> tuple[Graph, str]:
    """The graph of ``plan``, with shared memory where it applies, and a
    word for :func:`describe` saying how its links moved bytes."""
    if uses_shm(plan, workers, domains):
        graph = shm_direct.build_direct(plan, inputs, workers, size=size, shape=shape, dtype=dtype, op=op,
                                        accumulate=accumulate)
        return graph, ("same worker" if len(set(workers)) == 1 else
                       "in-process" if domains[0] == IN_PROCESS else "shared memory")
    graph = build_graph(plan, inputs, workers, size=size, shape=shape, op=op, in_place=in_place,
                        accumulate=accumulate)
    shared = shm_edges.published_nodes(plan, workers, [None if d == IN_PROCESS else d for d in domains])
    if not shared:
        return graph, "dask"
    return shm_edges.publish(graph, shared), "shared memory within hosts, dask across"
