"""The scheduler side of flowreduce: one plugin, installed once per client,
with two guards.

* **Pin guard.** A flowreduce task fails at once when the worker it is
  pinned to leaves the cluster, instead of waiting forever for a worker
  that will never come back (restricted tasks otherwise sit in the
  scheduler's ``no-worker`` state). The same holds for an all-reduce's
  input pinned by the user to the lost worker (``submit(..., workers=[w])``):
  it can never be recomputed, so it is failed too, and the error flows down
  to every rank's result.
* **Replica guard.** Dask's Active Memory Manager (``ReduceReplicas``)
  drops every replica of a key beyond one, from the worker using the most
  memory, without looking at where the key's waiting dependents are pinned.
  When a rank's value has been fetched by a peer while a task of its own
  worker still waits for it (the rank's final gather, say), the AMM may drop
  the *owner's* copy, and the owner fetches its own data back. The guard
  swaps the AMM's ``ReduceReplicas`` policy for one that never drops the
  replica on a worker where a waiting flowreduce task is pinned, nor a
  flowreduce value's replica on the worker it was computed on (a
  shared-memory payload's lease lives there while peers read it); every
  other key is treated exactly as before.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Generator, Hashable
from typing import Any

from distributed.active_memory_manager import ReduceReplicas, Suggestion
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import WorkerState

from flowreduce.errors import WorkerLostError


class KeepPinnedReplicas(ReduceReplicas):
    """``ReduceReplicas`` that keeps the replicas pinned flowreduce tasks wait for."""

    def run(self) -> Generator[Suggestion, WorkerState | None, None]:
        workers = self.manager.scheduler.workers
        for s in super().run():
            keep = {workers[w] for waiter in s.ts.waiters or () if _ours(waiter.key)
                    for w in waiter.worker_restrictions or () if w in workers}
            if _ours(s.ts.key):  # its own worker keeps it: a shared-memory payload's lease lives there
                keep |= {workers[w] for w in s.ts.worker_restrictions or () if w in workers}
            if not keep:
                yield s
                continue
            candidates = (s.candidates if s.candidates is not None else set(s.ts.who_has or ())) - keep
            if candidates:
                yield Suggestion("drop", s.ts, candidates)


class PinGuard(SchedulerPlugin):
    name = "flowreduce-pin-guard"

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        amm = scheduler.extensions.get("amm")
        if amm is not None:
            for policy in list(amm.policies):
                if type(policy) is ReduceReplicas:
                    amm.policies.discard(policy)
                    amm.add_policy(KeepPinnedReplicas())

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "no-worker":  # rare: decide later, once the transition batch is done
            self.scheduler.loop.add_callback(self._fail, key)

    def _fail(self, key: Hashable) -> None:
        s = self.scheduler
        ts = s.tasks.get(key)
        if ts is None or ts.state != "no-worker":
            return
        if not (_ours(key) or any(_ours(d.key) for d in ts.dependents)):
            return  # neither ours nor an input of ours
        gone = sorted(ts.worker_restrictions or ())
        if not gone or any(w in s.workers for w in gone) or ts.loose_restrictions:
            return  # it can still run somewhere: not ours to fail
        what = "flowreduce task" if _ours(key) else "all-reduce input"
        exc = WorkerLostError(
            f"{what} {key!r} is pinned to worker {', '.join(gone)}, which left the cluster "
            "(died or was retired); this all-reduce cannot finish. Its inputs or partial results "
            "lived there: recompute the inputs and call allreduce again."
        )
        stimulus = f"flowreduce-pin-guard-{key!r}"
        recs = s.transition(key, "erred", exception=pickle.dumps(exc), cause=key, stimulus_id=stimulus)
        s.transitions(recs, stimulus_id=stimulus)


def _ours(key: Hashable) -> bool:
    return isinstance(key, tuple) and str(key[0]).startswith("flowreduce-")


_guarded: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def ensure_guard(client: Any) -> None:
    """Install the guards once per client (and so per scheduler)."""
    if client not in _guarded:
        client.register_plugin(PinGuard())
        _guarded[client] = True
