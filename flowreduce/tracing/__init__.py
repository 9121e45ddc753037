"""Traces of all-reduce calls: capture, export, summarise, draw.

Data first: :func:`trace` records a list of typed :class:`Event` with a fixed
phase vocabulary (:data:`PHASES`); the exporters, the summary and the
pictures all read that list. Only :mod:`capture` talks to the cluster;
:mod:`plot` needs matplotlib (``pip install flowreduce[viz]``).
"""

from __future__ import annotations

from flowreduce.tracing.capture import Trace, trace
from flowreduce.tracing.events import PHASES, Event
from flowreduce.tracing.export import to_chrome, to_csv, to_dataframe
from flowreduce.tracing.spmd_summary import SpmdSummary, summarize_spmd
from flowreduce.tracing.summary import Summary, summarize

__all__ = ["PHASES", "Event", "SpmdSummary", "Summary", "Trace", "plot_timeline", "summarize", "summarize_spmd",
           "to_chrome", "to_csv", "to_dataframe", "trace"]


def plot_timeline(trace, path=None, **kwargs):
    from flowreduce.tracing.plot import plot_timeline as _plot

    return _plot(trace, path, **kwargs)


plot_timeline.__doc__ = "Draw a trace, one lane per rank; see flowreduce.tracing.plot.plot_timeline."
