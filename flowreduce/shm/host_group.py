"""The ranks of one host exchanging through POSIX shared memory, no message at all.

Used by SPMD jobs' communicators (:mod:`flowreduce.spmd.comm`) for every
collective inside a host, and by the p2p engine (:mod:`flowreduce.schedule.p2p`)
for a run whose workers all share one host (its ``shm-direct`` plan).

Each host group of a job has one *control* segment and each of its ranks
one *data* segment of three regions (two inputs, used by collectives in
turn, and one output for the reduce-scatter's slice)::

    control:  [abort word, message] [rank 0: step | region 0 | region 1 | out] [rank 1: ...] ...
              [small slots, turn 0: rank 0 | rank 1 | ...] [turn 1: ...]
    data:     [ input region 0 | input region 1 | out ]     (one segment per rank, grown as needed)

An all-reduce under :data:`SPLIT_BYTES` writes to its rank's small slot of
the turn instead: the group's inputs then lie at a fixed stride in one
mapping, sliced once per size and dtype, and folded row after row in place
(at 1e3 a collective's own Python, not the bytes, is what the ranks wait for).

A collective is one or two *steps*. In a step every rank writes its region,
then bumps its step counter; then it waits until every peer's counter
reaches the step (yielding the CPU at every poll, then, after 1 ms, sleeping
on the peer's counter, a futex: :mod:`flowreduce.shm.futex`; the sleeper sets
the word after the counter, and the peer, as it bumps its counter, wakes
sleepers only if that word is set: no system call on a step nobody sleeps in)
and reads the peers' regions. Why no one
overwrites what a peer still reads: collectives alternate input regions,
and passing a step's wait means every peer has finished every earlier
collective (it bumped its counter for this one after). A rank whose data
outgrows its segment maps a bigger one (a new *generation*); each region
names the generation it was written in, and the old name is unlinked once
every peer has passed the next step (they have mapped it, if they read it).

* ``allreduce``: small vectors in one step (every rank folds every slot, in
  rank order: the same bits on every rank); from :data:`SPLIT_BYTES` a
  reduce-scatter (rank ``i`` folds slice ``i`` of every slot into its out
  region) and an all-gather of the slices, two steps, the work split.
* ``broadcast``, ``allgather``, ``barrier``: one step.

Failure: a rank that fails sets the abort word (with why), and every rank
polling a counter raises; the communicator also gives a callable checked
while waiting (a peer on another worker or the scheduler said the job
failed) and the deadline. Names start with the group's ``base`` (an SPMD
job's: :meth:`flowreduce.spmd.layout.Layout.prefix`), so a sweep removes
everything of a failed attempt (:func:`sweep`).

x86 stores are not reordered with other stores, nor loads with loads: a
counter written after the data is seen after it. Another architecture
would need a fence, which Python cannot issue: there no rank shares memory
(:func:`stores_ordered`; every rank is a host group of its own, and the
trainer does not fuse steps).
"""

from __future__ import annotations

import glob
import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flowreduce.errors import AllreduceTimeoutError, FlowreduceError, InputError, OptionError
from flowreduce.ops import FOLD_BLOCK_BYTES, Op
from flowreduce.shm import futex
from flowreduce.shm import pool as shm_pool
from flowreduce.shm.lease import Lease
from flowreduce.shm.result_buffers import buffers

