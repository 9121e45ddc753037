"""The same-host data plane's one value type and its one lifetime rule. Pure: numpy and the pool.

A :class:`Lease` is a segment of this process's pool (:mod:`flowreduce.shm.pool`) and the rule of
its lifetime, the same for every user of the plane (a task value published for a peer, the
engine's messages, ``direct``'s posts, a host group's data, the torch trainer's buckets): it goes
back to the pool, for the next lease, once its last holder lets go; if a holder lets go after a
failure, a reader may still be reading it, so it is discarded (unlinked, never leased again).
Holders are counted (:meth:`Lease.hold`, :meth:`Lease.release`) or, for a task's value that Dask
drops once every dependent has run, they are the Python references to the lease
(:meth:`Lease.until_dropped`).

A :class:`Handle` is where values sit in a lease: the segment, the lease's generation and the
pieces ``(dtype, byte offset, count)``. It is what crosses the wire (pickled inside a task's value,
or as plain data in an engine's message: :meth:`Handle.wire`, :meth:`Handle.from_wire`) and the
reader's side of the rule: the pieces must be plain dtypes lying inside the segment, and the
generation is checked after reading, so a payload overwritten by a later lease is an error, never a
silently wrong sum.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from flowreduce.shm import pool as shm_pool

#: Most pieces one handle may name (an engine's message of many chunks' values).
MAX_PIECES = 1 << 20


class Lease:
    """A leased segment of ``pool``, given back when its last holder lets go (discarded if one let
    go after a failure)."""

    __slots__ = ("pool", "segment", "generation", "holders", "failed", "__weakref__")

    def __init__(self, pool: shm_pool.Pool, segment: shm_pool.Segment):
        self.pool, self.segment, self.generation = pool, segment, segment.generation
        self.holders, self.failed = 1, False

    @classmethod
    def take(cls, nbytes: int, owner: str = "", pool: shm_pool.Pool | None = None) -> Lease:
        """A lease of at least ``nbytes`` for the call ``owner`` (the worker plugin gives back what a
        call still holds once its keys are gone from the worker). Raises
        :class:`~flowreduce.shm.pool.Unavailable` (logged once by the pool): Dask's comm carries the data."""
        pool = shm_pool.pool() if pool is None else pool
        return cls(pool, pool.lease(nbytes, owner))

    @classmethod
    def taken(cls, nbytes: int, owner: str = "") -> Lease | None:
        """:meth:`take`, or None when no segment can be had."""
        try:
            return cls.take(nbytes, owner)
        except shm_pool.Unavailable:
            return None

    def hold(self) -> None:
        """One more holder (a second reader of the same values)."""
        if self.holders <= 0:  # given back already: the pool may have leased it again
            raise RuntimeError(f"lease of shared-memory segment {self.segment.name} held after it was given back")
        self.holders += 1

    def release(self, failed: bool = False) -> None:
        """A holder lets go (``failed``: after a failure, while a reader may still read it)."""
        if self.holders <= 0:  # a holder's count gone wrong would give a segment back while read
            raise RuntimeError(f"lease of shared-memory segment {self.segment.name} released more often than held")
        self.holders -= 1
        self.failed |= failed
        if self.holders == 0:
            (self.pool.discard if self.failed else self.pool.give_back)(self.segment, self.generation)

    def until_dropped(self) -> Lease:
        """This lease, let go when nothing references it any more (a task's value: Dask drops it
        once every dependent has run, wherever they run)."""
        weakref.finalize(self, self.pool.give_back, self.segment, self.generation)
        return self

    def view(self, dtype: npt.DTypeLike, count: int, offset: int = 0) -> np.ndarray:
        """``count`` items of ``dtype`` at byte ``offset`` of the payload."""
        return self.segment.view(dtype, count, offset)

    def handle(self, pieces: Sequence[tuple[npt.DTypeLike, int, int]], key: str = "") -> Handle:
        """Where ``pieces`` ``(dtype, byte offset, count)`` of this lease are, for a reader."""
        seg = self.segment
        return Handle(seg.name, seg.size, self.generation, tuple((np.dtype(dt).str, o, c) for dt, o, c in pieces), key)


