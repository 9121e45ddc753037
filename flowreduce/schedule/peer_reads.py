"""Read peers' inputs from their workers inside a task: the reads of the
one-level ``direct`` collective (:mod:`flowreduce.lower.direct`).

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
and what each rank holds (:class:`~flowreduce.lower.direct.Partial`): the
handler :data:`HANDLER`, which :class:`PeerHandlersPlugin` (a part of the worker extension) gives every worker.
Anything that keeps it from answering (an input it no longer holds, inputs
it cannot reduce, no handler) makes the reader read those ranks' values
instead, as above.

Peers on the reader's host do not send at all (:func:`reading`): every
task of the call on that host posts its ranks' value in shared memory, and
reads its peers' posts where they lie (:mod:`flowreduce.shm.posts`):
no request, no socket, no pickling, whatever the size. A post stays up
until every reader has acknowledged it, then its segment goes back to the
poster's pool; a task that fails or is cancelled unlinks its post instead
(a reader may still be reading it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from functools import partial
from typing import Any, cast

import numpy as np
from dask.typing import Key
from distributed import Reschedule
from distributed.diagnostics.plugin import WorkerPlugin

from flowreduce.errors import WorkerLostError, refused
from flowreduce.keys import parse as parse_key
from flowreduce.lower.direct import Partial
from flowreduce.ops import Op, resolve_op
from flowreduce.shm import posts as shm_posts

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
            leave_slot(worker, key)  # the recomputation may need this worker's slot (all readers waiting: a deadlock)
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


def leave_slot(worker: Any, key: Hashable) -> None:
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
    if not several:
        return {}
    name = named_op(op)
    if name is None:  # a callable of the user's: peers take reductions by name only, so read the values
        return dict.fromkeys(several)

    async def ask(address: str, wanted: dict[Hashable, list[int]]) -> Partial | None:
        order = sorted((r, k) for k, rs in wanted.items() for r in rs)
        try:
            await _connect_briefly(worker, address)
            reply = await getattr(worker.rpc(address), HANDLER)(keys=[k for _, k in order], reduce_with=name)
        except Exception as e:  # gone, or no handler: read the values instead
            logger.debug("flowreduce: %s did not sum its ranks (%r); reading their values", address, e)
            return None
        if not isinstance(reply, dict) or reply.get("status") != "OK":
            logger.debug("flowreduce: %s did not sum its ranks (%r); reading their values", address, reply)
            return None
        return Partial(reply["value"], tuple(reply["metas"]))

    replies = await asyncio.gather(*(ask(w, ks) for w, ks in several.items()))
    return dict(zip(several, replies))


def named_op(op: Op) -> str | None:
    """The name :func:`flowreduce.ops.resolve_op` gives ``op`` back by (a named
    op or a numpy ufunc), or None: a callable is never sent to a peer."""
    try:
        return op.name if resolve_op(op.name) == op else None
    except ValueError:
        return None


#: Most keys one :data:`HANDLER` request may name (ranks on one worker).
MAX_HELD_KEYS = 1 << 16


async def reduce_held(worker: Any, keys: Any, reduce_with: Any) -> dict[str, Any]:
    """The handler: the values of ``keys`` held here (in the reader's rank
    order, a key once per rank) reduced in that order with the op named
    ``reduce_with`` (:func:`named_op`), with what each is.
    ``{"status": "unreduced"}`` when they cannot be reduced together (the
    reader's check names why); ``{"status": "missing"}`` when a key is not
    held here (released or moved since the reader asked: not an error);
    ``{"status": "error", "message": ...}``,
    logged, for a request that is not one flowreduce sends: keys that are
    not a list of keys held here, or an op that is not a name of
    :mod:`flowreduce.ops` (never a pickled callable: any process that
    reaches the worker could run one). Any status but ``"OK"`` makes the
    reader read the values instead."""
    from dask.core import iskey
    from distributed.protocol.serialize import to_serialize

    from flowreduce.lower.direct import accumulate, off_loop_if_large
    from flowreduce.schedule.inputs import meta_of

    if not isinstance(keys, (list, tuple)) or not 0 < len(keys) <= MAX_HELD_KEYS:
        return refused(HANDLER, f"keys must be a list of 1 to {MAX_HELD_KEYS} keys, got {type(keys).__name__}"
                        + (f" of {len(keys)}" if isinstance(keys, (list, tuple)) else ""))
    if not all(iskey(k) for k in keys):
        return refused(HANDLER, f"keys must be Dask keys, got {next(k for k in keys if not iskey(k))!r}"[:300])
    if not isinstance(reduce_with, str) or len(reduce_with) > 64:
        return refused(HANDLER, f"reduce_with must be the name of an op, got {type(reduce_with).__name__}"
                        + (" (a pickled reduction is not accepted)" if isinstance(reduce_with, bytes) else ""))
    try:
        how = resolve_op(reduce_with)
    except ValueError:
        return refused(HANDLER, f"unknown op {reduce_with!r}")
    absent = [k for k in keys if k not in worker.data]
    if absent:  # released or moved since the reader asked (a harmless race: not logged as an error), or never here
        why = f"{len(absent)} of the {len(keys)} keys are not held here, e.g. {absent[0]!r}"[:300]
        logger.debug("flowreduce: %s: %s", HANDLER, why)
        return {"status": "missing", "message": why}
    values = [worker.data[k] for k in keys]
    metas = [meta_of(v) for v in values]
    if len(set(metas)) > 1 or not all(type(v) is np.ndarray and not v.dtype.hasobject for v in values):
        return {"status": "unreduced"}
    try:
        value = await off_loop_if_large(sum(v.nbytes for v in values), accumulate, how, values)
    except Exception:
        return {"status": "unreduced"}
    return {"status": "OK", "value": to_serialize(value), "metas": to_serialize(metas)}


#: Seconds a reader waits for a peer's post before reading that peer over
#: Dask's comm instead: the peer's task has not started (its worker runs
#: another task, or the peer's input is still being computed).
POST_WAIT = 0.1
#: Seconds of waiting for posts after which the task leaves its worker's
#: slot, so that the worker can run a task of another call that a peer of
#: that call waits for (two calls on the same workers, started in different
#: orders, would otherwise wait out :data:`POST_WAIT` for each other).
POST_PATIENCE = 0.01
#: Seconds a post stays up for readers that have not acknowledged it; then
#: it is taken down and its segment unlinked, not reused. A reader that read
#: a peer over Dask's comm acknowledges its post if it comes up within this.
ACK_SECONDS = 10.0
#: Seconds an ``unfit`` post stays up after its task, for peers that start later.
UNFIT_SECONDS = 2 * POST_WAIT
#: Background work of posts: withdrawals and late acknowledgements (referenced until done).
_BACKGROUND: set[asyncio.Task] = set()


@contextlib.asynccontextmanager
async def reading(peers: Sequence[tuple[int, str, Hashable]], op: Op | None = None, key: Hashable = None,
                  local: dict[int, Any] | None = None, *, domains: Sequence[tuple[str, Any]] = ()
                  ) -> AsyncIterator[tuple[dict[int, Any], dict[int, Partial]]]:
    """:func:`read_peers` as a context: the peers' values (and partials)
    while the block runs. Groups of ranks whose workers share this worker's
    memory domain (``domains``: ``(worker, domain)`` pairs of the call's
    workers as placed, given by the client: :class:`flowreduce.schedule.routes.DirectReads`)
    post their ranks' values (``local``: this task's, ``{rank: value}``) in
    shared memory, one value per group (its ranks' sum in the op's
    accumulating dtype when it has several: a :class:`Partial`), and read
    each other's posts in place (:mod:`flowreduce.shm.posts`): no
    message, no socket, no pickling. A peer whose post does not come within
    :data:`POST_WAIT`, peers on other hosts, and anything that cannot be
    posted are read over Dask's comm. Posted values are read-only views,
    valid inside the block; this task's own post stays up until its
    readers have acknowledged it.

    Posts and acknowledgement slots belong to groups, named by their first
    rank, not to workers: a task that recovery moved to another worker of
    the host posts and reads as its group did."""
    from distributed import get_worker

    from flowreduce.shm import pool as shm_pool

    worker = get_worker()
    where = dict(domains)
    own = where.get(worker.address)
    token = (parse_key(key) or {}).get("token", "")
    groups: dict[str, list[int]] = {}
    for r, w, _ in peers:
        groups.setdefault(w, []).append(r)
    near = {w: min(rs) for w, rs in groups.items() if own is not None and where.get(w) == own}  # worker: first rank
    pool = shm_pool.pool() if near and local and token else None
    if pool is None or not pool.available:
        yield await read_peers(peers, op, key)
        return
    assert local is not None
    mine_first = min(local)
    slots = sorted([mine_first, *near.values()])
    slot = slots.index(mine_first)
    found: dict[str, shm_posts.Found] = {}
    done: set[str] = set()  # posts acknowledged
    mine: shm_posts.Post | None = None
    clean = False
    try:
        mine = await _post_own(pool, token, local, op, repr(key), slots=len(slots),
                               readers=[slots.index(r) for r in near.values()])
        found = await _collect(worker, pool, token, near, key)
        rest = [p for p in peers if p[1] not in found]
        got, partials = await read_peers(rest, op, key) if rest else ({}, {})
        for w, f in found.items():
            if f.metas is None:
                got[near[w]] = f.value
            else:
                partials[near[w]] = Partial(f.value, f.metas)
        if mine.value is not None and mine.metas is not None:  # this group's ranks, already summed for the peers
            partials[mine_first] = Partial(mine.value, mine.metas)
        began = time.time()
        yield got, partials
        _log_reads(found, repr(key), began)
        try:
            for w, f in found.items():
                f.acknowledge(slot)
                done.add(w)
        except shm_posts.Overwritten:
            # the poster posted again for the call's next attempt (a worker was lost) while this task of the
            # attempt before read it: what it read may mix both, and the task runs again as the new attempt's
            raise Reschedule() from None
        clean = True
    finally:
        try:
            for w, f in found.items():  # done with what was read, whatever happened
                if w not in done:
                    f.acknowledge(slot, check=False)
            unread = [r for w, r in near.items() if w not in found]
            if unread:  # read over Dask's comm: a post that comes up later need not wait for this reader
                _background(_acknowledge_late(pool, token, unread, slot))
        finally:
            if mine is not None:
                _withdraw(pool, mine, clean)


def _background(work: Any) -> None:
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def _acknowledge_late(pool: Any, token: str, ranks: Sequence[int], slot: int) -> None:
    """Acknowledge the posts of the groups ``ranks`` (first ranks) as they
    come up, for :data:`ACK_SECONDS`: this reader read them over Dask's comm."""
    loop = asyncio.get_running_loop()
    deadline, pause, pending = loop.time() + ACK_SECONDS, 0.001, set(ranks)
    while pending and loop.time() < deadline:
        for r in list(pending):
            try:
                late = shm_posts.find(pool, token, r)
            except Exception:  # not a post of ours after all
                late = shm_posts.UNFIT
            if isinstance(late, shm_posts.Found):
                late.acknowledge(slot, check=False)
            if late is not None:
                pending.discard(r)
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.1)


