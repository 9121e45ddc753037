"""Which workers share a host (and a rack, a switch...): the groups a
hierarchical all-reduce runs its inner levels in.

A :class:`Topology` labels every worker address at one or more levels,
innermost first: level 0 is the host, higher levels are optional coarser
groupings (each a union of host groups). Build one

* from worker addresses: ``Topology.from_addresses(addrs)`` groups by the
  host part of ``tcp://host:port``;
* from an explicit grouping: ``Topology.from_groups([[a, b], [c]])``;
* from worker information (what ``client.scheduler_info()["workers"]``
  holds): ``Topology.from_info(info, key=by_name_prefix())`` for
  dask-jobqueue job names, ``by_resource("host-")`` for a resource label;
* from a running cluster: ``flowreduce.topology(client)``, grouped by node
  as ``allreduce`` groups ranks (:func:`flowreduce.schedule.hosts.topology`:
  the part that talks to the cluster lives in ``schedule``, above this module).

Then ``topo.for_ranks(rank_workers)`` turns it into groups of ranks for
``flowreduce.plan("hierarchical", p, groups=...)`` and
``topo.levels_for_ranks(...)`` into ``levels=...``; or pass the topology
(or a key function) to ``flowreduce.allreduce(..., topology=...)``.
Nothing here imports dask or distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: ``key(address, info) -> label``: which group a worker belongs to.
GroupKey = Callable[[str, Mapping[str, Any]], Hashable]


def host_of(address: str) -> str:
    """The host part of a worker address.

    >>> host_of("tcp://10.0.0.5:40123"), host_of("tls://[::1]:8786"), host_of("inproc://10.0.0.5/77/3")
    ('10.0.0.5', '::1', '10.0.0.5')
    """
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):  # IPv6 literal
        return rest[1:rest.index("]")]
    rest = rest.split("/", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def by_host(address: str, info: Mapping[str, Any]) -> Hashable:
    """Group by the host the scheduler reports, else the address's host."""
    return info.get("host") or host_of(address)


def by_name_prefix(sep: str = "-") -> GroupKey:
    """Group by the worker name up to its last ``sep``: dask-jobqueue names
    the workers of job ``SLURMCluster-3`` ``SLURMCluster-3-0``,
    ``SLURMCluster-3-1``... when a job runs several worker processes.
    (With one process per job the name *is* the job name; group by host.)"""

    def key(address: str, info: Mapping[str, Any]) -> Hashable:
        name = str(info.get("name", address))
        return name.rsplit(sep, 1)[0] if sep in name else name

    return key


def by_resource(prefix: str) -> GroupKey:
    """Group by the worker resource whose name starts with ``prefix``
    (``dask worker --resources "host-a=1"`` with ``by_resource("host-")``).
    A worker without such a resource raises ValueError."""

    def key(address: str, info: Mapping[str, Any]) -> Hashable:
        found = sorted(r for r in info.get("resources", {}) if r.startswith(prefix))
        if len(found) != 1:
            raise ValueError(f"worker {address} has {len(found)} resources starting with {prefix!r}: "
                             f"{found}; give each worker exactly one")
        return found[0]

    return key


