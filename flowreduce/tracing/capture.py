"""Capture: record what a cluster did while a block of code ran.

>>> with flowreduce.trace(client) as tr:                      # doctest: +SKIP
...     out = flowreduce.allreduce(client, parts)
...     client.gather(out)          # wait inside the block
>>> tr.events[:3], tr.calls                                    # doctest: +SKIP

Everything comes from dask's own records, read in one scheduler call and one
broadcast to the workers per *flush* (at exit, and every ``flush_every``
noted calls so that dask's bounded buffers do not overflow):

* the scheduler's task stream (``TaskStreamPlugin``), read from a cursor
  (``get_task_stream_index``), so only tasks finished inside the block come
  back: their ``startstops`` give compute, transfer, disk-read/-write;
* each worker's ``transfer_incoming_log`` / ``transfer_outgoing_log`` (one
  entry per batched message, with its keys and bytes), read past a
  position (the last entry seen: their times need not grow);
* each worker's cumulative fine-grained metrics (``digests_total``) for
  ``get-data``/``gather-dep`` serialise, compress, deserialise, decompress:
  dask does not time these per message, so the difference between two
  flushes is apportioned to that worker's messages by bytes
  (``Event.estimated``);
* each worker's log of its p2p engine (:mod:`flowreduce.schedule.engine_log`:
  plan nodes computed, messages sent and received, raw worker times), read
  past a cursor, for ``method="p2p"`` calls, whose plan steps are no tasks;
* each worker's log of SPMD collectives (``Mailbox.log`` of
  :mod:`flowreduce.schedule.spmd_mailbox`: one entry per collective and rank, raw
  worker times), read past the entry read last: one event per collective
  and rank (phase: the collective), next to the rank's task;
* the scheduler's transition log (``story``) for when each rank's input
  reached memory (the ``wait-for-input`` phase);
* each worker's ``scheduler_delay`` and heartbeat latency, to align clocks
  (:mod:`flowreduce.tracing.clocks`).

Bounded memory: at most ``max_events`` events are kept (the newest);
``sample_every=k`` keeps only every k-th all-reduce call (and drops the
events of the others); ``max_calls=N`` keeps only the last N calls. Dask
itself keeps the last ``distributed.scheduler.dashboard.tasks.task-stream-length``
task records and ``distributed.admin.low-level-log-length`` transfers per
worker: if a flush finds records were lost, ``Trace.lost`` counts them.
"""

from __future__ import annotations

import warnings
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from typing import Any

from flowreduce import keys as keymod
from flowreduce.dashboard.record import parse_spmd_key
from flowreduce.phases import ARRIVE, HAND_IN, OTHER, TASK_PHASES, TRANSFER
from flowreduce.schedule import records
from flowreduce.tracing import registry
from flowreduce.tracing.clocks import WorkerClock, choose_mode
from flowreduce.tracing.events import KEY_PHASE, Event
from flowreduce.tracing.registry import Call

DIGESTS = {
    "serialise": (("get-data", "serialize", "seconds"), ("get-data", "compress", "seconds")),
    "deserialise": (("gather-dep", "deserialize", "seconds"), ("gather-dep", "decompress", "seconds")),
}


# -- what runs on the scheduler and the workers ---------------------------------
def _scheduler_snapshot(cursor: int | None, input_keys: list, dask_scheduler: Any = None) -> dict:
    from distributed.metrics import time

    s = dask_scheduler
    index = s.get_task_stream_index()
    records = s.get_task_stream(start_index=cursor) if cursor is not None else []
    ready = {}
    for k in input_keys:
        times = [t.timestamp for t in s.story(k) if t.finish == "memory"]
        if times:
            ready[k] = max(times)
    return {
        "index": index,
        "time": time(),
        "records": records,
        "ready": ready,
        "host": s.address,
        "workers": {w: ws.host for w, ws in s.workers.items()},
    }


def entry_mark(entry: dict) -> tuple:
    """What identifies one entry of a worker's transfer log (its cursor)."""
    return (entry["start"], entry["stop"], str(entry["who"]), entry["total"])


def entries_since(log: Any, mark: tuple | str | None) -> list[dict]:
    """Entries of a transfer log appended after the one ``mark``
    identifies (``""``: the log was empty; ``None``: none at all). By
    position, not by time: a log's times are shifted by an estimate that
    changes between entries, so they need not grow monotonically."""
    if mark is None:
        return []
    entries = list(log)
    if mark != "":
        for i in range(len(entries) - 1, -1, -1):
            if entry_mark(entries[i]) == mark:
                return [dict(e) for e in entries[i + 1:]]
    return [dict(e) for e in entries]  # the marked entry rotated out: everything is new


