"""The guard, a part of flowreduce's scheduler extension
(:mod:`flowreduce.schedule.extension`): it keeps a call from hanging or
silently losing a rank.

* **Recovery.** When a worker holding part of a call leaves the cluster
  (killed, or retired gracefully), the call's tasks pinned to it are
  re-pinned to a surviving worker and every unfinished part of the call
  runs again, so the result futures the user holds resolve to the right
  answer (:mod:`flowreduce.schedule.recovery`; docs/failures.md).
* **Unrecoverable inputs.** An input that cannot be recomputed fails the
  call with :class:`WorkerLostError` naming its rank and key, instead of
  cancelling the results with Dask's "already forgotten": scattered data
  whose only copy died, or a task pinned by the user strictly to a worker
  that is gone.
* **Timeouts.** ``allreduce(..., timeout=)`` (default: the dask config key
  ``flowreduce.timeout``) fails the results still pending with
  :class:`AllreduceTimeoutError` saying where the call is stuck
  (:mod:`flowreduce.schedule.stuck`).
* **Replica guard.** Dask's Active Memory Manager (``ReduceReplicas``)
  drops every replica of a key beyond one, from the worker using the most
  memory, without looking at where the key's waiting dependents are pinned.
  When a rank's value has been fetched by a peer while a task of its own
  worker still waits for it (the rank's final gather, say), the AMM may drop
  the *owner's* copy, and the owner fetches its own data back. The guard
  swaps the AMM's ``ReduceReplicas`` policy for one that never drops the
  replica on a worker where a waiting flowreduce task is pinned, nor a
  flowreduce value's replica on the worker it was computed on (a
  shared-memory payload's lease lives there while peers read it), unless
  that worker is retiring (its data must move off, or ``retire_workers``
  never returns); every other key is treated exactly as before.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dask.utils import parse_timedelta
from distributed.active_memory_manager import ReduceReplicas, Suggestion
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import monotonic
from distributed.scheduler import WorkerState

from flowreduce import config
from flowreduce.dashboard.record import EXTENSION
from flowreduce.errors import AllreduceTimeoutError, WorkerLostError, refused

__all__ = ["AllreduceTimeoutError", "KeepPinnedReplicas", "PinGuard", "WorkerLostError", "guard_of",
           "resolve_timeout", "wait_inputs", "watch"]

logger = logging.getLogger("flowreduce")


def resolve_timeout(timeout: Any) -> float | None:
    """Seconds of ``timeout`` (a number or a Dask time string like ``"30s"``),
    else the dask config key ``flowreduce.timeout``; None: wait forever."""
    if timeout is None:
        timeout = config.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool):
        raise TypeError(f"timeout must be seconds or a time string like '30s', got {timeout!r}")
    seconds = parse_timedelta(timeout, default="seconds")
    if seconds is None or seconds <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return float(seconds)


class KeepPinnedReplicas(ReduceReplicas):
    """``ReduceReplicas`` that keeps the replicas pinned flowreduce tasks wait for."""

    def run(self) -> Generator[Suggestion, WorkerState | None, None]:
        workers = self.manager.scheduler.workers
        for s in super().run():
            keep = {ws for waiter in s.ts.waiters or () if _leasing(waiter.key)
                    for w in waiter.worker_restrictions or ()
                    if (ws := workers.get(w)) is not None and ws.status in (Status.running, Status.paused)}
            if _leasing(s.ts.key):  # its own worker keeps it: a shared-memory payload's lease lives there
                keep |= {ws for w in s.ts.worker_restrictions or ()
                         if (ws := workers.get(w)) is not None and ws.status in (Status.running, Status.paused)}
            if not keep:
                yield s
                continue
            candidates = (s.candidates if s.candidates is not None else set(s.ts.who_has or ())) - keep
            if candidates:
                yield Suggestion("drop", s.ts, candidates)


@dataclass
class Watch:
    """A call the guard watches until its results are done."""

    token: str
    outputs: set[Hashable]
    inputs: dict[Hashable, list[int]]  # input key -> the ranks reading it
    pending: set[Hashable] = field(default_factory=set)  # results not done yet
    timer: Any = None
    patched: list[Any] = field(default_factory=list)  # scattered inputs given a run_spec that names them when lost
    holder: str | None = None  # the pseudo-client keeping the inputs while the call reads them without depending


class PinGuard(SchedulerPlugin):
    """One per scheduler, whichever client installs the extension first: its watches survive the others."""

    def __init__(self, attempts: int | None = None):
        if attempts is None:
            attempts = int(config.get("recovery.attempts"))
        self.attempts = attempts

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.watches: dict[str, Watch] = {}
        self.watch_of: dict[Hashable, str] = {}  # output key -> token
        self.input_ranks: dict[Hashable, list[int]] = {}  # input key of a watched call -> ranks
        self.since: dict[Hashable, float] = {}  # key (ours or a watched input) -> when it started processing
        self.tries: OrderedDict[str, int] = OrderedDict()  # token -> recoveries so far
        # input key of a finished call -> its ranks, so that losing it later still names them (bounded)
        self.finished_inputs: OrderedDict[Hashable, list[int]] = OrderedDict()
        # finished call -> (its results still on the scheduler, its patched scattered inputs), and result -> call
        self.lingering: dict[str, tuple[set[Hashable], list[Any]]] = {}
        self.lingering_of: dict[Hashable, str] = {}
        amm = scheduler.extensions.get("amm")
        if amm is not None:
            for policy in list(amm.policies):
                if type(policy) is ReduceReplicas:
                    amm.policies.discard(policy)
                    amm.add_policy(KeepPinnedReplicas())

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {STATES: self.states}

    def stream_handlers(self) -> dict[str, Callable[..., Any]]:
        return {WATCH: self.watch}

    def states(self, keys: Any = None, **other: Any) -> list[tuple] | dict[str, str] | None:
        """The :data:`STATES` request (a plain RPC, cheaper than ``run_on_scheduler``,
        which ships a function): per key ``(state, holders, restrictions,
        nbytes, type)``; None if a key is unknown; ``{"status": "error",
        "message": ...}``, logged, for a request flowreduce does not send (not
        a list of Dask keys, more of them than the scheduler has tasks
        and than :data:`MAX_STATES_KEYS`)."""
        from dask.core import iskey

        if other:
            return refused(STATES, f"unknown arguments {sorted(map(str, other))[:10]}")
        # not the scheduler's task count: the inputs asked about may still be on their way (another comm)
        most = max(len(self.scheduler.tasks), MAX_STATES_KEYS)
        if not isinstance(keys, (list, tuple)) or len(keys) > most:
            return refused(STATES, f"keys must be a list of at most {most} keys, got {type(keys).__name__}"
                            + (f" of {len(keys)}" if isinstance(keys, (list, tuple)) else ""))
        if not all(iskey(k) for k in keys):
            return refused(STATES, f"keys must be Dask keys, got {next(k for k in keys if not iskey(k))!r}"[:300])
        out = []
        for k in keys:
            ts = self.scheduler.tasks.get(k)
            if ts is None:
                return None
            out.append((ts.state, sorted(ws.address for ws in ts.who_has or ()),
                        sorted(ts.worker_restrictions or ()), ts.nbytes, ts.type))
        return out

    # -- the client's message at submission ------------------------------------------------------------

    def watch(self, token: Any = "", outputs: Any = (), inputs: Any = (), timeout: Any = None, client: Any = None,
              hold: Any = False, **other: Any) -> None:
        """Watch call ``token``: its ``outputs`` keys, ``inputs[r]`` the input keys of rank ``r``.
        ``hold``: its tasks read inputs they do not depend on (``direct``), so
        the inputs are kept, as a client's futures keep them, until the call is done.
        A message that is not one :func:`watch` sends (other arguments or
        types, a token that is not of a call of these outputs or is watched
        already, more keys than the scheduler has tasks, a timeout that is
        not a positive number) is refused with a logged error: a stream
        handler that raises would drop the client's connection."""
        try:
            why = _watch_refusal(self, token, outputs, inputs, timeout, hold, other)
        except Exception as e:
            why = repr(e)
        if why is not None:
            refused(WATCH, why)
            return
        try:
            self._watch(token, outputs, inputs, timeout, hold)
        except Exception as e:
            logger.exception("flowreduce: %s failed for call %s: %r", WATCH, token, e)

    def _watch(self, token: str, outputs: Sequence[Hashable], inputs: Sequence[Sequence[Hashable]],
               timeout: float | None, hold: bool) -> None:
        s = self.scheduler
        ranks: dict[Hashable, list[int]] = {}
        for r, keys in enumerate(inputs):
            for k in keys:
                ranks.setdefault(k, []).append(r)
        w = Watch(token, {k for k in outputs if k in s.tasks}, ranks)
        w.pending = {k for k in w.outputs if s.tasks[k].state not in ("memory", "erred")}
        self.watches[token] = w
        for k in w.outputs:
            self.watch_of[k] = token
        if hold and w.pending:
            w.holder = f"flowreduce-hold-{token}"
            s.client_desires_keys(keys=[k for k in ranks if k in s.tasks], client=w.holder)
        from flowreduce.schedule.recovery import is_lost_input_spec

        for k, rs in ranks.items():
            self.input_ranks.setdefault(k, []).extend(rs)
            ts = s.tasks.get(k)
            # scattered: a loss must name it, not cancel the call (patched already while a finished call's results
            # may need it)
            if ts is not None and (ts.run_spec is None or is_lost_input_spec(ts.run_spec)):
                _name_when_lost(s, ts, rs)
                w.patched.append(ts)
        if not w.pending:  # it finished before this message came: kept as any finished call (its inputs patched)
            self._unwatch(token)
        elif timeout is not None:
            w.timer = s.loop.call_later(timeout, self._expire, token, timeout)

    def _unwatch(self, token: str) -> None:
        w = self.watches.pop(token, None)
        if w is None:
            return
        if w.timer is not None:
            w.timer.cancel()
        for k in w.outputs:
            self.watch_of.pop(k, None)
        if w.holder is not None and w.holder in self.scheduler.clients:
            self.scheduler.client_releases_keys(keys=list(w.inputs), client=w.holder,
                                                stimulus_id=f"flowreduce-release-{token}")
            self.scheduler.clients.pop(w.holder, None)
        for k, rs in w.inputs.items():
            self.finished_inputs.pop(k, None)
            self.finished_inputs[k] = sorted(set(rs))
            left = self.input_ranks.get(k, [])
            for r in rs:
                if r in left:
                    left.remove(r)
            if not left:
                self.input_ranks.pop(k, None)
        while len(self.finished_inputs) > 4096:
            self.finished_inputs.popitem(last=False)
        # while a result of the call is kept, a loss may have to recompute it from the scattered inputs:
        # they keep naming their rank until then, then are the user's plain scattered data again
        live = {k for k in w.outputs if k in self.scheduler.tasks}
        if w.patched and live:
            self.lingering[token] = (live, w.patched)
            for k in live:
                self.lingering_of[k] = token
        else:
            self._unpatch(w.patched)

    def _unpatch(self, patched: list[Any]) -> None:
        from flowreduce.schedule.recovery import is_lost_input_spec

        held = set(self.input_ranks) | {ts.key for _, kept in self.lingering.values() for ts in kept}
        for ts in patched:
            if ts.key not in held and is_lost_input_spec(ts.run_spec) and ts.state == "memory":
                ts.run_spec = None

    def _expire(self, token: str, timeout: float) -> None:
        from flowreduce.schedule.recovery import fail
        from flowreduce.schedule.stuck import explain

        w = self.watches.get(token)
        if w is None:
            return
        s = self.scheduler
        pending = [k for k in w.outputs if k in s.tasks and s.tasks[k].state not in ("memory", "erred")]
        if not pending:
            return
        engine = getattr(s.plugins.get(EXTENSION), "p2p", None)  # the p2p engine's part of the extension
        late = engine.not_arrived(token) if engine is not None else None
        exc = AllreduceTimeoutError(f"all-reduce {token} did not finish within {timeout:g} s "
                                    f"({len(pending)} of {len(w.outputs)} results pending); "
                                    + (f"rank(s) {late[:20]} had not arrived (their inputs not computed yet: the "
                                       "call begins when the last rank's is); " if late else "")
                                    + explain(s, pending, self.input_ranks, self.since))
        logger.warning("%s", exc)
        fail(s, pending, exc, f"flowreduce-timeout-{token}")

    # -- scheduler hooks -------------------------------------------------------------------------------

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "no-worker":  # rare: decide later, once the transition batch is done
            self.scheduler.loop.add_callback(self._no_worker, key)
        if finish == "processing":
            if _ours(key) or key in self.input_ranks:
                self.since[key] = monotonic()
        elif start == "processing":
            self.since.pop(key, None)
        if finish == "forgotten":
            self.finished_inputs.pop(key, None)
            if (done := self.lingering_of.pop(key, None)) is not None:
                live, patched = self.lingering[done]
                live.discard(key)
                if not live:
                    del self.lingering[done]
                    self._unpatch(patched)
        if finish in ("memory", "erred", "forgotten") and key in self.watch_of:
            token = self.watch_of[key]
            pending = self.watches[token].pending
            pending.discard(key)
            if not pending:
                self._unwatch(token)

    def update_graph(self, scheduler: Any, *, tasks: Any = (), **kwargs: Any) -> None:
        """A graph has arrived, before any of its tasks can run: the scattered
        inputs that flowreduce tasks depend on name their ranks if lost. The
        call's watch, sent after the graph, does that too, with each input's
        exact ranks, but a worker can die before it is read (CI saw a rank's
        hand-in start, and its worker die, first: Dask then forgot the call)."""
        s = scheduler
        readers: dict[Hashable, list[Any]] = {}
        for key in tasks:
            ts = s.tasks.get(key)
            if ts is None or not _ours(key):
                continue
            for dts in ts.dependencies:
                if dts.run_spec is None and dts.state == "memory":
                    readers.setdefault(dts.key, []).append(ts)
        for key, rs in readers.items():
            _name_when_lost(s, s.tasks[key], _ranks_of(rs))

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        from flowreduce.schedule.recovery import recover

        recover(self, {worker}, f"flowreduce-recover-{worker}")

    def _no_worker(self, key: Hashable) -> None:
        s = self.scheduler
        ts = s.tasks.get(key)
        if ts is None or ts.state != "no-worker":
            return
        pinned = sorted(ts.worker_restrictions or ())
        if not pinned or ts.loose_restrictions or any(w in s.workers for w in pinned):
            return  # it can still run somewhere (a paused or retiring worker comes back or is removed later)
        if _ours(key):  # pinned to a worker removed before this task reached the scheduler
            from flowreduce.schedule.recovery import recover

            recover(self, set(pinned), f"flowreduce-recover-{key!r}")
            return
        readers = [d for d in ts.dependents if _ours(d.key)]
        if not readers:
            return  # not an input of ours
        from flowreduce.schedule.recovery import fail

        # a call whose watch has not arrived yet (the worker died while its graph was being registered):
        # the ranks of the flowreduce tasks reading the input, from their keys
        ranks = self.input_ranks.get(key) or self.finished_inputs.get(key) or _ranks_of(readers)
        who = f"input of rank {', '.join(map(str, sorted(set(ranks))))}" if ranks else "all-reduce input"
        exc = WorkerLostError(
            f"{who} (key {key!r}) is pinned to worker {', '.join(pinned)}, which left the cluster "
            "(died or was retired); it cannot be recomputed anywhere else, so this all-reduce cannot finish: "
            "recompute this input and call allreduce again."
        )
        fail(s, [key], exc, f"flowreduce-pin-guard-{key!r}")

    def attempt(self, token: str) -> int:
        """Count one more recovery of call ``token``; how many so far."""
        n = self.tries.pop(token, 0) + 1
        self.tries[token] = n
        while len(self.tries) > 4096:
            self.tries.popitem(last=False)
        return n


