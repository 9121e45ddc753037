"""A per-process pool of shared-memory segments: the same-host data plane's
buffers. Pure (os, mmap, numpy, dask.config); the kernels get it through
:func:`pool`, and the scheduling layer's worker plugin releases it when idle
and when the worker closes.

A segment is a file in a memory-backed directory (``/dev/shm``) mapped with
``mmap``: POSIX shared memory without a compiled helper, and the directory is
configurable so a host with a missing, read-only or tiny ``/dev/shm`` is
handled (and tested). Mapping a fresh segment costs a page fault per page, more
than the copy into it, so segments are leased and given back, and the next
call reuses them; peers' segments stay mapped in this process for the same
reason. Space is reserved with ``posix_fallocate`` before mapping, so a full
tmpfs is an error here (and a fallback to Dask's comm), never a bus error on
first touch.

Names carry the owner's pid and process start time
(``flowreduce-shm-<pid>-<start>-<n>``): the first pool of a process on a host
unlinks segments whose owner is gone (a worker killed with SIGKILL that its
nanny restarted). The pool also makes symbolic links, named by what they
announce (:mod:`flowreduce.shm.posts`), whose target starts with the
name of the segment (or the stem of the process) they belong to: they are
judged by that owner.

Configuration (dask config, defaults in flowreduce/flowreduce.yaml, read
when the process's pool is made):

``flowreduce.shm.enabled``      false: never use shared memory
``flowreduce.shm.directory``    where segments live (default ``/dev/shm``)
``flowreduce.shm.pool-bytes``   bound on this process's segments, leased or free
``flowreduce.shm.memory-fraction``  and at most this share of the worker's memory
                                limit (the plugin applies it: the pool's pages
                                count in the worker's RSS, which Dask's memory
                                manager pauses and kills by)
``flowreduce.shm.idle-seconds`` free segments and peer mappings unused this long are dropped
``flowreduce.shm.min-bytes``    a plan node's value smaller than this goes through Dask's comm
                                (a message that small costs no more than the handle);
                                ``direct``'s posts need no message and ignore it
``flowreduce.shm.result-pool-bytes``  free warm buffers kept for results
                                (:mod:`flowreduce.shm.result_buffers`)
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import numpy.typing as npt

logger = logging.getLogger("flowreduce")

PREFIX = "flowreduce-shm-"
#: After :data:`PREFIX`, the start of a link's name (:mod:`flowreduce.shm.posts`).
LINK = "post-"
#: A segment's name (:data:`PREFIX`, pid, start time, number) and a post link's
#: (:data:`PREFIX`, :data:`LINK`, call token, first rank): the only names the pool
#: maps, links or unlinks when they come from elsewhere (a handle, a link's target).
SEGMENT_NAME = re.compile(r"flowreduce-shm-[0-9]{1,10}-[0-9]{1,20}-[0-9]{1,20}")
LINK_NAME = re.compile(r"flowreduce-shm-post-[A-Za-z0-9_]{1,128}-[0-9]{1,10}")
#: The settings' keys under ``flowreduce.shm`` (defaults in flowreduce/flowreduce.yaml).
KEYS = ("enabled", "directory", "pool-bytes", "memory-fraction", "idle-seconds", "min-bytes", "result-pool-bytes")
#: Segments are sized in these units so calls of nearby sizes share them.
GRAIN = 1 << 20
#: Bytes at the head of a segment: its lease generation (an int64), so a
#: reader can tell a payload that was overwritten by a later lease.
HEADER = 64
#: Room left free in the directory for everybody else.
HEADROOM = 64 << 20


def config() -> dict:
    """The pool's settings from the dask config (:mod:`flowreduce.config`)."""
    from dask.utils import parse_bytes

    from flowreduce import config as settings

    got = {k: settings.get(f"shm.{k}") for k in KEYS}
    for k in ("pool-bytes", "min-bytes", "result-pool-bytes"):
        got[k] = parse_bytes(got[k]) if isinstance(got[k], str) else int(got[k])
    got["idle-seconds"] = float(got["idle-seconds"])
    got["memory-fraction"] = float(got["memory-fraction"])
    got["enabled"] = bool(got["enabled"])
    return got


def enabled() -> bool:
    """Whether shared memory is on (``flowreduce.shm.enabled``): :func:`config`'s one key, read alone
    where every call asks it (the scheduler's decision, each published input)."""
    from flowreduce import config as settings

    return bool(settings.get("shm.enabled"))


