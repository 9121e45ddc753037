"""Trace events: one typed record per interval of time, with a fixed phase
vocabulary (after Horovod's timeline; the words are spelled once, in
:mod:`flowreduce.phases`). Pure Python, no Dask.

Phases
------
``wait-for-input``
    Rank ``r`` waiting for its own input: from the moment the first rank's
    input was ready to the moment rank ``r``'s was. Long bars are stragglers.
``split``
    The rank cutting its input into segment views (zero-copy slices), or
    compacting its non-zeros of a range (sparse and block-sparse ``compact`` tasks).
``fusion``
    Tensor fusion (pytree all-reduces): ``pack`` copies a bucket's tensors
    into one flat buffer before the reduction, ``unpack`` cuts the reduced
    buffer back into the rank's tensors (views: near-zero bars). Horovod's
    MEMCPY_IN_FUSION_BUFFER / MEMCPY_OUT_FUSION_BUFFER.
``serialise``
    The sender pickling the data of one message (``get-data`` ``serialize``
    metric, apportioned to the message by bytes, see ``estimated``), or a
    spill to disk (``detail="disk-write"``).
``transfer``
    One fetch as the *receiver* saw it, from request to data in hand (the
    worker's ``transfer_incoming_log``; one event per batched message, which
    may carry several keys). Dask batches every key a worker wants from one
    peer, so one message can carry keys of several calls: it then becomes one
    event per call, each with that call's keys and bytes, all with the
    message's times (``detail`` says ``shared message``). Contains the
    serialise and deserialise time.
``deserialise``
    The receiver unpickling one message (``gather-dep`` ``deserialize``
    metric, apportioned by bytes), or an unspill (``detail="disk-read"``).
``shm-copy``
    A copy through shared memory between workers of one host (inside a
    task: ``detail="shm-write"`` a rank's data into its segment,
    ``"shm-read"`` a peer's segment read or copied out, or a ``direct``
    peer's post read in place by the sum (the sum's time shared among the
    posts by bytes); ``source`` is the segment's worker, ``dest`` the
    worker that read it). Counted as communication, and part of the
    enclosing task's bar.
``reduce``
    A reduction task (reduce-scatter, reduce, exchange phases of the plan;
    block-sparse ``aggregate`` tasks).
``copy``
    A gather task (all-gather, broadcast: zero-copy unless it assembles the
    output, so usually near-zero long) or the output task (the copy or
    concatenation into the rank's result).
``user-compute``
    Any task that is not part of a flowreduce graph.
``other``
    Anything else dask reported (unknown startstop actions).
``allreduce``, ``broadcast``, ``allgather``, ``barrier``
    One collective of an SPMD job (``flowreduce.spmd``) on one rank
    (:data:`SPMD_PHASES`): from the call to its return, inside the rank's
    task (a ``user-compute`` event with the same ``job`` and ``rank``).
    ``nbytes`` is the rank's input, ``sent``/``received`` the bytes it
    exchanged between hosts, ``peers`` the ranks it exchanged with,
    ``path`` how (``local``, ``shm``, ``dask``, ``shm+dask``), ``seq`` its
    number in the job, ``algorithm`` the plan between hosts.

Times are seconds on the aligned timeline (the scheduler's clock, see
:mod:`flowreduce.tracing.clocks`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from flowreduce.phases import COMM_PHASES, COMPUTE_PHASES, SPMD_PHASES, TRACE_PHASE_OF, TRACE_PHASES

__all__ = ["COMM_PHASES", "COMPUTE_PHASES", "EVENT_FIELDS", "KEY_PHASE", "PHASES", "SPMD_PHASES", "Event",
           "pack_lanes"]

#: The trace's phases (:data:`flowreduce.phases.TRACE_PHASES`, then :data:`SPMD_PHASES`), in display order.
PHASES: tuple[str, ...] = (*TRACE_PHASES, *SPMD_PHASES)
#: flowreduce key phase -> trace phase (:data:`flowreduce.phases.TRACE_PHASE_OF`).
KEY_PHASE: dict[str, str] = TRACE_PHASE_OF


@dataclass(frozen=True)
class Event:
    """One interval of time on one worker.

    Parameters
    ----------
    phase : str
        One of :data:`PHASES`.
    start, stop : float
        Seconds on the aligned timeline (scheduler clock, epoch seconds).
    worker, host : str
        Where it happened (for a transfer: the receiving worker).
    rank : int or None
        The flowreduce rank it belongs to (for a transfer: the receiver's),
        None for work on a worker that holds no rank.
    algorithm, token : str
        The all-reduce call, empty for non-flowreduce work.
    step, chunk, node : int or None
        From the task key (plan step, chunk index, plan node id).
    key : str
        ``repr`` of the task key (``ast.literal_eval`` gives it back); for a
        transfer, the first key of the message.
    nbytes : int
        Bytes of the task's result, or of the message.
    source, dest : str
        Sending and receiving worker of a transfer (empty otherwise).
    keys, key_bytes : tuple
        The keys of a batched message that belong to this event's call, and
        their bytes (transfers and the serialise/deserialise of one message).
    estimated : bool
        The duration is apportioned from a cumulative dask metric rather
        than timed per event (serialise / deserialise).
    detail : str
        Dask's own name for what happened (``compute``, ``transfer``,
        ``disk-write``, ``metric:get-data.serialize``, ...).
    job : str
        The SPMD job attempt (``<token>.<attempt>``, ``/<subgroup>`` for a
        subgroup's collectives) of a collective and of a rank's task; empty otherwise.
    seq : int or None
        The collective's number in its job (1, 2, ...).
    peers : tuple of int
        The ranks a collective exchanged with.
    path : str
        How a collective went: ``local``, ``shm``, ``dask`` or ``shm+dask``.
    sent, received : int
        Bytes a collective sent and received between hosts.
    """

    phase: str
    start: float
    stop: float
    worker: str
    host: str = ""
    rank: int | None = None
    algorithm: str = ""
    step: int | None = None
    chunk: int | None = None
    key: str = ""
    nbytes: int = 0
    source: str = ""
    dest: str = ""
    token: str = ""
    node: int | None = None
    keys: tuple[str, ...] = ()
    key_bytes: tuple[int, ...] = ()
    estimated: bool = False
    detail: str = ""
    job: str = ""
    seq: int | None = None
    peers: tuple[int, ...] = ()
    path: str = ""
    sent: int = 0
    received: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; valid: {', '.join(PHASES)}")
        if self.stop < self.start:
            raise ValueError(f"event {self.key or self.phase!r} stops before it starts ({self.start} > {self.stop})")

    @property
    def duration(self) -> float:
        return self.stop - self.start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


EVENT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Event))


def pack_lanes(events: list[Event]) -> list[int]:
    """Greedy interval colouring: a lane index per event such that events of
    one lane never overlap (events sorted by start go to the first free lane)."""
    order = sorted(range(len(events)), key=lambda i: (events[i].start, events[i].stop))
    ends: list[float] = []
    lane = [0] * len(events)
    for i in order:
        e = events[i]
        for j, end in enumerate(ends):
            if end <= e.start:
                ends[j] = e.stop
                lane[i] = j
                break
        else:
            ends.append(e.stop)
            lane[i] = len(ends) - 1
    return lane
