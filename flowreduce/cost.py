"""The cost model, and ``auto``: pick the plan the model says is fastest.

The textbook α-β-γ model (REFERENCES §2) counts messages and bytes; on a
task scheduler the latency term is per *dependent level* of the graph, plus
a per-task overhead in the scheduler. The model here reads every term off
the plan itself (:meth:`Plan.cost`), so a new algorithm needs no formula::

    T = steps·level + tasks·task
        + pipelined(comm, compute, chunks) + copy of the output

    comm    = busiest rank's bytes in + out / bandwidth
    compute = busiest rank's combined bytes / reduce_rate
    pipelined(a, b, c) = max(a, b) + min(a, b)/c    (chunks overlap the two)

Where ranks outnumber cores (``cores``), total work over all ranks divided
by the cores bounds comm + compute from below. Constants default to values
measured for dask.distributed on one host (milliseconds per level) and can
be replaced by calibrated ones.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from flowreduce._plan import Plan
from flowreduce.algorithms import plan as make_plan

logger = logging.getLogger("flowreduce")


@dataclass(frozen=True)
class CostModel:
    level: float = 7e-3  # s per dependent task level (scheduler<->worker batching)
    task: float = 0.4e-3  # s of scheduler time per task
    bandwidth: float = 1.0e9  # bytes/s a rank moves (serialise + send + receive)
    reduce_rate: float = 1.5e9  # bytes/s a rank combines
    copy_rate: float = 1.0e9  # bytes/s for assembling a chunked output (fresh pages)
    cores: int | None = None  # CPU cores shared by the ranks (None: one each)

    def predict(self, plan: Plan, nbytes: float) -> float:
        card = plan.cost(nbytes)
        comm = card.max_rank_bytes / self.bandwidth
        compute = card.reduce_bytes / self.reduce_rate
        if self.cores and self.cores < plan.ranks:
            total = (2 * card.bytes_on_wire / self.bandwidth + plan.ranks * compute)
            comm = max(comm, total / self.cores - compute)
        big, small = max(comm, compute), min(comm, compute)
        body = big + small / plan.chunks
        copy = nbytes / self.copy_rate if plan.chunks > 1 else 0.0
        return card.steps * self.level + card.tasks * self.task + body + copy


DEFAULT_MODEL = CostModel()

#: Candidate (algorithm, options) pairs that ``auto`` considers.
def candidates(ranks: int) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("reduce-broadcast", {}), ("ring", {})]
    for k in sorted({2, 4, ranks}):
        if k >= 2:
            out.append(("butterfly", {"radix": k}))
            out.append(("recursive-doubling", {"radix": k}))
    out.append(("tree", {"fan_in": 2}))
    return out


def chunk_choices(nbytes: float, max_chunks: int = 64, min_chunk_bytes: float = 1 << 20) -> list[int]:
    """Chunk counts worth trying: powers of two while chunks stay >= 1 MiB."""
    out, c = [1], 2
    while c <= max_chunks and nbytes / c >= min_chunk_bytes:
        out.append(c)
        c *= 2
    return out


def choose(
    ranks: int,
    nbytes: float,
    *,
    model: CostModel | None = None,
    chunks: int | None = None,
    algorithms: list[str] | None = None,
) -> Plan:
    """The plan with the lowest predicted time (``algorithm="auto"``)."""
    model = model or DEFAULT_MODEL
    best, best_t = None, math.inf
    for name, opts in candidates(ranks):
        if algorithms and name not in algorithms:
            continue
        base = make_plan(name, ranks, **opts)
        for c in [chunks] if chunks else chunk_choices(nbytes):
            p = replace(base, chunks=c)
            t = model.predict(p, nbytes)
            if t < best_t:
                best, best_t = p, t
    assert best is not None
    logger.info("auto chose %r (predicted %.3g s for %d bytes on %d ranks)", best, best_t, nbytes, ranks)
    return best