async def _post_own(pool: Any, token: str, local: dict[int, Any], op: Op | None, key: str, *, slots: int,
                    readers: Sequence[int]) -> shm_posts.Post:
    """Post this group's value (one rank: its input; several: their sum, in
    rank order, with what each held), or :data:`~flowreduce.shm.posts.UNFIT`
    when it cannot be (the readers then ask for the values over Dask's comm:
    anything but a plain numpy array of numbers, ranks that disagree, or
    several ranks and an op that is not a ufunc, whose sum its peers must
    see as :func:`reduce_held` makes it)."""
    from flowreduce.kernels import shm as shm_kernels
    from flowreduce.lower.direct import OFF_LOOP_BYTES
    from flowreduce.schedule.inputs import meta_of

    ranks = sorted(local)
    values = [local[r] for r in ranks]
    link = shm_posts.name(token, ranks[0])
    metas = tuple(meta_of(v) for v in values) if len(values) > 1 else None
    plain = all(type(v) is np.ndarray and not v.dtype.hasobject and v.dtype.fields is None for v in values)
    if not plain or (metas is not None and (op is None or not op.in_place or len(set(metas)) > 1)):
        return shm_posts.unfit(pool, link)
    first = values[0]
    if metas is None:
        dtype, fill = first.dtype, partial(_copy_into, first)
    else:
        how = cast(Op, op)
        dtype, fill = np.dtype(how.accumulator(first.dtype) or first.dtype), partial(_sum_into, how, values)
    t0 = time.time()
    job = partial(shm_posts.post, pool, link, dtype, first.shape, metas, fill, slots=slots, readers=readers)
    try:
        if sum(v.nbytes for v in values) <= OFF_LOOP_BYTES:
            mine = job()
        else:  # in a thread, which goes on if the task is cancelled meanwhile: then it takes its post down
            done = asyncio.get_running_loop().run_in_executor(None, job)
            try:
                mine = await asyncio.shield(done)
            except asyncio.CancelledError:
                done.add_done_callback(partial(_withdraw_late, pool))
                raise
    except Exception as e:  # the op failed on these ranks, or no link can be made: read over Dask's comm
        logger.debug("flowreduce: cannot post %s (%r); peers read it over Dask's comm", link, e)
        return shm_posts.unfit(pool, link)
    if mine.value is not None:
        shm_kernels.log_copy("write", key, os.getpid(), mine.value.nbytes, t0)
    return mine


