"""Read peers' inputs from their workers inside a task: the reads of the
one-level ``direct`` collective (:mod:`flowreduce.build.direct`).

A task that depends only on its own rank's input asks each peer's worker for
the peer's input itself, with the call Dask's own dependency fetch uses
(``distributed.worker.get_data_from_worker``), all peers at once, one
request per worker. A worker that is busy serving others says so, and is
asked again (as Dask does). A worker that no longer holds the input, or is
gone, is replaced by a holder the scheduler names; when none holds it any
more and it is not being recomputed (it failed, was forgotten, or nothing
happens for :data:`LOST_INPUT_PATIENCE` s) the task fails with
:class:`~flowreduce.errors.WorkerLostError` naming the rank and the key.
The reading task is a coroutine, run on its worker's event loop, where the
reads go (no hand-off to a thread and back, which costs milliseconds on
shared cores). While it waits for a recomputation it leaves the worker's
slot, as :func:`distributed.secede` does for a task in a thread: the
recomputation may need that slot.

A peer worker holding several of the ranks (64 ranks on 4 workers) is
asked instead to reduce them itself, in rank order, and to send one array
and what each rank holds (:class:`~flowreduce.build.direct.Partial`): the
handler :data:`HANDLER`, which :class:`PeerHandlersPlugin` gives every worker.
Anything that keeps it from answering (an input it no longer holds, inputs
it cannot reduce, no handler) makes the reader read those ranks' values
instead, as above.

Peers on the reader's host do not send at all (:func:`reading`): for
inputs of at least ``flowreduce.shm.min-bytes`` the reader leases a
segment with a slot per such peer worker, and each peer writes its input
(or its ranks' sum) into its slot (:data:`WRITE_HANDLER`): one copy, no
socket, no pickling. The segment goes back to the reader's pool when its
sum is done, or is unlinked if the task fails (a peer may still be writing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import weakref
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any, cast

import numpy as np
from dask.typing import Key
from distributed.diagnostics.plugin import WorkerPlugin

from flowreduce.build.direct import Partial
from flowreduce.errors import WorkerLostError
from flowreduce.keys import parse as parse_key
from flowreduce.ops import Op

logger = logging.getLogger("flowreduce")

#: Scheduler states of an input being (re)computed: a reader waits for it.
COMPUTING = frozenset({"waiting", "queued", "processing"})
#: Seconds a read waits for a lost input in any other state (released, no-worker)
#: to be recomputed or failed by the guard, before the task fails on its own.
LOST_INPUT_PATIENCE = 10.0
#: Seconds to connect to a peer before asking the scheduler again who holds
#: its input (a worker that died is still listed until the scheduler notices).
CONNECT_SECONDS = 2.0
#: The worker handler reducing the ranks a worker holds for a reader (:func:`reduce_held`).
HANDLER = "flowreduce_reduce_held"
#: The worker handler writing the ranks a worker holds into a reader's segment (:func:`write_held`).
WRITE_HANDLER = "flowreduce_write_held"


async def read_peers(peers: Sequence[tuple[int, str, Hashable]], op: Op | None = None, key: Hashable = None
                     ) -> tuple[dict[int, Any], dict[int, Partial]]:
    """``({rank: value}, {first rank: Partial})`` of the peers ``(rank,
    worker, key)``, the ranks of a worker holding several of them reduced
    there with ``op`` (when given) into one :class:`Partial`. Runs in a task
    on its worker's event loop; ``key``, the task's, lets the task leave its
    slot while it waits for an input Dask recomputes."""
    from distributed import get_worker

    worker = get_worker()
    by_worker: dict[str, dict[Hashable, list[int]]] = {}
    for r, w, k in peers:
        by_worker.setdefault(w, {}).setdefault(k, []).append(r)
    several = {w: ks for w, ks in by_worker.items() if sum(map(len, ks.values())) > 1} if op is not None else {}
    singles = {w: ks for w, ks in by_worker.items() if w not in several}

    async def read_values(groups: dict[str, dict[Hashable, list[int]]]) -> list[dict[Hashable, Any]]:
        async def read_all(patient: bool) -> list[dict[Hashable, Any]]:
            return await asyncio.gather(*(_read(worker, w, ks, patient) for w, ks in groups.items()))

        try:
            return await read_all(False)
        except _Absent:  # an input no worker holds now: wait for Dask to recompute it
            _leave_slot(worker, key)  # the recomputation may need this worker's slot (all readers waiting: a deadlock)
            return await read_all(True)

    # the sums asked of peers holding several ranks and the other peers' values, at once
    replies, values = await asyncio.gather(_reduce_at_peers(worker, several, cast(Op, op)), read_values(singles))
    partials = {min(r for rs in several[w].values() for r in rs): part for w, part in replies.items()
                if part is not None}
    unreduced = {w: several[w] for w, part in replies.items() if part is None}  # read value by value instead
    read = [*zip(singles.values(), values), *zip(unreduced.values(), await read_values(unreduced) if unreduced else [])]
    out: dict[int, Any] = {}
    for ks, got in read:
        for k, rs in ks.items():
            for r in rs:
                out[r] = got[k]
    return out, partials


def _leave_slot(worker: Any, key: Hashable) -> None:
    """What :func:`distributed.secede` does for a task in a thread, for the
    task ``key`` running on the event loop: it stops counting against the
    worker's threads (long-running), so another task can run meanwhile."""
    if key is None:
        return
    from distributed.metrics import time
    from distributed.worker_state_machine import SecedeEvent

    ts = worker.state.tasks.get(key)
    started = getattr(ts, "start_time", None)  # the time so far counts as the task's compute time, as secede's does
    worker.handle_stimulus(SecedeEvent(key=cast(Key, key), compute_duration=time() - started if started else 0.0,
                                       stimulus_id=f"flowreduce-read-wait-{time()}"))


