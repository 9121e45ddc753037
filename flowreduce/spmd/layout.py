"""Where an SPMD job's ranks run, decided once by the client: the peer table.

A :class:`Layout` travels in every rank's task. It holds everything a rank
needs to find its peers (each rank's worker, the host group of each rank,
the shared-memory names), so setting up the communicator needs no message
to the scheduler and no exchange between the ranks. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Layout:
    """One attempt of one job.

    ``workers[r]`` is rank ``r``'s worker address and ``hosts[r]`` the index
    of its host group (ranks of one group exchange through shared memory,
    the groups' leaders -- each group's lowest rank -- over Dask's comm).
    """

    job: str
    attempt: int
    workers: tuple[str, ...]
    hosts: tuple[int, ...]
    timeout: float | None = None
    #: the directory of shared-memory segments (``flowreduce.shm.directory``)
    directory: str = "/dev/shm"
    #: a subgroup's tag (``Communicator.subgroup``), "" for the job's communicator
    sub: str = ""

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def run(self) -> str:
        """The attempt's id: names its shared segments and its messages."""
        return f"{self.job}.{self.attempt}" + (f"/{self.sub}" if self.sub else "")

    @property
    def parent_run(self) -> str:
        """The job's attempt (a subgroup fails with it, and it with the subgroup)."""
        return f"{self.job}.{self.attempt}"

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of each host group, groups ordered by their lowest rank (the plan's order)."""
        by: dict[int, list[int]] = {}
        for r, h in enumerate(self.hosts):
            by.setdefault(h, []).append(r)
        return tuple(sorted((tuple(rs) for rs in by.values()), key=lambda g: g[0]))

    @cached_property
    def group_of(self) -> tuple[int, ...]:
        """Rank -> the index of its group in :attr:`groups`."""
        out = [0] * self.size
        for i, g in enumerate(self.groups):
            for r in g:
                out[r] = i
        return tuple(out)

    @cached_property
    def leaders(self) -> tuple[int, ...]:
        """The lowest rank of each group: the one that talks to the other groups."""
        return tuple(g[0] for g in self.groups)

    def prefix(self) -> str:
        """The start of every shared-memory name of this attempt (what a sweep removes)."""
        return prefix(self.job, self.attempt) + self.sub


def prefix(job: str, attempt: int) -> str:
    """The start of every shared-memory name of a job's attempt, its subgroups' included."""
    return f"frspmd-{job}-{attempt}-"


def round_robin(ranks: int, workers: Sequence[str]) -> list[str]:
    """Rank ``r`` on ``workers[r % len(workers)]`` (workers sorted by address)."""
    ordered = sorted(workers)
    return [ordered[r % len(ordered)] for r in range(ranks)]
