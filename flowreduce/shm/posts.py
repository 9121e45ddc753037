"""Posts: a worker puts a value up in shared memory under a name its peers
on the host can compute, and they read it in place. What the one-level
``direct`` collective's tasks exchange (:func:`flowreduce.schedule.peer_reads.reading`):
no message, no request, no socket between two workers of one host.

A post is a lease of the worker's pool (:mod:`flowreduce.shm.lease`: warm,
reused across calls, so nobody page-faults) and a symbolic link next to it
named after the call and the poster's first rank (:func:`name`), pointing at
the segment, its lease generation and where the value sits. Peers wait for
the link, map the segment once (the pool keeps peers' mappings for the
next call), check the generation, and read the value where it lies. Each
reader then sets its byte in the post's acknowledgements; the poster takes
the link down and lets the lease go once every reader has
(:meth:`Post.read_by_all`): back to its pool, or, if one never does, discarded,
so a segment is never reused under a reader (the lease's one rule). A reader
reads the value through its :class:`~flowreduce.shm.lease.Handle`.

The segment holds, after the pool's header: one acknowledgement byte per
worker of the host group, what the value is (its dtype, shape and, for a
worker's several ranks reduced into one, what each rank held: pickled),
then the value. A value that cannot be posted (not a numpy array of plain
numbers, or ranks that do not agree) is posted as :data:`UNFIT`, a link
with nothing behind it, so readers ask for it over Dask's comm at once
instead of waiting.

Pure: os, pickle, numpy, the pool and its leases.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowreduce.shm import pool as shm_pool
from flowreduce.shm.lease import Handle, Lease

logger = logging.getLogger("flowreduce")
#: A post with nothing behind it: its readers read the value over Dask's comm.
UNFIT = "unfit"
#: Alignment of the description and the value in the segment (cache lines).
ALIGN = 64


def name(token: str, rank: int) -> str:
    """The link of the post of the worker whose first rank is ``rank`` in the call ``token``
    (:class:`~flowreduce.shm.pool.Refused` unless that is a plain name: a token of
    letters, digits and ``_``, a rank that is an int)."""
    link = f"{shm_pool.PREFIX}{shm_pool.LINK}{token}-{rank}"
    if (not isinstance(token, str) or not isinstance(rank, (int, np.integer)) or isinstance(rank, bool)
            or not shm_pool.LINK_NAME.fullmatch(link)):
        shm_pool.refuse(f"shared-memory post of call {token!r}, rank {rank!r}"[:300], "not a plain token and rank")
    return link


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Overwritten(RuntimeError):
    """A post changed under its reader: its poster posted again (a new attempt of the call, after a
    worker was lost), so what was read may mix two generations."""


@dataclass
class Post:
    """A value this worker put up: its lease (None for :data:`UNFIT`) and
    the host group's slots that must acknowledge it."""

    link: str
    target: str  # what the link points at: it is taken down only if it still does
    lease: Lease | None
    readers: tuple[int, ...]  # the acknowledgement slots of the groups that will read it
    value: np.ndarray | None = None  # what was posted (read-only)
    metas: tuple | None = None

    @property
    def segment(self) -> shm_pool.Segment | None:
        return None if self.lease is None else self.lease.segment

    @property
    def generation(self) -> int:
        return 0 if self.lease is None else self.lease.generation

    def read_by_all(self) -> bool:
        if self.lease is None:
            return True
        acks = self.lease.segment.buf[shm_pool.HEADER:shm_pool.HEADER + (max(self.readers) + 1 if self.readers else 0)]
        return all(acks[i] for i in self.readers)

    def withdraw(self, pool: shm_pool.Pool, *, reuse: bool) -> None:
        """Take the link down, then let the lease go: back for reuse (every
        reader is done with it) or discarded (one may still read it). A link
        that a later post of the same name replaced (its task run again) stays."""
        pool.unlink_link(self.link, self.target)
        if self.lease is not None:
            self.lease.release(failed=not reuse)


