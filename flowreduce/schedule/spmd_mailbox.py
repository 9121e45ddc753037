"""The worker side of SPMD jobs: values between hosts, and the word that a job failed.

:class:`Mailbox` (:func:`mailbox_of` a worker; :class:`SpmdWorkerPlugin`'s,
a part of flowreduce's worker extension, :mod:`flowreduce.schedule.extension`) keeps, per attempt of a job, the
values other workers' ranks sent to this worker's ranks (stream message
:data:`DELIVER`, worker to worker on one stream per peer: a connection of the
worker's pool handed to the peer's ``handle_stream``) until a rank takes them,
and why the attempt failed, if it did (handler :data:`ABORT` from a peer,
stream message :data:`ABORT` from the scheduler's watch). A rank's thread
queues what it sends on the worker's event loop and waits on a condition
variable; a plan run on the event loop (:meth:`Mailbox.call`) sends with
:meth:`Mailbox.post` and waits with :meth:`Mailbox.take_async`, woken where
the value arrives. Nothing here talks to the scheduler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from flowreduce.dashboard.record import EXTENSION, SPMD_LAST
from flowreduce.errors import AllreduceTimeoutError, refused
from flowreduce.schedule.spmd_log import Log
from flowreduce.shm.host_group import Aborted, sweep

logger = logging.getLogger("flowreduce")

DELIVER = "flowreduce_spmd_deliver"
ABORT = "flowreduce_spmd_abort"
#: Failed attempts remembered (a late message for one is dropped, a late rank fails at once).
KEPT = 1024
#: Ranks whose start time a worker remembers (the newest).
BEGUN = 10_000
#: Messages queued together for one peer go in one write up to this many bytes (a larger one goes alone).
BATCH_BYTES = 64 << 10
#: A numpy array of numbers up to this many bytes (or a list of them, or an int) goes inside the message
#: itself, as msgpack bytes, rather than through Dask's serialisation, whose frames cost a fixed ~40-60 us a
#: message each way. Inline, the bytes are copied twice on each side (into msgpack and out, then into an
#: array of the receiver's own), and a copy over glibc's mmap threshold (128 kB: Dask's nanny sets
#: MALLOC_TRIM_THRESHOLD_, which keeps it there) takes fresh pages each time: on 4 emulated hosts at 1 Gbit/s,
#: 1e4 float64 (80 kB messages) took 3.9 ms inline against 5.5 as frames, but 1e6 in a ring of 8 chunks
#: (250 kB messages) 141 ms inline against 116 as frames (2026-11-28)
INLINE_BYTES = 96 << 10


class Mailbox:
    """One worker's mailboxes, one per attempt of a job with ranks here."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.cond = threading.Condition()
        self.boxes: dict[str, dict[str, Any]] = defaultdict(dict)
        self.users: dict[str, int] = defaultdict(int)  # ranks here using each attempt's box
        self.segments: dict[str, tuple[str, str]] = {}  # run -> (directory, prefix) of its shared memory
        self.failed: OrderedDict[str, str] = OrderedDict()
        self.ended: OrderedDict[str, None] = OrderedDict()
        #: a record of every collective of the ranks here, the newest LOGGED (:mod:`flowreduce.schedule.spmd_log`:
        #: ``comm.events``, :mod:`flowreduce.spmd.events` and ``flowreduce.trace`` read it)
        self.log = Log()
        #: run -> rank -> its communicator, while the rank runs here (the dashboard reads their last event)
        self.ranks: dict[str, dict[int, Any]] = defaultdict(dict)
        #: (run, rank) -> its last event (or None), once the rank ended here (the newest KEPT)
        self.lasts: OrderedDict[tuple[str, int], Any] = OrderedDict()
        #: (run, rank) -> when its communicator opened, raw ``time.time()`` (the newest BEGUN): where
        #: ``flowreduce.trace`` puts the start of the rank's task, which dask shifts by an estimate
        self.begun: OrderedDict[tuple[str, int], float] = OrderedDict()
        #: peer address -> the stream to it (touched on the event loop only)
        self.outboxes: dict[str, _Outbox] = {}
        #: (run, key) -> the future a plan on the event loop waits on for it, what and whose the wait is
        #: and the attempts whose failure ends it (:meth:`take_async`)
        self.waiting: dict[tuple[str, str], tuple[asyncio.Future[Any], str, int, tuple[str, ...]]] = {}

    # -- ranks ------------------------------------------------------------------
    def open(self, run: str, segments: tuple[str, str] | None = None, rank: int | None = None,
             comm: Any = None) -> None:
        """A rank here uses ``run``; ``segments``: the directory and name prefix of its shared memory;
        ``comm``: rank ``rank``'s communicator (whose last event the dashboard asks for, :meth:`last`)."""
        with self.cond:
            self.users[run] += 1
            if segments is not None:
                self.segments[run] = segments
            if comm is not None and rank is not None:
                self.ranks[run][rank] = comm
                self.begun[run, rank] = time.time()
                while len(self.begun) > BEGUN:
                    self.begun.popitem(last=False)

    def close(self, run: str, rank: int | None = None) -> None:
        with self.cond:
            comm = self.ranks.get(run, {}).pop(rank, None) if rank is not None else None
            if comm is not None and rank is not None:  # keep its last event only (not its 10,000)
                self.lasts[run, rank] = comm.last_collective()
                while len(self.lasts) > KEPT:
                    self.lasts.popitem(last=False)
            if run in self.ranks and not self.ranks[run]:
                del self.ranks[run]
            self.users[run] -= 1
            if self.users[run] <= 0:
                self.users.pop(run, None)
                self.segments.pop(run, None)
                self.boxes.pop(run, None)
                self.ended[run] = None
                while len(self.ended) > KEPT:
                    self.ended.popitem(last=False)

    def why(self, run: str) -> str | None:
        """Why ``run`` failed, if some worker said so."""
        return self.failed.get(run)

    def take(self, run: str, key: str, *, deadline: float | None, what: str, rank: int, source: int,
             also: tuple[str, ...] = ()) -> Any:
        """The value sent for ``key``, waiting for it until the deadline or the failure of ``run``
        (or of a run in ``also``: a subgroup's job)."""
        with self.cond:
            while True:
                found, value = self._taken(run, key, what, rank, also)
                if found:
                    return value
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise _late(what, rank, source, key, run)
                self.cond.wait(1.0 if left is None else min(left, 1.0))

    def _taken(self, run: str, key: str, what: str, rank: int, also: tuple[str, ...]) -> tuple[bool, Any]:
        """Under the lock: ``(True, value)`` if the value for ``key`` is here (taken out), ``(False, None)``
        if not yet; raises if ``run`` (or a run in ``also``) failed."""
        box = self.boxes.get(run)
        if box is not None and key in box:
            return True, box.pop(key)
        why = next((self.failed[r] for r in (run, *also) if r in self.failed), None)
        if why is not None:
            raise Aborted(f"{what} on rank {rank}: {why}")
        return False, None

    async def take_async(self, run: str, key: str, *, deadline: float | None, what: str, rank: int, source: int,
                         also: tuple[str, ...] = ()) -> Any:
        """:meth:`take` on the worker's event loop (a plan run there, :meth:`call`): the value is handed
        over by :meth:`_put` where it arrives, with no thread to wake."""
        with self.cond:
            found, value = self._taken(run, key, what, rank, also)
            if found:
                return value
            future = asyncio.get_running_loop().create_future()
            self.waiting[run, key] = (future, what, rank, (run, *also))
        try:
            if deadline is None:
                return await future
            left = deadline - time.monotonic()
            if left > 0:
                return await asyncio.wait_for(future, left)
            raise asyncio.TimeoutError
        except asyncio.TimeoutError:
            raise _late(what, rank, source, key, run) from None
        finally:
            with self.cond:
                if self.waiting.get((run, key), (None,))[0] is future:
                    del self.waiting[run, key]

    def call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coroutine`` on the worker's event loop and wait for its result, from a rank's thread."""
        loop = self.worker.loop.asyncio_loop
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if future.done():  # the coroutine's own TimeoutError (AllreduceTimeoutError is one), not the wait's
                    raise
                if not loop.is_running() or loop.is_closed():
                    future.cancel()
                    raise Aborted("the worker's event loop stopped under a collective") from None

    def post(self, address: str, run: str, key: str, value: Any) -> None:
        """:meth:`send` from a plan run on the worker's event loop: written from there at once, or, from
        the thread such a plan hands a large reduce to, queued as :meth:`send` does."""
        if address == self.worker.address:
            self._put(run, key, value)
        elif _on(self.worker.loop.asyncio_loop):
            self._queue(address, run, key, value)
        else:
            self.send(address, run, key, value)

    def send(self, address: str, run: str, key: str, value: Any) -> None:
        """Deliver ``value`` to the worker at ``address`` (without waiting for it to arrive): queued on
        this worker's stream to that worker, in the order of the calls (:class:`_Outbox`)."""
        if address == self.worker.address:
            self._put(run, key, value)
            return
        self.worker.loop.asyncio_loop.call_soon_threadsafe(self._queue, address, run, key, value)

    def _queue(self, address: str, run: str, key: str, value: Any) -> None:
        """On the event loop: ``value`` onto the stream to ``address`` (opened by the first message)."""
        out = self.outboxes.get(address)
        if out is None or out.dead:
            out = self.outboxes[address] = _Outbox()
            out.task = asyncio.ensure_future(self._write(address, out))
        out.pending.append((run, key, value))
        out.ready.set()

    async def _write(self, address: str, out: _Outbox) -> None:
        """The writer of the stream to ``address``: one connection of the worker's pool, handed to the
        peer's :meth:`~distributed.core.Server.handle_stream`; then the queued messages in order, each
        large one alone (the peer takes it as soon as it is read: a chunk is reduced while the next is on
        the wire), small ones that queued together in one write. A failed connect or write fails the job
        attempts of the messages not known written, and the next message opens a new stream."""
        comm = None
        batch: list[tuple[str, str, Any]] = []
        try:
            comm = out.comm = await self.worker.rpc.connect(address)
            await comm.write({"op": "connection_stream", "reply": False})
            while True:
                while not out.pending:
                    out.ready.clear()
                    await out.ready.wait()
                batch = [out.pending.popleft()]
                size = _nbytes(batch[0][2])
                while out.pending and size < BATCH_BYTES and _nbytes(out.pending[0][2]) + size <= BATCH_BYTES:
                    size += _nbytes(out.pending[0][2])
                    batch.append(out.pending.popleft())
                await self._write_batch(comm, batch)
                batch = []
        except Exception as e:  # the peer is gone: its rank fails the job, or the scheduler says it left
            out.dead = True
            for run, key, _ in [*batch, *out.pending]:
                self.fail(run, f"sending {key} to {address} failed: {e!r}")
            out.pending.clear()
        finally:
            out.dead = True
            if comm is not None:
                comm.abort()
                self.worker.rpc.reuse(address, comm)  # the pool forgets it (closed)

    def tell(self, addresses: Iterable[str], run: str, why: str) -> None:
        """Fail ``run`` here and on ``addresses`` (a rank here raised or timed out)."""
        self.fail(run, why)
        for address in set(addresses) - {self.worker.address}:
            asyncio.run_coroutine_threadsafe(self._tell(address, run, why), self.worker.loop.asyncio_loop)

    async def _tell(self, address: str, run: str, why: str) -> None:
        try:
            await self.worker.rpc(address).flowreduce_spmd_abort(run=run, why=why)
        except Exception as e:  # gone too: the scheduler's watch tells the others
            logger.debug("flowreduce: could not tell %s that %s failed: %r", address, run, e)

    def fail(self, run: str, why: str) -> None:
        with self.cond:
            if run not in self.failed:
                self.failed[run] = why
                while len(self.failed) > KEPT:
                    self.failed.popitem(last=False)
            self.boxes.pop(run, None)
            self.cond.notify_all()
            ended = [k for k, (_, _, _, runs) in self.waiting.items() if run in runs]
            waits = [self.waiting.pop(k) for k in ended]
            # the host groups of the job's ranks here (a subgroup's too): their abort word wakes every rank
            # of the host asleep in a step at once
            hosts = [c.host for comms in self.ranks.values() for c in comms.values()
                     if run in getattr(c, "runs", ()) and getattr(c, "host", None) is not None]
        for future, what, rank, _ in waits:
            _settle(future, error=Aborted(f"{what} on rank {rank}: {why}"))
        for host in hosts:
            host.abort(why)

    def _put(self, run: str, key: str, value: Any) -> None:
        with self.cond:
            if run in self.failed or run in self.ended:
                return
            wait = self.waiting.pop((run, key), None)
            if wait is None:
                self.boxes[run][key] = value
                self.cond.notify_all()
                return
        _settle(wait[0], value)

    # -- handlers -----------------------------------------------------------------
    async def deliver(self, run: Any = None, key: Any = None, value: Any = None, inline: Any = None,
                      **other: Any) -> dict[str, Any]:
        if other or not isinstance(run, str) or not isinstance(key, str):
            return refused(DELIVER, f"not an SPMD message: run {type(run).__name__}, key {type(key).__name__}, "
                                    f"other arguments {sorted(map(str, other))[:10]}")
        try:
            got = _value(value, inline)
        except ValueError as e:
            return refused(DELIVER, str(e))
        self._put(run, key, got)
        return {"status": "OK"}

    async def _write_batch(self, comm: Any, batch: list[tuple[str, str, Any]]) -> None:
        await comm.write([_message(run, key, value) for run, key, value in batch])

    def delivered(self, run: Any = None, key: Any = None, value: Any = None, inline: Any = None,
                  **other: Any) -> None:
        """Stream handler (:data:`DELIVER` on a peer's stream, :meth:`_write`): as :meth:`deliver`; a
        message that is not one is logged and dropped (raising would close the stream)."""
        if other or not isinstance(run, str) or not isinstance(key, str):
            refused(DELIVER, f"not an SPMD message on a stream: run {type(run).__name__}, key {type(key).__name__}")
            return
        try:
            got = _value(value, inline)
        except ValueError as e:  # refused, not raised: raising would close the stream
            refused(DELIVER, str(e))
            return
        self._put(run, key, got)

    def stop(self) -> None:
        """The worker closes: its streams end (their pool closes the connections too)."""
        for out in self.outboxes.values():
            out.dead = True
            if out.task is not None:
                out.task.cancel()
        self.outboxes.clear()

    async def aborted(self, run: Any = None, why: Any = None, **other: Any) -> dict[str, Any]:
        if other or not isinstance(run, str):
            return refused(ABORT, f"not an SPMD abort: run {type(run).__name__}")
        self.fail(run, str(why))
        return {"status": "OK"}

    async def last(self, runs: Any = None, **other: Any) -> list[list[Any]]:
        """Handler (:data:`~flowreduce.dashboard.record.SPMD_LAST`, the dashboard's poll): per rank here of
        the attempts ``runs`` (None: every attempt with a rank running here), ``[run, rank, running,
        collective, seq, nbytes, start, stop]`` of its last collective (``""``, 0, 0, 0.0, 0.0 before its
        first), times the worker's ``time.time()``. Reads what the ranks keep anyway: nothing is sent
        while nobody asks."""
        wanted: set[str] | None = None
        if runs is not None:
            wanted = {r for r in runs if isinstance(r, str)} if isinstance(runs, (list, tuple)) else set()
        out: list[list[Any]] = []
        with self.cond:
            live = [(run, rank, c) for run, ranks in self.ranks.items() for rank, c in ranks.items()]
            ended = [(run, rank, e) for (run, rank), e in self.lasts.items() if wanted is not None and run in wanted]
        for run, rank, c in live:
            if wanted is None or run in wanted:
                out.append(_last_row(run, rank, True, c.last_collective()))
        for run, rank, e in ended:
            out.append(_last_row(run, rank, False, e))
        return out

    def scheduler_says(self, run: Any = None, why: Any = None, **other: Any) -> None:
        if isinstance(run, str):
            self.fail(run, str(why))


