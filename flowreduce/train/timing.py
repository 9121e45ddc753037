"""Time per training step, split into computation and communication.

* **step**: the time between the client learning that step ``n-1``'s and
  step ``n``'s new weights exist on every rank (done callbacks on the
  update futures); with two steps in flight this is the steady-state time
  per step, client overhead included.
* **compute**: per rank, the summed ``compute`` time of its own training
  tasks in that step (forward, per-layer backward, gather, update: the
  scheduler's task stream); the step's compute is the busiest rank's.
* **comm** = step − compute: what the step costs beyond its computation,
  i.e. the gradient all-reduce that the backward pass did not hide
  (transfers, the all-reduce's own tasks, scheduling latency, waiting for a
  straggler).
* **allreduce work**: the busiest rank's summed compute time of the
  all-reduce's own tasks (fusion copies, splits, reductions, output copies),
  a part of comm when it is not hidden.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from flowreduce import keys as keymod


class _CommShare:
    """Step seconds split into compute and communication."""

    seconds: float
    comm: float

    @property
    def comm_share(self) -> float:
        return self.comm / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "comm_share": self.comm_share}  # type: ignore[call-overload]  # on dataclasses


@dataclass
class StepTiming(_CommShare):
    step: int
    epoch: int
    seconds: float
    compute: float
    comm: float
    allreduce_work: float


def _compute_seconds(record: dict) -> float:
    return sum(s["stop"] - s["start"] for s in record.get("startstops", ()) if s.get("action") == "compute")


def breakdown(records: list[dict], trainer: Any, steps: list[Any]) -> list[StepTiming]:
    """:class:`StepTiming` of ``steps`` (the trainer's :class:`StepRecord`),
    from task-stream ``records`` that cover them."""
    token = trainer.token
    rank_of = {w: r for r, w in enumerate(trainer.workers)}
    step_of_token = {t: s.step for s in trainer.steps for t in s.tokens}
    compute: dict[tuple[int, int], float] = {}
    work: dict[tuple[int, int], float] = {}
    for rec in records:
        key = rec.get("key")
        if not isinstance(key, tuple) or not isinstance(key[0], str):
            continue
        if key[0].startswith("train-") and key[0].endswith(token) and len(key) >= 3:
            k = (key[1], key[2])
            compute[k] = compute.get(k, 0.0) + _compute_seconds(rec)
            continue
        info = keymod.parse(key)
        if info is not None and info["token"] in step_of_token:
            r = rank_of.get(rec.get("worker"), info.get("rank"))
            k = (step_of_token[info["token"]], r)
            work[k] = work.get(k, 0.0) + _compute_seconds(rec)
    by_step = {s.step: s for s in trainer.steps}
    out = []
    for s in steps:
        prev = by_step.get(s.step - 1)
        seconds = s.done - (prev.done if prev is not None and prev.done else s.submitted)
        c = max((v for (n, _), v in compute.items() if n == s.step), default=0.0)
        w = max((v for (n, _), v in work.items() if n == s.step), default=0.0)
        out.append(StepTiming(s.step, s.epoch, seconds, c, max(0.0, seconds - c), w))
    return out


def read(client: Any, trainer: Any, steps: list[Any], since: float) -> list[StepTiming]:
    """Ask the scheduler's task stream for what ran since ``since`` (epoch
    seconds) and break ``steps`` down."""
    return breakdown(client.get_task_stream(start=since), trainer, steps)


@dataclass
class Medians(_CommShare):
    steps: int
    seconds: float
    compute: float
    comm: float
    allreduce_work: float


def medians(timings: list[StepTiming]) -> Medians:
    if not timings:
        return Medians(0, 0.0, 0.0, 0.0, 0.0)
    return Medians(len(timings), statistics.median(t.seconds for t in timings),
                   statistics.median(t.compute for t in timings), statistics.median(t.comm for t in timings),
                   statistics.median(t.allreduce_work for t in timings))
