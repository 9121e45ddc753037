"""How a call's plan runs: each way of lowering a plan is one registered
:class:`Route`, and :func:`choose` is the one place that picks it.

A route is a method (``"tasks"``: a task graph; ``"p2p"``: the workers'
engine) and a way of moving bytes. It owns its applicability check
(:meth:`Route.applies`), its price (the cost model's seconds for the graph
it really builds: :meth:`Route.price`), the plans it proposes to ``auto``
(:meth:`Route.proposals`), its lowering and its links, and says what it
runs in one line (:meth:`Route.describe`). :data:`ROUTES` lists them in
the order they are tried: a plan runs on the first route of its method
that applies to it (:func:`route_of`; the Dask graph and the engine's
messages take every plan, so they come last of their method), and of the
candidate plans the call's plan search found, :func:`choose` keeps the
one whose route is priced lowest (the first on a tie: a plan as chosen
before one a route proposed, tasks before p2p).

What decides between shared memory and Dask's comm for a pair of workers
(their memory domains) is :mod:`flowreduce.schedule.transport`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

import numpy as np

from flowreduce.algorithms import direct as _direct
from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms import shm_direct as _shm_direct
from flowreduce.algorithms.hierarchical import DIRECT as DIRECT_INNER
from flowreduce.algorithms.hierarchical import direct_lowered
from flowreduce.algorithms.ir import CostCard, Plan
from flowreduce.cost import CostModel, Groups, tune
from flowreduce.cost import Lowered as Priced
from flowreduce.lower import shm_direct, shm_edges, shm_hierarchical
from flowreduce.lower.direct import build_direct
from flowreduce.lower.graph import Graph, build_graph, gathers_every_rank
from flowreduce.lower.p2p import Spec
from flowreduce.ops import Op
from flowreduce.schedule import p2p as _p2p
from flowreduce.schedule.inputs import check_values
from flowreduce.schedule.peer_reads import reading
from flowreduce.schedule.transport import (
    IN_PROCESS,
    Links,
    hosts_share_memory,
    links,
    one_host,
    sharing,
    through_segments,
)
from flowreduce.shm.host_group import SPLIT_BYTES

TASKS, P2P = "tasks", "p2p"
#: The one-level intra-host collective's plan name (:mod:`flowreduce.algorithms.shm_direct`).
SHM_DIRECT = _shm_direct.NAME
#: The one-level plan whose tasks read their peers' inputs (:mod:`flowreduce.algorithms.direct`).
DIRECT = _direct.NAME


@dataclass(frozen=True)
class Lowering:
    """What a call's graph is built from: the ranks' input futures (or task
    references) and their keys, one rank's input (``size`` items, ``shape``,
    ``dtype``; None: unseen, ``direct``'s tasks check them), the op and the
    dtype it accumulates in. ``deterministic``: the call's
    ``deterministic=True`` (``direct`` folds in rank order); ``check``:
    ``direct``'s tasks check the unseen inputs; ``recorded``: what the
    call's record says of determinism."""

    inputs: tuple[Any, ...]
    input_keys: tuple[Hashable, ...]
    size: int
    shape: tuple[int, ...]
    dtype: np.dtype | None
    op: Op
    accumulate: Any = None
    in_place: bool = False
    deterministic: bool = False
    check: bool = False
    recorded: bool | str = False


@dataclass(frozen=True)
class Engines:
    """The call as the p2p engine runs it: over the ranks' distinct
    ``workers`` (a worker's ranks combined there), of memory ``domains``
    (per worker; None: Dask's comm, one process hands values over by
    reference), grouped by host as ``hosts``, priced by ``model``.
    ``group_asked``: ``auto`` or ``shm-direct`` asked and no chunks, so a
    host group may run the call; ``in_place``: the engine may reduce into
    what it received; ``native``: the library of the ranks' arrays."""

    workers: tuple[str, ...]
    domains: tuple[Any, ...]
    hosts: Groups | None
    model: CostModel
    group_asked: bool = False
    in_place: bool = False
    native: Any = None


