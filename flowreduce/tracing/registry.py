"""Which all-reduce calls a trace should know about.

A module-level, weakly held set of the traces that are open right now.
``flowreduce.schedule.allreduce`` tells it about every call with one line::

    tracing.registry.note(futures, inputs)

which costs one empty-set test when no trace is open (an all-reduce of
pytrees notes each bucket's call with ``note_call(client, call)``). Traces can also be
told by hand with ``Trace.add(futures, inputs)``; a call noted twice is
kept once.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_ACTIVE: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class Call:
    """One all-reduce call as a trace needs it (no futures held)."""

    token: str
    algorithm: str
    plan: Any  # flowreduce.algorithms.ir.Plan
    nbytes: int
    predicted: float
    workers: tuple[str, ...] = ()  # worker of each rank, if known
    input_keys: tuple[Any, ...] = ()  # key of each rank's input, if known


def describe_call(futures: Sequence[Any], inputs: Sequence[Any] = ()) -> Call:
    """A :class:`Call` from an all-reduce's output futures (an
    ``AllreduceResult`` with ``.plan``, or plain futures that
    ``flowreduce.describe`` knows) and, optionally, its input futures."""
    from flowreduce import keys

    if hasattr(futures, "plan"):  # an AllreduceResult
        info: Any = futures
    else:
        from flowreduce.schedule import call as schedule

        info = schedule.describe(futures)
    token = getattr(info, "token", None) or keys.parse(futures[0].key)["token"]
    return Call(
        token=token,
        algorithm=info.plan.algorithm,
        plan=info.plan,
        nbytes=int(info.nbytes),
        predicted=float(info.predicted),
        workers=tuple(getattr(info, "workers", ()) or ()),
        input_keys=tuple(f.key for f in inputs),
    )


def lookup(token: str) -> Call | None:
    """A call found by its token in flowreduce's own record of recent calls
    (no input keys then), or None."""
    try:
        from flowreduce.schedule import call as schedule
    except ImportError:  # pragma: no cover - distributed missing
        return None
    info = getattr(schedule, "_CALLS", {}).get(token)
    if info is None:
        return None
    return Call(token, info.plan.algorithm, info.plan, int(info.nbytes), float(info.predicted),
                tuple(getattr(info, "workers", ()) or ()))


def open_traces() -> list[Any]:
    return list(_ACTIVE)


def activate(trace: Any) -> None:
    _ACTIVE.add(trace)


def deactivate(trace: Any) -> None:
    _ACTIVE.discard(trace)


def note_call(client: Any, call: Call) -> None:
    """Tell every open trace of ``client`` about one all-reduce (a bucket of
    a pytree all-reduce has no futures of its own to describe it by)."""
    for tr in list(_ACTIVE):
        if tr.client is client:
            tr.add_call(call)


def note(futures: Sequence[Any], inputs: Sequence[Any] = ()) -> None:
    """Tell every open trace of the futures' client about one all-reduce call."""
    if not _ACTIVE or not futures:
        return
    client = getattr(futures[0], "client", None)
    for tr in list(_ACTIVE):
        if client is None or tr.client is client:
            tr.add(futures, inputs)