class _Outbox:
    """The stream to one peer worker: what is queued for it, and its writer (:meth:`Mailbox._write`)."""

    def __init__(self) -> None:
        self.pending: deque[tuple[str, str, Any]] = deque()
        self.ready = asyncio.Event()
        self.task: asyncio.Future[None] | None = None
        self.comm: Any = None
        self.dead = False


def _late(what: str, rank: int, source: int, key: str, run: str) -> AllreduceTimeoutError:
    return AllreduceTimeoutError(f"{what} on rank {rank} timed out waiting for rank {source} "
                                 f"(message {key} of job attempt {run})")


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread runs ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _settle(future: asyncio.Future[Any], value: Any = None, error: BaseException | None = None) -> None:
    """Set ``future``'s result (or exception), from its event loop or any other thread."""
    def settle() -> None:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    loop = future.get_loop()
    if _on(loop):
        settle()
    else:
        loop.call_soon_threadsafe(settle)


def _message(run: str, key: str, value: Any) -> dict[str, Any]:
    """The :data:`DELIVER` message of ``value``: inline (:func:`_inline`) if it can be, else Dask-serialised."""
    inline = _inline(value)
    if inline is None:
        return {"op": DELIVER, "run": run, "key": key, "value": to_serialize(value)}
    return {"op": DELIVER, "run": run, "key": key, "inline": inline}


