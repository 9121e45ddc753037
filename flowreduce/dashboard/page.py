"""The ``/flowreduce`` page of the Dask dashboard (Bokeh, like the rest of it).

Built the way distributed builds its own pages
(``distributed.dashboard.components.scheduler``): a component with an
``update()`` run by the document's periodic callback, the dashboard's
``simple.html`` template and theme. :func:`serve` adds it to a running
scheduler's dashboard with distributed's own ``BokehApplication`` (what
``distributed.dashboard.scheduler.connect`` does for the built-in pages)
and lists it in the navigation bar (the memoized ``template_variables``
of the scheduler, shared by every page).

Every data source has a ``name`` (``flowreduce-calls``, ``-grid``,
``-edges``, ``-ranks``, ``-links``, ``-straggler``, ``-spmd-jobs``,
``-spmd-ranks``) so a browser, or a test,
can read the page's data: ``Bokeh.documents[0].get_model_by_name(...)``.
"""

from __future__ import annotations

import logging
from typing import Any

from bokeh.core.properties import without_property_validation
from bokeh.layouts import column, row
from bokeh.models import (
    ColumnDataSource,
    FixedTicker,
    HoverTool,
    Range1d,
)
from bokeh.models.widgets import Div, Select
from bokeh.plotting import figure
from dask.utils import format_bytes
from distributed.dashboard.components import DashboardComponent, add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.metrics import time
from distributed.utils import log_errors
from tornado.ioloop import IOLoop

from flowreduce.dashboard import views
from flowreduce.dashboard.record import PACK_COLUMN
from flowreduce.dashboard.store import store_of

logger = logging.getLogger("flowreduce.dashboard")

ROUTE = "/flowreduce"
#: Milliseconds between refreshes: the cadence of the dashboard's tables (its workers page).
INTERVAL = 500

#: Fill colour per cell state (done green, failure red, moving warm, waiting grey).
STATE_COLOURS = {
    "waiting": "#d9d9d9",
    "ready": "#fee391",
    "running": "#fe9929",
    "transferring": "#6baed6",
    "done": "#74c476",
    "erred": "#de2d26",
}


def _columns(**cols: list) -> dict[str, list]:
    return cols


