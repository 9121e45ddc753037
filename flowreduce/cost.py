"""The cost model, and ``auto``: pick the plan the model says is fastest.

The textbook α-β-γ model (REFERENCES §2) counts messages and bytes; on a
task scheduler the latency term is per *dependent level* of the graph, plus
a per-task overhead in the scheduler. The model here reads every term off
the plan itself (:meth:`Plan.cost`), so a new algorithm needs no formula::

    T = call + steps·level + tasks·task + body

    comm    = busiest rank's bytes in + out / bandwidth
    compute = busiest rank's combined bytes / reduce_rate
    copy    = one rank's output assembly (concatenating pieces) / copy_rate

    ranks with a core each:   body = max(comm, compute) + min(comm, compute)/chunks + copy
                              (chunks pipeline communication with reduction)
    ranks sharing C cores:    body = max((2·bytes on wire/bandwidth + all combining + all copies) / C,
                                         bytes on the longest chain of dependent transfers/bandwidth + copy)
                              (every byte costs CPU at both ends, there is no idle
                              core for chunks to overlap with, and a chain of
                              transfers runs one after another)

``allreduce`` tells the model how many cores the ranks share (per host, the
fewer of its CPUs and its ranks), learnt from the workers in the same
broadcast that checks the inputs. Constants default to values measured for
dask.distributed over loopback TCP on this project's 2-core machine (see
README, "Measured on this machine"); calibrate them for a real network.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from flowreduce._plan import Plan
from flowreduce.algorithms import plan as make_plan

logger = logging.getLogger("flowreduce")


@dataclass(frozen=True)
class CostModel:
    # Fitted (least squares on log time) to 28 side-by-side measurements, 1e3..1e8
    # float64 on 4 ranks, one host, loopback TCP, 2 cores (benchmarks/results/);
    # bandwidth is loopback's: set your network's bytes/s per rank for several hosts.
    level: float = 4e-3  # s per dependent task level (scheduler<->worker batching)
    task: float = 0.6e-3  # s of scheduler and worker time per task
    call: float = 15e-3  # s per call: locating inputs, building and submitting the graph
    bandwidth: float = 6.0e9  # bytes/s a rank moves (serialise + send + receive)
    reduce_rate: float = 1.5e10  # bytes/s a rank combines
    copy_rate: float = 1.0e10  # bytes/s for assembling an output from pieces (fresh pages)
    cores: int | None = None  # CPU cores shared by the ranks (None: one each)

    def predict(self, plan: Plan, nbytes: float) -> float:
        card = plan.cost(nbytes)
        comm = card.max_rank_bytes / self.bandwidth
        compute = card.reduce_bytes / self.reduce_rate
        copy = (nbytes if card.copy_bytes else 0.0) / self.copy_rate
        if self.cores and self.cores < plan.ranks:
            # every byte costs CPU at both ends and all of it queues on the shared cores;
            # a chain of dependent transfers cannot go faster than one stream
            work = (2 * card.bytes_on_wire / self.bandwidth + card.total_reduce_bytes / self.reduce_rate
                    + card.copy_bytes / self.copy_rate)
            body = max(work / self.cores, card.critical_bytes / self.bandwidth + copy)
        else:
            big, small = max(comm, compute), min(comm, compute)
            body = big + small / plan.chunks + copy
        return self.call + card.steps * self.level + card.tasks * self.task + body


DEFAULT_MODEL = CostModel()

#: Above this many ranks ``auto`` does not price plans with Θ(p²) tasks per
#: chunk (ring, butterfly of radix p): at ~0.6 ms a task they never win on a
#: task scheduler there, and building them alone takes seconds at p = 256.
QUADRATIC_PLANS_UP_TO = 16


def candidates(ranks: int) -> list[tuple[str, dict]]:
    """(algorithm, options) pairs that ``auto`` considers for ``ranks`` ranks."""
    small = ranks <= QUADRATIC_PLANS_UP_TO
    out: list[tuple[str, dict]] = [("reduce-broadcast", {})] + ([("ring", {})] if small else [])
    for k in sorted({2, 4, ranks}):
        if k >= 2:
            if k < ranks or small:
                out.append(("butterfly", {"radix": k}))
            out.append(("recursive-doubling", {"radix": k}))  # p + p tasks: a full exchange
    out.append(("tree", {"fan_in": 2}))
    return out


def chunk_choices(nbytes: float, max_chunks: int = 64, min_chunk_bytes: float = 1 << 20) -> list[int]:
    """Chunk counts worth trying: powers of two while chunks stay >= 1 MiB."""
    out, c = [1], 2
    while c <= max_chunks and nbytes / c >= min_chunk_bytes:
        out.append(c)
        c *= 2
    return out


def best_chunks(plan: Plan, nbytes: float, model: CostModel | None = None) -> Plan:
    """``plan`` with the chunk count the model predicts fastest for it."""
    model = model or DEFAULT_MODEL
    return min((plan.with_chunks(c) for c in chunk_choices(nbytes)), key=lambda p: model.predict(p, nbytes))


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
            p = base.with_chunks(c)
            t = model.predict(p, nbytes)
            if t < best_t:
                best, best_t = p, t
    assert best is not None
    logger.info("auto chose %r (predicted %.3g s for %d bytes on %d ranks)", best, best_t, nbytes, ranks)
    return best
