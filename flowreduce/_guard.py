"""A scheduler plugin that fails a flowreduce task at once when the worker
it is pinned to leaves the cluster, instead of leaving it waiting forever
for a worker that will never come back (restricted tasks otherwise sit in
the scheduler's ``no-worker`` state).

The same holds for an all-reduce's input pinned by the user to the lost
worker (``submit(..., workers=[w])``): it can never be recomputed, so it is
failed too, and the error flows down to every rank's result."""

from __future__ import annotations

import pickle
import weakref

from distributed.diagnostics.plugin import SchedulerPlugin


class WorkerLostError(RuntimeError):
    """A worker holding part of an all-reduce left the cluster."""


class PinGuard(SchedulerPlugin):
    name = "flowreduce-pin-guard"

    def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish == "no-worker":  # rare: decide later, once the transition batch is done
            self.scheduler.loop.add_callback(self._fail, key)

    def _fail(self, key) -> None:
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


def _ours(key) -> bool:
    return isinstance(key, tuple) and str(key[0]).startswith("flowreduce-")


_guarded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ensure_guard(client) -> None:
    """Install the guard once per client (and so per scheduler)."""
    if client not in _guarded:
        client.register_plugin(PinGuard())
        _guarded[client] = True