#: Key prefixes of tasks whose values may hold a shared-memory lease: a call's, and
#: :class:`flowreduce.torch.Trainer`'s (its step tasks' buckets).
LEASING = ("flowreduce-", "torch-")


def _ours(key: Hashable) -> bool:
    return isinstance(key, tuple) and str(key[0]).startswith("flowreduce-")


def _leasing(key: Hashable) -> bool:
    return isinstance(key, tuple) and str(key[0]).startswith(LEASING)


def _watch_refusal(guard: PinGuard, token: Any, outputs: Any, inputs: Any, timeout: Any, hold: Any,
                   other: dict) -> str | None:
    """Why a ``flowreduce-watch`` message is not one :func:`watch` sends, or None."""
    import math

    from dask.core import iskey

    from flowreduce import keys as keymod

    tasks = guard.scheduler.tasks
    if other:
        return f"unknown arguments {sorted(map(str, other))[:10]}"
    if not isinstance(token, str) or not 0 < len(token) <= 128 or not token.isascii() \
            or not token.replace("_", "").isalnum():
        return f"token must be a call's token (letters, digits, _), got {token!r}"[:300]
    if token in guard.watches:
        return f"call {token} is watched already"
    if not isinstance(outputs, (list, tuple)) or not 0 < len(outputs) <= len(tasks):
        return f"outputs must be a list of 1 to {len(tasks)} keys (the scheduler's tasks), got {type(outputs).__name__}"
    if not isinstance(inputs, (list, tuple)) or len(inputs) > len(outputs) or \
            not all(isinstance(ks, (list, tuple)) for ks in inputs) or sum(map(len, inputs)) > len(tasks):
        return "inputs must be a list (one per rank, no more ranks than outputs) of lists of keys"
    if not all(iskey(k) for k in outputs) or not all(iskey(k) for ks in inputs for k in ks):
        return "outputs and inputs must be Dask keys"
    parsed = [keymod.parse(k) if isinstance(k, tuple) and k else None for k in outputs]
    if any(p is None for p in parsed):
        return f"outputs must be flowreduce keys, got e.g. {outputs[parsed.index(None)]!r}"[:300]
    if not any(p is not None and p["token"] == token and k in tasks for k, p in zip(outputs, parsed)):
        return f"unknown call {token}: the scheduler has none of its keys"
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        return f"timeout must be positive seconds or None, got {timeout!r}"[:300]
    if not isinstance(hold, bool):
        return f"hold must be True or False, got {hold!r}"[:300]
    return None


