"""Which ranks share a host: the one place that decides it.

The rule: ranks share a host when their workers run on the same *node*,
the batch system's name for the machine when it has one (``SLURMD_NODENAME``:
SLURM's virtual nodes on one box stay distinct, as on a real cluster),
else the host of the worker's address (workers in separate network
namespaces are distinct hosts). The batch job plays no part: two jobs on
one node share its host and form one group, and one job spanning two nodes
is two groups (its ranks on different nodes talk over the network like any
others). ``allreduce`` (hierarchical groups, the cost model's hosts),
``flowreduce.topology(client)`` (:func:`topology`, here) and
``flowreduce.rank_groups`` (:func:`flowreduce.schedule.placement.rank_groups`)
all group by this rule, unless given a topology or key of their own.

Each worker's place is asked of the workers (``client.run``) and kept per
client, so a training loop calling ``allreduce`` every step does not
broadcast to the workers every step.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flowreduce.errors import InputTypeError, OptionError, raised_as
from flowreduce.grouping import GroupKey, Topology, host_of

#: Environment variables naming the batch job a worker runs in, per queue system.
_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "JOB_ID", "LSB_JOBID", "OAR_JOB_ID", "_CONDOR_JOB_AD")


@dataclass(frozen=True)
class Place:
    """Where a worker runs: its node (what groups ranks), the CPUs it may
    use, its batch job (``""`` outside one) and the machine's hostname
    (what shares CPUs: virtual nodes on one machine share its cores)."""

    node: str
    cpus: int
    job: str
    machine: str


def place_of(dask_worker: Any = None) -> tuple[str, str]:
    """``(node, job)`` of a worker (see the module's rule); run on a worker
    by ``client.run``. Workers are ranked by it (:func:`flowreduce.launch.ranked_workers`)."""
    address = getattr(dask_worker, "address", None)
    node = os.environ.get("SLURMD_NODENAME") or (host_of(address) if address else socket.gethostname())
    job = next((os.environ[v] for v in _JOB_VARS if os.environ.get(v)), "")
    return node, job


def worker_place(dask_worker: Any = None) -> Place:
    """The :class:`Place` of a worker; run on a worker by ``client.run``."""
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        ncpu = os.cpu_count() or 1
    node, job = place_of(dask_worker)
    return Place(node, ncpu, job, socket.gethostname())


_PLACES: weakref.WeakKeyDictionary[Any, dict[str, Place]] = weakref.WeakKeyDictionary()


def remember(client: Any, places: dict[str, Place]) -> None:
    """Keep places learnt fresh (the in-memory path asks them with its inputs' broadcast)."""
    _PLACES.setdefault(client, {}).update(places)


def worker_places(client: Any, workers: Sequence[str], *, fresh: bool = False) -> dict[str, Place]:
    """``worker -> Place`` for ``workers``: asked of those not seen before
    (all of them if ``fresh``), in one broadcast to those only."""
    known = _PLACES.setdefault(client, {})
    missing = sorted(set(workers) if fresh else set(workers) - set(known))
    if missing:
        known.update(client.run(worker_place, workers=missing))
    return {w: known[w] for w in workers}


def node_of(worker: str, places: Mapping[str, Place]) -> str:
    """The node of ``worker``; a worker missing from ``places`` is a node of its own."""
    place = places.get(worker)
    return place.node if place is not None else worker


def host_groups(workers: Sequence[str], places: Mapping[str, Place]) -> list[list[int]]:
    """Ranks (rank ``r`` on ``workers[r]``) grouped by node, groups in order
    of their first rank and ranks in rank order: what the hierarchical
    algorithm reduces inside before crossing hosts."""
    groups: dict[str, list[int]] = {}
    for r, w in enumerate(workers):
        groups.setdefault(node_of(w, places), []).append(r)
    return list(groups.values())


def shared_cores(workers: Sequence[str], places: Mapping[str, Place]) -> int | None:
    """CPU cores the ranks run on: per machine, the fewer of its CPUs and its
    ranks. None when every rank has a core of its own (the model's default)."""
    per_machine: dict[str, list[int]] = {}
    for w in workers:  # the machine, not the batch system's node: virtual nodes share its CPUs
        place = places.get(w, Place(w, 1, "", w))
        per_machine.setdefault(place.machine, []).append(place.cpus)
    cores = sum(min(len(ranks), max(ranks)) for ranks in per_machine.values())
    return cores if cores < len(workers) else None


def _workers_info(dask_scheduler: Any = None) -> dict[str, Any]:
    return dict(dask_scheduler.identity(n_workers=-1)["workers"])


def topology(client: Any, workers: Sequence[str] | None = None, *, key: GroupKey | None = None,
             coarser: Sequence[GroupKey] = ()) -> Topology:
    """The :class:`~flowreduce.grouping.Topology` of a (synchronous)
    client's workers, or of ``workers`` among them: grouped by
    ``key(address, info)``, by default by the node each worker runs on (the
    rule above, asked of the workers afresh), the rule ``allreduce`` groups
    ranks by. ``coarser`` keys add higher levels. Public as
    ``flowreduce.topology(client)``.

    Raises
    ------
    ValueError
        A worker in ``workers`` that the scheduler does not know.
    """
    # asked of the scheduler directly: client.scheduler_info() returns a cache
    # that its periodic refresh may replace by one without workers
    info = client.run_on_scheduler(_workers_info)
    if workers is not None:
        unknown = [w for w in workers if w not in info]
        if unknown:
            raise OptionError(f"workers {unknown} are not in the cluster; known: {sorted(info)}")
        info = {w: info[w] for w in dict.fromkeys(workers)}
    if key is None:
        places = worker_places(client, list(info), fresh=True)

        def key(address: str, _: Any) -> Hashable:
            return node_of(address, places)

    return Topology.from_info(info, key, *coarser)


def rank_levels(client: Any, workers: Sequence[str], places: Mapping[str, Place],
                given: Topology | GroupKey | Sequence[GroupKey] | None) -> list[list[list[int]]]:
    """Groups of ranks at every level (innermost first) for ranks placed on
    ``workers``, as ``given`` (``allreduce``'s ``topology=``) says: by node
    (None), from a :class:`Topology`, or from one key function (or several,
    innermost first) applied to the workers' information.

    Raises
    ------
    TypeError
        Something that is neither a Topology nor key functions.
    ValueError
        A worker the topology does not know.
    """
    if given is None:
        return [host_groups(workers, places)]
    if isinstance(given, Topology):
        topo = given
    else:
        keys = [given] if callable(given) else list(given) if isinstance(given, Sequence) else []
        if not keys or not all(callable(k) for k in keys):
            raise InputTypeError(f"topology must be a flowreduce.Topology or key functions "
                                 f"f(address, info) -> label, got {given!r}")
        topo = topology(client, sorted(set(workers)), key=keys[0], coarser=keys[1:])
    with raised_as(OptionError):
        return topo.levels_for_ranks(workers)