@dataclass(frozen=True)
class Site:
    """Where a call's plans run: rank ``r`` on ``workers[r]`` of memory
    domain ``domains[r]`` (:func:`~flowreduce.schedule.transport.memory_domains`),
    the ranks grouped by host (and coarser ``levels``), ``nbytes`` per rank,
    priced by ``model``. ``ordered``: ``deterministic=True`` on an op and
    dtype the reference tree orders. ``lowering``: what the task routes
    build graphs from; ``engines``: the p2p engine's view (None: the call
    does not run on the engine)."""

    workers: tuple[str, ...]
    domains: tuple[Any, ...]
    levels: Sequence[Sequence[Sequence[int]]]
    model: CostModel
    nbytes: int
    ordered: bool = False
    lowering: Lowering | None = None
    engines: Engines | None = None

    @property
    def hosts(self) -> Groups | None:
        """The ranks of each host (None: not known, one host)."""
        return self.levels[0] if self.levels else None

    @property
    def one_host(self) -> bool:
        return one_host(self.workers, self.domains)

    def built(self) -> Lowering:
        if self.lowering is None:
            raise ValueError("this call site has nothing to lower (no Lowering)")
        return self.lowering


@dataclass(frozen=True)
class Lowered:
    """A plan lowered by its route: the graph, the word :func:`flowreduce.describe`
    says of how its links moved bytes, per link its transport, and whether
    its tasks read inputs they do not depend on (the guard keeps them)."""

    graph: Graph
    how: str
    links: Links
    hold: bool = False
    deterministic: bool | str = False


class Route(Protocol):
    """One way a plan runs (see the module's docstring)."""

    @property
    def name(self) -> str: ...
    @property
    def method(self) -> str: ...  # "tasks" or "p2p"
    @property
    def transport(self) -> str: ...  # how bytes move, in words

    def applies(self, plan: Plan, site: Site) -> bool: ...
    def price(self, plan: Plan, site: Site) -> float: ...
    def proposals(self, site: Site) -> tuple[Plan, ...]: ...
    def lower(self, plan: Plan, site: Site) -> Lowered: ...
    def links(self, plan: Plan, site: Site) -> Links: ...
    def describe(self) -> str: ...


@dataclass(frozen=True)
class _Described:
    """A route's name, method and transport words, and its one-line description."""

    name: str
    method: str
    transport: str
    runs: str

    def describe(self) -> str:
        return f"{self.name} ({self.method}): {self.runs}; bytes move by {self.transport}"

    def proposals(self, site: Site) -> tuple[Plan, ...]:
        return ()


@dataclass(frozen=True)
class ShmDirect(_Described):
    """``shm-direct`` on one host (or one worker, or in one process): the fused collective over segments."""

    def applies(self, plan: Plan, site: Site) -> bool:
        return plan.algorithm == SHM_DIRECT and plan.chunks == 1 and site.one_host

    def price(self, plan: Plan, site: Site) -> float:
        hosts = site.hosts
        if hosts is None or len(hosts) < 2:
            return site.model.shm_direct_time(plan, site.nbytes)
        return site.model.predict(plan, site.nbytes, hosts)  # topology= split the host: its card, as before

    def proposals(self, site: Site) -> tuple[Plan, ...]:
        return (shm_direct_plan(len(site.workers), site.workers),) if site.one_host else ()

    def lower(self, plan: Plan, site: Site) -> Lowered:
        low = site.built()
        assert low.dtype is not None
        graph = shm_direct.build_direct(plan, low.inputs, site.workers, size=low.size, shape=low.shape,
                                        dtype=low.dtype, op=low.op, accumulate=low.accumulate, ordered=site.ordered)
        how = ("same worker" if len(set(site.workers)) == 1 else
               "in-process" if site.domains[0] == IN_PROCESS else "shared memory")
        return Lowered(graph, how, self.links(plan, site), deterministic=low.recorded)

    def links(self, plan: Plan, site: Site) -> Links:
        return links(plan, site.workers, site.domains, site.nbytes, direct=True)


