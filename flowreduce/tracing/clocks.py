"""Putting every worker's timestamps on one timeline.

Dask already shifts what a worker reports (task ``startstops``, the
transfer logs) by its ``scheduler_delay``: the scheduler's clock minus the
worker's, estimated at each heartbeat as ``scheduler_time - (send + recv)/2``.
The estimate is only as good as the heartbeat's round trip is symmetric:
±RTT/2 in principle, and on a loaded machine the scheduler answers late, so
on one host we measured estimates of 20-80 ms where the true offset is 0.

Two policies, chosen per worker by ``align``:

``"host"`` (what ``"auto"`` picks for a worker on the scheduler's host)
    The clocks are the same clock, so dask's shift is undone: exact but for
    the estimate changing between our samples of it.
``"dask"`` (what ``"auto"`` picks for a worker on another host)
    Keep dask's shift; the uncertainty is RTT/2 (the worker's measured
    latency / 2) plus the spread of the estimates seen during the trace.

The estimate moves at every heartbeat (on a loaded 2-core host we saw it
swing by 0.2 s within one second), so one value per worker is not enough.
Where a raw (unshifted) worker timestamp sits next to a shifted one, the
shift dask applied to *that record* is known:

* a task's ``stimulus_id`` is ``task-finished-<raw time>``, taken as the
  thread hands the result back, next to the shifted compute ``stop``;
* a fetch's ``receive-dep`` entry in the worker's state log has the raw
  time the data arrived, next to the incoming log's shifted ``stop``;
* the outgoing log keeps the raw ``middle`` beside shifted ``start``/``stop``.

In ``"host"`` mode such records are aligned with their own shift (exact up
to the hop from the thread to the event loop, well under a millisecond
when idle). Other records use the sample nearest their end, and the
worker's uncertainty is then half the spread of the samples. In ``"dask"``
mode the shifted times are kept as dask recorded them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

ALIGN_MODES = ("auto", "host", "dask")


@dataclass
class WorkerClock:
    """What is known of one worker's clock during a trace."""

    worker: str
    host: str
    same_host: bool
    latency: float = 0.0  # worker's heartbeat round trip (s)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, shift) sorted
    mode: str = "dask"
    exact: int = 0  # intervals aligned with their own recorded shift
    sampled: int = 0  # intervals aligned with the nearest sample

    def add_sample(self, t: float, shift: float) -> None:
        bisect.insort(self.samples, (t, shift))

    def shift_at(self, t: float) -> float:
        """Dask's shift in force near time ``t`` (0 if never sampled)."""
        if not self.samples:
            return 0.0
        i = bisect.bisect_left(self.samples, (t, float("-inf")))
        near = self.samples[max(0, i - 1): i + 1]
        return min(near, key=lambda s: abs(s[0] - t))[1]

    @property
    def spread(self) -> float:
        shifts = [s for _, s in self.samples]
        return (max(shifts) - min(shifts)) / 2 if shifts else 0.0

    @property
    def uncertainty(self) -> float:
        """Half-width (s) of the interval the true aligned time lies in."""
        if self.mode == "host":
            return self.spread if self.sampled else 0.0
        return self.latency / 2 + self.spread

    def align(self, t: float, shifted: bool = True) -> float:
        """A worker timestamp on the aligned timeline. ``shifted``: dask has
        already added its shift (startstops of compute/transfer, the logs'
        start/stop); False for raw worker times (``disk-read``/``disk-write``)."""
        if self.mode == "host":
            return t - self.shift_at(t) if shifted else t
        return t if shifted else t + self.shift_at(t)

    def align_interval(self, start: float, stop: float, shifted: bool = True,
                       exact: float | None = None) -> tuple[float, float]:
        """Both ends with the one shift dask applied when it recorded the
        interval, so an interval never turns negative. ``exact``: that shift
        when known for this very record (from a raw worker timestamp);
        otherwise the sample nearest the interval's end is used."""
        if exact is not None:
            self.exact += 1
            shift = exact
        else:
            self.sampled += shifted
            shift = self.shift_at(stop)
        if self.mode == "host":
            a, b = (start - shift, stop - shift) if shifted else (start, stop)
        else:
            a, b = (start, stop) if shifted else (start + shift, stop + shift)
        return a, max(a, b)

    def describe(self) -> dict[str, Any]:
        shifts = [s for _, s in self.samples]
        return {
            "host": self.host,
            "same_host_as_scheduler": self.same_host,
            "mode": self.mode,
            "dask_shift_min_s": min(shifts, default=0.0),
            "dask_shift_max_s": max(shifts, default=0.0),
            "shift_samples": len(shifts),
            "heartbeat_rtt_s": self.latency,
            "events_with_own_shift": self.exact,
            "events_with_sampled_shift": self.sampled,
            "uncertainty_s": self.uncertainty,
        }


def choose_mode(align: str, same_host: bool) -> str:
    if align not in ALIGN_MODES:
        raise ValueError(f"align must be one of {', '.join(ALIGN_MODES)}; got {align!r}")
    if align == "auto":
        return "host" if same_host else "dask"
    return align
