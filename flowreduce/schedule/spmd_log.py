"""The log of SPMD collectives a worker keeps: a compact record per collective and rank.

Every collective of a rank adds one record to its worker's :class:`Log` (a
preallocated ring, the newest :data:`LOGGED` records of all the worker's
ranks together): one plain tuple of references the rank holds anyway (its
job attempt's id, its rank, its peers and path) and the call's numbers,
stored in a slot of a list made once. Nothing else is made per collective:
no :class:`Event`, no second container, no entry let go but the slot's
previous record. Records become :class:`Event` objects only when read:
``comm.events``, :func:`flowreduce.spmd.collect`, ``flowreduce.trace``
(:meth:`Log.since`, past the record it read last) and the dashboard (a
rank's last record).

(Before, each collective made an ``Event``, appended it to its rank's deque
of 10,000 and appended ``(run, rank, event)`` to the worker's deque of
100,000, letting the oldest of each go: 8-10% of a one-host all-reduce of
1e3 elements, half of it the cold memory of entries 100,000 collectives old.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

#: Collectives remembered per worker, all its ranks together (the newest).
LOGGED = 100_000

#: A record: (position, run, rank, collective, seq, start, stop, nbytes, sent, received, peers, path, algorithm)
Record = tuple[int, str, int, str, int, float, float, int, int, int, tuple[int, ...], str, str]


class Event(NamedTuple):
    """One collective on one rank: what it was, when (``time.time()`` of the
    worker), the bytes of the rank's input and of what it sent and received
    between hosts, the peers it exchanged with (the job's ranks), and the path taken."""

    collective: str
    seq: int
    start: float
    stop: float
    nbytes: int
    sent: int
    received: int
    peers: tuple[int, ...]
    path: str  # "local" (one rank), "shm", "dask" or "shm+dask"
    algorithm: str = ""


def event(record: Record) -> Event:
    """The :class:`Event` of a record."""
    return Event(*record[3:])


class Log:
    """A worker's ring of collective records (:data:`LOGGED`), written by its ranks' threads.

    A record's position (its first field) counts every record the log was given; the ring's slot
    of position ``i`` is ``i % size``. A writer takes its position (one ``next`` of a counter, atomic
    under the GIL) and then stores its record: readers copy the ring in one C call and read the
    records in position order, stopping at a position taken but not yet stored."""

    def __init__(self, size: int = LOGGED):
        self.size = size
        self.ring: list[Record | None] = [None] * size
        self.count = itertools.count()

    def add(self, run: str, rank: int, collective: str, seq: int, start: float, stop: float, nbytes: int, sent: int,
            received: int, peers: tuple[int, ...], path: str, algorithm: str) -> Record:
        """Log one collective of rank ``rank`` of ``run``; the record."""
        i = next(self.count)
        record = self.ring[i % self.size] = (i, run, rank, collective, seq, start, stop, nbytes, sent, received,
                                             peers, path, algorithm)
        return record

    def _ordered(self, after: int = -1) -> tuple[list[Record], bool]:
        """The records past position ``after``, in position order up to the first not stored yet, and
        whether records past ``after`` were lost (overwritten before being read)."""
        ring = list(self.ring)  # one C call: writers storing meanwhile cannot tear it
        size = len(ring)
        first = ring[(after + 1) % size]
        lost = first is not None and first[0] > after + 1
        records = sorted((r for r in ring if r is not None and r[0] > after), key=lambda r: r[0])
        out: list[Record] = []
        expected = records[0][0] if lost and records else after + 1
        for r in records:
            if r[0] != expected:
                break  # a position taken, its record not stored yet: read from there next time
            out.append(r)
            expected += 1
        return out, lost

    def entries(self, select: Callable[[str, int], bool] | None = None) -> list[tuple[str, int, Event]]:
        """``(run, rank, event)`` of every record kept (those ``select(run, rank)`` accepts), oldest first."""
        records, _ = self._ordered()
        return [(r[1], r[2], event(r)) for r in records if select is None or select(r[1], r[2])]

    def since(self, mark: int | None) -> tuple[list[tuple[Any, ...]], int, bool]:
        """The records past position ``mark`` (None: none, only where the log ends) as plain tuples
        ``(run, rank, collective, seq, start, stop, nbytes, sent, received, peers, path, algorithm)``,
        the new mark (the last position read, -1: none), and whether records were lost past ``mark``."""
        records, lost = self._ordered(-1 if mark is None else mark)
        last = records[-1][0] if records else (-1 if mark is None else mark)
        if mark is None:
            return [], last, False
        return [r[1:] for r in records], last, lost