@dataclass(frozen=True)
class ShmHierarchical(_Described):
    """``hierarchical`` with ``shm-direct`` inside hosts whose workers share memory: a task per worker
    and phase inside each host, the outer algorithm's edges through Dask between hosts. Under
    ``deterministic=True`` the plan takes the Dask graph (its edges through shared memory)."""

    def applies(self, plan: Plan, site: Site) -> bool:
        return (plan.algorithm == "hierarchical" and plan.options.get("inner") == DIRECT_INNER
                and plan.chunks == 1 and hosts_share_memory(plan.options["groups"], site.domains)
                and not site.ordered)

    def price(self, plan: Plan, site: Site) -> float:
        return site.model.predict(plan, site.nbytes, site.hosts, lowered_card)

    def proposals(self, site: Site) -> tuple[Plan, ...]:  # only what it runs (not under deterministic=True)
        if len(site.levels) != 1 or not hosts_share_memory(site.levels[0], site.domains) or site.ordered:
            return ()
        return (shm_hierarchical_plan(site),)

    def lower(self, plan: Plan, site: Site) -> Lowered:
        low = site.built()
        assert low.dtype is not None
        graph = shm_hierarchical.build_hierarchical(plan, low.inputs, site.workers, size=low.size, shape=low.shape,
                                                    dtype=low.dtype, op=low.op, in_place=low.in_place,
                                                    accumulate=low.accumulate)
        return Lowered(graph, "shared memory within hosts, dask across", self.links(plan, site),
                       deterministic=low.recorded)

    def links(self, plan: Plan, site: Site) -> Links:
        return links(plan, site.workers, site.domains, site.nbytes, direct=True)


@dataclass(frozen=True)
class DirectReads(_Described):
    """``direct``: a task per worker reads its peers' inputs itself, through posts in shared memory
    between the workers of a host, through Dask's comm otherwise."""

    def applies(self, plan: Plan, site: Site) -> bool:
        return plan.algorithm == DIRECT and plan.chunks == 1

    def price(self, plan: Plan, site: Site) -> float:
        if site.one_host and self._near(site):  # one level, posts read in place
            return site.model.direct_shm_time(plan, site.nbytes, len(set(site.workers)))
        return site.model.predict(plan, site.nbytes, site.hosts)

    def proposals(self, site: Site) -> tuple[Plan, ...]:
        return (make_plan(DIRECT, len(site.workers)),) if site.one_host and self._near(site) else ()

    def lower(self, plan: Plan, site: Site) -> Lowered:
        low = site.built()
        near = self._near(site)
        read = partial(reading, domains=near) if near else reading
        graph = build_direct(plan, low.inputs, site.workers, input_keys=low.input_keys, op=low.op, read=read,
                             check=check_values if low.check else None, ordered=low.deterministic)
        found = self.links(plan, site)
        kinds = {k for _, _, k in found}
        how = ("dask" if "shared memory" not in kinds else
               "shared memory within hosts, dask across" if "dask" in kinds else "shared memory")
        return Lowered(graph, how, found, hold=True, deterministic=low.recorded)

    def links(self, plan: Plan, site: Site) -> Links:
        domains = site.domains if self._near(site) else (None,) * len(site.workers)
        return links(plan, site.workers, domains, site.nbytes, direct=True, posts=True)

    @staticmethod
    def _near(site: Site) -> tuple[tuple[str, Any], ...]:
        """``(worker, domain)`` of the workers that read a peer of their host through its post."""
        return sharing(site.workers, site.domains, site.nbytes)