def spmd_since(log: Any, mark: int | str | None) -> tuple[list[tuple], int, bool]:
    """Records of an SPMD mailbox's log (:class:`flowreduce.schedule.spmd_log.Log`) past the one ``mark``
    names (its position; ``""``: everything kept; None: none, only where it ends), as plain tuples
    ``(run, rank, *event)``; the new mark; whether records were lost (overwritten before this read)."""
    return log.since(-1 if mark == "" else mark)


def _worker_snapshot(marks: dict, shm_marks: dict | None = None, engine_marks: dict | None = None,
                     spmd_marks: dict | None = None, spmd_tasks: list | None = None, dask_worker: Any = None) -> dict:
    import os

    from distributed.metrics import time

    from flowreduce.kernels.shm import COPIES
    from flowreduce.schedule.p2p import engine_of
    from flowreduce.schedule.spmd_mailbox import mailbox_of

    w = dask_worker
    found = engine_of(w)
    elog = found.log if found is not None else None
    engine, engine_lost = elog.since((engine_marks or {}).get(w.address, 0) if engine_marks is not None else None) \
        if elog is not None else ([], 0)
    box = mailbox_of(w)
    spmd, spmd_last, spmd_lost = spmd_since(box.log, (spmd_marks or {}).get(w.address, "")
                                            if spmd_marks is not None else None) if box is not None \
        else ([], "", False)
    begun = [] if box is None else [(run, rank, box.begun[run, rank]) for run, rank in spmd_tasks or ()
                                    if (run, rank) in box.begun]
    copies = list(COPIES) if shm_marks is not None else []  # None: only where the log ends
    shm_mark = (shm_marks or {}).get(w.address, 0)
    in_mark, out_mark = marks.get(w.address, ("", ""))  # a worker that joined since: all of it is new
    incoming = entries_since(w.transfer_incoming_log, in_mark)
    received = []  # raw arrival times of fetches, to know the shift of each
    if incoming:
        oldest = min(e["start"] for e in incoming) - 10.0
        for entry in reversed(w.state.log):
            if entry[-1] < oldest:
                break
            if entry[0] == "receive-dep":
                received.append((entry[1], [repr(k) for k in entry[2]], entry[-1]))
    return {
        "time": time(),
        "shift": w.scheduler_delay,
        "latency": w.latency,
        "digests": {k: w.digests_total.get(k, 0.0) for ks in DIGESTS.values() for k in ks},
        "incoming": incoming,
        "received": received,
        "outgoing": entries_since(w.transfer_outgoing_log, out_mark),
        "last_in": entry_mark(w.transfer_incoming_log[-1]) if w.transfer_incoming_log else "",
        "last_out": entry_mark(w.transfer_outgoing_log[-1]) if w.transfer_outgoing_log else "",
        "pid": os.getpid(),
        "shm": [c for c in copies if c[0] > shm_mark],
        "shm_last": COPIES[-1][0] if COPIES else 0,
        "engine": engine,
        "engine_lost": engine_lost,
        "engine_last": elog.count if elog is not None else 0,
        "spmd": spmd,
        "spmd_last": spmd_last,
        "spmd_lost": spmd_lost,
        "spmd_begun": begun,
    }


def _attempt(run: str) -> str:
    """``, attempt N`` for a p2p run restarted N times (run id ``"<token>.<N>"``), else nothing."""
    tail = run.rpartition(".")[2]
    return f", attempt {tail}" if tail not in ("", "0") else ""