def layout(arrays: Sequence[np.ndarray], align: int = 8) -> tuple[list[tuple[np.dtype, int, int]], int]:
    """Each array's ``(dtype, byte offset, count)`` packed one after another (each ``align``-byte
    aligned), and the bytes they take."""
    out, offset = [], 0
    for a in arrays:
        out.append((a.dtype, offset, a.size))
        offset += -(-a.nbytes // align) * align
    return out, offset


#: The dtype kinds a reduction combines: booleans, integers, floats, complex
NUMERIC = "biufc"


def peer_dtype(name: Any, kinds: str | None = NUMERIC) -> np.dtype | str:
    """The plain dtype a peer named (of ``kinds``, when given), or why it is refused: what any message or
    handle from another process says its bytes are is checked here before they are viewed."""
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.hasobject:
        return f"{str(name)[:40]!r} is not a plain dtype"
    if kinds is not None and dtype.kind not in kinds:
        return f"dtype {name!r} is not numeric"
    return dtype


@dataclass(frozen=True)
class Handle:
    """Where a payload sits: a segment, its lease generation, and the pieces
    ``(dtype, byte offset, count)`` in it. What crosses the wire."""

    name: str
    size: int
    generation: int
    pieces: tuple[tuple[str, int, int], ...]
    key: str = ""  # the producing task's key (repr), for traces

    def wire(self) -> list[Any]:
        """This handle as plain data (an engine's message): ``[name, size, generation, pieces]``."""
        return [self.name, self.size, self.generation, [list(p) for p in self.pieces]]

    @classmethod
    def from_wire(cls, data: Any) -> Handle:
        """The handle :meth:`wire` made, or :class:`~flowreduce.shm.pool.Refused` (logged) naming what
        is wrong with ``data``; :meth:`arrays` checks the pieces against the segment."""
        if not (isinstance(data, (list, tuple)) and len(data) == 4 and isinstance(data[0], str)
                and type(data[1]) is int and type(data[2]) is int and isinstance(data[3], (list, tuple))
                and len(data[3]) <= MAX_PIECES):
            shm_pool.refuse("shared-memory handle", "not [name, size, generation, pieces]")
        name, size, generation, pieces = data
        if not all(isinstance(p, (list, tuple)) and len(p) == 3 for p in pieces):
            shm_pool.refuse(f"shared-memory handle of {name[:80]}", "a piece is not [dtype, offset, count]")
        return cls(name, size, generation, tuple(tuple(p) for p in pieces))

    def segment(self) -> shm_pool.Segment:
        """The segment, mapped here (the pool checks its name and size: a segment of this user, in its directory)."""
        return shm_pool.pool().attach(self.name, self.size)

    def arrays(self, seg: shm_pool.Segment, kinds: str | None = None) -> list[np.ndarray]:
        """Views of the pieces in ``seg``; a handle whose pieces are not plain dtypes (of ``kinds``,
        when given: :func:`peer_dtype`) lying inside the segment is :class:`~flowreduce.shm.pool.Refused` (logged)."""
        out = []
        for piece in self.pieces:
            dt, offset, count = piece
            if not (type(offset) is int and type(count) is int):
                shm_pool.refuse(f"shared-memory handle of {self.name}", f"piece {piece!r} is not (dtype, offset, count)")
            dtype = peer_dtype(dt, kinds)
            if isinstance(dtype, str):
                shm_pool.refuse(f"shared-memory handle of {self.name}", f"piece {piece!r}: {dtype}")
            if not 0 <= offset <= offset + count * dtype.itemsize <= seg.size - shm_pool.HEADER:
                shm_pool.refuse(f"shared-memory handle of {self.name}",
                                f"piece {piece!r} does not lie inside its {seg.size} bytes")
            out.append(seg.view(dtype, count, offset))
        return out

    def current(self, seg: shm_pool.Segment) -> bool:
        """Whether ``seg`` still holds this handle's lease."""
        return seg.stamped() == self.generation

    def check(self, seg: shm_pool.Segment) -> None:
        """After reading: the lease must not have changed under the read."""
        if not self.current(seg):
            raise RuntimeError(f"shared-memory segment {self.name} was leased again before its reader "
                               f"copied it (generation {seg.stamped()}, expected {self.generation}); "
                               "was the value spilled to disk?")