@dataclass(frozen=True)
class DaskGraph(_Described):
    """Any plan as a task per node and chunk; an edge between workers of one host whose value is big
    enough goes through a shared segment (Dask moves its handle), every other one through Dask's comm."""

    def applies(self, plan: Plan, site: Site) -> bool:
        return True

    def price(self, plan: Plan, site: Site) -> float:
        """The model over the plan's own card: the graph has its nodes' tasks (a task per node and chunk)
        and levels, whatever the plan (``shm-direct`` and ``hierarchical`` with ``shm-direct`` inside,
        run here when their own routes do not apply, too)."""
        return site.model.predict(plan, site.nbytes, site.hosts)

    def lower(self, plan: Plan, site: Site) -> Lowered:
        low = site.built()
        graph = build_graph(plan, low.inputs, site.workers, size=low.size, shape=low.shape, op=low.op,
                            in_place=low.in_place, accumulate=low.accumulate, ordered=site.ordered)
        shared = self._published(plan, site)
        how = "shared memory within hosts, dask across" if shared else "dask"
        return Lowered(shm_edges.publish(graph, shared) if shared else graph, how, self.links(plan, site),
                       deterministic=low.recorded)

    def links(self, plan: Plan, site: Site) -> Links:
        return links(plan, site.workers, site.domains, site.nbytes, published=self._published(plan, site))

    @staticmethod
    def _published(plan: Plan, site: Site) -> set[int]:
        return shm_edges.published_nodes(plan, site.workers, list(through_segments(site.domains)))


@dataclass(frozen=True)
class HostGroup(_Described):
    """``method="p2p"``, ``shm-direct`` over workers that all share one host's memory: their engines
    run it as one all-reduce of a host group, no message (what each worker decides by:
    :func:`flowreduce.schedule.p2p.host_group_route`)."""

    def applies(self, plan: Plan, site: Site) -> bool:
        engines = site.engines
        return (engines is not None and plan.algorithm == SHM_DIRECT and engines.group_asked
                and _p2p.host_group_route(SHM_DIRECT, engines.domains, site.ordered))

    def price(self, plan: Plan, site: Site) -> float:
        return _engines(site).model.p2p_host_time(plan, site.nbytes, len(site.workers), SPLIT_BYTES)

    def proposals(self, site: Site) -> tuple[Plan, ...]:
        if site.engines is None:
            return ()
        shared = shm_direct_plan(len(site.engines.workers), site.engines.workers)
        return (shared,) if self.applies(shared, site) else ()

    def lower(self, plan: Plan, site: Site) -> Lowered:
        return _engine_lowered(plan, site)

    def links(self, plan: Plan, site: Site) -> Links:
        return ()  # the record tells none for the engine's runs


@dataclass(frozen=True)
class EngineRun(_Described):
    """``method="p2p"``: the plan over the ranks' workers, run by their engines as its inputs arrive,
    a worker's values in one message per destination (through a shared segment within a host)."""

    def applies(self, plan: Plan, site: Site) -> bool:
        return site.engines is not None

    def price(self, plan: Plan, site: Site) -> float:
        engines = _engines(site)
        return engines.model.p2p_time(plan, site.nbytes, len(site.workers), engines.hosts)

    def lower(self, plan: Plan, site: Site) -> Lowered:
        return _engine_lowered(plan, site)

    def links(self, plan: Plan, site: Site) -> Links:
        return ()


SHM_DIRECT_ROUTE = ShmDirect("shm-direct", TASKS, "shared memory (one host)",
                             "the one-level collective, two tasks per worker and one per rank over its segments")
SHM_HIERARCHICAL = ShmHierarchical("shm-hierarchical", TASKS, "shared memory within hosts, dask comm across",
                                   "hierarchical with shm-direct inside each host, its outer algorithm between hosts")
DIRECT_READS = DirectReads("direct-reads", TASKS, "posts in shared memory within a host, dask comm across",
                           "the one-level direct plan, a task per worker reading its peers' inputs itself")