def _key_of(text: str) -> Any:
    """A task key back from its repr (as events keep it)."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None


def _raw_time(stimulus_id: str, prefix: str) -> float | None:
    """The raw worker time dask put in a stimulus id, if it did."""
    if stimulus_id.startswith(prefix):
        try:
            return float(stimulus_id[len(prefix):])
        except ValueError:
            return None
    return None


def _host(addr: str | None) -> str:
    if not addr:
        return ""
    from distributed.comm import get_address_host

    try:
        return get_address_host(addr)
    except Exception:
        return addr


# -- the trace ------------------------------------------------------------------
class Trace:
    """Events recorded while a ``with flowreduce.trace(client)`` block ran.

    Attributes
    ----------
    events : list of Event
        Sorted by start time (a copy; see :meth:`iter_events`).
    calls : dict
        ``token -> Call`` of the traced all-reduce calls, in call order.
    clocks : dict
        ``worker -> WorkerClock``: how each worker's times were aligned.
    origin, end : float
        Scheduler time when the trace started and stopped (epoch seconds).
    input_ready : dict
        ``token -> [aligned time each rank's input reached memory]``.
    lost : dict
        Records dask dropped before a flush could read them.
    """

    def __init__(
        self,
        client: Any,
        *,
        align: str = "auto",
        max_events: int = 200_000,
        max_calls: int | None = None,
        sample_every: int = 1,
        flush_every: int = 8,
    ) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be >= 1 or None, got {max_calls}")
        choose_mode(align, True)  # validates
        self.client = client
        self._asked: set[str] = set()  # tokens asked of the scheduler (_lookup)
        self.align = align
        self.max_calls = max_calls
        self.sample_every = sample_every
        self.flush_every = flush_every
        self._events: deque[Event] = deque(maxlen=max_events)
        self.calls: dict[str, Call] = {}
        self.clocks: dict[str, WorkerClock] = {}
        self.input_ready: dict[str, list[float | None]] = {}
        self.lost = {"task_records": 0, "transfer_log": 0, "events_over_max": 0, "engine_log": 0, "spmd_log": 0}
        self.origin: float = 0.0
        self.end: float | None = None
        self._order: list[str] = []  # tokens by first sight
        self._added: list[str] = []  # tokens told by add() (allreduce notes its own calls), in call order
        self._skipped: set[str] = set()
        self._pending: dict[str, Call] = {}  # calls whose input readiness is unresolved
        self._cursor: int | None = None
        self._marks: dict[str, tuple] = {}  # worker -> fingerprints of its last logged transfers
        self._shm_marks: dict[str, int] = {}  # worker -> sequence number of its last logged shared-memory copy
        self._engine_marks: dict[str, int] = {}  # worker -> entries of its p2p engine log read so far
        self._spmd_marks: dict[str, tuple | str] = {}  # worker -> (run, rank, seq) of its SPMD log's entry read last
        self._spmd_begun: dict[tuple[str, int], float] = {}  # (run, rank) -> raw time its communicator opened
        self._arrivals: dict[tuple, tuple] = {}  # (dest, run, chunk, node) -> (aligned time, values, bytes)
        self._digests: dict[str, dict] = {}
        self._added_since_flush = 0
        self._scheduler_host = ""
        self._worker_host: dict[str, str] = {}
        self._worker_rank: dict[str, int] = {}

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> Trace:
        snap = self.client.run_on_scheduler(_scheduler_snapshot, None, [])
        self._cursor = snap["index"]
        self.origin = snap["time"]
        self._scheduler_host = _host(snap["host"])
        self._worker_host = dict(snap["workers"])
        marks = {w: (None, None) for w in self._worker_host}  # read nothing yet: only where the logs end
        for w, ws in self.client.run(_worker_snapshot, marks).items():
            self._marks[w] = (ws["last_in"], ws["last_out"])
            self._shm_marks[w] = ws["shm_last"]
            self._engine_marks[w] = ws["engine_last"]
            self._spmd_marks[w] = ws["spmd_last"]
            self._digests[w] = ws["digests"]
            self._clock(w, ws)
        registry.activate(self)
        return self

    def stop(self) -> Trace:
        """Collect what is left and stop listening (``__exit__`` calls it)."""
        registry.deactivate(self)
        self.flush()
        _warn_lost(self)
        return self

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- calls ------------------------------------------------------------------
    def add(self, futures: Sequence[Any], inputs: Sequence[Any] = ()) -> None:
        """Tell the trace about an all-reduce call (its output futures and,
        for the wait-for-input phase, its input futures)."""
        self.add_call(registry.describe_call(futures, inputs))

    def add_call(self, call: Call) -> None:
        """Tell the trace about an all-reduce call described by a :class:`Call`."""
        old = self.calls.get(call.token)
        if old is not None and (old.input_keys or not call.input_keys):
            return
        if call.token in self._skipped:
            return
        if self._see(call.token, call) and call.token not in self._added:
            self._added.append(call.token)
        self._added_since_flush += 1
        if self.flush_every and self._added_since_flush >= self.flush_every:
            self.flush()

    def _lookup(self, token: str) -> Call | None:
        """The call of ``token`` from the schedule's records, else (a call
        placed on arrival, whose plan its barrier chose) from the scheduler,
        asked once per token."""
        call = registry.lookup(token)
        if call is None and token not in self._asked:
            self._asked.add(token)
            from flowreduce.schedule import arrivals  # here: `import flowreduce` imports no distributed

            try:
                found = arrivals.record_of(self.client, token, [], wait=0)
            except Exception:  # a scheduler without the engine's plugin: not such a call
                found = None
            if found is not None:
                records.remember(self.client, (found,))
                call = registry.lookup(token)
        return call

    def _see(self, token: str, call: Call | None) -> bool:
        """Register a token; False if sampling drops it."""
        if token in self._skipped:
            return False
        if token not in self.calls and token not in self._order:
            n = len(self._order) + len(self._skipped)
            if n % self.sample_every:
                self._skipped.add(token)
                return False
            self._order.append(token)
        if call is not None:
            self.calls[token] = call
            if call.input_keys:
                self._pending[token] = call
            for r, w in enumerate(call.workers):
                self._worker_rank.setdefault(w, r)
        if self.max_calls is not None and len(self._order) > self.max_calls:
            self._forget(self._order[: len(self._order) - self.max_calls])
        return True

    def _forget(self, tokens: list[str]) -> None:
        gone = set(tokens)
        self._order = [t for t in self._order if t not in gone]
        self._added = [t for t in self._added if t not in gone]
        self._skipped |= gone
        for t in gone:
            self.calls.pop(t, None)
            self._pending.pop(t, None)
            self.input_ready.pop(t, None)
        kept = [e for e in self._events if e.token not in gone]
        self._events.clear()
        self._events.extend(kept)

    # -- reading dask's records -----------------------------------------------------
    def _clock(self, w: str, ws: dict) -> WorkerClock:
        clock = self._clock_for(w)
        clock.latency = max(clock.latency, ws["latency"])
        clock.add_sample(ws["time"] + ws["shift"], ws["shift"])
        for e in ws["outgoing"]:
            clock.add_sample(e["stop"], (e["start"] + e["stop"]) / 2 - e["middle"])
        return clock

    def _clock_for(self, w: str) -> WorkerClock:
        """The clock of a worker that may have left (no samples: no shift)."""
        if w not in self.clocks:
            host = self._worker_host.get(w) or _host(w)
            same = host == self._scheduler_host
            self.clocks[w] = WorkerClock(w, host, same, mode=choose_mode(self.align, same))
        return self.clocks[w]

    def flush(self) -> None:
        """Read what dask recorded since the last flush into events."""
        self._added_since_flush = 0
        pending_keys = [k for c in self._pending.values() for k in c.input_keys]
        snap = self.client.run_on_scheduler(_scheduler_snapshot, self._cursor, pending_keys)
        if self._cursor is not None:
            self.lost["task_records"] += max(0, snap["index"] - self._cursor - len(snap["records"]))
        self._cursor = snap["index"]
        self.end = snap["time"]
        self._worker_host.update(snap["workers"])
        spmd_tasks = [p for p in (parse_spmd_key(r["key"]) for r in snap["records"]) if p is not None]
        workers = self.client.run(_worker_snapshot, self._marks, self._shm_marks, self._engine_marks,
                                  self._spmd_marks, spmd_tasks)
        self._spmd_begun = {(run, rank): t for ws in workers.values() for run, rank, t in ws["spmd_begun"]}
        for w, ws in workers.items():
            self._clock(w, ws)
        new: list[Event] = []
        fallback = self._task_events(snap["records"], new)
        self._transfer_events(workers, fallback, new)
        self._shm_events(workers, new)
        self._engine_events(workers, new)
        self._spmd_events(workers, new)
        self._wait_events(snap["ready"], new)
        new.sort(key=lambda e: (e.start, e.stop))
        if self._events.maxlen is not None:
            self.lost["events_over_max"] += max(0, len(self._events) + len(new) - self._events.maxlen)
        self._events.extend(new)

    def _phase_of(self, info: dict) -> tuple[str, int | None]:
        """Trace phase and plan node of a flowreduce task."""
        call = self.calls.get(info["token"])
        if info["phase"] != "output":
            return KEY_PHASE[info["phase"]], info["node"]
        if call is None:
            return "copy", None
        if call.method == "p2p":  # awaits the engine's result (on the event loop): the engine's events show the work
            return OTHER, None
        plan, r = call.plan, info["rank"]
        if plan.output_is_separate(r):
            return "copy", None
        final = plan.nodes[plan.finals[r]]
        return ("reduce" if final.kind == "reduce" else "copy"), final.id

    def _task_events(self, records: list[dict], out: list[Event]) -> list[dict]:
        fallback = []
        for msg in records:  # first learn which worker holds which rank
            info = keymod.parse(msg["key"])
            if info is not None and info["phase"] in ("split", HAND_IN, ARRIVE):
                self._worker_rank.setdefault(msg["worker"], info["rank"])
        for msg in records:
            key, w = msg["key"], msg["worker"]
            clock = self._clock_for(w)
            info = keymod.parse(key)
            base: dict[str, Any] = {"worker": w, "host": clock.host, "key": repr(key),
                                    "nbytes": int(msg.get("nbytes") or 0)}
            if info is not None:
                if not self._see(info["token"], self.calls.get(info["token"]) or self._lookup(info["token"])):
                    continue
                phase, node = self._phase_of(info)
                call = self.calls.get(info["token"])
                step = info.get("step")
                chunk = info.get("chunk")
                if info["phase"] == "output" and call is not None and node is not None:
                    step, chunk = call.plan.nodes[node].step, 0
                base.update(rank=info["rank"], algorithm=info["algorithm"], token=info["token"],
                            step=step, chunk=chunk, node=node)
            else:
                phase = "user-compute"
                spmd = parse_spmd_key(key)
                if spmd is not None:  # an SPMD job's rank: its collectives are events of their own (_spmd_events)
                    base.update(rank=spmd[1], job=spmd[0])
                else:
                    base["rank"] = self._worker_rank.get(w)
            raw_stop = _raw_time(msg.get("stimulus_id", ""), "task-finished-")
            spmd_begun = self._spmd_begun.get(parse_spmd_key(key) or ("", -1)) if info is None else None
            for ss in msg["startstops"]:
                action = ss["action"]
                if action == "transfer":
                    fallback.append({**ss, "worker": w, "cause": key})
                    continue
                shifted = action not in ("disk-read", "disk-write")
                exact = None
                if action == "compute" and spmd_begun is not None:
                    # an SPMD rank: dask's start is its thread's, a few us before the communicator opened;
                    # the stop's raw time (the event loop's) lags the thread by the hop between them
                    exact = ss["start"] - spmd_begun
                    clock.add_sample(ss["start"], exact)
                elif action == "compute" and raw_stop is not None:
                    exact = ss["stop"] - raw_stop
                    clock.add_sample(ss["stop"], exact)
                start, stop = clock.align_interval(ss["start"], ss["stop"], shifted, exact)
                ph = {"compute": phase, "disk-write": "serialise", "disk-read": "deserialise",
                      "deserialize": "deserialise"}.get(action, "other")
                out.append(Event(ph, start, stop, detail=action, **base))
        return fallback

    def _transfer_events(self, workers: dict[str, dict], fallback: list[dict], out: list[Event]) -> None:
        est: dict[str, dict[str, float]] = {}
        for w, ws in workers.items():
            prev = self._digests.get(w, {})
            est[w] = {ph: sum(ws["digests"].get(k, 0.0) - prev.get(k, 0.0) for k in ks)
                      for ph, ks in DIGESTS.items()}
            self._digests[w] = ws["digests"]
            self._marks[w] = (ws["last_in"], ws["last_out"])
        seen = set()
        sent_bytes = {w: sum(e["total"] for e in ws["outgoing"]) for w, ws in workers.items()}
        recv_bytes = {w: sum(e["total"] for e in ws["incoming"]) for w, ws in workers.items()}
        outgoing = {(w, e["who"], frozenset(map(repr, e["keys"]))): e
                    for w, ws in workers.items() for e in ws["outgoing"]}
        for dest, ws in workers.items():
            dclock = self.clocks[dest]
            arrived: dict[tuple, list[float]] = defaultdict(list)
            for who, ks, t in ws.get("received", ()):
                arrived[(who, frozenset(ks))].append(t)
            for e in ws["incoming"]:
                src = e["who"]
                seen.add((dest, round(e["start"], 6)))
                all_keys = frozenset(map(repr, e["keys"]))
                raws = arrived.get((src, all_keys), [])
                exact = None
                if raws:
                    raw = min(raws, key=lambda t: abs(e["stop"] - t))
                    exact = e["stop"] - raw
                start, stop = dclock.align_interval(e["start"], e["stop"], True, exact)
                sent = outgoing.get((src, dest, all_keys))
                s = est.get(src, {}).get("serialise", 0.0)
                if sent is not None and s > 0 and sent_bytes.get(src):  # the sender's view of the message
                    sclock = self.clocks[src]
                    s0, s1 = sclock.align_interval(sent["start"], sent["stop"], True,
                                                   (sent["start"] + sent["stop"]) / 2 - sent["middle"])
                else:
                    sent = None
                d = est.get(dest, {}).get("deserialise", 0.0)
                # dask batches every key a worker wants from one peer into one
                # message, so a message can carry keys of several concurrent
                # calls: one event per call, each with its own keys and bytes
                groups: dict[str, list] = {}
                for k in e["keys"]:
                    info = keymod.parse(k)
                    groups.setdefault(info["token"] if info else "", []).append((k, info))
                logged_total = sum(v or 0 for v in e["keys"].values()) or 1
                for token, members in groups.items():
                    if token and not self._see(token, self.calls.get(token) or self._lookup(token)):
                        continue
                    first = members[0][1]
                    meta: dict[str, Any] = {}
                    if first is not None:
                        meta = {"algorithm": first["algorithm"], "token": token,
                                "step": first.get("step"), "chunk": first.get("chunk"), "node": first.get("node")}
                    key_bytes = tuple(self._sent_bytes(k, i, e["keys"][k]) for k, i in members)
                    share = sum(e["keys"][k] or 0 for k, _ in members) / logged_total if len(groups) > 1 else 1.0
                    common = dict(keys=tuple(repr(k) for k, _ in members), key_bytes=key_bytes,
                                  nbytes=sum(key_bytes), source=src, dest=dest, key=repr(members[0][0]),
                                  rank=self._worker_rank.get(dest), **meta)
                    detail = "transfer_incoming_log" if len(groups) == 1 else "transfer_incoming_log (shared message)"
                    out.append(Event("transfer", start, stop, dest, dclock.host, detail=detail, **common))
                    if d > 0 and recv_bytes[dest]:
                        dur = min(d * e["total"] * share / recv_bytes[dest], stop - start)
                        out.append(Event("deserialise", stop - dur, stop, dest, dclock.host, estimated=True,
                                         detail="metric:gather-dep.deserialize", **common))
                    if sent is not None:
                        dur = min(s * sent["total"] * share / sent_bytes[src], s1 - s0)
                        out.append(Event("serialise", s0, s0 + dur, src, sclock.host, estimated=True,
                                         detail="metric:get-data.serialize",
                                         **{**common, "rank": self._worker_rank.get(src)}))
        for ss in fallback:  # transfers the logs no longer held
            w = ss["worker"]
            if (w, round(ss["start"], 6)) in seen:
                continue
            self.lost["transfer_log"] += 1
            clock = self.clocks[w]
            info = keymod.parse(ss["cause"]) or {}
            out.append(Event("transfer", *clock.align_interval(ss["start"], ss["stop"]), w, clock.host,
                             rank=self._worker_rank.get(w), source=ss.get("source") or "", dest=w,
                             key=repr(ss["cause"]), token=info.get("token", ""),
                             algorithm=info.get("algorithm", ""), detail="task-stream transfer (no log entry)"))

    def _shm_events(self, workers: dict[str, dict], out: list[Event]) -> None:
        """Copies through shared memory, from each worker's log
        (:data:`flowreduce.kernels.shm.COPIES`, raw worker times)."""
        by_pid = {ws["pid"]: w for w, ws in workers.items()}
        for w, ws in workers.items():
            if ws["shm"]:
                self._shm_marks[w] = ws["shm"][-1][0]
            clock = self.clocks[w]
            for _, t0, t1, nbytes, direction, owner, key in ws["shm"]:
                info = keymod.parse(_key_of(key)) or {}
                token = info.get("token", "")
                if not token or not self._see(token, self.calls.get(token) or self._lookup(token)):
                    continue
                # "read": w read the owner's segment; "write": w wrote into its own
                source = by_pid.get(owner, "") if direction == "read" else w
                dest = w
                start, stop = clock.align_interval(t0, t1, shifted=False)
                out.append(Event("shm-copy", start, stop, w, clock.host, rank=info.get("rank"),
                                 algorithm=info.get("algorithm", ""), token=token, step=info.get("step"),
                                 chunk=info.get("chunk"), node=info.get("node"), key=key, nbytes=int(nbytes),
                                 source=source, dest=dest, detail=f"shm-{direction}"))

    def _engine_events(self, workers: dict[str, dict], out: list[Event]) -> None:
        """What p2p engines did (:mod:`flowreduce.schedule.engine_log`, raw
        worker times): a ``reduce`` or ``copy`` event per plan node computed
        (the trace phase of its plan phase), keyed as the task of that node
        and chunk would be under ``method="tasks"``; a ``transfer`` per
        message, on the receiver, from the sender's send to the message
        handed to the receiver's run (the rpc's round trip in ``detail``)."""
        from flowreduce.schedule.engine_log import BEGIN, NODE, RECV, SEND, token_of
        from flowreduce.tracing.summary import engine_run_over_workers, plan_ranks

        sends = []
        names: dict[str, list[int] | None] = {}  # token -> the call's rank of each plan rank (p2p over workers)
        for w, ws in workers.items():
            self._engine_marks[w] = ws["engine_last"]
            self.lost["engine_log"] += ws["engine_lost"]
            clock = self._clock_for(w)
            for e in ws["engine"]:
                kind = e[0]
                if kind == BEGIN:
                    continue
                if kind == SEND:
                    sends.append((w, e))
                    continue
                token = token_of(e[1])
                if not self._see(token, self.calls.get(token) or self._lookup(token)):
                    continue
                if kind == RECV:
                    t = clock.align_interval(e[2], e[2], shifted=False)[0]
                    self._arrivals[(w, e[1], e[3], e[4])] = (t, e[5], e[6])
                    continue
                call = self.calls.get(token)
                if kind != NODE or call is None or not 0 <= e[3] < len(call.plan.nodes):
                    continue
                _, run, c, n, t0, t1, nbytes, executor = e
                node = call.plan.nodes[n]
                start, stop = clock.align_interval(t0, t1, shifted=False)
                if token not in names:
                    names[token] = plan_ranks(call) if engine_run_over_workers(call) else None
                rank = names[token][node.rank] if names[token] is not None else node.rank  # type: ignore[index]
                out.append(Event(KEY_PHASE[node.phase], start, stop, w, clock.host, rank=rank,
                                 algorithm=call.algorithm, step=node.step, chunk=c, token=token, node=n,
                                 key=repr(keymod.node_key(call.algorithm, node.phase, token, node.step, node.rank,
                                                          c, n)),
                                 nbytes=int(nbytes), detail="p2p engine" + (" (executor)" if executor else "")
                                 + _attempt(run)))
        if len(self._arrivals) > 1_000_000:  # arrivals whose sends were never read (sampled out calls)
            self._arrivals.clear()
        for src, (_, run, dest, t0, t1, values, nbytes, ids) in sends:
            token = token_of(run)
            call = self.calls.get(token) or self._lookup(token)
            if not self._see(token, call) or call is None:
                continue
            call = self.calls.get(token, call)
            plan = call.plan
            start, rtt_stop = self._clock_for(src).align_interval(t0, t1, shifted=False)
            arrived = self._arrivals.pop((dest, run, ids[0], ids[1]), None) if ids else None
            stop = max(start, arrived[0]) if arrived is not None else rtt_stop
            keys, key_bytes = [], []
            seg = call.nbytes / max(plan.segments * plan.chunks, 1)
            for i in range(0, len(ids), 2):
                c, n = ids[i], ids[i + 1]
                node = plan.nodes[n]
                keys.append(repr(keymod.node_key(call.algorithm, node.phase, token, node.step, node.rank, c, n)))
                key_bytes.append(int(round(node.width * seg)))
            first = plan.nodes[ids[1]] if ids else None
            dclock = self._clock_for(dest)
            ranks = [r for r, w in enumerate(call.workers) if w == dest]
            out.append(Event(TRANSFER, start, stop, dest, dclock.host, rank=min(ranks, default=None),
                             algorithm=call.algorithm, token=token, step=first.step if first else None,
                             chunk=ids[0] if ids else None, node=ids[1] if ids else None,
                             key=keys[0] if keys else "", nbytes=int(nbytes), source=src, dest=dest,
                             keys=tuple(keys), key_bytes=tuple(key_bytes),
                             detail=f"p2p message: {values} value(s), rpc round trip {(t1 - t0) * 1e3:.3f} ms"
                                    + ("" if arrived is not None else "; arrival not logged: stop is the reply")
                                    + _attempt(run)))

    def _spmd_events(self, workers: dict[str, dict], out: list[Event]) -> None:
        """SPMD collectives (:mod:`flowreduce.schedule.spmd_mailbox`'s log, raw worker times): one event per
        collective and rank, its phase the collective, its key its rank's task's (the
        ``user-compute`` event it lies in)."""
        from flowreduce.dashboard.record import SPMD_PREFIX

        for w, ws in workers.items():
            self._spmd_marks[w] = ws["spmd_last"]
            self.lost["spmd_log"] += int(ws["spmd_lost"])
            clock = self._clock_for(w)
            for run, rank, collective, seq, t0, t1, nbytes, sent, received, peers, path, algorithm in ws["spmd"]:
                start, stop = clock.align_interval(t0, t1, shifted=False)
                job = run.partition("/")[0]  # a subgroup's collective lies in its job's rank task (rank: the job's)
                out.append(Event(collective, start, stop, w, clock.host, rank=int(rank), algorithm=algorithm,
                                 key=repr(f"{SPMD_PREFIX}{job}-{rank}"),
                                 nbytes=int(nbytes), job=run, seq=int(seq), peers=tuple(peers), path=path,
                                 sent=int(sent), received=int(received),
                                 detail=f"spmd {collective} #{seq}" + _attempt(run.partition("/")[0])))

    def _sent_bytes(self, key: Any, info: dict | None, logged: Any) -> int:
        """Bytes a fetch of ``key`` carried. Dask logs its size estimate;
        for a view of a rank's input flowreduce makes that estimate tiny (so
        Dask's memory manager does not count the input twice: see
        ``_kernels.Views``), so a view's size comes from the plan instead."""
        call = self.calls.get(info["token"]) if info and info.get("phase") == "split" else None
        if info is None or call is None or call.plan is None:
            return int(logged or 0)
        node = call.plan.nodes[info["node"]]
        return int(round(node.width * call.nbytes / call.plan.segments / call.plan.chunks))

    def _wait_events(self, ready_sched: dict, out: list[Event]) -> None:
        computed = {e.key: e.stop for e in (*self._events, *out) if e.phase == "user-compute"}
        for token, call in list(self._pending.items()):
            times: list[float | None] = []
            for k in call.input_keys:
                t = computed.get(repr(k), ready_sched.get(k))
                times.append(None if t is None else max(t, self.origin))
            self.input_ready[token] = times
            del self._pending[token]
            known = [t for t in times if t is not None]
            if not known:
                continue
            t0 = min(known)
            by_rank = {r: w for w, r in {**self._worker_rank, **self.ranks_of(token)}.items()}
            for r, t in enumerate(times):
                if t is None or t <= t0:
                    continue
                w = call.workers[r] if r < len(call.workers) else by_rank.get(r, "")
                out.append(Event("wait-for-input", t0, t, w, self.clocks[w].host if w in self.clocks else "",
                                 rank=r, algorithm=call.algorithm, token=token, key=repr(call.input_keys[r]),
                                 detail="first input ready -> this rank's input ready"))

    # -- views ------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        return sorted(self._events, key=lambda e: (e.start, e.stop))

    def iter_events(self, token: str | None = None) -> Iterator[Event]:
        for e in self._events:
            if token is None or e.token == token:
                yield e

    @property
    def last_call(self) -> Call | None:
        """The call made (or added) last. A call only *seen* in dask's records
        does not count: an earlier call's late records (a transfer log read
        after the block opened, clocks aligned within their uncertainty) can
        fall inside the window."""
        told = [t for t in self._added if t in self.calls]
        if told:
            return self.calls[told[-1]]
        return self.calls[self._order[-1]] if self._order and self._order[-1] in self.calls else None

    def ranks_of(self, token: str) -> dict[str, int]:
        """worker -> the lowest rank it holds in call ``token``."""
        call = self.calls.get(token)
        out: dict[str, int] = {}
        if call is not None:
            for r, w in enumerate(call.workers):
                out.setdefault(w, r)
        for e in self.iter_events(token):
            if e.rank is not None and e.phase in TASK_PHASES:
                out[e.worker] = min(out.get(e.worker, e.rank), e.rank)
        return out

    def metadata(self) -> dict[str, Any]:
        """What a reader needs besides the events: the calls, the sizes and
        how clocks were aligned (and how well)."""
        import dask
        import distributed

        calls = []
        for t in self._order:
            c = self.calls.get(t)
            if c is None:
                continue
            card = c.plan.cost(c.nbytes)
            calls.append({"token": t, "algorithm": c.algorithm, "ranks": c.plan.ranks,
                          "chunks": c.plan.chunks, "segments": c.plan.segments,
                          "options": dict(c.plan.options), "nbytes_per_rank": c.nbytes,
                          "predicted_s": c.predicted, "tasks": card.tasks, "messages": card.messages,
                          "bytes_on_wire": card.bytes_on_wire, "workers": list(c.workers)})
        unc = max((c.uncertainty for c in self.clocks.values()), default=0.0)
        return {
            "origin": self.origin,
            "end": self.end,
            "timeline": "scheduler clock (epoch seconds); exported times are relative to origin",
            "calls": calls,
            "clock_alignment": {
                "policy": self.align,
                "max_uncertainty_s": unc,
                "workers": {w: c.describe() for w, c in sorted(self.clocks.items())},
                "how": "see flowreduce.tracing.clocks: dask shifts worker times by scheduler_delay "
                       "(heartbeat estimate); on the scheduler's host that shift is undone",
            },
            "lost": dict(self.lost),
            "sample_every": self.sample_every,
            "max_calls": self.max_calls,
            "versions": {"dask": dask.__version__, "distributed": distributed.__version__},
        }


