"""Which all-reduce calls a trace should know about.

A module-level, weakly held set of the traces that are open right now. The
schedule layer keeps one record per call (:mod:`flowreduce.schedule.records`)
and tells this module of each one as it is submitted (:func:`note_call`,
which costs one empty-set test when no trace is open). Traces can also be
told by hand with ``Trace.add(futures, inputs)``; a call noted twice is
kept once.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from flowreduce.schedule import records
from flowreduce.schedule.records import CallRecord

#: One all-reduce call as a trace needs it (no futures held): the schedule's record.
Call = CallRecord

_ACTIVE: weakref.WeakSet = weakref.WeakSet()


def describe_call(futures: Sequence[Any], inputs: Sequence[Any] = ()) -> Call:
    """The :class:`Call` of an all-reduce from its output futures (which
    ``flowreduce.describe`` knows) and, optionally, its input futures."""
    from flowreduce.schedule.call import describe

    info = describe(futures)
    call = info if isinstance(info, CallRecord) else CallRecord(
        info.token, info.plan, int(info.nbytes), float(info.predicted), tuple(info.workers))
    return replace(call, input_keys=tuple(f.key for f in inputs))


def lookup(token: str) -> Call | None:
    """A call (a pytree call's bucket included) found by its token in the
    schedule's record of recent calls (no input keys then: a trace told of
    a call afterwards does not know when its inputs were ready), or None."""
    call = records.find_call(token)
    return replace(call, input_keys=()) if call is not None else None


def open_traces() -> list[Any]:
    return list(_ACTIVE)


def activate(trace: Any) -> None:
    _ACTIVE.add(trace)


def deactivate(trace: Any) -> None:
    _ACTIVE.discard(trace)


def note_call(client: Any, call: Call) -> None:
    """Tell every open trace of ``client`` about one all-reduce."""
    if not _ACTIVE:
        return
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


records.listen(note_call)
