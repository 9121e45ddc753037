"""The route of a call (flowreduce.schedule.routes): one registry of the ways
a plan runs, one choice per call, and that choice is what runs.

No cluster: the calls are lowered from placed ranks holding stand-ins for
futures (objects with a key), as ``call.lower`` does after placing them.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import replace

import numpy as np
import pytest
from distributed import wait
from utils import graph_depth, workers_of

import flowreduce
from flowreduce.cost import CostModel
from flowreduce.pytree import LEAF
from flowreduce.schedule import call, hosts, routes
from flowreduce.schedule.inputs import ArrayMeta

ROOT = pathlib.Path(flowreduce.__file__).parent


class Stand:
    """What lowering reads of a future: its key."""

    def __init__(self, key):
        self.key = key


def test_every_route_says_what_it_runs_in_its_own_words():
    names = [r.name for r in routes.ROUTES]
    lines = [r.describe() for r in routes.ROUTES]
    assert len(set(names)) == len(names) and all(names)
    assert len(set(lines)) == len(lines) and all(line.strip() for line in lines)
    assert {r.method for r in routes.ROUTES} == {routes.TASKS, routes.P2P}
    assert [routes.named(n).describe() for n in names] == lines  # what a record's route name says
    with pytest.raises(KeyError):
        routes.named("carrier pigeon")
    for method in (routes.TASKS, routes.P2P):  # a route of each method takes any plan, and comes last of them
        last = [r for r in routes.ROUTES if r.method == method][-1]
        site = routes.Site(("a", "b"), (None, None), [[[0], [1]]], CostModel(), 8,
                           engines=routes.Engines(("a", "b"), (None, None), None, CostModel()))
        assert last.applies(flowreduce.plan("ring", 2), site)


def _layouts(p):
    return {
        "one host": [f"tcp://10.0.0.1:{9000 + r}" for r in range(p)],
        "2 ranks a worker": [f"tcp://10.0.0.1:{9000 + r // 2}" for r in range(p)],
        "two hosts": [f"tcp://10.0.0.{1 + r * 2 // p}:{9000 + r}" for r in range(p)],
        "one worker": ["tcp://10.0.0.1:9000"] * p,
    }


def _places(workers):
    host = {w: w.split("//")[1].split(":")[0] for w in workers}
    return {w: hosts.Place(h, 8, "", h) for w, h in host.items()}


CASES = [(p, layout, n, algorithm, det, transport)
         for p in (3, 4)
         for layout in _layouts(p)
         for n in (1, 10**3, 10**5, 10**7)  # 8 B .. 80 MB of float64
         for algorithm in ("auto", "shm-direct", "direct", "hierarchical", "butterfly")
         for det in (False, True)
         for transport in ("auto", "dask")]


@pytest.mark.parametrize("p, layout, n, algorithm, det, transport", CASES)
def test_the_chosen_route_applies_is_priced_lowest_and_is_what_runs(p, layout, n, algorithm, det, transport):
    """For each call site, the plan and route chosen are the candidate whose route (the first of its
    method that applies to it) is priced lowest, and the lowered call's record says that route, its
    price and the transport words that route's lowering gives."""
    workers = _layouts(p)[layout]
    places = _places(workers)
    model = CostModel(cores=2)
    settings = call.Settings.check("sum", algorithm, None, None, model, None, None, {}, None, transport)
    if det:
        settings = replace(settings, deterministic=True)
    held = ArrayMeta(shape=(n,), dtype=np.dtype("f8").str)
    ranks = call.Ranks(LEAF, tuple((Stand(("input", r)),) for r in range(p)), tuple(workers), places, held)
    may_p2p = call.p2p_refusal(ranks, settings) is None
    job = call.lower(None, ranks, settings, may_p2p=may_p2p)
    record = job.calls[0]

    # the same decision, made again here from its parts
    priced = model if not det else model.carrying_partials()
    levels = hosts.rank_levels(None, workers, places, None)
    named = settings
    if algorithm == "shm-direct":  # as the call names it: the ranks of each worker, one chunk
        named = replace(settings, options=routes.shm_direct_options({}, workers), chunks=1)
    site = call.call_site(workers, places, levels, priced, n * 8, named, ordered=det)
    tasks = call.dense_candidates(site, named)
    engines, p2p = call.p2p_candidates(None, ranks, settings) if may_p2p else (None, [])
    site = replace(site, engines=engines)
    p2p = p2p + routes.proposals(site, routes.P2P)
    candidates = [(q, routes.route_of(q, site, routes.TASKS)) for q in tasks]
    candidates += [(q, routes.route_of(q, site, routes.P2P)) for q in p2p]
    choice = routes.choose(site, tasks, p2p)

    assert choice.route.applies(choice.plan, site)
    assert choice.route is routes.route_of(choice.plan, site, choice.route.method)
    prices = [r.price(q, site) for q, r in candidates]
    assert choice.price == min(prices)
    assert (choice.plan, choice.route) == candidates[prices.index(min(prices))]  # the first on a tie
    assert (record.plan, record.route, record.method) == (choice.plan, choice.route.name, choice.route.method)
    assert record.predicted == pytest.approx(choice.price)
    if choice.route.method == routes.TASKS:
        inputs = tuple(Stand(("input", r)) for r in range(p))
        lowering = routes.Lowering(inputs, tuple(f.key for f in inputs), n, (n,), np.dtype("f8"), settings.op)
        lowered = choice.route.lower(choice.plan, replace(site, lowering=lowering))
        assert (record.transport, record.links) == (lowered.how, lowered.links)
        assert len(job.tasks) == len(lowered.graph.tasks)


