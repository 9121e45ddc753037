"""The files a traced run leaves in a directory (``flowreduce trace``, and
``flowreduce bench --trace DIR`` for every row): the Perfetto JSON, the CSV,
the summary and the timeline pictures."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for the annotation: the commands import tracing when they run
    from flowreduce.tracing.capture import Trace


def write_all(tr: Trace, out_dir: str, title: str = "") -> dict[str, str]:
    """Write every export of ``tr`` into ``out_dir``; returns name -> path."""
    from flowreduce.tracing.export import to_chrome, to_csv
    from flowreduce.tracing.spmd_summary import spmd_jobs, summarize_spmd
    from flowreduce.tracing.summary import summarize

    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "trace.json": to_chrome(tr, os.path.join(out_dir, "trace.json")),
        "trace.csv": to_csv(tr, os.path.join(out_dir, "trace.csv")),
    }

    def summary(stem: str, s: Any) -> None:
        """``s`` as ``<stem>.txt`` (the table) and ``<stem>.json``."""
        for name, text in ((f"{stem}.txt", str(s)), (f"{stem}.json", json.dumps(s.to_dict(), indent=1, default=str))):
            paths[name] = os.path.join(out_dir, name)
            with open(paths[name], "w") as f:
                f.write(text)

    token = None
    if tr.last_call is not None:  # a trace of user tasks only (bench's baseline) has no summary
        s = summarize(tr)
        token = s.token
        summary("summary", s)
    if spmd_jobs(tr):  # the last SPMD job's summary
        summary("spmd_summary", summarize_spmd(tr))
    try:
        from flowreduce.tracing.plot import plot_timeline

        png, svg = os.path.join(out_dir, "timeline.png"), os.path.join(out_dir, "timeline.svg")
        plot_timeline(tr, [png, svg], token=token, title=title or None)
        paths["timeline.png"], paths["timeline.svg"] = png, svg
    except ImportError as e:
        print(f"no pictures: {e}")
    return paths