async def _reduce_at_peers(worker: Any, several: dict[str, dict[Hashable, list[int]]], op: Op
                           ) -> dict[str, Partial | None]:
    """Ask each worker of ``several`` to reduce the ranks it holds (its keys
    in rank order); None for a worker that did not."""
    from distributed.protocol import pickle

    if not several:
        return {}
    blob = pickle.dumps(op)

    async def ask(address: str, wanted: dict[Hashable, list[int]]) -> Partial | None:
        order = sorted((r, k) for k, rs in wanted.items() for r in rs)
        try:
            await _connect_briefly(worker, address)
            reply = await getattr(worker.rpc(address), HANDLER)(keys=[k for _, k in order], reduce_with=blob)
        except Exception as e:  # gone, or no handler: read the values instead
            logger.debug("flowreduce: %s did not sum its ranks (%r); reading their values", address, e)
            return None
        if not isinstance(reply, dict) or reply.get("status") != "OK":
            logger.debug("flowreduce: %s did not sum its ranks (%r); reading their values", address, reply)
            return None
        return Partial(reply["value"], tuple(reply["metas"]))

    replies = await asyncio.gather(*(ask(w, ks) for w, ks in several.items()))
    return dict(zip(several, replies))


async def reduce_held(worker: Any, keys: Sequence[Hashable], reduce_with: bytes) -> dict[str, Any]:
    """The handler: the values of ``keys`` held here (in the reader's rank
    order, a key once per rank) reduced in that order, with what each is.
    ``{"status": "missing"}`` when one is not held here, ``"unreduced"``
    when they cannot be reduced together (the reader's check names why)."""
    from distributed.protocol import pickle
    from distributed.protocol.serialize import to_serialize

    from flowreduce.build.direct import accumulate, off_loop_if_large
    from flowreduce.schedule.inputs import meta_of

    try:
        values = [worker.data[k] for k in keys]
    except KeyError:
        return {"status": "missing"}
    metas = [meta_of(v) for v in values]
    if len(set(metas)) > 1 or not all(isinstance(v, np.ndarray) for v in values):
        return {"status": "unreduced"}
    how: Op = pickle.loads(reduce_with)  # the op, pickled: a message's own "op" names the handler
    try:
        value = await off_loop_if_large(sum(v.nbytes for v in values), accumulate, how, values)
    except Exception:
        return {"status": "unreduced"}
    return {"status": "OK", "value": to_serialize(value), "metas": to_serialize(metas)}