def trace(client: Any, **options: Any) -> Trace:
    """Record a timeline of everything the cluster does inside a ``with`` block.

    Parameters
    ----------
    client : distributed.Client
    align : {"auto", "host", "dask"}
        Clock alignment policy (:mod:`flowreduce.tracing.clocks`).
    max_events : int
        Keep at most this many events (the newest). Default 200,000.
    max_calls : int, optional
        Keep only the last N all-reduce calls' events.
    sample_every : int
        Keep every k-th all-reduce call only (default 1: all).
    flush_every : int
        Read dask's buffers after this many noted calls (default 8; 0: only
        at exit).

    Returns
    -------
    Trace
        Use as a context manager; wait for the results inside the block.

    Examples
    --------
    >>> with flowreduce.trace(client) as tr:                  # doctest: +SKIP
    ...     out = flowreduce.allreduce(client, parts, algorithm="butterfly")  # noted by itself
    ...     client.gather(out)
    >>> flowreduce.tracing.to_chrome(tr, "trace.json")        # doctest: +SKIP
    """
    return Trace(client, **options)


def _warn_lost(tr: Trace) -> None:  # pragma: no cover - only on overflow
    if any(tr.lost.values()):
        warnings.warn(f"trace lost records: {tr.lost}; flush more often or raise dask's buffer lengths",
                      stacklevel=3)