def _inline_array(a: Any) -> list[Any] | None:
    if (type(a) is not np.ndarray or a.dtype.kind not in "biufc" or a.dtype.fields is not None
            or not a.flags.c_contiguous):
        return None
    return [a.dtype.str, list(a.shape), a.data.cast("B") if a.nbytes else b""]


def _inline(value: Any) -> list[Any] | None:
    """``value`` as msgpack can write it (``["a", dtype, shape, bytes]``, ``["l", [array, ...]]``,
    ``["i", int]``), or None: it is not a numpy array of numbers (C-contiguous) of at most
    :data:`INLINE_BYTES`, nor a list of such arrays of at most that many bytes in all, nor an int of 64 bits."""
    if type(value) is np.ndarray:
        if value.nbytes > INLINE_BYTES:
            return None
        a = _inline_array(value)
        return None if a is None else ["a", *a]
    if type(value) is list and all(type(v) is np.ndarray for v in value):
        if sum(v.nbytes for v in value) > INLINE_BYTES:
            return None
        parts = [_inline_array(v) for v in value]
        return None if any(p is None for p in parts) else ["l", parts]
    if type(value) is int and -(1 << 63) <= value < (1 << 63):
        return ["i", value]
    return None


def _array_of(dtype: Any, shape: Any, data: Any) -> np.ndarray:
    """An array of :func:`_inline_array`'s (its own, writable, as Dask's deserialisation gives)."""
    kind = np.dtype(dtype)
    if kind.kind not in "biufc":
        raise TypeError(f"dtype {dtype!r}")
    return np.frombuffer(data, kind).reshape([int(d) for d in shape]).copy()