class FlowreducePage(DashboardComponent):
    """The calls table, the selected call's grid, its links and ranks, and the straggler line."""

    def __init__(self, scheduler, **kwargs: Any):
        self.scheduler = scheduler
        self.selected: str | None = None  # token chosen in the table; sticky while in the history
        self.shown: list[str] = []  # tokens of the table's rows, in order
        self.seen: tuple | None = None  # (store generation, selection) last shown
        self.calls = ColumnDataSource(_columns(token=[], algorithm=[], ranks=[], nbytes=[], chunks=[],
                                               transport=[], state=[], elapsed=[], predicted=[], group=[],
                                               error=[]), name="flowreduce-calls")
        self.cells = ColumnDataSource(_columns(token=[], rank=[], column=[], phase=[], state=[], colour=[], tasks=[],
                                               done=[], label=[]), name="flowreduce-grid")
        self.arrows = ColumnDataSource(_columns(x0=[], y0=[], x1=[], y1=[]), name="flowreduce-edges")
        self.ranks = ColumnDataSource(_columns(rank=[], done=[], tasks=[], fraction=[]), name="flowreduce-ranks")
        self.link_rows = ColumnDataSource(_columns(source=[], dest=[], source_worker=[], dest_worker=[], bytes=[],
                                                   rate=[], measured=[]), name="flowreduce-links")
        self.lag = ColumnDataSource(_columns(token=[], rank=[], column=[], lag=[], text=[]),
                                    name="flowreduce-straggler")
        self.spmd_jobs = ColumnDataSource(_columns(**{k: [] for k, _, _ in SPMD_JOB_COLUMNS}, run=[]),
                                          name="flowreduce-spmd-jobs")
        self.spmd_ranks = ColumnDataSource(_columns(**{k: [] for k, _, _ in SPMD_RANK_COLUMNS}, run=[], at=[]),
                                           name="flowreduce-spmd-ranks")
        self.spmd_seen: tuple | None = None

        # Tables are HTML drawn by the server (a Div): Bokeh's DataTable, in the headless Chromium
        # of the tests at least, kept its first drawing while its source changed.
        self.table = Div(text="", width=1100, height=190, styles={"overflow-y": "auto"}, tags=[self.calls])
        self.choose = Select(title="show call", value="", options=[], width=400)
        self.choose.on_change("value", self._on_select)

        # fixed sizes: a text that changes does not make the browser lay the whole page out again
        self.title = Div(text="", width=1100, height=22)
        self.legend = Div(text=" ".join(
            f"<span style='background:{c};border:1px solid #555;padding:0 6px;margin-left:8px'>&nbsp;</span> {s}"
            for s, c in STATE_COLOURS.items()), width=1100, height=22)
        # the straggler's source is drawn by no glyph: a tag of its line, so the browser holds it too
        self.straggler = Div(text="", width=1100, height=44, styles={"font-size": "15px", "font-weight": "bold"},
                             tags=[self.lag])

        self.grid = figure(title="ranks × steps (cell colour: state)", width=760, height=360, tools="",
                           x_range=Range1d(start=-0.5, end=0.5), y_range=Range1d(start=0.5, end=-0.5), toolbar_location=None)
        rects = self.grid.rect("column", "rank", width=0.86, height=0.8, source=self.cells, fill_color="colour",
                               line_color="#555555")
        # transfers between ranks, from the right edge of the sending cell to the left edge of the receiver
        self.grid.segment("x0", "y0", "x1", "y1", source=self.arrows, color="#222222", alpha=0.5, line_width=1.2)
        self.grid.text("column", "rank", text="label", source=self.cells, text_align="center",
                       text_baseline="middle", text_font_size="10px")
        self.grid.add_tools(HoverTool(renderers=[rects], tooltips=[
            ("rank", "@rank"), ("column", "@column"), ("phase", "@phase"), ("state", "@state"),
            ("tasks done", "@done / @tasks")]))
        self.steps, self.rank_ticks = FixedTicker(ticks=[]), FixedTicker(ticks=[])
        self.grid.xaxis.ticker = self.steps
        self.grid.yaxis.ticker = self.rank_ticks
        self.grid.xaxis.axis_label = "step"
        self.grid.yaxis.axis_label = "rank"
        self.grid.xgrid.visible = self.grid.ygrid.visible = False

        self.progress = figure(title="per-rank progress (tasks done)", width=330, height=360, tools="",
                               x_range=Range1d(start=0, end=1), y_range=Range1d(start=0.5, end=-0.5), toolbar_location=None)
        self.progress.hbar(y="rank", right="fraction", height=0.7, source=self.ranks, color="#74c476")
        self.progress.add_tools(HoverTool(tooltips=[("rank", "@rank"), ("done", "@done / @tasks")]))
        self.progress.yaxis.ticker = self.rank_ticks
        self.progress.xaxis.axis_label = "fraction of the rank's tasks done"

        self.links = Div(text="", width=1100, height=180, styles={"overflow-y": "auto"}, tags=[self.link_rows])
        # SPMD jobs (flowreduce.spmd): live jobs and each rank's last collective (docs/dashboard.md)
        self.spmd = Div(text="", width=1100, height=200, styles={"overflow-y": "auto"},
                        tags=[self.spmd_jobs, self.spmd_ranks])
        self.root = column(self.straggler, self.table, self.choose, self.title, self.legend, row(self.grid, self.progress), self.links,
                           self.spmd, **kwargs)

    def _on_select(self, attr, old, new) -> None:
        if new in self.shown:
            self.selected = new

    @without_property_validation
    def update(self) -> None:
        with log_errors():
            store = store_of(self.scheduler)
            if store is None:
                _assign(self.straggler, text="flowreduce has not run on this cluster yet")
                return
            self._show_spmd(store)
            seen = (store.generation, self.selected)
            if seen == self.seen and not store.calls:  # nothing in flight and nothing new: nothing moves
                return
            self.seen = seen
            now = time()
            rows = views.calls_table(store, now)
            self.shown = [r["token"] for r in rows]
            table = {k: [r[k] for r in rows] for k in self.calls.data}
            table["token"] = [t[:8] for t in table["token"]]
            _set(self.calls, table, patch=False)
            _assign(self.table, text=_html_table(CALL_COLUMNS, rows))
            _assign(self.choose, options=[("", "the oldest in flight, else the latest")] + [
                (r["token"], f"{r['token'][:8]} {r['algorithm']} {r['state']}") for r in rows])
            call = store.find(self.selected) if self.selected else None
            call = call or views.default_selection(store)
            if call is None:
                _assign(self.straggler, text="no flowreduce call yet")
                _assign(self.title, text="")
                for src in (self.cells, self.arrows, self.ranks, self.link_rows, self.lag):
                    _set(src, {k: [] for k in src.data})
                return
            self._show(call, now)

    def _show_spmd(self, store) -> None:
        """The SPMD jobs' tables; while a job is live, ask its workers for the ranks' last collectives
        (answered by the next refresh: the page never waits on a worker)."""
        jobs = getattr(store, "spmd", None)
        if jobs is None:
            return
        jobs.request_poll(self.scheduler, INTERVAL / 1000)
        seen = (jobs.generation, bool(jobs.live))
        if seen == self.spmd_seen and not jobs.live:
            return
        self.spmd_seen = seen
        now = time()
        job_rows = views.spmd_jobs(store, now)
        rank_rows = [r for r in views.spmd_ranks(store, now) if r["run"] in {j["run"] for j in job_rows[:20]}]
        _set(self.spmd_jobs, {k: [r[k] for r in job_rows] for k in self.spmd_jobs.data}, patch=False)
        _set(self.spmd_ranks, {k: [r[k] for r in rank_rows] for k in self.spmd_ranks.data}, patch=False)
        if not job_rows:
            _assign(self.spmd, text="")
            return
        _assign(self.spmd, text="<b>SPMD jobs</b> (flowreduce.spmd; live first)" + _html_table(SPMD_JOB_COLUMNS, job_rows)
                + "<b>last collective per rank</b>" + _html_table(SPMD_RANK_COLUMNS, rank_rows))

    def _show(self, call, now: float) -> None:
        cells = views.grid(call, self.scheduler)
        _set(self.cells, {
            "token": [call.token] * len(cells), "rank": [c.rank for c in cells], "column": [c.column for c in cells], "phase": [c.phase for c in cells],
            "state": [c.state for c in cells], "colour": [STATE_COLOURS[c.state] for c in cells],
            "tasks": [c.tasks for c in cells], "done": [c.done for c in cells],
            "label": [_label(c) for c in cells]})
        arrows = views.edges(call)
        _set(self.arrows, {"x0": [a[1] + 0.43 for a, _ in arrows], "y0": [a[0] for a, _ in arrows],
                           "x1": [b[1] - 0.43 for _, b in arrows], "y1": [b[0] for _, b in arrows]})
        progress = views.rank_progress(cells)
        _set(self.ranks, {k: [p[k] for p in progress] for k in self.ranks.data})
        link_rows = views.links(call, self.scheduler, now)
        _set(self.link_rows, {k: [r[k] for r in link_rows] for k in self.link_rows.data}, patch=False)
        _assign(self.links, text=_html_table(LINK_COLUMNS, link_rows))
        lag = views.straggler(call, cells, self.scheduler, now)
        _set(self.lag, {"token": [call.token], **{k: [lag[k]] for k in ("rank", "column", "lag", "text")}})
        _assign(self.straggler, text="straggler: " + lag["text"])
        rec = call.record
        detail = (f"{rec.ranks} ranks · {rec.nbytes:,} bytes each · {rec.chunks} chunk(s) · {rec.transport}"
                  if rec else "no record from the client (an older flowreduce): shown from its task keys")
        error = f" · <span style='color:#de2d26'>{_escape(call.error)}</span>" if call.error else ""
        _assign(self.title, text=f"<b>{call.algorithm}</b> call {call.token[:8]} · <b>{call.state}</b> · "
                           f"{call.elapsed(now):.1f} s · {detail}{error}")
        ranks = sorted({c.rank for c in cells}) or [0]
        cols = sorted({c.column for c in cells}) or [0]
        _assign(self.grid.x_range, start=cols[0] - 0.5, end=cols[-1] + 0.5)
        for fig in (self.grid, self.progress):
            _assign(fig.y_range, start=ranks[-1] + 0.5, end=ranks[0] - 0.5)
        _assign(self.steps, ticks=cols)
        _assign(self.rank_ticks, ticks=ranks)
        labels = views.column_labels(call)
        _assign(self.grid.xaxis[0], major_label_overrides={c: labels.get(c) or _column_label(c) for c in cols})