def settings_refusal(settings: object) -> str | None:
    """Why ``settings`` (``flowreduce.shm`` keys to values, as a client sends
    them to its workers in :class:`~flowreduce.schedule.shm_plugin.SharedMemoryPlugin`)
    are not settings the pool can take, or None: unknown keys, a directory
    that is not an existing absolute directory, sizes and times that are not
    non-negative numbers, a memory fraction outside (0, 1]."""
    from dask.utils import parse_bytes

    if not isinstance(settings, dict) or not set(settings) <= set(KEYS):
        return f"not a dict of {', '.join(KEYS)}"
    try:
        directory = settings.get("directory", "/dev/shm")
        if not isinstance(directory, str) or "\0" in directory or not os.path.isabs(directory) \
                or not os.path.isdir(directory):
            return f"directory {directory!r} is not an existing absolute directory"
        for k in ("pool-bytes", "min-bytes", "result-pool-bytes"):
            v = settings.get(k, 0)
            if isinstance(v, bool) or (parse_bytes(v) if isinstance(v, str) else int(v)) < 0:
                return f"{k} {v!r} is not a size"
        fraction, idle = float(settings.get("memory-fraction", 0.25)), float(settings.get("idle-seconds", 30))
        if not 0 < fraction <= 1 or not 0 <= idle < float("inf"):
            return f"memory-fraction {fraction!r} or idle-seconds {idle!r} out of range"
        if not isinstance(settings.get("enabled", True), bool):
            return "enabled is not true or false"
    except (TypeError, ValueError) as e:
        return repr(e)
    return None


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), so a pid
    reused by another process is not mistaken for the owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return "0"


def owner_alive(name: str, directory: str | None = None) -> bool:
    """Whether the process that made segment ``name`` still runs (for a
    link in ``directory``: the process its target names)."""
    if directory is not None and name[len(PREFIX):].startswith(LINK):
        try:
            name = os.readlink(os.path.join(directory, name)).split(":")[0]
        except OSError:
            return True  # gone already, or not a link: not ours to judge
    try:
        pid_s, start = name[len(PREFIX):].split("-")[:2]
        pid = int(pid_s)
    except ValueError:
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start == "0" or _start_time(pid) in (start, "0")


@dataclass(eq=False)
class Segment:
    """One mapped file: ``buf`` is its bytes as a uint8 array; payloads start
    after a :data:`HEADER` holding the lease generation."""

    name: str
    size: int
    buf: np.ndarray
    used: float = field(default_factory=time.monotonic)
    generation: int = 0
    owner: str = ""  # the call (key token) holding the lease
    writable: bool = True  # a peer's segment mapped for writing (own segments always are)

    def view(self, dtype: npt.DTypeLike, count: int, offset: int = 0) -> np.ndarray:
        """``count`` items of ``dtype`` at byte ``offset`` of the payload."""
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=HEADER + offset)

    def stamp(self) -> int:
        self.generation += 1
        self.buf[:8].view(np.int64)[0] = self.generation
        return self.generation

    def stamped(self) -> int:
        return int(self.buf[:8].view(np.int64)[0])


class Unavailable(Exception):
    """No segment can be had here: the caller moves the data through Dask's comm."""


class Refused(ValueError):
    """A segment or link name, or a size, that the pool will not touch: it came
    from elsewhere (a peer's handle or post) and is not one of flowreduce's own."""


def refuse(what: str, why: str) -> NoReturn:
    """Log (logger ``flowreduce``, error) and raise :class:`Refused`."""
    logger.error("flowreduce: refused %s: %s", what, why)
    raise Refused(f"{what}: {why}")


def checked_name(directory: str, name: object, pattern: re.Pattern[str] = SEGMENT_NAME, what: str = "segment") -> str:
    """The path of ``name`` in ``directory`` if it is one of the pool's names
    (``pattern``: no separator, no ``..``, no NUL, bounded length) and lands
    in ``directory`` once resolved; else :func:`refuse`."""
    if not isinstance(name, str) or not pattern.fullmatch(name):
        refuse(f"shared-memory {what} name {name!r}"[:300], f"not a flowreduce {what} name ({pattern.pattern})")
    path = os.path.join(directory, name)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(directory) and what == "segment":
        refuse(f"shared-memory {what} {name!r}", f"resolves outside {directory}")
    return path