DASK_GRAPH = DaskGraph("dask-graph", TASKS, "dask comm (big edges within a host through shared segments)",
                       "a task per plan node and chunk")
HOST_GROUP = HostGroup("p2p-host-group", P2P, "shared memory (one host)",
                       "shm-direct as one all-reduce of a host group in the workers' engines")
ENGINE_RUN = EngineRun("p2p-engine", P2P, "messages between engines (a shared segment within a host)",
                       "the plan run by the workers' engines, a task per worker and one per rank")

#: Every route, in the order a plan is matched to one (:func:`route_of`): the Dask graph and the
#: engine's messages take any plan, so they come after the routes of their method that take some.
ROUTES: tuple[Route, ...] = (SHM_DIRECT_ROUTE, SHM_HIERARCHICAL, DIRECT_READS, DASK_GRAPH, HOST_GROUP, ENGINE_RUN)


def named(name: str) -> Route:
    """The route a call's record names (``flowreduce.describe(result).route``): ``named(...).describe()``
    says what it runs and how its bytes move."""
    for r in ROUTES:
        if r.name == name:
            return r
    raise KeyError(f"no route {name!r}; routes: {', '.join(r.name for r in ROUTES)}")


def route_of(plan: Plan, site: Site, method: str = TASKS) -> Route:
    """The route ``plan`` runs on by ``method`` at ``site``: the first of :data:`ROUTES` that applies."""
    return next(r for r in ROUTES if r.method == method and r.applies(plan, site))


@dataclass(frozen=True)
class Choice:
    """A plan, the route it runs on and the route's price of it."""

    plan: Plan
    route: Route
    price: float

    def lower(self, site: Site) -> Lowered:
        return self.route.lower(self.plan, site)


def choose(site: Site, tasks: Sequence[Plan] = (), p2p: Sequence[Plan] = ()) -> Choice:
    """The one decision of how a call runs: of the candidate plans (``tasks``,
    then ``p2p`` over the engines' workers), each on its route (:func:`route_of`),
    the one whose route's price is lowest; on a tie the first."""
    candidates = [(q, TASKS) for q in tasks] + [(q, P2P) for q in p2p]
    if not candidates:
        raise ValueError("no candidate plan to choose from")
    best: Choice | None = None
    for plan, method in candidates:
        route = route_of(plan, site, method)
        price = route.price(plan, site)
        if best is None or price < best.price:
            best = Choice(plan, route, price)
    assert best is not None
    return best


def proposals(site: Site, method: str = TASKS) -> list[Plan]:
    """The plans ``method``'s routes propose to ``auto`` at ``site``, in :data:`ROUTES`' order."""
    return [q for r in ROUTES if r.method == method for q in r.proposals(site)]


def gathering(site: Site) -> list[Plan]:
    """The plans that bring every rank's own values to where they are reduced
    (so ``deterministic="exact"`` folds them there), as their routes run
    them: on one host ``shm-direct``, and ``direct`` reading its peers through
    shared memory; across hosts ``direct`` and a reduce-scatter by direct sends
    then an allgather (``butterfly`` of radix p: the default's bytes, two levels)."""
    p = len(site.workers)
    if site.one_host:
        return proposals(site)
    return [make_plan(DIRECT, p)] + ([make_plan("butterfly", p, radix=p)] if p > 2 else [])


def gathers(choice: Choice) -> bool:
    """Whether the chosen lowering reduces every rank's own values at once (so
    it can fold them exactly): the ``shm-direct`` collective, and the plans
    whose every reduction takes all ranks' own values
    (:func:`~flowreduce.lower.graph.gathers_every_rank`)."""
    return choice.route is SHM_DIRECT_ROUTE or gathers_every_rank(choice.plan)