#: (field, title, format) of the calls table and the links table.
CALL_COLUMNS = [("token", "call", "{:.8}"), ("algorithm", "algorithm", "{}"), ("ranks", "ranks", "{}"),
                ("nbytes", "bytes/rank", "bytes"), ("chunks", "chunks", "{}"), ("transport", "transport", "{}"),
                ("state", "state", "{}"), ("elapsed", "elapsed s", "{:.1f}"), ("predicted", "predicted s", "{:.3f}"),
                ("error", "error", "{}")]
LINK_COLUMNS = [("source", "from rank", "{}"), ("dest", "to rank", "{}"), ("source_worker", "from worker", "{}"),
                ("dest_worker", "to worker", "{}"), ("bytes", "bytes so far", "bytes"),
                ("rate", "bytes/s over the call", "bytes"), ("measured", "bytes/s measured by dask", "bytes")]

SPMD_JOB_COLUMNS = [("job", "job", "{:.8}"), ("attempt", "attempt", "{}"), ("ranks", "ranks", "{}"),
                    ("workers", "workers", "{}"), ("state", "state", "{}"), ("elapsed", "elapsed s", "{:.1f}"),
                    ("error", "error", "{}")]
SPMD_RANK_COLUMNS = [("job", "job", "{:.8}"), ("rank", "rank", "{}"), ("worker", "worker", "{}"),
                     ("task", "task", "{}"), ("collective", "last collective", "{}"), ("seq", "#", "{}"),
                     ("nbytes", "bytes", "bytes"), ("ago", "ended s ago", "{:.3f}")]


