"""The cost model, and ``auto``: pick the plan the model says is fastest.

The textbook α-β-γ model (Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005) counts messages and bytes; on a
task scheduler the latency term is per *dependent level* of the graph, plus
a per-task overhead in the scheduler. The model here reads every term off
the plan itself (:meth:`Plan.cost`), so a new algorithm needs no formula.

**One host** (``groups`` not given, or one group)::

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

**Several hosts** (``groups``: the ranks of each host): every transfer of
the plan is either *intra* (both ranks on one host) or *inter* (it crosses
the sender's and the receiver's host links), two link classes with their own
latency α and seconds per byte β (:class:`Link`)::

    T = call + tasks·task + Σ_levels α(level) + body

    α(level)  = α of the slowest class a transfer of that dependent level uses
                (``level`` when it has no transfer)
    t_l       = max over hosts of max(bytes in, bytes out) of the host link at level l · β_inter
                + max over ranks of intra bytes in + out at level l · β_intra
    link      = max(Σ t_l / chunks + (chunks-1)/chunks · max t_l,     (chunks pipeline the levels)
                    max over hosts of max(all bytes in, all bytes out) · β_inter)   (a link's capacity)
    body      = max(link, compute) + min(link, compute)/chunks + copy, or, when the ranks
                share C cores, max(link + copy, all CPU work / C) as above

A host link is full duplex: a level where every host sends and receives the
same amount (butterfly, ring) costs that amount once, a reduce to one root
costs the root's whole inbound volume. ``hierarchical`` is priced by the
same rule: its inner levels use the intra class, its outer level the inter
class.

**deterministic=True** (a float sum or mean, ordered by the reference tree):
a message carries the partial sums of the tree covering the ranks its value
combines, one array each, so plans whose merges are not the tree's siblings
(ring, tree, radix 4 at some p) move more bytes than the default. A model
with ``partials`` set (:meth:`CostModel.carrying_partials`, what a call
under True is priced with) weighs every transfer's bytes by the partial sums
it carries (:func:`flowreduce.algorithms.partials.carried`) in all the terms
above: bytes on the wire, the busiest rank's, the longest chain's and the
links' loads.

``allreduce`` tells the model how many cores the ranks share (per host, the
fewer of its CPUs and its ranks) and which ranks share a host, learnt from
the workers in the same broadcast that checks the inputs. Constants default
to values measured for dask.distributed over loopback TCP on this project's
2-core machine (see README, "Measured on this machine"); the inter class
defaults to 10 Gbit/s Ethernet. ``flowreduce calibrate`` measures α and β of
both classes on a running cluster and writes them to a file:
``CostModel.from_file(path)``, ``--cost-model PATH`` on ``bench`` and
``trace``, or the dask config key ``flowreduce.cost-model`` (environment:
``DASK_FLOWREDUCE__COST_MODEL``) to use it everywhere.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from itertools import product
from typing import Any

from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms.hierarchical import ALLREDUCE_ALGORITHMS, SCATTER_ALGORITHMS
from flowreduce.algorithms.ir import CostCard, Plan
from flowreduce.algorithms.partials import Carried, carried
from flowreduce.algorithms.sparse import SparsePlan

logger = logging.getLogger("flowreduce")

#: The dask config key naming a calibrated cost model file.
CONFIG_KEY = "flowreduce.cost-model"
#: What ``flowreduce calibrate`` writes in the file's ``format`` field.
FILE_FORMAT = "flowreduce-cost-model"

Groups = Sequence[Sequence[int]]
#: How a plan's lowering changes its price (a route's, :mod:`flowreduce.schedule.routes`): from the
#: plan and its card, the card of the graph really built, and whether its transfers inside a host go
#: through shared memory (priced on :attr:`CostModel.shm`, not as Dask's). None: the plan's own card,
#: every transfer through Dask's comm.
Lowered = Callable[[Plan, CostCard], tuple[CostCard, bool]]


@dataclass(frozen=True)
class Link:
    """One class of link: ``alpha`` seconds per dependent hop (a task whose
    input comes from another worker: scheduling plus network latency) and
    ``beta`` seconds per byte of one transfer."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta > 0 and math.isfinite(self.alpha) and math.isfinite(self.beta)):
            raise ValueError(f"a link needs alpha >= 0 and beta > 0 (finite), got alpha={self.alpha!r}, "
                             f"beta={self.beta!r}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one transfer, 1/β."""
        return 1.0 / self.beta

    def hop(self, nbytes: float) -> float:
        """Predicted seconds of one dependent hop moving ``nbytes``: α + n·β."""
        return self.alpha + nbytes * self.beta


#: The inter-host class when none is calibrated: 10 Gbit/s Ethernet, 4 ms per hop.
DEFAULT_INTER = Link(alpha=4e-3, beta=8 / 10e9)
#: The shared-memory class when none is calibrated: a scheduler level per hop,
#: and a byte read or written through a segment priced on the scale of the
#: fitted loopback constants above (where one Dask transfer costs 2/bandwidth
#: per byte): side by side on this project's machine (noisy, 2026-11), the
#: three-level collective beat the fastest Dask plan by 2-3x from 1e7 elements.
DEFAULT_SHM = Link(alpha=4e-3, beta=1 / 2e10)
#: One step of a host group (:mod:`flowreduce.shm.host_group`): its workers polling each other's counters
#: in shared memory, no scheduler between them (an SPMD all-reduce of 1e3 float64 over 4 ranks on 2 cores,
#: a barrier and a step, took 60-110 us, docs/spmd.md).
HOST_GROUP_STEP = 1e-4


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
    # s per dependent step of a plan run by the workers' p2p engine (one message between two workers'
    # event loops, no scheduler): 4 and 64 ranks on 4 workers, loopback, benchmarks/p2p_scale.py
    message: float = 1.5e-3
    intra: Link | None = None  # between ranks of one host (None: level and bandwidth above)
    inter: Link | None = None  # through a host's network link (None: DEFAULT_INTER)
    shm: Link | None = None  # shared memory between workers of one host (None: DEFAULT_SHM)
    # how many plain additions of the same bytes an exact fold costs (deterministic="exact" on a plan
    # gathering every rank's values: flowreduce.reproducible.exact_fold): 4 x 2.5e6 float64 in 24 ms against
    # 5.6 ms for their sum, float32 13.5 against 2.8 ms, in one process on this machine (2026-11-27)
    exact_fold: float = 4.5
    # deterministic=True on an op and dtype the reference tree orders: each transfer's bytes weighed by
    # the partial sums its value carries (set per call, like cores; never in a file)
    partials: bool = False

    def folding_exactly(self) -> CostModel:
        """This model with the exact fold's combining speed in place of the additions'."""
        return replace(self, reduce_rate=self.reduce_rate / self.exact_fold)

    def carrying_partials(self) -> CostModel:
        """This model pricing ``deterministic=True``'s messages: every
        transfer's bytes weighed by the partial sums of the reference tree
        its value carries (:func:`carried_card`, :func:`link_loads`)."""
        return replace(self, partials=True)

    def card(self, plan: Plan, nbytes: float) -> CostCard:
        """``plan``'s cost card for ``nbytes`` per rank as this model prices it."""
        card = plan.cost(nbytes)
        return carried_card(plan, card) if self.partials else card

    def loads(self, plan: Plan, groups: Groups | None, nbytes: float) -> LinkLoads | None:
        """``plan``'s link loads over the hosts ``groups`` as this model prices
        them (None on one host)."""
        if groups is None or len(groups) < 2:
            return None
        return link_loads(plan, groups, nbytes, carried(plan).widths if self.partials else None)

    def predict(self, plan: Plan, nbytes: float, groups: Groups | None = None, lowered: Lowered | None = None
                ) -> float:
        """Predicted seconds of ``plan`` on ``nbytes`` per rank; ``groups``
        lists the ranks of each host (default: all on one host). This is
        ``plan``'s card as a task graph runs it; a call's route prices what it
        really runs (:mod:`flowreduce.schedule.routes`: the shared-memory
        collective by :meth:`shm_direct_time`, ``direct``'s posts by
        :meth:`direct_shm_time`, the engine by :meth:`p2p_time`, and ``lowered``
        says what a lowering changes in the card)."""
        card, shared_inside = (lowered or as_planned)(plan, self.card(plan, nbytes))
        return self._time(plan.ranks, plan.chunks, card, self.loads(plan, groups, nbytes), nbytes,
                          shared_inside=shared_inside)

    def _time(self, ranks: int, chunks: int, card: CostCard, loads: LinkLoads | None, nbytes: float,
              shared_inside: bool = False) -> float:
        copy = (nbytes if card.copy_bytes else 0.0) / self.copy_rate
        cores = self.cores if self.cores and self.cores < ranks else None  # set when the ranks share cores
        # every byte costs CPU at both ends and all of it queues on the shared cores
        work = (2 * card.bytes_on_wire / self.bandwidth + card.total_reduce_bytes / self.reduce_rate
                + card.copy_bytes / self.copy_rate)
        compute = card.reduce_bytes / self.reduce_rate
        if loads is None:  # one host
            comm = card.max_rank_bytes / self.bandwidth
            if cores:  # a chain of dependent transfers cannot go faster than one stream
                body = max(work / cores, card.critical_bytes / self.bandwidth + copy)
            else:
                body = max(comm, compute) + min(comm, compute) / chunks + copy
            return self.call + card.steps * self.level + card.tasks * self.task + body
        intra = self.intra or Link(self.level, 1.0 / self.bandwidth)
        if shared_inside:  # transfers inside hosts through shared memory: only inter-host bytes go through Dask
            intra = self.shm or DEFAULT_SHM
            work -= 2 * (card.bytes_on_wire - loads.inter_total) / self.bandwidth
        inter = self.inter or DEFAULT_INTER
        link = link_seconds(loads, chunks, inter.beta, intra.beta)
        latency = sum(inter.alpha if i else intra.alpha if a else self.level
                      for i, a in zip(loads.inter, loads.intra))
        latency += max(card.steps - len(loads.inter), 0) * self.level  # levels past the last transfer
        if cores:
            body = max(link + copy, work / cores)
        else:
            body = max(link, compute) + min(link, compute) / chunks + copy
        return self.call + card.tasks * self.task + latency + body

    def p2p_time(self, plan: Plan, nbytes: float, ranks: int, groups: Groups | None = None) -> float:
        """``method="p2p"``: ``plan`` over the call's workers (``plan.ranks``
        of them) run by their engines, for ``ranks`` ranks (docs/p2p.md)::

            T = call + 3·level + (workers + 1 + ranks)·task + combine + copies + engine

        three dependent task levels (hand-in, barrier, output) of a hand-in
        per worker and an output per rank; each worker combines its
        ``ranks/workers`` inputs and copies the result out for each but one;
        the engine is the plan priced as for tasks but with no task and a
        message (``message``, or the inter-host α) per dependent step."""
        workers = plan.ranks
        card = self.card(plan, nbytes)
        loads = self.loads(plan, groups, nbytes)
        return self._p2p_tasks(workers, ranks, nbytes) + self.engine()._time(workers, plan.chunks, card, loads, nbytes)

    def engine(self) -> CostModel:
        """This model as the workers' engines run a plan: a message (``message``, or the inter-host
        α) per dependent step, no task and no call. :meth:`p2p_time` prices the exchange with it, and
        the engine's plan search ranks its variants (algorithm, radix, chunks) with it: with no task
        per chunk and step, the engine pipelines more chunks than a task graph would."""
        intra = Link(self.message, (self.intra or Link(self.level, 1.0 / self.bandwidth)).beta)
        return replace(self, level=self.message, task=0.0, call=0.0, intra=intra)

    def _p2p_tasks(self, workers: int, ranks: int, nbytes: float) -> float:
        """What every p2p run costs besides the engine's exchange: the call, three task levels of a
        hand-in per worker and an output per rank, and each worker combining its ranks' inputs and
        copying the result out for each but one (the workers sharing the cores)."""
        per_worker = math.ceil(ranks / workers)
        local = (per_worker - 1) * nbytes * (1 / self.reduce_rate + 1 / self.copy_rate)
        if self.cores and self.cores < workers:
            local = local * workers / self.cores
        return self.call + 3 * self.level + (workers + 1 + ranks) * self.task + local

    def p2p_host_time(self, plan: Plan, nbytes: float, ranks: int, split_bytes: int) -> float:
        """``method="p2p"`` with ``plan`` ``shm-direct`` over workers of one host: their engines run it
        as one all-reduce of a host group (:mod:`flowreduce.shm.host_group`), no message. The task
        levels and each worker's combining and copies are :meth:`p2p_time`'s; the engine's part is
        each worker writing its sum into shared memory, then, under ``split_bytes``, folding every
        worker's (one step), from it folding its slice and copying every slice (two steps)."""
        workers = plan.ranks
        link = self.shm or DEFAULT_SHM
        body = nbytes * link.beta
        if nbytes < split_bytes:
            steps = 1
            body += workers * nbytes * link.beta + (workers - 1) * nbytes / self.reduce_rate
        else:
            steps = 2
            body += ((workers - 1) / workers * nbytes * (link.beta + 1 / self.reduce_rate)
                     + nbytes * link.beta + nbytes / self.copy_rate)
        if self.cores and self.cores < workers:
            body = body * workers / self.cores
        return self._p2p_tasks(workers, ranks, nbytes) + steps * HOST_GROUP_STEP + body

    def shm_direct_time(self, plan: Plan, nbytes: float) -> float:
        """The one-level intra-host collective over shared memory: 3 levels,
        2 tasks per worker and one per rank; each worker writes its ranks'
        sum into its segment and reduces its slice reading every peer's, each
        rank copies the whole result out of the segments (fresh pages).
        Ranks sharing C cores share the CPU work."""
        link = self.shm or DEFAULT_SHM
        workers, p = plan.segments, plan.ranks
        per_worker = math.ceil(p / workers)
        write = nbytes * link.beta + (per_worker - 1) * nbytes / self.reduce_rate
        scatter = (workers - 1) * nbytes / workers * (link.beta + 1 / self.reduce_rate)
        gather = nbytes * link.beta + nbytes / self.copy_rate
        if self.cores and self.cores < workers:
            body = (workers * (write + scatter) + p * gather) / self.cores
        else:
            body = write + scatter + per_worker * gather
        return self.call + 3 * link.alpha + (2 * workers + p) * self.task + body

    def direct_shm_time(self, plan: Plan, nbytes: float, workers: int) -> float:
        """``direct`` on one host, its workers reading each other's posts
        (:func:`flowreduce.schedule.peer_reads.reading`): one level, a task
        per worker; each worker posts its ranks' sum (one copy), then reads
        its W-1 peer workers' posts in place and combines all W into a
        warm result, a cache-sized block at a time (:meth:`flowreduce.ops.Op.fold`:
        each post read once, the result written once). Ranks sharing C
        cores share the CPU work. Against :meth:`shm_direct_time` this
        crosses at ~1e7 float64 elements on 4 workers and 2 cores, as
        measured (2026-11-25: `direct` 3% faster at 1e7, 12% slower at 2e7)."""
        link = self.shm or DEFAULT_SHM
        per_worker = math.ceil(plan.ranks / workers)
        post = nbytes * link.beta + (per_worker - 1) * nbytes / self.reduce_rate
        combine = workers * nbytes / self.reduce_rate + nbytes * link.beta
        if self.cores and self.cores < workers:
            body = workers * (post + combine) / self.cores
        else:
            body = post + combine
        return self.call + self.level + workers * self.task + body

    # -- files ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The model's constants as plain data (links as ``{"alpha", "beta"}``)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("cores", "partials") or v is None:
                continue  # cores are the cluster's, learnt per call; partials the call's
            out[f.name] = {"alpha": v.alpha, "beta": v.beta} if isinstance(v, Link) else v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """The inverse of :meth:`to_dict`; keys left out keep their defaults.

        Raises
        ------
        ValueError
            An unknown key or a link without ``alpha`` and ``beta``.
        """
        known = {f.name for f in fields(cls)} - {"cores", "partials"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cost model keys {unknown}; valid: {sorted(known)}")
        kw: dict[str, Any] = {}
        for k, v in data.items():
            if k in ("intra", "inter", "shm"):
                if not isinstance(v, dict) or set(v) != {"alpha", "beta"}:
                    raise ValueError(f"link {k!r} must be {{'alpha': seconds, 'beta': seconds per byte}}, got {v!r}")
                kw[k] = Link(float(v["alpha"]), float(v["beta"]))
            else:
                kw[k] = float(v)
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> CostModel:
        """The model a ``flowreduce calibrate`` file describes (its ``model``).

        Raises
        ------
        FileNotFoundError
            No such file.
        ValueError
            Not a cost model file, or bad constants in it (the message names the file).
        """
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)} is not JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT or "model" not in data:
            raise ValueError(f"{os.fspath(path)} is not a flowreduce cost model file "
                             f"(expected {{'format': {FILE_FORMAT!r}, 'model': {{...}}}})")
        try:
            return cls.from_dict(data["model"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None

    def to_file(self, path: str | os.PathLike, **meta: Any) -> None:
        """Write the model (and ``meta``: how it was measured) as JSON."""
        with open(path, "w") as f:
            json.dump({"format": FILE_FORMAT, "version": 1, "model": self.to_dict(), **meta}, f, indent=1)
            f.write("\n")


DEFAULT_MODEL = CostModel()


def as_planned(plan: Plan, card: CostCard) -> tuple[CostCard, bool]:
    """A plan priced as planned: its own card, every transfer through Dask's comm."""
    return card, False

_LOADED: dict[tuple[str, float], CostModel] = {}


def configured_model() -> CostModel:
    """The model ``allreduce`` and ``choose`` use when given none: the file
    named by the dask config key ``flowreduce.cost-model`` if set, else the
    fitted defaults. (Reads dask's config only if dask is installed.)"""
    try:
        import dask.config
    except ImportError:
        return DEFAULT_MODEL
    path = dask.config.get(CONFIG_KEY, None)
    if not path:
        return DEFAULT_MODEL
    path = os.path.expanduser(str(path))
    key = (path, os.stat(path).st_mtime)
    if key not in _LOADED:
        _LOADED[key] = CostModel.from_file(path)
    return _LOADED[key]


def model_for(model: CostModel | None, cores: int | None) -> CostModel:
    """The model a call is judged by: ``model`` (default: :func:`configured_model`)
    knowing the CPU cores its ranks share, unless it names its own ``cores``."""
    model = model or configured_model()
    return replace(model, cores=cores) if model.cores is None else model


@dataclass(frozen=True)
class LinkLoads:
    """Bytes a plan puts on each link class, per dependent level (whole
    vector, all chunks): ``inter[l]`` is the largest of any host link's bytes
    in or out at level ``l+1``; ``intra[l]`` the largest bytes in + out of a
    rank between ranks of its own host; ``host_max`` the largest bytes in or
    out of any host link over the whole call; ``inter_total`` all bytes
    that cross host links."""

    inter: tuple[float, ...]
    intra: tuple[float, ...]
    host_max: float
    inter_total: float


def link_seconds(loads: LinkLoads, chunks: int, inter_beta: float, intra_beta: float = 0.0) -> float:
    """Time the links need for ``loads`` (seconds per byte ``inter_beta``
    across hosts, ``intra_beta`` within one), pipelined over ``chunks``: the
    levels' sum once per chunk plus the slowest level for the rest, and never
    less than the busiest host link's bytes."""
    per_level = [i * inter_beta + a * intra_beta for i, a in zip(loads.inter, loads.intra)]
    piped = sum(per_level) / chunks + (chunks - 1) / chunks * max(per_level, default=0.0)
    return max(piped, loads.host_max * inter_beta)


def carried_card(plan: Plan, card: CostCard, w: Carried | None = None) -> CostCard:
    """``card`` (``plan``'s, at any size) with each transfer's bytes weighed
    by the partial sums its value carries under ``deterministic=True``
    (``w``, default :func:`flowreduce.algorithms.partials.carried`): the
    bytes on the wire, the busiest rank's and the longest chain's."""
    st, w = plan.structure, w or carried(plan)

    def times(new: int, old: int) -> float:
        return new / old if old else 1.0

    return replace(card, bytes_on_wire=card.bytes_on_wire * times(w.wire_width, st.wire_width),
                   max_rank_bytes=card.max_rank_bytes * times(w.max_rank_width, st.max_rank_width),
                   critical_bytes=card.critical_bytes * times(w.chain_width, st.chain_width))


def link_loads(plan: Plan, groups: Groups, nbytes: float, widths: Sequence[int] | None = None) -> LinkLoads:
    """Where ``plan``'s bytes go when ``groups`` are the hosts; ``widths``:
    the segments each node's value carries when not its own width
    (``deterministic=True``'s partial sums, :func:`flowreduce.algorithms.partials.carried`).

    Raises
    ------
    ValueError
        ``groups`` that do not cover every rank of the plan exactly once.
    """
    host = {r: h for h, g in enumerate(groups) for r in g}
    if sorted(host) != list(range(plan.ranks)) or sum(map(len, groups)) != plan.ranks:
        raise ValueError(f"groups {[list(g) for g in groups]} must partition ranks 0..{plan.ranks - 1}")
    seg = nbytes / plan.segments if plan.segments else 0.0
    levels = plan.levels
    depth = max(levels, default=0)
    h_in = [[0.0] * len(groups) for _ in range(depth)]
    h_out = [[0.0] * len(groups) for _ in range(depth)]
    r_intra = [[0.0] * plan.ranks for _ in range(depth)]
    seen = set()
    for n in plan.nodes:
        for i in n.inputs:
            src = plan.nodes[i]
            if src.rank == n.rank or (i, n.rank) in seen:
                continue
            seen.add((i, n.rank))
            b, lv = (src.width if widths is None else widths[i]) * seg, levels[n.id] - 1
            a, z = host[src.rank], host[n.rank]
            if a != z:
                h_out[lv][a] += b
                h_in[lv][z] += b
            else:
                r_intra[lv][src.rank] += b
                r_intra[lv][n.rank] += b
    inter = tuple(max(max(i), max(o)) for i, o in zip(h_in, h_out))
    intra = tuple(max(r) for r in r_intra)
    tot_in = [sum(h_in[lv][h] for lv in range(depth)) for h in range(len(groups))]
    tot_out = [sum(h_out[lv][h] for lv in range(depth)) for h in range(len(groups))]
    return LinkLoads(inter, intra, max(tot_in + tot_out, default=0.0), sum(tot_out))


#: Above this many ranks ``auto`` does not price plans with Θ(p²) tasks per
#: chunk (ring, butterfly of radix p): at ~0.6 ms a task they never win on a
#: task scheduler there, and building them alone takes seconds at p = 256.
QUADRATIC_PLANS_UP_TO = 16


def candidates(ranks: int, groups: Groups | None = None, *, direct: bool = False) -> list[tuple[str, dict]]:
    """Flat algorithms (radix 2, 4 and p; ring and radix-p butterfly only up
    to :data:`QUADRATIC_PLANS_UP_TO` ranks), ``direct`` when the call can
    lower it (its inputs are in memory on known workers: ``direct=True``),
    and, when ``groups`` holds more than one host, ``hierarchical`` over
    those hosts with every inner/outer pair."""
    small = ranks <= QUADRATIC_PLANS_UP_TO
    out: list[tuple[str, dict]] = [("reduce-broadcast", {})] + ([("ring", {})] if small else [])
    if direct and ranks > 1:
        out.insert(0, ("direct", {}))  # first: on a tie with the radix-p exchange, one level fewer wins
    for k in sorted({2, 4, ranks}):
        if k >= 2:
            if k < ranks or small:
                out.append(("butterfly", {"radix": k}))
            out.append(("recursive-doubling", {"radix": k}))  # p + p tasks: a full exchange
    out.append(("tree", {"fan_in": 2}))
    if groups is not None and len(groups) > 1:
        out += [("hierarchical", {"groups": [list(g) for g in groups], **o}) for o in _hierarchical_options(1)]
    return out


def _hierarchical_options(depth: int) -> list[dict]:
    """inner (one per level below the top) and outer choices."""
    out = []
    for inner in product(SCATTER_ALGORITHMS, repeat=depth):
        for outer in ALLREDUCE_ALGORITHMS:
            out.append({"inner": inner[0] if depth == 1 else list(inner), "outer": outer})
    return out


def chunk_choices(nbytes: float, max_chunks: int = 64, min_chunk_bytes: float = 1 << 20) -> list[int]:
    """Chunk counts worth trying: powers of two while chunks stay >= 1 MiB."""
    out, c = [1], 2
    while c <= max_chunks and nbytes / c >= min_chunk_bytes:
        out.append(c)
        c *= 2
    return out


def best_chunks(plan: Plan, nbytes: float, model: CostModel | None = None, groups: Groups | None = None) -> Plan:
    """``plan`` with the chunk count the model predicts fastest for it."""
    model = model_for(model, None)
    return min((plan.with_chunks(c) for c in chunk_choices(nbytes)),
               key=lambda p: model.predict(p, nbytes, groups))


def _base(name: str, ranks: int, options: str) -> Plan:
    return make_plan(name, ranks, **json.loads(options))  # the registry builds each plan once


@functools.lru_cache(maxsize=512)
def unit_price(name: str, ranks: int, options: str, groups: str | None,
               partials: bool = False) -> tuple[CostCard, CostCard, LinkLoads | None]:
    """A base plan's cost cards at 1 and 2 chunks and its link loads, for
    one byte per rank (every byte count is linear in the vector's bytes);
    ``partials``: as :meth:`CostModel.carrying_partials` prices them."""
    base = _base(name, ranks, options)
    hosts = json.loads(groups) if groups else None
    one, two, widths = base.with_chunks(1).cost(1.0), base.with_chunks(2).cost(1.0), None
    if partials:
        w = carried(base)
        one, two, widths = carried_card(base, one, w), carried_card(base, two, w), w.widths
    return one, two, link_loads(base, hosts, 1.0, widths) if hosts else None


def _scaled(card: CostCard, n: float) -> CostCard:
    return replace(card, **{k: getattr(card, k) * n for k in
                            ("bytes_on_wire", "max_rank_bytes", "reduce_bytes", "total_reduce_bytes",
                             "copy_bytes", "critical_bytes")})


def card_at(one: CostCard, two: CostCard, chunks: int, nodes: int, nbytes: float) -> CostCard:
    """:meth:`Plan.cost` at ``chunks`` chunks from the cards at 1 and 2:
    chunks repeat the plan (tasks and messages scale, each chunk's chain
    carries 1/chunks of the bytes); from 2 chunks on every rank's output is
    a task of its own and is assembled from pieces."""
    if chunks == 1:
        return _scaled(one, nbytes)
    card = replace(two, tasks=two.tasks + (chunks - 2) * nodes, messages=one.messages * chunks,
                   critical_bytes=one.critical_bytes / chunks)
    return _scaled(card, nbytes)


def _fastest(model: CostModel, variants: list[tuple[str, dict]], ranks: int, nbytes: float,
             chunks: int | None, groups: Groups | None, lowered: Lowered = as_planned) -> tuple[Plan, float]:
    gkey = json.dumps([list(g) for g in groups]) if groups is not None and len(groups) > 1 else None
    best, best_t = None, math.inf
    for name, opts in variants:
        okey = json.dumps(opts, sort_keys=True)
        base = _base(name, ranks, okey)
        one, two, unit_loads = unit_price(name, ranks, okey, gkey, model.partials)
        loads = None if unit_loads is None else LinkLoads(
            tuple(x * nbytes for x in unit_loads.inter), tuple(x * nbytes for x in unit_loads.intra),
            unit_loads.host_max * nbytes, unit_loads.inter_total * nbytes)
        # fused views read whole inputs in the task: one chunk
        for c in [chunks] if chunks else [1] if base.fused_views else chunk_choices(nbytes):
            card = card_at(one, two, c, len(base.nodes), nbytes)
            card, shared_inside = lowered(base.with_chunks(c), card)
            t = model._time(ranks, c, card, loads, nbytes, shared_inside=shared_inside)
            if t < best_t:
                best, best_t = base.with_chunks(c), t
    if best is None:
        raise ValueError("no candidate plan to choose from")
    return best, best_t


def tune(
    algorithm: str,
    ranks: int,
    nbytes: float,
    *,
    model: CostModel | None = None,
    chunks: int | None = None,
    hosts: Groups | None = None,
    lowered: Lowered = as_planned,
    **options: Any,
) -> Plan:
    """The plan of a named ``algorithm`` with what was left open chosen by
    the model: the chunk count, and for ``hierarchical`` the groups (the
    ``hosts``, unless ``groups``/``group_size``/``levels`` are given) and
    the ``inner`` algorithm of every level and the ``outer`` one, priced
    with the intra-host and inter-host links, each variant's card as
    ``lowered`` says its lowering changes it (:data:`Lowered`)."""
    model = model_for(model, None)
    variants = [options]
    if algorithm == "hierarchical":
        if not {"groups", "group_size", "levels"} & set(options) and hosts is not None:
            options = {**options, "groups": [list(g) for g in hosts]}
        depth = len(options["levels"]) if options.get("levels") is not None else 1
        variants = [{**options, **{k: v for k, v in o.items() if k not in options}}
                    for o in _hierarchical_options(depth)]
        variants = list({json.dumps(v, sort_keys=True): v for v in variants}.values())
    if len(variants) == 1 and chunks:  # nothing to choose
        return make_plan(algorithm, ranks, chunks=chunks, **variants[0])
    make_plan(algorithm, ranks, **variants[0])  # bad options fail here, with the planner's message
    return _fastest(model, [(algorithm, v) for v in variants], ranks, nbytes, chunks, hosts, lowered)[0]


def choose(
    ranks: int,
    nbytes: float,
    *,
    model: CostModel | None = None,
    chunks: int | None = None,
    algorithms: list[str] | None = None,
    groups: Groups | None = None,
    direct: bool = False,
) -> Plan:
    """The plan with the lowest predicted time (``algorithm="auto"``).

    Parameters
    ----------
    ranks, nbytes : int, float
        Ranks, and bytes of each rank's vector.
    model : CostModel, optional
        Default: :func:`configured_model` (a calibrated file named in the
        dask config, else the fitted defaults).
    chunks : int, optional
        Only plans with this many chunks (default: every sensible count).
    algorithms : list of str, optional
        Only these algorithms.
    groups : list of lists of int, optional
        The ranks of each host. With more than one host, transfers between
        hosts are priced on the model's inter-host link and ``hierarchical``
        over these hosts is a candidate.
    direct : bool
        Whether the one-level ``direct`` plan is a candidate: the call's
        inputs are in memory on known workers, whole (one chunk).

    Returns
    -------
    Plan
    """
    model = model_for(model, None)
    if groups is not None and len(groups) < 2:
        groups = None
    direct = direct and chunks in (None, 1)
    frozen = tuple(tuple(g) for g in groups) if groups is not None else None
    best, best_t = _choice(model, ranks, float(nbytes), chunks, tuple(algorithms) if algorithms else None, frozen,
                           direct)
    logger.info("auto chose %r (predicted %.3g s for %d bytes on %d ranks%s)", best, best_t, nbytes, ranks,
                f", {len(groups)} hosts" if groups else "")
    return best


@functools.lru_cache(maxsize=1024)
def _choice(model: CostModel, ranks: int, nbytes: float, chunks: int | None, algorithms: tuple[str, ...] | None,
            groups: tuple[tuple[int, ...], ...] | None, direct: bool) -> tuple[Plan, float]:
    """:func:`choose`'s pick and its predicted time, once per question: a
    training loop asks the same one every step (plans are immutable)."""
    variants = [(n, o) for n, o in candidates(ranks, groups, direct=direct) if not algorithms or n in algorithms]
    if not variants:
        names = sorted({n for n, _ in candidates(2, [[0], [1]])})
        raise ValueError(f"no candidate algorithm among {list(algorithms or [])}; auto considers {names}")
    return _fastest(model, variants, ranks, nbytes, chunks, groups)


def choose_sparse(
    ranks: int,
    size: int,
    itemsize: int,
    density: Sequence[float],
    *,
    model: CostModel | None = None,
    delta: float | None = None,
    codec: str | None = None,
) -> SparsePlan:
    """``auto`` for sparse inputs: the sparse plan the cost model predicts
    fastest for ``size`` elements of ``itemsize`` bytes at each rank's
    ``density``.

    Candidates: ``sparse-recursive-doubling`` (radix 2, 4, p) and
    ``sparse-split-allgather`` over a butterfly (radix 2, 4, p) or a ring,
    one chunk each. The model (default: :func:`configured_model`, as for
    :func:`choose`) prices every card as it prices dense ones (levels,
    tasks, bytes), so very sparse or small inputs go to recursive doubling
    (fewest levels; each step's message grows with the union) and denser,
    larger ones to split-allgather (each rank merges and sends only its
    share of the index space).
    """
    model = model_for(model, None)
    nbytes = size * itemsize
    density = tuple(density)
    cands: list[tuple[str, dict]] = []
    for k in sorted({2, 4, ranks}):
        if 2 <= k <= max(ranks, 2):
            cands.append(("sparse-recursive-doubling", {"radix": k}))
            cands.append(("sparse-split-allgather", {"inner": "butterfly", "radix": k}))
    cands.append(("sparse-split-allgather", {"inner": "ring"}))
    best: SparsePlan | None = None
    best_t = math.inf
    for name, opts in cands:
        p = make_plan(name, ranks, **opts)
        assert isinstance(p, SparsePlan)
        p = replace(p, density=density, value_bytes=itemsize, delta=delta, codec=codec)
        t = model.predict(p, nbytes)
        if t < best_t:
            best, best_t = p, t
    logger.info("auto chose %r (predicted %.3g s for %d elements at density %s on %d ranks)",
                best, best_t, size, "/".join(f"{d:.3g}" for d in density), ranks)
    assert best is not None  # there is always a candidate
    return best