class Pool:
    """This process's segments: leased ones, free ones (kept for reuse), and
    mappings of peers' segments. Thread-safe (a worker's tasks run in threads)."""

    def __init__(self, directory: str = "/dev/shm", limit: int = 4 << 30, idle: float = 30.0, enabled: bool = True,
                 min_bytes: int = 64 << 10):
        self.directory, self.limit, self.idle, self.min_bytes = directory, limit, idle, min_bytes
        self.configured = limit  # the bound before bound_by_memory lowered it: peers may have more
        self._lock = threading.Lock()
        self._leased: dict[str, Segment] = {}
        self._free: OrderedDict[str, Segment] = OrderedDict()
        self._peers: OrderedDict[str, Segment] = OrderedDict()
        self._links: set[str] = set()
        self._count = itertools.count()
        self._stem = f"{PREFIX}{os.getpid()}-{_start_time(os.getpid())}-"
        self._warned: set[str] = set()
        self.closed = False
        self.reason: str | None = None if enabled else "disabled by flowreduce.shm.enabled"
        if self.reason is None:
            self.reason = self._usable()
        if self.reason is None:
            self.reclaim_orphans()

    # -- what the pool holds ---------------------------------------------
    @property
    def available(self) -> bool:
        return self.reason is None and not self.closed

    @property
    def nbytes(self) -> int:
        """Bytes of this process's own segments (leased and free)."""
        with self._lock:
            return sum(s.size for s in (*self._leased.values(), *self._free.values()))

    def stats(self) -> dict:
        with self._lock:
            return {"leased": len(self._leased), "free": len(self._free), "peers": len(self._peers),
                    "bytes": sum(s.size for s in (*self._leased.values(), *self._free.values())),
                    "peer_bytes": sum(s.size for s in self._peers.values()), "limit": self.limit,
                    "directory": self.directory,
                    "reason": self.reason}

    def names(self) -> list[str]:
        with self._lock:
            return [*self._leased, *self._free]

    def shares_memory(self, x: np.ndarray) -> bool:
        """Whether ``x`` lies in a segment mapped here (own, leased or free, or a peer's): a value
        that must outlive the pool's reuse of its segments must not."""
        with self._lock:
            segs = [s.buf for s in (*self._leased.values(), *self._free.values(), *self._peers.values())]
        return any(np.shares_memory(x, b) for b in segs)

    # -- own segments ----------------------------------------------------
    def lease(self, nbytes: int, owner: str = "") -> Segment:
        """A segment of at least ``nbytes`` for this process to write, reused
        when one is free and was not the call ``owner``'s already. Raises :class:`Unavailable` (logged once per reason)
        when shared memory is off, missing, full or the pool is at its bound."""
        if not self.available:
            raise Unavailable(self.reason or "pool closed")
        nbytes += HEADER
        size = max(GRAIN, -(-nbytes // GRAIN) * GRAIN)
        with self._lock:
            # never a segment this call gave back: a call run again after a worker loss has the same
            # keys, and a reader may still hold the first run's handle (a fetch in flight when the
            # scheduler released the key); its payload stays valid until another call leases it
            fits = [s for s in self._free.values()
                    if nbytes <= s.size <= 2 * size and not (owner and s.owner == owner)]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                del self._free[seg.name]
                self._leased[seg.name] = seg
                seg.used, seg.owner = time.monotonic(), owner
                seg.stamp()
                return seg
            held = sum(s.size for s in (*self._leased.values(), *self._free.values()))
            while self._free and held + size > self.limit:  # make room: drop the least recently used
                _, old = self._free.popitem(last=False)
                held -= old.size
                self._unlink(old)
            if held + size > self.limit:
                self._fallback(f"pool bound flowreduce.shm.pool-bytes={self.limit} reached", "bound")
            seg = self._create(size)
            self._leased[seg.name] = seg
            seg.owner = owner
            seg.stamp()
            return seg

    def give_back(self, seg: Segment, generation: int | None = None) -> None:
        """Return a leased segment for reuse (unlinked if the pool is closed);
        with ``generation``, only if it is still that lease."""
        with self._lock:
            if generation is not None and seg.generation != generation:
                return  # given back already (its call ended) and leased again since
            if self._leased.pop(seg.name, None) is None:
                return
            seg.used = time.monotonic()
            if self.closed:
                self._unlink(seg)
            else:
                self._free[seg.name] = seg

    def owns(self, owner: str) -> bool:
        with self._lock:
            return any(s.owner == owner for s in self._leased.values())

    def release_owner(self, owner: str) -> int:
        """Give back every segment the call ``owner`` still leases (its keys
        are gone from this worker: an error or a cancellation left values
        referenced by a kept traceback). Returns how many."""
        with self._lock:
            held = [s for s in self._leased.values() if s.owner == owner]
        for s in held:
            self.give_back(s, s.generation)
        return len(held)

    def discard(self, seg: Segment, generation: int | None = None) -> None:
        """Unlink a leased segment (a call that ended abnormally: a task of
        it may still read or write the memory, so it is never reused); with
        ``generation``, only if it is still that lease."""
        with self._lock:
            if generation is not None and seg.generation != generation:
                return
            if self._leased.pop(seg.name, None) is not None:
                self._unlink(seg)

    def _create(self, size: int) -> Segment:
        try:
            free = os.statvfs(self.directory)
            room = free.f_bavail * free.f_frsize
        except OSError as e:
            self._fallback(f"cannot read {self.directory}: {e.strerror}", "read", sticky=True)
        if size + HEADROOM > room:
            self._fallback(f"{self.directory} has {room} bytes free, a segment needs {size}", "full")
        name = f"{self._stem}{next(self._count)}"
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            self._fallback(f"cannot create segments in {self.directory}: {e.strerror}", "create", sticky=True)
        try:
            try:  # reserve the pages now: a full tmpfs fails here, not with SIGBUS on first touch
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError as e:
            os.unlink(path)
            self._fallback(f"cannot reserve {size} bytes in {self.directory}: {e.strerror}", "full")
        finally:
            os.close(fd)
        return Segment(name, size, np.frombuffer(mm, dtype=np.uint8))

    def _unlink(self, seg: Segment) -> None:
        """The name goes now; the memory when the last view of it is dropped."""
        try:
            os.unlink(os.path.join(self.directory, seg.name))
        except FileNotFoundError:
            pass

    def _fallback(self, reason: str, kind: str, sticky: bool = False) -> NoReturn:
        """Raise :class:`Unavailable`, logging one line per ``kind`` of reason.
        ``sticky``: the directory is unusable, the pool stays unavailable;
        else a passing condition (a full pool or tmpfs)."""
        if sticky:
            self.reason = reason
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("flowreduce: same-host transfers use Dask's comm (%s)", reason)
        raise Unavailable(reason)

    def _usable(self) -> str | None:
        if not os.path.isdir(self.directory):
            reason = f"shared-memory directory {self.directory} is missing"
        elif not os.access(self.directory, os.W_OK) or _read_only(self.directory):
            reason = f"shared-memory directory {self.directory} is read-only"
        else:
            return None
        logger.warning("flowreduce: same-host transfers use Dask's comm (%s)", reason)
        return reason

    # -- links ------------------------------------------------------------
    @property
    def stem(self) -> str:
        """This process's names start with it (a link without a segment names its owner by it)."""
        return self._stem

    def link(self, name: str, target: str) -> None:
        """Make the symbolic link ``name`` to ``target`` (which starts with
        this process's stem or one of its segments' names), replacing one
        left by an earlier attempt; unlinked on :meth:`close`."""
        path = checked_name(self.directory, name, LINK_NAME, "link")
        with self._lock:
            self._links.add(name)
        try:
            os.symlink(target, path)
        except FileExistsError:  # a task run again (its worker died under it): the newer post wins
            os.unlink(path)
            os.symlink(target, path)

    def unlink_link(self, name: str, target: str | None = None) -> None:
        """Remove the link ``name`` (with ``target``: only while it still points there)."""
        path = checked_name(self.directory, name, LINK_NAME, "link")
        try:
            if target is not None and os.readlink(path) != target:
                return  # replaced by a later link of the same name: its owner takes it down
            os.unlink(path)
        except OSError:  # gone already
            pass
        with self._lock:
            self._links.discard(name)

    # -- peers' segments -------------------------------------------------
    def attach(self, name: str, size: int, writable: bool = False) -> Segment:
        """A peer's segment mapped read-only (``writable``: also for writing
        into it, as a post's reader does its acknowledgement), kept mapped
        for the next call. ``name`` and ``size`` come from a peer (a handle,
        a post's link): only a regular file of this user named as the pool
        names segments, directly in the pool's directory (never through a
        symbolic link), and no more bytes than it has, are mapped; anything
        else is :class:`Refused` (logged)."""
        path = checked_name(self.directory, name)
        if type(size) is not int or not HEADER < size <= self.limit_of_peers:
            refuse(f"shared-memory segment {name} of {size!r} bytes",
                   f"size must be an int in ({HEADER}, {self.limit_of_peers}]")
        with self._lock:
            own = self._leased.get(name)
            if own is not None:
                return own
            seg = self._peers.get(name)
            # mapped before for a smaller lease of it (the owner reuses its segments): mapped again, whole
            if seg is not None and (seg.writable or not writable) and seg.size >= size:
                self._peers.move_to_end(name)
                seg.used = time.monotonic()
                return seg
        try:  # O_NOFOLLOW: a link put in the segment's place is refused, not followed (O_NONBLOCK: nor a fifo waited on)
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RuntimeError(f"shared-memory segment {name} is gone: its worker died or released it "
                               f"before its readers ran") from None
        except OSError as e:
            refuse(f"shared-memory segment {name}", f"cannot be opened as a plain file ({e.strerror})")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                refuse(f"shared-memory segment {name}", "not a regular file of this user")
            if size > st.st_size:
                refuse(f"shared-memory segment {name} of {size} bytes", f"the file has {st.st_size}")
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        seg = Segment(name, size, np.frombuffer(mm, dtype=np.uint8), writable=writable)
        with self._lock:
            self._peers[name] = seg
            while len(self._peers) > 1 and sum(s.size for s in self._peers.values()) > self.limit:
                self._peers.popitem(last=False)
        return seg

    @property
    def limit_of_peers(self) -> int:
        """Most bytes one peer's segment may have: any worker's pool is
        bounded by ``flowreduce.shm.pool-bytes`` (or less, by memory)."""
        return max(self.limit, self.configured)

    def forget_peer(self, name: str) -> None:
        with self._lock:
            self._peers.pop(name, None)

    # -- housekeeping ----------------------------------------------------
    def release_idle(self, now: float | None = None) -> int:
        """Unlink free segments and unmap peers unused for ``idle`` seconds
        (peers whose file is gone at once). Returns how many were dropped."""
        now = time.monotonic() if now is None else now
        dropped = 0
        with self._lock:
            for name, seg in list(self._free.items()):
                if now - seg.used >= self.idle:
                    del self._free[name]
                    self._unlink(seg)
                    dropped += 1
            for name, seg in list(self._peers.items()):
                if now - seg.used >= self.idle or not os.path.exists(os.path.join(self.directory, name)):
                    del self._peers[name]
                    dropped += 1
        return dropped

    def close(self) -> None:
        """Unlink every own segment and unmap peers (the worker is closing)."""
        with self._lock:
            self.closed = True
            for seg in (*self._leased.values(), *self._free.values()):
                self._unlink(seg)
            for name in self._links:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass
            self._leased.clear()
            self._free.clear()
            self._peers.clear()
            self._links.clear()

    def reclaim_orphans(self) -> list[str]:
        """Unlink segments in the directory whose owning process is gone."""
        gone: list[str] = []
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith(PREFIX)]
        except OSError:
            return gone
        for name in names:
            if not owner_alive(name, self.directory):
                try:
                    os.unlink(os.path.join(self.directory, name))
                    gone.append(name)
                except FileNotFoundError:
                    pass
        if gone:
            logger.info("flowreduce: reclaimed %d shared-memory segments of dead workers", len(gone))
        return gone


def _read_only(directory: str) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return True


_POOL: Pool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> Pool:
    """This process's pool, made from the dask config on first use (and again
    after :func:`close`)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.closed:
            c = config()
            _POOL = Pool(c["directory"], c["pool-bytes"], c["idle-seconds"], c["enabled"], c["min-bytes"])
        return _POOL


def current() -> Pool | None:
    """The pool if one was made in this process (housekeeping must not make one)."""
    return _POOL


def close() -> None:
    """Close this process's pool (the worker plugin's teardown)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


def segments(directory: str | None = None) -> list[str]:
    """flowreduce segments present in ``directory`` (any process's): what the
    lifecycle tests list."""
    directory = directory or config()["directory"]
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith(PREFIX))
    except OSError:
        return []