def _withdraw_late(pool: Any, done: asyncio.Future) -> None:
    """A post its task no longer waited for (cancelled): taken down, its segment unlinked."""
    if not done.cancelled() and done.exception() is None:
        done.result().withdraw(pool, reuse=False)


def _copy_into(value: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, value)


def _sum_into(op: Op, values: Sequence[np.ndarray], out: np.ndarray) -> None:
    op.fold(values, out)  # the bits of lower.direct.accumulate: the first cast to ``out``'s dtype, then the rest


async def _collect(worker: Any, pool: Any, token: str, first: dict[str, int], key: Hashable
                   ) -> dict[str, shm_posts.Found]:
    """The posts of the peer workers ``first`` (worker -> its first rank),
    as they come up, for at most :data:`POST_WAIT`; an :data:`~flowreduce.shm.posts.UNFIT`
    one is not waited for (nor returned)."""
    loop = asyncio.get_running_loop()
    start, pause, left = loop.time(), 0.0002, False
    pending = dict(first)
    found: dict[str, shm_posts.Found] = {}
    while True:
        for w, r in list(pending.items()):
            got = shm_posts.find(pool, token, r)
            if got is not None:
                del pending[w]
                if isinstance(got, shm_posts.Found):
                    found[w] = got
        waited = loop.time() - start
        if not pending or waited > POST_WAIT:
            return found
        if waited > POST_PATIENCE and not left:
            leave_slot(worker, key)
            left = True
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.002)