async def write_held(worker: Any, keys: Sequence[Hashable], reduce_with: bytes | None, segment: str, size: int,
                     offset: int, capacity: int, reader: str = "") -> dict[str, Any]:
    """The handler a reader on this host calls: the value of the one key,
    or the values of ``keys`` reduced in that order (``reduce_with``, the
    op pickled), written at ``offset`` of the reader's segment ``segment``,
    one copy and no serialisation. Replies what was written and what each
    key holds; ``{"status": "missing"}`` / ``"unfit"`` when a key is not
    held here, or the value is not a numpy array that fits ``capacity``
    bytes, or the segment cannot be mapped: the reader reads those over
    Dask's comm instead."""
    import time

    from distributed.protocol import pickle
    from distributed.protocol.serialize import to_serialize

    from flowreduce.build import shm_kernels, shm_pool
    from flowreduce.build.direct import accumulate, off_loop_if_large
    from flowreduce.schedule.inputs import meta_of

    try:
        values = [worker.data[k] for k in keys]
    except KeyError:
        return {"status": "missing"}
    if not values or not all(isinstance(v, np.ndarray) and not v.dtype.hasobject for v in values):
        return {"status": "unfit"}
    metas = [meta_of(v) for v in values]
    if reduce_with is None and len(values) == 1:
        value = values[0]
    elif reduce_with is not None and len(set(metas)) == 1:
        try:
            value = await off_loop_if_large(sum(v.nbytes for v in values), accumulate, pickle.loads(reduce_with),
                                            values)
        except Exception:
            return {"status": "unfit"}
    else:
        return {"status": "unfit"}
    if value.nbytes > capacity:
        return {"status": "unfit"}
    try:
        seg = shm_pool.pool().attach(segment, size, writable=True)
    except (RuntimeError, OSError, ValueError) as e:  # gone, or not on this host after all
        logger.debug("flowreduce: cannot write into %s (%r); the reader reads over Dask's comm", segment, e)
        return {"status": "unfit"}
    t0 = time.time()
    dest = seg.view(value.dtype, value.size, offset).reshape(value.shape)
    await off_loop_if_large(value.nbytes, np.copyto, dest, value)
    shm_kernels.log_copy("peer-write", reader, shm_kernels.owner_pid(segment), value.nbytes, t0)
    return {"status": "OK", "dtype": value.dtype.str, "shape": value.shape, "metas": to_serialize(metas)}


#: Bytes between the slots peers write into a reader's segment (cache lines apart).
SLOT_ALIGN = 64


