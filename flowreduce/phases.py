"""The phase vocabulary, spelled once: what planners call a plan node's work,
what task keys carry, and what the trace calls an interval of time.

Three layers of names, each known to the next:

* **plan phases** (``Node.phase``), chosen by the planners in
  :mod:`flowreduce.algorithms`: :data:`PLAN_PHASES`;
* **key phases** (the ``<phase>`` of ``flowreduce-<algorithm>-<phase>-<token>``,
  :mod:`flowreduce.keys`): the plan phases plus the tasks the builder adds
  around a plan (a rank's output, tensor-fusion pack and unpack):
  :data:`KEY_PHASES`;
* **trace phases** (:class:`flowreduce.tracing.events.Event`), a coarser
  vocabulary after Horovod's timeline: every key phase maps to one
  (:data:`TRACE_PHASE_OF`), and the tracer adds phases no key has
  (waiting for input, serialising, transferring, ...): :data:`TRACE_PHASES`.

A new plan phase is added here, with its trace phase; ``keys.parse``, the
tracer and the drawer read these tuples, so none of them can miss it
(``tests/test_plans.py`` checks every planner's phases against them).
Pure Python, imports nothing.
"""

from __future__ import annotations

# -- plan phases: what a planner names a node's work ------------------------------
SPLIT = "split"  # a rank's input cut into segment views (zero-copy)
REDUCE_SCATTER = "reduce-scatter"
REDUCE = "reduce"
EXCHANGE = "exchange"  # recursive doubling: whole partials swapped and combined
ALL_GATHER = "all-gather"
BROADCAST = "broadcast"
COMPACT = "compact"  # sparse: a rank's non-zeros (or non-zero blocks) of a range
AGGREGATE = "aggregate"  # block-sparse: an aggregator adds the compacted ranges it owns
READ_REDUCE = "read-reduce"  # direct: a task reads its peers' inputs itself and reduces all of them

#: Every phase a planner may give a node, in drawing-legend order.
PLAN_PHASES: tuple[str, ...] = (SPLIT, REDUCE_SCATTER, REDUCE, EXCHANGE, READ_REDUCE, ALL_GATHER, BROADCAST, COMPACT,
                                AGGREGATE)

# -- key-only phases: tasks the builder adds around a plan ------------------------
OUTPUT = "output"  # a rank's result (a copy, or the concatenation of its pieces)
PACK = "pack"  # tensor fusion: a rank's tensors copied into one bucket
UNPACK = "unpack"  # tensor fusion: a rank's tensor cut from the reduced buckets
HAND_IN = "hand-in"  # method="p2p": a rank's input handed to the worker extension that runs the plan
BARRIER = "barrier"  # method="p2p": every rank has handed its input in
ARRIVE = "arrive"  # method="p2p", placed by Dask: a rank's input kept by its worker's engine until the call begins

#: Every phase a flowreduce task key may carry.
KEY_PHASES: tuple[str, ...] = (*PLAN_PHASES, OUTPUT, PACK, UNPACK, HAND_IN, BARRIER, ARRIVE)

# -- trace phases -----------------------------------------------------------------
WAIT_FOR_INPUT = "wait-for-input"
FUSION = "fusion"
SERIALISE = "serialise"
TRANSFER = "transfer"
DESERIALISE = "deserialise"
SHM_COPY = "shm-copy"  # bytes copied into or out of a shared-memory segment (same-host data plane)
COPY = "copy"
USER_COMPUTE = "user-compute"
OTHER = "other"

#: The trace's phases, in the order timelines and tables show them
#: (``split`` and ``reduce`` are also plan phases: the same words).
TRACE_PHASES: tuple[str, ...] = (
    WAIT_FOR_INPUT, SPLIT, FUSION, SERIALISE, TRANSFER, DESERIALISE, SHM_COPY, REDUCE, COPY, USER_COMPUTE, OTHER,
)
#: The collectives of SPMD jobs (``flowreduce.spmd``'s communicator): a trace phase each, on the rank's timeline.
SPMD_PHASES: tuple[str, ...] = ("allreduce", "broadcast", "allgather", "barrier")
#: Trace phases that keep a worker's thread busy computing.
COMPUTE_PHASES: frozenset[str] = frozenset({SPLIT, FUSION, REDUCE, COPY, USER_COMPUTE})
#: Trace phases of flowreduce's own tasks (the compute phases but user work).
TASK_PHASES: frozenset[str] = COMPUTE_PHASES - {USER_COMPUTE}
#: Trace phases that are communication.
COMM_PHASES: frozenset[str] = frozenset({SERIALISE, TRANSFER, DESERIALISE, SHM_COPY})

#: Key phase -> trace phase (``output`` and the all-gather / broadcast
#: gathers are ``copy``; the capture refines outputs merged into a reduction).
TRACE_PHASE_OF: dict[str, str] = {
    SPLIT: SPLIT,
    REDUCE_SCATTER: REDUCE,
    REDUCE: REDUCE,
    EXCHANGE: REDUCE,
    ALL_GATHER: COPY,
    BROADCAST: COPY,
    COMPACT: SPLIT,
    AGGREGATE: REDUCE,
    READ_REDUCE: REDUCE,  # the reads happen inside the task: its time is the reduction's and the reads'
    OUTPUT: COPY,
    PACK: FUSION,
    UNPACK: FUSION,
    HAND_IN: OTHER,  # the engine's own steps are not tasks (docs/p2p.md)
    BARRIER: OTHER,
    ARRIVE: OTHER,
}

