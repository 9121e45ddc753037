"""What a client tells the dashboard about one all-reduce call, and the
vocabulary of states the page shows.

The client sends the record as a plain, versioned dict (:meth:`DashboardRecord.message`)
so that a scheduler running another flowreduce version reads what it knows
and ignores the rest (:meth:`DashboardRecord.from_message` never raises on a
malformed message: it returns None). Imports neither dask nor distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Version of the message layout; a reader takes the fields it knows from any version.
VERSION = 1

#: State of one cell (rank × step) of a call, from the scheduler's task states;
#: a cell with several tasks (chunks) shows the first of these any of them is in.
CELL_STATES = ("erred", "transferring", "running", "ready", "waiting", "done")
#: State of one call (one row of the calls table).
CALL_STATES = ("submitted", "running", "done", "failed", "cancelled")

#: Plans with more nodes than this send no per-node widths (the store then
#: counts the bytes dask measured, which sees zero-copy views as a few bytes).
MAX_WIDTHS = 4096

#: The stream message a p2p engine's worker sends the scheduler with the plan nodes it computed
#: per (rank, step) (:mod:`flowreduce.schedule.engine_log`; filed by ``DashboardStore.engine_steps``).
ENGINE_OP = "flowreduce-dashboard-engine-steps"
#: Grid columns of a ``method="p2p"`` call: its hand-in tasks, the barrier, then the engine's plan steps
#: (plan step ``s`` in column ``ENGINE_COLUMN + s``), then the outputs.
ENGINE_COLUMN = 2

#: Columns of the grid that are not plan steps: tensor fusion's pack before
#: step 0, its unpack after the outputs.
PACK_COLUMN = -1


@dataclass(frozen=True)
class DashboardRecord:
    """One all-reduce as the dashboard shows it (one bucket of a pytree call).

    ``output_columns[r]`` is the grid column of rank ``r``'s output key: the
    step of its final plan node when the output is that node, else one past
    the last step. ``group`` is the token of the whole call (its first
    bucket's) when a pytree call ran several buckets."""

    token: str
    algorithm: str
    ranks: int
    nbytes: int
    chunks: int
    steps: int
    predicted: float | None = None
    workers: tuple[str, ...] = ()
    transport: str = "dask"
    group: str = ""
    output_columns: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = ""
    segment_bytes: float = 0.0  # bytes of one segment of one chunk
    widths: tuple[int, ...] = ()  # segments of each plan node (what a message from it carries)

    def message_bytes(self, node: int) -> float | None:
        """Bytes a message from plan node ``node`` carries (one chunk), if known."""
        return self.widths[node] * self.segment_bytes if 0 <= node < len(self.widths) else None

    def message(self) -> dict[str, Any]:
        return {"version": VERSION, "token": self.token, "algorithm": self.algorithm, "ranks": self.ranks,
                "nbytes": self.nbytes, "chunks": self.chunks, "steps": self.steps, "predicted": self.predicted,
                "workers": list(self.workers), "transport": self.transport, "group": self.group,
                "output_columns": list(self.output_columns), "shape": list(self.shape), "dtype": self.dtype,
                "segment_bytes": self.segment_bytes, "widths": list(self.widths)}

    @classmethod
    def from_message(cls, msg: Any) -> DashboardRecord | None:
        """The record in ``msg``, or None when it is not one (wrong type,
        missing token): a client of another version must not break the page."""
        if not isinstance(msg, dict) or not isinstance(msg.get("token"), str):
            return None
        try:
            predicted = msg.get("predicted")
            return cls(
                token=msg["token"],
                algorithm=str(msg.get("algorithm", "?")),
                ranks=int(msg.get("ranks", 0)),
                nbytes=int(msg.get("nbytes", 0)),
                chunks=int(msg.get("chunks", 1)),
                steps=int(msg.get("steps", 0)),
                predicted=None if predicted is None else float(predicted),
                workers=tuple(str(w) for w in msg.get("workers", ())),
                transport=str(msg.get("transport", "dask")),
                group=str(msg.get("group", "") or ""),
                output_columns=tuple(int(c) for c in msg.get("output_columns", ())),
                shape=tuple(int(s) for s in msg.get("shape", ())),
                dtype=str(msg.get("dtype", "")),
                segment_bytes=float(msg.get("segment_bytes", 0.0)),
                widths=tuple(int(w) for w in msg.get("widths", ())),
            )
        except (TypeError, ValueError):
            return None


def record_of(info: Any, *, group: str = "", transport: str | None = None) -> DashboardRecord:
    """The record of a call from what the schedule layer keeps of it: any
    object with ``plan``, ``token``, ``nbytes``, ``predicted`` and
    ``workers`` (and optionally ``transport``, ``shape``, ``dtype``)."""
    plan = info.plan
    last = max((n.step for n in plan.nodes), default=0)
    columns = tuple(plan.nodes[f].step if not plan.output_is_separate(r) else last + 1
                    for r, f in enumerate(plan.finals))
    # a p2p plan may run over the call's workers, fewer than its ranks (ranks sharing a worker are combined)
    ranks = len(info.workers) if getattr(info, "method", "tasks") == "p2p" and info.workers else plan.ranks
    return DashboardRecord(
        token=info.token, algorithm=plan.algorithm, ranks=ranks, nbytes=int(info.nbytes),
        chunks=plan.chunks, steps=max(columns, default=last) + 1, predicted=float(info.predicted),
        workers=tuple(info.workers), transport=transport or str(getattr(info, "transport", "dask")),
        group=group if group != info.token else "", output_columns=columns,
        shape=tuple(getattr(info, "shape", ()) or ()), dtype=str(getattr(info, "dtype", "") or ""),
        segment_bytes=int(info.nbytes) / max(plan.segments * plan.chunks, 1),
        widths=tuple(n.width for n in plan.nodes) if len(plan.nodes) <= MAX_WIDTHS else ())


#: The name of flowreduce's one scheduler plugin and one worker plugin (:mod:`flowreduce.schedule.extension`),
#: spelled here, below every layer that finds them: the page finds its store in the scheduler's.
EXTENSION = "flowreduce"


# -- SPMD jobs (flowreduce.spmd) -------------------------------------------------------
#: Prefix of an SPMD rank's task key, ``flowreduce-spmd-rank-<token>.<attempt>-<rank>``
#: (:func:`flowreduce.schedule.spmd_watch.rank_key`); spelled here, below every layer that reads it.
SPMD_PREFIX = "flowreduce-spmd-rank-"
#: The worker handler the dashboard asks for the last collective of each rank there
#: (:meth:`flowreduce.schedule.spmd_mailbox.Mailbox.last`): the page polls, the ranks send nothing.
SPMD_LAST = "flowreduce_spmd_last"
#: State of one SPMD job (one attempt), from its ranks' task states.
JOB_STATES = ("submitted", "running", "done", "failed", "cancelled")


def parse_spmd_key(key: Any) -> tuple[str, int] | None:
    """``(run, rank)`` of an SPMD rank's task key (run: ``<token>.<attempt>``), else None."""
    if not (isinstance(key, str) and key.startswith(SPMD_PREFIX)):
        return None
    run, _, rank = key[len(SPMD_PREFIX):].rpartition("-")
    return (run, int(rank)) if rank.isdigit() and run else None