def _log_reads(found: dict[str, shm_posts.Found], key: str, began: float) -> None:
    """A trace event per post read: the block's time (the sum reading them
    in place), shared among them by bytes."""
    from flowreduce.kernels import shm as shm_kernels

    total = sum(f.value.nbytes for f in found.values())
    t, span = began, time.time() - began
    for f in sorted(found.values(), key=lambda f: f.segment.name):
        share = span * f.value.nbytes / total if total else 0.0
        shm_kernels.log_copy("read", key, shm_kernels.owner_pid(f.segment.name), f.value.nbytes, t, t + share)
        t += share


def _withdraw(pool: Any, post: shm_posts.Post, clean: bool) -> None:
    """Take this task's post down: now if every reader acknowledged it (or
    the task failed: then its segment is unlinked, never reused), else once
    they have (:func:`_withdraw_when_read`), off the task's path; an
    ``unfit`` post after :data:`UNFIT_SECONDS`, for peers that start later."""
    if post.segment is None and clean:
        asyncio.get_running_loop().call_later(UNFIT_SECONDS, partial(post.withdraw, pool, reuse=False))
    elif not clean or post.read_by_all():
        post.withdraw(pool, reuse=clean)
    else:
        _background(_withdraw_when_read(pool, post))


async def _withdraw_when_read(pool: Any, post: shm_posts.Post) -> None:
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + ACK_SECONDS, 0.001
    while not post.read_by_all():
        if loop.time() > deadline:  # a reader never came (it read over Dask's comm): nobody may reuse it
            post.withdraw(pool, reuse=False)
            return
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.05)
    post.withdraw(pool, reuse=True)


class PeerHandlersPlugin(WorkerPlugin):
    """The peer reads' part of flowreduce's worker extension: the handler
    its reading peers call, :data:`HANDLER` (reduce the ranks held here and
    send them). A worker without it is read value by value over Dask's comm."""

    worker: Any = None

    def setup(self, worker: Any) -> None:
        self.worker = worker

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {HANDLER: self.reduce_handler}

    async def reduce_handler(self, keys: Any = None, reduce_with: Any = None, **other: Any) -> dict[str, Any]:
        if other:
            return refused(HANDLER, f"unknown arguments {sorted(map(str, other))[:10]}")
        try:
            return await reduce_held(self.worker, keys, reduce_with)
        except Exception as e:  # never the worker's problem: the reader reads the values instead
            return refused(HANDLER, f"{e!r}"[:300])


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