def _value(value: Any, inline: Any) -> Any:
    """A :data:`DELIVER` message's value: ``value`` (Dask's), or the one ``inline`` carries (ValueError, naming
    the problem, if ``inline`` is not one of :func:`_inline`'s, whatever decoding it raised)."""
    if inline is None:
        return value
    try:
        return _from_inline(inline)
    except Exception as e:
        raise ValueError(f"an SPMD message's inline value is not one: {e}") from e


def _from_inline(inline: Any) -> Any:
    """The value of :func:`_inline`'s ``inline``."""
    tag = inline[0]
    if tag == "a":
        return _array_of(*inline[1:])
    if tag == "l":
        return [_array_of(*a) for a in inline[1]]
    if tag == "i":
        return int(inline[1])
    raise ValueError(f"unknown inline kind {tag!r}")


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 64))


def _last_row(run: str, rank: int, running: bool, last: tuple[str, Any] | None) -> list[Any]:
    """``last``: a communicator's :meth:`~flowreduce.spmd.comm.Communicator.last_collective`."""
    if last is None:
        return [run, rank, running, "", 0, 0, 0.0, 0.0]
    name, e = last
    return [run, rank, running, name, e.seq, e.nbytes, e.start, e.stop]


class SpmdWorkerPlugin(WorkerPlugin):
    """The SPMD jobs' part of flowreduce's worker extension: a :class:`Mailbox` on every worker."""

    mailbox: Mailbox | None = None

    def setup(self, worker: Any) -> None:
        self.mailbox = Mailbox(worker)

    def handlers(self) -> dict[str, Callable[..., Any]]:
        box = self.mailbox
        assert box is not None  # set up
        return {DELIVER: box.deliver, ABORT: box.aborted, SPMD_LAST: box.last}

    def stream_handlers(self) -> dict[str, Callable[..., Any]]:
        box = self.mailbox
        assert box is not None  # set up
        return {ABORT: box.scheduler_says, DELIVER: box.delivered}

    def teardown(self, worker: Any) -> None:
        box = self.mailbox
        if box is not None:  # the worker closes under running ranks: their jobs' segments go with it
            box.stop()
            for directory, prefix in list(box.segments.values()):
                sweep(directory, prefix)


def mailbox_of(worker: Any) -> Mailbox | None:
    """The worker's mailbox (None before the extension is installed there)."""
    return getattr(getattr(worker.plugins.get(EXTENSION), "spmd", None), "mailbox", None)