#: From this many bytes an all-reduce is a reduce-scatter and an all-gather (two steps, the work split).
#: Below, one step where every rank folds every slot: 4 processes on 2 cores, float64, 1e4 (80 KB) took
#: 0.055-0.059 ms in one step against 0.09-0.15 in two, 128 KB 0.08-0.11 against 0.12-0.22; from 160 KB
#: to 256 KB either way by turns (2026-11-28; 64 KiB before).
SPLIT_BYTES = 128 << 10
HEADER = 1024  # abort word, message length, message
SLOT = 768  # per rank: step counter and its "wake me" word (64 bytes), three regions' records, two data segments' names
REGION = 128  # generation, bytes, meta length, dtype code, meta (dtype and shape)
META = REGION - 32
NAMED = 128  # a data segment: its size, its name's length, its name (one per generation parity)
NAME_AT = 64 + 3 * REGION
OUT = 2  # the output region's index
#: How long a waiting rank keeps yielding its core (at every poll) before it sleeps on the peer's stamp
#: (:mod:`flowreduce.shm.futex`): the ranks of a host often outnumber its free cores, so a rank that
#: waits gives its core away at once, and one that waits longer than a collective takes leaves it.
YIELD_SECONDS = 1e-3 if futex.AVAILABLE else 50e-3
#: Longest sleep between polls where there are no futexes, and how often the external abort and the
#: deadline are checked while yielding.
MAX_SLEEP, CHECK_EVERY = 1e-3, 2e-3
#: Longest sleep on a peer's stamp (then the external abort and the deadline are checked again): what
#: ends a sleep is the peer's wake, the abort word's (a rank of the host, or the job's failure said
#: elsewhere: the communicator's mailbox, the engine's run, abort the group), or the deadline.
ASLEEP_SECONDS = 0.1


class Aborted(FlowreduceError, RuntimeError):
    """The job failed elsewhere (a rank raised, a worker left, a collective timed out)."""


#: Machines (``platform.machine()``) whose stores are seen in program order (see the module).
ORDERED_STORES = ("x86_64", "AMD64", "i386", "i686")


def stores_ordered() -> bool:
    import platform

    return platform.machine() in ORDERED_STORES


def _page(n: int) -> int:
    return max(mmap.PAGESIZE, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)