def _name_when_lost(s: Any, ts: Any, ranks: list[int]) -> None:
    """Give scattered input ``ts`` a task that fails naming ``ranks`` and its key, should its only copy be lost."""
    from flowreduce.schedule.recovery import lost_input_spec

    ts.run_spec = lost_input_spec(ts.key, ranks)
    ts.priority = ts.priority or (0, s.generation, 0)  # scattered data has none, a task needs one


def _ranks_of(tasks: Sequence[Any]) -> list[int]:
    """The ranks named by the keys of these flowreduce tasks."""
    from flowreduce.keys import parse

    return sorted({info["rank"] for ts in tasks if (info := parse(ts.key)) is not None
                   and isinstance(info.get("rank"), int)})


#: The client's stream message telling the guard about a call just submitted (:func:`watch`).
WATCH = "flowreduce-watch"
#: The guard's scheduler handler answering what the scheduler knows of some keys (:meth:`PinGuard.states`).
STATES = "flowreduce_states"
#: Most keys one :data:`STATES` request may name beyond the scheduler's own tasks.
MAX_STATES_KEYS = 1 << 16


def guard_of(scheduler: Any) -> PinGuard | None:
    """The guard of the scheduler's extension (None before it is installed)."""
    return getattr(scheduler.plugins.get(EXTENSION), "guard", None)