def _html_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    import html

    def cell(value, fmt: str) -> str:
        if fmt == "bytes":
            text = "?" if value is None or value < 0 else format_bytes(value)
        else:
            text = "?" if value in (None, -1, -1.0) else fmt.format(value)
        return f"<td style='padding:2px 10px 2px 0;white-space:nowrap'>{html.escape(text[:120])}</td>"

    head = "".join(f"<th style='text-align:left;padding-right:10px'>{html.escape(t)}</th>" for _, t, _ in columns)
    body = "".join("<tr>" + "".join(cell(r[f], fmt) for f, _, fmt in columns) + "</tr>" for r in rows)
    return f"<table style='border-collapse:collapse;font-size:12px'><tr>{head}</tr>{body}</table>"


def _label(c: views.Cell) -> str:
    short = {"reduce-scatter": "rs", "all-gather": "ag", "output": "out"}.get(c.phase, c.phase)
    return short if c.tasks == 1 else f"{short} {c.done}/{c.tasks}"


def _column_label(column: int) -> str:
    return "pack" if column == PACK_COLUMN else str(column)


def _escape(text: str) -> str:
    import html

    return html.escape(text[:300])


def _assign(model, **values: Any) -> None:
    """Set the properties that changed (setting a Bokeh property validates it and may send it)."""
    for name, value in values.items():
        if getattr(model, name) != value:
            setattr(model, name, value)


def _set(source: ColumnDataSource, data: dict[str, list], patch: bool = True) -> None:
    """Give a source new data, sending the browser only what changed: nothing
    when nothing did, a patch of the changed cells when the rows are the same
    and few changed (a cell's state), else all. ``patch=False`` for a table's
    source: Bokeh's DataTable does not redraw on a patch."""
    old = source.data
    if list(old) == list(data) and all(len(old[k]) == len(v) for k, v in data.items()):
        patches = {k: [(i, b) for i, (a, b) in enumerate(zip(old[k], v)) if a != b] for k, v in data.items()}
        patches = {k: p for k, p in patches.items() if p}
        if not patches:
            return
        cells = sum(len(v) for v in data.values())
        if patch and sum(len(p) for p in patches.values()) * 4 < cells:
            source.patch(patches)
            return
    source.data = data


@log_errors
def flowreduce_doc(scheduler, extra, doc) -> None:
    page = FlowreducePage(scheduler, sizing_mode="fixed")
    page.update()
    add_periodic_callback(doc, page, INTERVAL)
    doc.title = "Dask: flowreduce"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def serve(scheduler) -> bool:
    """Add the page to a running scheduler's dashboard, once; list it in the
    navigation bar. False when the scheduler runs no dashboard."""
    from bokeh.server.server import BokehTornado
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables

    http = getattr(scheduler, "http_application", None)
    if http is None:
        return False
    dashboards = [a for a in getattr(http, "applications", ()) if isinstance(a, BokehTornado)]
    if not dashboards:
        return False
    variables = template_variables(scheduler)
    if "flowreduce" not in variables["pages"]:
        variables["pages"].append("flowreduce")
    if any(ROUTE in a.app_paths for a in dashboards):
        return True
    prefix = dashboards[0].prefix or ""
    app = BokehApplication({ROUTE: flowreduce_doc}, scheduler, prefix=prefix, template_variables=variables)
    http.add_application(app)
    app.initialize(IOLoop.current())  # as distributed's connect(): we run on the scheduler's loop
    app.start()
    return True