def post(pool: shm_pool.Pool, link: str, dtype: np.dtype, shape: tuple[int, ...], metas: tuple | None,
         fill: Callable[[np.ndarray], None], *, slots: int, readers: Sequence[int]) -> Post:
    """Put up under ``link`` an array of ``dtype`` and ``shape`` that
    ``fill`` writes, described by ``metas`` (what each of several ranks
    held; None for one rank's own input). ``slots``: the host group's size
    (acknowledgement bytes); ``readers``: the slots that will read it.
    :data:`UNFIT` when no segment can be had (the pool logs why, once)."""
    dtype = np.dtype(dtype)
    described = pickle.dumps((dtype, tuple(shape), metas), protocol=pickle.HIGHEST_PROTOCOL)
    acks, about = _align(slots), len(described)
    at = _align(acks + about)
    count = int(np.prod(shape, dtype=np.int64))
    try:
        lease = Lease.take(at + count * dtype.itemsize, pool=pool)
    except shm_pool.Unavailable:
        return unfit(pool, link)
    seg = lease.segment
    try:
        head = seg.buf[shm_pool.HEADER:]
        head[:acks] = 0
        head[acks:acks + about] = np.frombuffer(described, np.uint8)
        value = lease.view(dtype, count, at).reshape(shape)
        fill(value)
        value.flags.writeable = False
        target = f"{seg.name}:{seg.size}:{lease.generation}:{acks}:{about}"
        pool.link(link, target)
    except BaseException:
        lease.release(failed=True)
        raise
    return Post(link, target, lease, tuple(readers), value, metas)


def unfit(pool: shm_pool.Pool, link: str) -> Post:
    """Post :data:`UNFIT` under ``link`` (the target names this process,
    whose death reclaims it); if no link can be made there, nothing, and
    readers read over Dask's comm once they stop waiting."""
    target = f"{pool.stem}:{UNFIT}"
    try:
        pool.link(link, target)
    except OSError as e:
        logger.debug("flowreduce: cannot link %s (%r)", link, e)
    return Post(link, target, None, ())


@dataclass
class Found:
    """A peer's post as read: the value (a read-only view of its segment),
    what its ranks held (None: one rank, the value itself), the segment to
    acknowledge in and the handle of the value in it."""

    value: np.ndarray
    metas: tuple | None
    segment: shm_pool.Segment
    handle: Handle

    def acknowledge(self, slot: int, check: bool = True) -> None:
        """Say this reader (the host group's ``slot``) is done with it. The
        generation must not have changed under the read (``check``): the
        poster reuses a segment only once every reader has acknowledged it."""
        if not self.handle.current(self.segment):
            if not check:
                return
            raise Overwritten(f"shared-memory post {self.segment.name} was overwritten while it was read "
                               f"(generation {self.handle.generation}, now {self.segment.stamped()})")
        self.segment.buf[shm_pool.HEADER + slot] = 1


def find(pool: shm_pool.Pool, token: str, rank: int) -> Found | str | None:
    """The post of the worker whose first rank is ``rank`` in the call
    ``token``: :class:`Found`, :data:`UNFIT` (read it over Dask's comm),
    or None (not up yet, or taken down)."""
    try:
        target = os.readlink(os.path.join(pool.directory, name(token, rank)))
    except OSError:
        return None
    fields = target.split(":")
    if fields[1:] == [UNFIT] or len(fields) != 5:  # not a value of ours to read: Dask's comm reads it
        return UNFIT
    try:
        seg_name = fields[0]
        size, generation, acks, about = (int(f) for f in fields[1:])
    except ValueError:
        logger.error("flowreduce: refused shared-memory post %s: its target %r is not one of a post",
                     name(token, rank), target[:200])
        return UNFIT
    try:  # the pool checks the name and size (a segment of this user, in its directory)
        seg = pool.attach(seg_name, size, writable=True)
    except shm_pool.Refused:
        return UNFIT
    except (RuntimeError, OSError, ValueError):  # taken down since: its poster's readers were all done
        return None
    if seg.stamped() != generation:  # given back and leased again: this link is stale
        return None
    at = _align(acks + about)
    try:  # a file of this user (checked by attach): the description is the poster's own pickle
        if not (0 <= acks and 0 < about and at <= size - shm_pool.HEADER):
            raise ValueError(f"description at {acks}+{about} outside {size} bytes")
        head = seg.buf[shm_pool.HEADER:]
        dtype, shape, metas = pickle.loads(head[acks:acks + about].tobytes())
        dtype = np.dtype(dtype)
        handle = Handle(seg_name, size, generation, ((dtype.str, at, int(np.prod(shape, dtype=np.int64))),))
        value = handle.arrays(seg)[0].reshape(shape)  # refused unless a plain dtype inside the segment
    except Exception as e:
        logger.error("flowreduce: refused shared-memory post %s: %r", name(token, rank), e)
        return UNFIT
    value.flags.writeable = False
    return Found(value, metas, seg, handle)