@contextlib.asynccontextmanager
async def reading(peers: Sequence[tuple[int, str, Hashable]], op: Op | None = None, key: Hashable = None,
                  like: Any = None, *, domains: Sequence[tuple[str, Any]] = (), nbytes: int = 0
                  ) -> AsyncIterator[tuple[dict[int, Any], dict[int, Partial]]]:
    """:func:`read_peers` as a context: the peers' values (and partials)
    while the block runs. Peer workers sharing this worker's memory domain
    (``domains``: ``(worker, domain)`` pairs, given by the client, which
    decided from the inputs' size: :func:`flowreduce.schedule.transport.direct_reads`)
    write them into a segment this worker leases for the block (one copy
    each, no serialisation, no socket), given back when the block ends; the
    rest, and anything such a peer cannot write, are read over Dask's comm.
    A slot holds ``nbytes`` (one rank's input), or, for a peer holding
    several ranks, their sum in the op's accumulating dtype (``like``: this
    worker's own input, whose dtype the ranks share). Values written here
    are read-only views of the segment."""
    from distributed import get_worker
    from distributed.protocol import pickle

    from flowreduce.build import shm_pool

    worker = get_worker()
    where = dict(domains)
    own = where.get(worker.address)
    near = sorted({w for _, w, _ in peers if own is not None and w != worker.address and where.get(w) == own})
    ranks_of = {w: sorted((r, k) for r, pw, k in peers if pw == w) for w in near}
    widen = 1
    if op is not None and isinstance(like, np.ndarray) and like.dtype.itemsize:
        widen = max(1, np.dtype(op.accumulator(like.dtype) or like.dtype).itemsize // like.dtype.itemsize)
    slots = [-(-nbytes * (widen if len(ranks_of[w]) > 1 else 1) // SLOT_ALIGN) * SLOT_ALIGN for w in near]
    offsets = [sum(slots[:i]) for i in range(len(slots))]
    pool = shm_pool.pool() if near and nbytes else None
    seg = None
    if pool is not None:
        try:
            seg = pool.lease(sum(slots), owner=(parse_key(key) or {}).get("token", ""))
        except shm_pool.Unavailable:  # logged once by the pool
            seg = None
    if seg is None:
        yield await read_peers(peers, op, key)
        return
    generation = seg.generation  # this lease's: giving back or unlinking must not touch a later one
    clean = True
    try:
        got: dict[int, Any] = {}
        partials: dict[int, Partial] = {}

        async def write(i: int, w: str) -> bool:
            nonlocal clean
            order = ranks_of[w]
            several = len(order) > 1
            if several and op is None:
                return False
            try:
                await _connect_briefly(worker, w)
                reply = await getattr(worker.rpc(w), WRITE_HANDLER)(
                    keys=[k for _, k in order], reduce_with=pickle.dumps(op) if several else None,
                    segment=seg.name, size=seg.size, offset=offsets[i], capacity=slots[i], reader=repr(key))
            except Exception as e:  # gone, or no handler; a write may still be under way: never reuse the segment
                clean = False
                logger.debug("flowreduce: %s did not write into %s (%r); reading over Dask's comm", w, seg.name, e)
                return False
            if not isinstance(reply, dict) or reply.get("status") != "OK":
                return False
            count = math.prod(reply["shape"])
            value = seg.view(np.dtype(reply["dtype"]), count, offsets[i]).reshape(reply["shape"])
            value.flags.writeable = False  # the segment goes back to the pool: nothing may keep it as its own
            if several:
                partials[order[0][0]] = Partial(value, tuple(reply["metas"]))
            else:
                got[order[0][0]] = value
            return True

        far = [p for p in peers if p[1] not in near]
        written, (far_got, far_partials) = await asyncio.gather(
            asyncio.gather(*(write(i, w) for i, w in enumerate(near))), read_peers(far, op, key))
        unwritten = [p for p in peers if p[1] in {w for w, ok in zip(near, written) if not ok}]
        if unwritten:
            more, more_partials = await read_peers(unwritten, op, key)
            far_got, far_partials = {**far_got, **more}, {**far_partials, **more_partials}
        yield {**got, **far_got}, {**partials, **far_partials}
    except BaseException:
        clean = False
        raise
    finally:
        if clean:
            pool.give_back(seg, generation)  # type: ignore[union-attr]
        else:
            pool.discard(seg, generation)  # type: ignore[union-attr]


class PeerHandlersPlugin(WorkerPlugin):
    """Gives a worker the handlers its reading peers call: :data:`HANDLER`
    (reduce the ranks held here and send them) and :data:`WRITE_HANDLER`
    (write them into the reader's segment)."""

    name = "flowreduce-peer-handlers"
    idempotent = True

    def setup(self, worker: Any) -> None:
        async def reduce_handler(keys: Sequence[Hashable], reduce_with: bytes) -> dict[str, Any]:
            return await reduce_held(worker, keys, reduce_with)

        async def write_handler(keys: Sequence[Hashable], reduce_with: bytes | None, segment: str, size: int,
                                offset: int, capacity: int, reader: str = "") -> dict[str, Any]:
            return await write_held(worker, keys, reduce_with, segment, size, offset, capacity, reader)

        worker.handlers[HANDLER] = reduce_handler
        worker.handlers[WRITE_HANDLER] = write_handler

    def teardown(self, worker: Any) -> None:
        worker.handlers.pop(HANDLER, None)
        worker.handlers.pop(WRITE_HANDLER, None)


_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ensure_peer_handlers(client: Any) -> None:
    """Install :class:`PeerHandlersPlugin` once per client (on every worker,
    present and future). If that fails, readers read values over Dask's comm instead."""
    if client not in _installed:
        try:
            client.register_plugin(PeerHandlersPlugin())
        except Exception as e:
            logger.warning("flowreduce: could not install the peer-read handlers on the workers (%r); peers "
                           "will be read value by value over Dask's comm", e)
            return
        _installed[client] = True


async def _connect_briefly(worker: Any, address: str) -> None:
    """Connect to ``address`` within :data:`CONNECT_SECONDS` (OSError past
    it) and put the connection back in the pool for the request that
    follows: a dead worker's address would otherwise take Dask's whole
    connect timeout (30 s) to fail."""
    worker.rpc.reuse(address, await worker.rpc.connect(address, timeout=CONNECT_SECONDS))


class _Absent(Exception):
    """No worker holds an input now (the first, impatient read gives up at once)."""


async def _read(worker: Any, address: str, wanted: dict[Hashable, list[int]], patient: bool) -> dict[Hashable, Any]:
    """The values of the ``wanted`` keys (key -> ranks), asked of ``address``
    first; an input nobody holds raises :class:`_Absent` unless ``patient``."""
    from distributed.metrics import monotonic
    from distributed.worker import get_data_from_worker

    got: dict[Hashable, Any] = {}
    where = {k: address for k in wanted}
    pause, lost_since = 0.001, None
    while True:
        asked: dict[str, list[Key]] = {}
        for k in wanted:
            if k not in got:
                asked.setdefault(where[k], []).append(cast(Key, k))
        busy: set[Hashable] = set()
        for w, ks in asked.items():
            try:
                await _connect_briefly(worker, w)
                reply = await get_data_from_worker(worker.rpc, ks, w, who=worker.address)
            except OSError:  # the worker is gone (CommClosedError is an OSError): ask who else holds it
                continue
            if reply["status"] == "busy":  # it serves too many transfers: ask again shortly
                busy.update(ks)
                continue
            got.update((k, v) for k, v in reply["data"].items() if k in wanted)
        absent = [k for k in wanted if k not in got]
        if not absent:
            return got
        if busy.issuperset(absent):
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)
            continue
        holders = await worker.scheduler.who_has(keys=absent)
        for k in absent:
            if holders.get(k):
                where[k] = holders[k][0]
        if any(holders.get(k) for k in absent):
            lost_since = None
        elif not patient:
            raise _Absent()
        else:
            states = await worker.scheduler.get_task_status(keys=absent)
            lost_since = monotonic() if lost_since is None else lost_since
            gone = [k for k in absent if states.get(k) in (None, "erred", "forgotten")]
            stuck = [k for k in absent if states.get(k) not in COMPUTING]
            if gone or (stuck and monotonic() - lost_since > LOST_INPUT_PATIENCE):
                k = (gone or stuck)[0]
                raise WorkerLostError(
                    f"input of rank {', '.join(map(str, wanted[k]))} (key {k!r}) was on worker {address}, and "
                    f"no worker holds it any more (its worker left the cluster, or it was released); this "
                    "all-reduce cannot read it. Recompute it and call allreduce again.")
        await asyncio.sleep(0.01)