@dataclass(frozen=True)
class Topology:
    """Worker addresses with a group label per level (level 0 = host).

    ``labels[l][i]`` is the label of ``workers[i]``'s group at level ``l``;
    every coarser level must be a union of groups of the level below.
    """

    workers: tuple[str, ...]
    labels: tuple[tuple[Hashable, ...], ...]

    def __post_init__(self) -> None:
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"a worker is listed twice: {list(self.workers)}")
        if not self.labels:
            raise ValueError("a topology needs at least the host level")
        for lv, labels in enumerate(self.labels):
            if len(labels) != len(self.workers):
                raise ValueError(f"level {lv} labels {len(labels)} workers, expected {len(self.workers)}")
        for lv in range(1, len(self.labels)):
            coarse: dict[Hashable, Hashable] = {}
            for fine, big in zip(self.labels[lv - 1], self.labels[lv], strict=True):
                if coarse.setdefault(fine, big) != big:
                    raise ValueError(f"level {lv} splits group {fine!r} of level {lv - 1} "
                                     f"(between {coarse[fine]!r} and {big!r}); levels must nest")

    # -- constructors -------------------------------------------------------------
    @classmethod
    def from_addresses(cls, addresses: Sequence[str], *coarser: GroupKey) -> Topology:
        """Group workers by the host part of their addresses; ``coarser``
        keys (called with ``(address, {})``) add higher levels."""
        return cls.from_info({a: {} for a in addresses}, by_host, *coarser)

    @classmethod
    def from_groups(cls, groups: Sequence[Sequence[str]] | Mapping[Hashable, Sequence[str]],
                    *coarser: Sequence[Sequence[str]] | Mapping[Hashable, Sequence[str]]) -> Topology:
        """An explicit grouping of worker addresses, e.g. ``[["tcp://a:1",
        "tcp://a:2"], ["tcp://b:1"]]`` or ``{"hostA": [...], ...}``; each of
        ``coarser`` groups the same workers at a higher level."""
        levels = [_labelled(g) for g in (groups, *coarser)]
        workers = tuple(levels[0])
        for lv, labels in enumerate(levels[1:], 1):
            if set(labels) != set(workers):
                raise ValueError(f"level {lv} groups workers {sorted(labels)}, level 0 {sorted(workers)}")
        return cls(workers, tuple(tuple(lab[w] for w in workers) for lab in levels))

    @classmethod
    def from_info(cls, info: Mapping[str, Mapping[str, Any]], key: GroupKey = by_host,
                  *coarser: GroupKey) -> Topology:
        """Group by ``key(address, info[address])``, e.g. by host, by job name
        prefix or by a resource label; ``coarser`` keys add higher levels."""
        workers = tuple(info)
        labels = tuple(tuple(k(w, info[w]) for w in workers) for k in (key, *coarser))
        return cls(workers, labels)

    def __str__(self) -> str:
        names = ["host", *(f"level {lv}" for lv in range(1, self.depth))]
        lines = [f"Topology: {len(self.workers)} workers, "
                 + ", ".join(f"{len(self.groups(lv))} {names[lv]} group{'s' * (len(self.groups(lv)) != 1)}"
                             for lv in range(self.depth))]
        for lv in range(self.depth):
            for label, members in self.groups(lv).items():
                lines.append(f"  {names[lv]} {label}: {', '.join(members)}")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython shows the summary
        p.text(str(self))

    # -- queries ------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self.labels)

    def group_of(self, worker: str, level: int = 0) -> Hashable:
        try:
            i = self.workers.index(worker)
        except ValueError:
            raise ValueError(f"worker {worker!r} is not in this topology; known: {list(self.workers)}") from None
        return self.labels[level][i]

    def groups(self, level: int = 0) -> dict[Hashable, list[str]]:
        """Label -> worker addresses at ``level``, in first-seen order."""
        out: dict[Hashable, list[str]] = {}
        for w, lab in zip(self.workers, self.labels[level], strict=True):
            out.setdefault(lab, []).append(w)
        return out

    def for_ranks(self, rank_workers: Sequence[str], level: int = 0) -> list[list[int]]:
        """Groups of ranks (rank i runs on ``rank_workers[i]``) at ``level``:
        the ``groups=`` of the hierarchical planner. Ranks sharing a worker
        share a group; groups come in order of their first rank."""
        out: dict[Hashable, list[int]] = {}
        for r, w in enumerate(rank_workers):
            out.setdefault(self.group_of(w, level), []).append(r)
        return list(out.values())

    def levels_for_ranks(self, rank_workers: Sequence[str]) -> list[list[list[int]]]:
        """Every level's groups of ranks, innermost first: ``levels=``."""
        return [self.for_ranks(rank_workers, lv) for lv in range(self.depth)]


def _labelled(groups: Sequence[Sequence[str]] | Mapping[Hashable, Sequence[str]]) -> dict[str, Hashable]:
    items = groups.items() if isinstance(groups, Mapping) else enumerate(groups)
    out: dict[str, Hashable] = {}
    for label, members in items:
        if isinstance(members, str):
            raise TypeError(f"group {label!r} is a string {members!r}; give a list of addresses")
        for w in members:
            if w in out:
                raise ValueError(f"worker {w!r} is in groups {out[w]!r} and {label!r}")
            out[w] = label
    return out