def wait_inputs(client: Any, ranks: Sequence[Sequence[Any]], timeout: float | None) -> None:
    """Wait (on ``client``'s loop) until the futures ``ranks[r]`` of every
    rank are done; past ``timeout`` s raise :class:`AllreduceTimeoutError`
    saying which inputs are still computing, where and for how long."""
    from distributed import wait
    from distributed.utils import TimeoutError as DaskTimeout

    flat = [f for fs in ranks for f in fs]
    try:
        with client.as_current():  # distributed.wait runs on the default client's loop, not theirs
            wait(flat, timeout=timeout)
    except (DaskTimeout, TimeoutError):
        pending: dict[Hashable, list[int]] = {}
        for r, fs in enumerate(ranks):
            for f in fs:
                if not f.done():
                    pending.setdefault(f.key, []).append(r)
        detail = client.run_on_scheduler(_explain_inputs, list(pending), pending)
        raise AllreduceTimeoutError(f"all-reduce inputs not ready within {timeout:g} s; {detail}") from None


def _explain_inputs(keys: list[Hashable], ranks: dict[Hashable, list[int]], dask_scheduler: Any = None) -> str:
    from flowreduce.schedule.stuck import explain

    guard = guard_of(dask_scheduler)
    return explain(dask_scheduler, keys, ranks, guard.since if guard is not None else {})


def watch(client: Any, token: str, outputs: Sequence[Hashable], inputs: Sequence[Sequence[Hashable]],
          timeout: float | None, hold: bool = False) -> None:
    """Tell the guard about a call just submitted: its result keys, each
    rank's input keys, and how long it may take (None: forever); ``hold``:
    keep the inputs until the call is done (its tasks read them without
    depending on them). Sent on the client's stream after the graph, so the
    scheduler knows the keys by then, and before the caller can release an input;
    after :func:`flowreduce.schedule.extension.ensure_extension` (a stream message
    without a handler would close the client's stream)."""
    client._send_to_scheduler({"op": WATCH, "token": token, "outputs": list(outputs),
                               "inputs": [list(ks) for ks in inputs], "timeout": timeout, "hold": hold})