#: Where a plan's name may decide how it is lowered: the routes, the planners and the lowerings
#: themselves, and the engine's runtime (a worker deciding how to run a spec it was handed).
DISPATCH_ALLOWED = {"schedule/routes.py", "schedule/p2p.py"}
ROUTE_PLANS = {"shm-direct", "direct"}
ROUTE_PLAN_NAMES = {"SHM_DIRECT", "DIRECT", "READ_DIRECT", "NAME"}


def _names_a_route_plan(node):
    if isinstance(node, ast.Constant):
        return node.value in ROUTE_PLANS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_route_plan(e) for e in node.elts)
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name in ROUTE_PLAN_NAMES


def _a_plans_algorithm(node):
    """``<a plan>.algorithm``: not what the call asked for (``settings.algorithm``, a trainer's own)."""
    return (isinstance(node, ast.Attribute) and node.attr == "algorithm"
            and not (isinstance(node.value, ast.Name) and node.value.id in {"settings", "self", "asked"}))


def test_only_the_routes_dispatch_on_a_plans_name():
    """No module but the routes compares a plan's algorithm with the plans
    only some routes lower (``shm-direct``, ``direct``): the choice of a
    lowering is made in one place."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in DISPATCH_ALLOWED or rel.startswith(("algorithms/", "lower/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_a_plans_algorithm(s) for s in sides) and any(_names_a_route_plan(s) for s in sides):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"lowering decided by a plan's name outside flowreduce/schedule/routes.py: {found}"


def test_a_calls_record_names_its_route(proc_client):
    """``describe(result).route`` names the registered route that ran, of the method the record says."""
    ws = workers_of(proc_client)
    parts = [proc_client.submit(np.full, 1000, float(r), workers=[ws[r]], pure=False) for r in range(4)]
    wait(parts)
    ran = {}
    for method, algorithm in (("tasks", "ring"), ("tasks", "auto"), ("p2p", "ring"), ("p2p", "auto")):
        out = flowreduce.allreduce(proc_client, parts, algorithm=algorithm, method=method)
        for o in proc_client.gather(out):
            np.testing.assert_array_equal(o, np.full(1000, 6.0))
        record = flowreduce.describe(out)
        assert routes.named(record.route).method == record.method == method
        ran[method, algorithm] = record.route
    assert ran["tasks", "ring"] == "dask-graph"


# -- the plan search runs once per call ---------------------------------------------------------------

def _counting(monkeypatch, *names):
    """Count the calls of these public functions of flowreduce.schedule.call (the plan search's parts)."""
    seen = {n: 0 for n in names}
    for n in names:
        real = getattr(call, n)

        def counted(*args, _real=real, _name=n, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(call, n, counted)
    return seen


SEARCHED = [(p, layout, n, algorithm, det)
            for p in (3, 4)
            for layout in ("one host", "2 ranks a worker", "two hosts")
            for n in (10**3, 10**6, 10**7, 4 * 10**7)  # the glance picks direct-reads, or the inputs are described
            for algorithm in ("auto", "direct")
            for det in (False, True)]


@pytest.mark.parametrize("p, layout, n, algorithm, det", SEARCHED)
def test_a_call_searches_its_plans_once(monkeypatch, p, layout, n, algorithm, det):
    """The glance (numpy arrays in memory: their workers and bytes from the scheduler) searches the
    plans; when its choice is not direct's peer reads the inputs are described and lowering re-prices
    those candidates, with the engine's, without a second search; and it chooses what a call
    described first (no glance) chooses."""
    from flowreduce.schedule import placement

    workers = _layouts(p)[layout]
    places = _places(workers)
    model = CostModel(cores=2)
    settings = call.Settings.check("sum", algorithm, None, None, model, None, None, {}, None, "auto")
    if det:
        settings = replace(settings, deterministic=True)
    held = ArrayMeta(shape=(n,), dtype=np.dtype("f8").str)
    monkeypatch.setattr(placement, "glance", lambda client, futures: (list(workers), n * 8))
    monkeypatch.setattr(hosts, "worker_places", lambda client, ws, **kw: {w: places[w] for w in ws})
    monkeypatch.setattr(placement, "locate", lambda client, futures, timeout=None: (
        [[w] for w in workers], [[held] for _ in workers]))
    futures = [[Stand(("input", r))] for r in range(p)]
    described = call.Ranks(LEAF, tuple(tuple(fs) for fs in futures), tuple(workers), places, held)
    expected = call.lower(None, described, settings, may_p2p=True).calls[0]

    seen = _counting(monkeypatch, "dense_candidates", "p2p_candidates", "choose_plan")
    ranks = call.describe_inputs(None, LEAF, futures, None, settings)
    record = call.lower(None, ranks, settings, may_p2p=call.p2p_refusal(ranks, settings) is None).calls[0]
    assert seen["dense_candidates"] == 1, "the task routes' plans were searched more than once"
    assert seen["p2p_candidates"] <= 1
    assert seen["choose_plan"] == seen["dense_candidates"] + seen["p2p_candidates"]
    if record.route == routes.DIRECT_READS.name:  # the glance's choice: direct's tasks check the inputs
        assert ranks.check and not isinstance(ranks.held, ArrayMeta)
    else:
        assert ranks.held == held
        assert (record.plan, record.route, record.predicted) == (expected.plan, expected.route, expected.predicted)


# -- the Dask graph is priced by the card of the graph it builds ------------------------------------

def _site(workers, n, *, ordered=False, transport="auto", model=None):
    places = _places(workers)
    settings = call.Settings.check("sum", "auto", None, None, None, None, None, {}, None, transport)
    inputs = tuple(Stand(("input", r)) for r in range(len(workers)))
    lowering = routes.Lowering(inputs, tuple(f.key for f in inputs), n, (n,), np.dtype("f8"), settings.op)
    return call.call_site(workers, places, hosts.rank_levels(None, workers, places, None), model or CostModel(cores=2),
                          n * 8, settings, ordered=ordered, lowering=lowering)


ONE, TWO = _layouts(4)["one host"], _layouts(4)["two hosts"]
PAIRS = _layouts(4)["2 ranks a worker"]
ON_THE_DASK_GRAPH = {  # plans some other route runs elsewhere, and plain ones
    "shm-direct, transport='dask'": (lambda: flowreduce.plan("shm-direct", 4), ONE, {"transport": "dask"}),
    "shm-direct of 2 workers, transport='dask'": (lambda: routes.shm_direct_plan(4, PAIRS), PAIRS,
                                                  {"transport": "dask"}),
    "shm-direct in 2 chunks": (lambda: flowreduce.plan("shm-direct", 4, chunks=2), ONE, {}),
    "hierarchical over shm-direct, deterministic": (
        lambda: flowreduce.plan("hierarchical", 4, groups=[[0, 1], [2, 3]], inner="shm-direct", outer="butterfly"),
        TWO, {"ordered": True}),
    "hierarchical over shm-direct, transport='dask'": (
        lambda: flowreduce.plan("hierarchical", 4, groups=[[0, 1], [2, 3]], inner="shm-direct", outer="ring"),
        TWO, {"transport": "dask"}),
    "butterfly in 3 chunks, two hosts": (lambda: flowreduce.plan("butterfly", 4, chunks=3), TWO, {}),
    "ring": (lambda: flowreduce.plan("ring", 4), ONE, {}),
    "tree, deterministic": (lambda: flowreduce.plan("tree", 4, chunks=2), ONE, {"ordered": True}),
}


@pytest.mark.parametrize("n", [10**3, 10**6])
@pytest.mark.parametrize("case", ON_THE_DASK_GRAPH)
def test_the_dask_graph_is_priced_by_the_graph_it_builds(case, n):
    """The dask-graph route's price is the cost model over the card of the graph it lowers to: the
    plan's card, whose tasks and levels are the built graph's, whatever the plan (no collective's
    price for shm-direct, no fused card for hierarchical over shm-direct: those are their routes')."""
    make, workers, kw = ON_THE_DASK_GRAPH[case]
    plan, site = make(), _site(workers, n, **kw)
    assert routes.route_of(plan, site) is routes.DASK_GRAPH
    graph = routes.DASK_GRAPH.lower(plan, site).graph
    tasks, levels = len(graph.tasks), graph_depth(graph)
    card = site.model.card(plan, site.nbytes)
    assert (card.tasks, card.steps) == (tasks, levels)

    def built(q, c):  # the card with the real graph's tasks and levels, every byte through Dask's comm
        return replace(c, tasks=tasks, steps=levels), False

    assert routes.DASK_GRAPH.price(plan, site) == pytest.approx(
        site.model.predict(plan, site.nbytes, site.hosts, built), rel=1e-12)


@pytest.mark.parametrize("n", [10**3, 10**6, 10**8])
@pytest.mark.parametrize("where", ["transport='dask'", "deterministic", "shared memory"])
def test_a_named_algorithms_variants_are_priced_as_their_route_runs_them(where, n):
    """A named ``hierarchical`` over ``shm-direct`` with its outer algorithm left open: the search keeps
    the outer algorithm the route that runs the plan prices lowest (the fused graph over shared
    memory where that route applies, else the Dask graph's own card)."""
    from flowreduce.algorithms.hierarchical import ALLREDUCE_ALGORITHMS

    kw = {"transport='dask'": {"transport": "dask"}, "deterministic": {"ordered": True}, "shared memory": {}}[where]
    site = _site(TWO, n, **kw)
    settings = call.Settings.check("sum", "hierarchical", None, None, None, None, None, {"inner": "shm-direct"},
                                   None, kw.get("transport", "auto"))
    chosen = call.dense_candidates(site, settings)[0]
    route = routes.route_of(chosen, site)
    assert (route is routes.SHM_HIERARCHICAL) == (where == "shared memory")
    variants = [flowreduce.plan("hierarchical", 4, groups=[[0, 1], [2, 3]], inner="shm-direct", outer=o)
                for o in ALLREDUCE_ALGORITHMS]
    best = min(routes.route_of(q, site).price(q, site) for q in variants)
    assert route.price(chosen, site) == pytest.approx(best, rel=1e-12)


def test_calls_through_the_front_door_search_their_plans_once(proc_client, monkeypatch):
    """On worker processes: inputs in memory (the glance), a named algorithm (no glance) and
    ``deterministic=True`` each search the task routes' plans once, and the engine's at most once."""
    ws = workers_of(proc_client)
    for n, kw in ((1000, {}), (10**6, {}), (1000, {"algorithm": "ring"}), (10**5, {"deterministic": True}),
                  (1000, {"algorithm": "direct", "chunks": 2})):  # the glance picks the Dask graph: inputs described
        parts = [proc_client.submit(np.full, n, float(r), workers=[ws[r]], pure=False) for r in range(4)]
        wait(parts)
        seen = _counting(monkeypatch, "dense_candidates", "p2p_candidates")
        out = flowreduce.allreduce(proc_client, parts, **kw)
        for o in proc_client.gather(out):
            np.testing.assert_array_equal(o, np.full(n, 6.0))
        assert seen["dense_candidates"] == 1 and seen["p2p_candidates"] <= 1, (n, kw, seen)
        monkeypatch.undo()


@pytest.mark.parametrize("p, hosts_", [(4, 2), (8, 2), (8, 4), (16, 4)])
@pytest.mark.parametrize("n", [10**3, 10**5, 10**6, 10**7])
def test_the_engines_plan_is_the_variant_the_engine_runs_fastest(p, hosts_, n):
    """Between hosts (no host group), ``auto``'s engine candidate is, of every algorithm and chunk
    count ``auto`` considers, the one ``p2p_time`` (what the engine's route is priced by) prices
    lowest: the engine's variants are ranked with a message per step and no task, not by the task
    graph's formula (which would pick fewer chunks and other algorithms at 1e6 and 1e7)."""
    from flowreduce.cost import candidates, chunk_choices

    workers = [f"tcp://10.0.0.{1 + r * hosts_ // p}:{9000 + r}" for r in range(p)]
    places = _places(workers)
    model = CostModel()
    settings = call.Settings.check("sum", "auto", None, None, model, None, None, {}, None, "auto")
    ranks = call.Ranks(LEAF, tuple((Stand(("input", r)),) for r in range(p)), tuple(workers), places,
                       ArrayMeta(shape=(n,), dtype=np.dtype("f8").str))
    _, plans = call.p2p_candidates(None, ranks, settings)
    groups = hosts.rank_levels(None, workers, places, None)[0]
    assert len(groups) == hosts_
    priced = [(model.p2p_time(plan, n * 8, p, groups), plan)
              for name, options in candidates(p, groups) for c in chunk_choices(n * 8)
              for plan in [flowreduce.plan(name, p, chunks=c, **options)]]
    best = min(priced, key=lambda tp: tp[0])
    assert model.p2p_time(plans[0], n * 8, p, groups) == pytest.approx(best[0], rel=1e-9), (plans[0], best[1])