def _create(path: str, size: int, exclusive: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _open(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _cap(size: int) -> int:
    """The bytes of each of the three regions of a data segment of ``size`` bytes, whole pages
    (the writer cuts its segment so, and every reader the same)."""
    return size // 3 // mmap.PAGESIZE * mmap.PAGESIZE


def _name_at(i: int, gen: int) -> int:
    """The byte in the control segment where rank ``i`` (of the group) names its data segment of
    generation ``gen`` (one place per generation parity)."""
    return HEADER + SLOT * i + NAME_AT + NAMED * (gen % 2)


def sweep(directory: str, prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; the names removed."""
    gone = []
    for path in glob.glob(os.path.join(directory, glob.escape(prefix) + "*")):
        _unlink(path)
        gone.append(os.path.basename(path))
    return gone


def dtype_code(dtype: np.dtype) -> int:
    """A dtype as one integer, the same in every process (its ``str``, e.g. ``<f8``, as 8 bytes)."""
    return int.from_bytes(dtype.str.encode()[:8].ljust(8, b"\0"), "little", signed=True)


_codes: dict[np.dtype, int] = {}


def _code(dtype: np.dtype) -> int:
    """:func:`dtype_code`, remembered."""
    found = _codes.get(dtype)
    if found is None:
        found = _codes[dtype] = dtype_code(dtype)
    return found


def encode_meta(dtype: np.dtype, shape: Sequence[int]) -> bytes:
    meta = f"{dtype.str};{','.join(map(str, shape))}".encode()
    if len(meta) > META:
        raise OptionError(f"an array of shape {tuple(shape)} has too many dimensions for the shared-memory exchange; "
                          "reshape it to fewer before the collective")
    return meta


def decode_meta(meta: bytes) -> tuple[np.dtype, tuple[int, ...]]:
    dt, _, shape = meta.decode().partition(";")
    return np.dtype(dt), tuple(int(s) for s in shape.split(",") if s)


class Files:
    """Where a group's data segments live by default: files of the group's own, named after it
    (so that a sweep of its names takes them all), unlinked when retired."""

    def __init__(self, directory: str):
        self.directory = directory

    def create(self, name: str, size: int) -> tuple[str, np.ndarray]:
        """A new segment of ``size`` bytes, named ``name`` here (the name peers open, and its bytes)."""
        return name, np.frombuffer(_create(os.path.join(self.directory, name), size, exclusive=True), np.uint8)

    def open(self, name: str, size: int) -> np.ndarray:
        """A peer's segment (raises FileNotFoundError if it is gone)."""
        return np.frombuffer(_open(os.path.join(self.directory, name)), np.uint8)

    def retire(self, name: str, failed: bool) -> None:
        """One of mine that no peer reads any more (``failed``: one peers may still read)."""
        _unlink(os.path.join(self.directory, name))


class Pooled(Files):
    """Data segments leased from this process's segment pool (:mod:`flowreduce.shm.pool`): pages
    already touched, and peers' segments kept mapped from one group to the next (the p2p engine
    makes a group per run). Files of the group's own when the pool has none to lease."""

    def __init__(self, directory: str, owner: str):
        super().__init__(directory)
        self.owner = owner  # the lease's owner: the run
        self.leases: dict[str, Lease] = {}

    def create(self, name: str, size: int) -> tuple[str, np.ndarray]:
        try:
            lease = Lease.take(size, owner=self.owner)
        except shm_pool.Unavailable:
            return super().create(name, size)
        seg = lease.segment
        self.leases[seg.name] = lease
        return seg.name, seg.buf[shm_pool.HEADER:shm_pool.HEADER + size]

    def open(self, name: str, size: int) -> np.ndarray:
        if not shm_pool.SEGMENT_NAME.fullmatch(name):
            return super().open(name, size)
        pool, need = shm_pool.pool(), shm_pool.HEADER + size
        try:
            seg = pool.attach(name, need)
        except RuntimeError as e:  # gone (the pool says so with a RuntimeError)
            raise FileNotFoundError(str(e)) from None
        return seg.buf[shm_pool.HEADER:need]

    def retire(self, name: str, failed: bool) -> None:
        lease = self.leases.pop(name, None)
        if lease is None:
            return super().retire(name, failed)
        lease.release(failed)  # reused by the next lease, unless peers may still read it


class HostGroup:
    """One rank's view of its host group.

    ``members``: the group's ranks (more than one), in the order they are
    folded; ``rank``: this one (named in errors, as every member); ``base``:
    the start of every segment name of the group in ``directory``, unique to
    the group and the attempt (a sweep of it removes everything of theirs);
    ``external()``: why the job failed, said elsewhere (None: it did not);
    ``segments``: where the data segments come from (:class:`Files`, or the
    segment pool's warm ones, :class:`Pooled`)."""

    def __init__(self, directory: str, base: str, members: Sequence[int], rank: int,
                 external: Callable[[], str | None], yield_seconds: float = YIELD_SECONDS,
                 segments: Files | None = None):
        self.rank, self.external = rank, external
        self.segments = segments if segments is not None else Files(directory)
        #: how long a wait keeps yielding its core before it sleeps between polls: an SPMD rank's
        #: thread has its worker to itself; the engine's shares its process with the event loop,
        #: whose every turn needs the GIL the polling thread keeps taking back
        self.yield_seconds = yield_seconds
        self.local = tuple(members)
        self.n, self.me = len(self.local), self.local.index(rank)
        self.dir = directory
        self.base = f"{base}-"  # every segment of this group's, and only of it
        self.control_path = os.path.join(self.dir, f"{base}-ctl")
        self.data_base = f"{base}-r"
        small_at = _page(HEADER + SLOT * self.n)  # pages of small slots are only allocated when written
        self.ctl = _create(self.control_path, small_at + 2 * self.n * SPLIT_BYTES, exclusive=False)
        #: turn -> the group's small slots, one row of SPLIT_BYTES per rank
        self.small = np.frombuffer(self.ctl, np.uint8, 2 * self.n * SPLIT_BYTES, small_at).reshape(2, self.n, -1)
        self.words = np.frombuffer(self.ctl, dtype=np.int64, count=small_at // 8)
        self.bytes = np.frombuffer(self.ctl, dtype=np.uint8)
        self.stamps = self.words[HEADER // 8::SLOT // 8][:self.n]
        #: the same words as Python ints, read and written faster one at a time than through numpy
        self.q = memoryview(self.ctl).cast("q")
        self.stamp_at = tuple((HEADER + SLOT * i) // 8 for i in range(self.n))
        self.peer_stamps = tuple(a for i, a in enumerate(self.stamp_at) if i != self.me)
        self.my_stamp = self.stamp_at[self.me]
        #: the address of word 0 of the control segment here: a waiting rank sleeps on a peer's stamp
        self.base_address = self.words.__array_interface__["data"][0]
        #: turn -> the word of each rank's record of its small slot (the input region's record)
        self.small_records = tuple(tuple(self._record(i, turn) for i in range(self.n)) for turn in (0, 1))
        #: (turn, bytes, dtype) -> (my small slot, the group's slots (rows, in group order), the word of
        #: my slot's record, the dtype's code, (index, word) of every peer's record), sliced once
        self.small_views: dict[tuple[int, int, np.dtype],
                               tuple[np.ndarray, tuple[np.ndarray, ...], int, int, tuple[tuple[int, int], ...]]] = {}
        #: (peer, region) -> (generation, bytes, dtype code, its bytes): a region read again is not sliced again
        self.views: dict[tuple[int, int], tuple[int, int, int, np.ndarray]] = {}
        self.step = 0
        self.turn = 0  # which input region the next collective writes
        self.gen, self.cap = 0, 0
        self.data: np.ndarray | None = None
        self.mine: list[str] = []  # names of my data segments not retired yet
        self.retired: list[tuple[int, str]] = []  # (step after which no peer needs it, name)
        self.peers: dict[int, dict[int, np.ndarray]] = {i: {} for i in range(self.n)}
        self.control_unlinked = False

    # -- records ----------------------------------------------------------------
    def _record(self, i: int, region: int) -> int:
        return (HEADER + SLOT * i + 64 + REGION * region) // 8

    def _write_record(self, region: int, nbytes: int, meta: bytes = b"", code: int = 0) -> None:
        """My record of ``region``: its generation, bytes, meta (dtype and shape) or dtype code."""
        w, q = self._record(self.me, region), self.q
        q[w] = self.gen
        q[w + 1] = nbytes
        q[w + 2] = len(meta)
        q[w + 3] = code
        if meta:
            self.bytes[w * 8 + 32:w * 8 + 32 + len(meta)] = np.frombuffer(meta, np.uint8)

    def _peer_meta(self, i: int, region: int) -> bytes:
        w = self._record(i, region)
        return self.bytes[w * 8 + 32:w * 8 + 32 + self.q[w + 2]].tobytes()

    def _peer_region(self, i: int, region: int, what: str) -> tuple[np.ndarray, int, int]:
        """Peer ``i``'s region (its bytes), the bytes written and their dtype code."""
        w, q = self._record(i, region), self.q
        gen, nbytes, code = q[w], q[w + 1], q[w + 3]
        found = self.views.get((i, region))
        if found is not None and found[0] == gen and found[1] == nbytes:
            return found[3], nbytes, code
        if i == self.me:
            assert self.data is not None
            buf = self.data
        else:
            maps = self.peers[i]
            buf = maps.get(gen)  # type: ignore[assignment]
            if buf is None:
                try:
                    buf = maps[gen] = self.segments.open(*self._peer_segment(i, gen))
                except FileNotFoundError:
                    failure = self._failure(what)  # the job failed and its segments were taken down
                    if failure is not None:
                        raise failure from None
                    raise
                for old in [g for g in maps if g < gen - 1]:
                    del maps[old]
        cap = _cap(buf.size)
        view = buf[region * cap:region * cap + nbytes]
        self.views[i, region] = (gen, nbytes, code, view)
        return view, nbytes, code

    def _ensure(self, nbytes: int) -> None:
        """A data segment whose regions hold ``nbytes`` (a new generation if the current is smaller),
        its name published in my slot for the generation's parity: a peer reading a region of
        generation ``g`` finds it there until I make ``g + 2``, two collectives later at least,
        once every peer is past this one."""
        if nbytes <= self.cap and self.data is not None:
            return
        cap = _page(max(nbytes, 2 * self.cap, 4096))
        gen = self.gen + 1
        name, data = self.segments.create(f"{self.data_base}{self.rank}-g{gen}", 3 * cap)
        raw = name.encode()
        if len(raw) > NAMED - 16:
            raise RuntimeError(f"shared-memory segment name {name!r} is longer than {NAMED - 16} bytes")
        at = _name_at(self.me, gen)
        self.q[at // 8] = data.size
        self.q[at // 8 + 1] = len(raw)
        self.bytes[at + 16:at + 16 + len(raw)] = np.frombuffer(raw, np.uint8)
        if self.mine:
            self.retired.append((self.step + 1, self.mine[-1]))
        self.mine.append(name)
        self.data, self.cap, self.gen = data, _cap(data.size), gen

    def _peer_segment(self, i: int, gen: int) -> tuple[str, int]:
        """The name and size peer ``i`` published for its data segment of generation ``gen``."""
        at = _name_at(i, gen)
        size, length = self.q[at // 8], self.q[at // 8 + 1]
        return self.bytes[at + 16:at + 16 + length].tobytes().decode(), size

    def _region(self, region: int, nbytes: int) -> np.ndarray:
        assert self.data is not None
        return self.data[region * self.cap:region * self.cap + nbytes]

    # -- steps ------------------------------------------------------------------
    def _arrive(self, what: str, deadline: float | None) -> None:
        """Bump my counter and wait for every peer's."""
        self.step = target = self.step + 1
        q = self.q
        q[self.my_stamp] = target
        if q[self.my_stamp + 1]:  # a peer may sleep on my stamp: wake it (a syscall saved on every other step)
            q[self.my_stamp + 1] = 0
            futex.wake(self.base_address + 8 * self.my_stamp)
        for at in self.peer_stamps:  # one peer at a time: one word read per poll
            if q[at] < target:
                self._wait(at, target, what, deadline)
        if q[0]:
            raise self._aborted(what)
        if self.retired or not self.control_unlinked:
            self._tidy(target)

    def _tidy(self, target: int) -> None:
        """Once every peer has passed step ``target``: unlink the control segment's name (every peer
        has mapped it) and retire the data segments no peer reads any more."""
        if not self.control_unlinked:
            _unlink(self.control_path)
            self.control_unlinked = True
        while self.retired and self.retired[0][0] <= target:
            name = self.retired.pop(0)[1]
            self.segments.retire(name, failed=False)
            self.mine.remove(name)

    def _wait(self, at: int, target: int, what: str, deadline: float | None) -> None:
        """Until the stamp at word ``at`` reaches ``target``: yield the core at every poll for
        ``yield_seconds``, then sleep on the stamp (a futex the peer wakes as it bumps it, and an
        abort as it is set, up to :data:`ASLEEP_SECONDS` or the deadline at a time; where there are
        none, sleep a little longer between polls each time); check the abort word, the job and the
        deadline."""
        q, st = self.q, self.stamps
        spins, sleep = 0, 5e-5
        begun = checked = time.monotonic()
        address = self.base_address + 8 * at
        while q[at] < target:
            if q[0]:
                raise self._aborted(what)
            spins += 1
            if spins & 63 and sleep == 5e-5:  # the common case: give the core to a peer, check nothing else
                os.sched_yield()
                continue
            now = time.monotonic()
            if now - begun < self.yield_seconds:
                os.sched_yield()
            elif futex.AVAILABLE:
                sleep = CHECK_EVERY
                # a failure said before this group existed aborted nothing: seen here, not after a sleep
                failure = self._failure(what)
                if failure is not None:
                    raise failure
                q[at + 1] = 1  # wake me: set before the stamp is read again (the peer clears it as it wakes us)
                nap = ASLEEP_SECONDS if deadline is None else min(ASLEEP_SECONDS, max(deadline - now, 0.0) + 1e-4)
                futex.wait(address, q[at], nap)  # returns at once if the stamp moved since read
            else:
                time.sleep(sleep)
                sleep = min(sleep * 1.5, MAX_SLEEP)
            if now - checked > CHECK_EVERY:
                checked = now
                failure = self._failure(what)
                if failure is not None:
                    raise failure
                if deadline is not None and now > deadline:
                    late = [self.local[i] for i in range(self.n) if st[i] < target]
                    raise AllreduceTimeoutError(
                        f"{what} on rank {self.rank} timed out waiting for rank(s) {late} of its host "
                        f"(step {target}; they are at {[int(st[i]) for i in range(self.n) if st[i] < target]})")

    def _failure(self, what: str) -> Aborted | None:
        """The job's failure, if a rank of the host (the abort word) or anyone else
        (``external``: a peer on another worker, the scheduler) said so."""
        if self.q[0]:
            return self._aborted(what)
        why = self.external()
        return None if why is None else Aborted(f"{what} on rank {self.rank}: {why}")

    def _aborted(self, what: str) -> Aborted:
        n = int(self.words[1])
        why = self.bytes[16:16 + n].tobytes().decode(errors="replace")
        return Aborted(f"{what} on rank {self.rank}: {why}")

    def abort(self, why: str) -> None:
        """Tell every rank of the host that the job failed (their pending and next steps raise)."""
        if self.words[0]:
            return
        msg = why.encode()[:HEADER - 16]
        self.bytes[16:16 + len(msg)] = np.frombuffer(msg, np.uint8)
        self.words[1] = len(msg)
        self.words[0] = self.rank + 1
        if futex.AVAILABLE:  # every rank sleeping on a stamp reads the abort word now
            for at in self.stamp_at:
                futex.wake(self.base_address + 8 * at)

    def _next_region(self) -> int:
        region, self.turn = self.turn, 1 - self.turn
        return region

    # -- collectives ------------------------------------------------------------
    def allreduce(self, x: np.ndarray, op: Op, acc: np.dtype, what: str, deadline: float | None,
                  fold: Callable[[Sequence[np.ndarray], np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """``op`` over the group's ``x`` (1-d, same dtype and size everywhere),
        in ``acc``; unfinished (a mean is not divided here). ``fold(parts, out)``: how the group's
        arrays (in group order, read in place) are combined into ``out`` instead of left to right
        with ``op`` (elementwise: each rank may fold a slice)."""
        if x.nbytes < SPLIT_BYTES:
            return self._small_allreduce(x, op, acc, what, deadline, fold)
        size = x.size
        code = _code(x.dtype)
        part = -(-size // self.n) * acc.itemsize
        self._ensure(max(x.nbytes, part))
        region = self._next_region()
        np.copyto(self._region(region, x.nbytes).view(x.dtype), x)
        self._write_record(region, x.nbytes, code=code)
        self._arrive(what, deadline)
        views = []
        for i in range(self.n):
            buf, nbytes, theirs = self._peer_region(i, region, what)
            self._check(i, nbytes, theirs, x, code, what)
            views.append(buf.view(x.dtype))
        combine = fold or (lambda parts, into: fold_into(op, parts, into))
        out = buffers().empty(size, acc)
        lo, hi = size * self.me // self.n, size * (self.me + 1) // self.n
        mine = self._region(OUT, (hi - lo) * acc.itemsize).view(acc)
        combine([v[lo:hi] for v in views], mine)
        self._write_record(OUT, mine.nbytes)
        self._arrive(what, deadline)
        for i in range(self.n):
            a, b = size * i // self.n, size * (i + 1) // self.n
            buf, _, _ = self._peer_region(i, OUT, what)
            out[a:b] = buf.view(acc)[:b - a]
        return out

    def _small_allreduce(self, x: np.ndarray, op: Op, acc: np.dtype, what: str, deadline: float | None,
                         fold: Callable[[Sequence[np.ndarray], np.ndarray], np.ndarray] | None) -> np.ndarray:
        """One step through the turn's small slots (``x`` under :data:`SPLIT_BYTES`). Every rank folds
        every slot; at 1e3 the Python around the step is most of a call's time (every line here runs
        on every rank, four ranks on two cores), so what depends only on the turn, size and dtype is
        sliced once."""
        turn = self.turn
        self.turn = 1 - turn
        nbytes = x.nbytes
        found = self.small_views.get((turn, nbytes, x.dtype))
        if found is None:
            block = self.small[turn, :, :nbytes].view(x.dtype)  # (ranks, size): the group's inputs, in order
            words = self.small_records[turn]
            found = self.small_views[turn, nbytes, x.dtype] = (
                block[self.me], tuple(block), words[self.me], _code(x.dtype),
                tuple((i, w) for i, w in enumerate(words) if i != self.me))
        mine, rows, w, code, records = found
        np.copyto(mine, x)
        q = self.q
        q[w + 1] = nbytes
        q[w + 3] = code
        self._arrive(what, deadline)
        for i, w in records:
            if q[w + 1] != nbytes or q[w + 3] != code:
                self._check(i, q[w + 1], q[w + 3], x, code, what)
        out = np.empty(x.size, acc)
        if fold is not None:
            return fold(list(rows), out)
        func = op.func
        if (acc is x.dtype or acc == x.dtype) and type(func) is np.ufunc:
            # fold_into's left fold, inlined: ((x0 op x1) op x2) op ..., the same bits on every rank (one
            # ufunc.reduce over the rows' block, axis 0, took 8.9 us at 8000 float64 against 7.3 for these)
            func(rows[0], rows[1], out=out)
            for row in rows[2:]:
                func(out, row, out=out)
            return out
        return fold_into(op, rows, out)

    def _check(self, i: int, nbytes: int, theirs: int, x: np.ndarray, code: int, what: str) -> None:
        """Raise if peer ``i`` (which wrote ``nbytes`` of dtype code ``theirs``) disagrees with ``x``."""
        if nbytes != x.nbytes or theirs != code:
            got = theirs.to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace")
            raise InputError(f"{what}: rank {self.local[i]} gave {nbytes} bytes of {got!r}, rank {self.rank} "
                             f"{x.nbytes} bytes of {x.dtype.str!r}: every rank must give the same shape and dtype")

    def broadcast(self, x: np.ndarray | None, root: int, what: str, deadline: float | None) -> np.ndarray:
        """The array of the group's rank ``root`` (an index into the group), a copy on every rank."""
        region = self._next_region()
        if self.me == root:
            assert x is not None
            self._ensure(x.nbytes)
            np.copyto(self._region(region, x.nbytes).view(x.dtype).reshape(x.shape), x)
            self._write_record(region, x.nbytes, encode_meta(x.dtype, x.shape))
        self._arrive(what, deadline)
        if self.me == root:
            assert x is not None
            return _copy(x)
        buf, _, _ = self._peer_region(root, region, what)
        dtype, shape = decode_meta(self._peer_meta(root, region))
        return _copy(buf.view(dtype).reshape(shape))

    def allgather(self, x: np.ndarray, what: str, deadline: float | None) -> list[np.ndarray]:
        """Every rank's array of the group, copies, in group order."""
        region = self._next_region()
        self._ensure(x.nbytes)
        np.copyto(self._region(region, x.nbytes).view(x.dtype).reshape(x.shape), x)
        self._write_record(region, x.nbytes, encode_meta(x.dtype, x.shape))
        self._arrive(what, deadline)
        out = []
        for i in range(self.n):
            if i == self.me:
                out.append(_copy(x))
                continue
            buf, _, _ = self._peer_region(i, region, what)
            dtype, shape = decode_meta(self._peer_meta(i, region))
            out.append(_copy(buf.view(dtype).reshape(shape)))
        return out

    def barrier(self, what: str, deadline: float | None) -> None:
        self._next_region()
        self._arrive(what, deadline)

    def close(self, failed: bool) -> None:
        """Retire my segments (and unlink all of my group's names if the job failed: a dead peer's too).
        Not ``failed``, a caller whose peers may still read my regions has passed a barrier first."""
        for name in self.mine:
            self.segments.retire(name, failed)
        self.mine.clear()
        _unlink(self.control_path)
        if failed:  # a dead peer's too; not another group's (with transport "worker", one directory holds several)
            sweep(self.dir, self.base)
        self.peers.clear()
        self.views.clear()
        self.small_views.clear()
        self.data = None


def _copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` (same shape and dtype) in warm memory."""
    out = buffers().empty(a.size, a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out


def fold_into(op: Op, parts: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``parts[0] op parts[1] op ...`` in that order, into ``out`` (a host group's fold, an SPMD
    plan's reduce between hosts, the engine's fold of published inputs)."""
    if op.in_place:
        if out.nbytes > FOLD_BLOCK_BYTES:
            return op.fold(parts, out)
        # small: no blocks (what fold adds is call overhead), and no copy of the first part if it need not be cast
        if len(parts) > 1 and parts[0].dtype == out.dtype:
            op.func(parts[0], parts[1], out=out)
            rest = parts[2:]
        else:
            np.copyto(out, parts[0], casting="unsafe")
            rest = parts[1:]
        for p in rest:
            op.func(out, p, out=out)
        return out
    acc: Any = parts[0]
    for p in parts[1:]:
        acc = op.func(acc, p)
    np.copyto(out, acc, casting="unsafe")
    return out