def shm_direct_plan(p: int, workers: Sequence[str]) -> Plan:
    """The ``shm-direct`` plan for these ranks' workers (its groups: the ranks of each worker)."""
    return make_plan(SHM_DIRECT, p, **shm_direct_options({}, workers))


def shm_direct_options(options: dict, workers: Sequence[str]) -> dict:
    """A named ``shm-direct`` call's options with the workers' groups filled in."""
    if "groups" in options:
        return options
    groups = shm_direct.worker_groups(workers)
    return {**options, **({"groups": groups} if len(groups) < len(workers) else {})}


def shm_hierarchical_plan(site: Site, **options: Any) -> Plan:
    """``hierarchical`` with the one-level shared-memory collective inside
    each host, its outer algorithm (unless in ``options``) chosen by the model."""
    p, hosts = len(site.workers), site.levels[0]
    groups = shm_direct.worker_groups(site.workers)
    extra = {"workers": groups} if len(groups) < p else {}
    return tune("hierarchical", p, site.nbytes, model=site.model, chunks=1, hosts=hosts, lowered=cards(site),
                **{**options, "groups": [list(g) for g in hosts], "inner": DIRECT_INNER, **extra})


def inside_hosts(site: Site, options: dict) -> bool:
    """Whether a named ``hierarchical`` call runs ``shm-direct`` inside each host: one level of hosts
    whose workers share memory, the call leaves the inner algorithm and the groups open, and
    :data:`SHM_HIERARCHICAL` can run it (not under ``deterministic=True``, whose Dask graph runs the
    inner algorithm the search prices lowest there)."""
    return (len(site.levels) == 1 and hosts_share_memory(site.levels[0], site.domains) and not site.ordered
            and not {"inner", "groups", "group_size", "levels", "workers"} & set(options))


def lowered_card(plan: Plan, card: CostCard) -> tuple[CostCard, bool]:
    """What :data:`SHM_HIERARCHICAL`'s lowering changes in a plan's price
    (a :data:`flowreduce.cost.Lowered`): ``hierarchical`` with ``shm-direct``
    inside, one chunk, fuses its views and sums into a task per worker
    (``card``'s tasks and levels are the graph's) and moves the bytes
    inside hosts through shared memory. Only for plans that route runs
    (:func:`cards`): on the Dask graph the same plan is a task per node."""
    if not (plan.algorithm == "hierarchical" and plan.options.get("inner") == DIRECT_INNER and plan.chunks == 1):
        return card, False
    tasks, steps = direct_lowered(plan)
    return replace(card, tasks=tasks, steps=steps), True


def cards(site: Site) -> Priced:
    """How the task routes at ``site`` change a plan's card while the plan search prices its variants
    (:func:`~flowreduce.cost.tune`'s ``lowered``): :data:`SHM_HIERARCHICAL`'s fused graph
    (:func:`lowered_card`) for the plans it runs there, every other plan's own card (the Dask graph,
    a task per node and chunk). The variants are priced as the route that will run them prices them."""

    def lowered(plan: Plan, card: CostCard) -> tuple[CostCard, bool]:
        return lowered_card(plan, card) if SHM_HIERARCHICAL.applies(plan, site) else (card, False)
    return lowered


def engine_spec(plan: Plan, site: Site) -> Spec:
    """The engine's spec of ``plan`` (over the engines' workers) for the ranks of ``site``."""
    engines, low = _engines(site), site.built()
    assert low.dtype is not None
    return Spec.of(plan, low.op, low.dtype, low.shape, list(site.workers), engines.in_place, engines.domains,
                   native=engines.native, ordered=site.ordered)


def _engine_lowered(plan: Plan, site: Site) -> Lowered:
    graph = _p2p.lower(engine_spec(plan, site), site.built().inputs)
    return Lowered(graph, "dask", (), deterministic=site.ordered)


def _engines(site: Site) -> Engines:
    if site.engines is None:
        raise ValueError("this call site has no engines (the call does not run on the p2p engine)")
    return site.engines
