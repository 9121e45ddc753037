"""Hierarchical (BlueConnect) all-reduce and topology detection.

Two tiers: the pure plan (bookkeeping with ``Plan.check``, bytes between
groups against the cost card, degenerate groupings against the flat
algorithms, a hypothesis property on random groupings), then numbers on an
in-process cluster. In-process workers all share one host, so the groups
are passed explicitly, as a caller with a real multi-host cluster would
pass ``flowreduce.rank_groups(client, inputs)``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from utils import assert_clean, scatter_ranks, workers_of

from flowreduce.algorithms import butterfly, hierarchical, recursive_doubling, reduce_broadcast, ring
from flowreduce.algorithms.hierarchical import ALLREDUCE_ALGORITHMS, SCATTER_ALGORITHMS
from flowreduce.grouping import Topology, by_name_prefix, by_resource, host_of

FLAT = {m.NAME: m for m in (butterfly, ring, recursive_doubling, reduce_broadcast)}
BANDWIDTH_OPTIMAL = ("butterfly", "ring", "reduce-broadcast")  # 2(m-1)·n over all links


def grouping(kind: str, p: int) -> list[list[int]] | None:
    """Named groupings valid for every rank count."""
    if kind == "singletons":
        return None
    if kind == "one-host":
        return [list(range(p))]
    if kind == "pairs":
        return [list(range(i, min(i + 2, p))) for i in range(0, p, 2)]
    if kind == "three-and-rest":  # [3, 5] at p = 8
        return [g for g in (list(range(min(3, p))), list(range(3, p))) if g]
    if kind == "interleaved":  # host = rank parity: ranks of a host are not consecutive
        return [g for g in (list(range(0, p, 2)), list(range(1, p, 2))) if g]
    if kind == "ragged":  # sizes 1, 2, 3, ...
        out, r, k = [], 0, 1
        while r < p:
            out.append(list(range(r, min(r + k, p))))
            r, k = r + k, k + 1
        return out
    raise AssertionError(kind)


KINDS = ["singletons", "one-host", "pairs", "three-and-rest", "interleaved", "ragged"]


def groups_or_singletons(groups: list[list[int]] | None, p: int) -> list[list[int]]:
    return groups if groups is not None else [[r] for r in range(p)]


def split_bytes(plan, groups: list[list[int]], nbytes: float):
    """(bytes between groups, bytes within groups, inter-group bytes sent per rank)."""
    where = {r: i for i, g in enumerate(groups) for r in g}
    seg = nbytes / plan.segments
    inter = intra = 0.0
    sent: dict[int, float] = {r: 0.0 for r in range(plan.ranks)}
    for t in plan.transfers():
        b = (t.hi - t.lo) * seg
        if where[t.source] != where[t.dest]:
            inter += b
            sent[t.source] += b
        else:
            intra += b
    return inter, intra, sent


def outer_bytes(outer: str, m: int, n: float) -> float:
    """Bytes between groups over all links, from the cost card: each shard
    range is all-reduced among m owners, so the ranges add up to one outer
    all-reduce of n. Bandwidth-optimal outers: 2(m-1)/m·n per owner share,
    2(m-1)·n in all; recursive doubling: the flat algorithm's bytes."""
    if outer in BANDWIDTH_OPTIMAL:
        return 2 * (m - 1) * n
    return FLAT[outer].plan(m).cost(n).bytes_on_wire


# -- the plan ------------------------------------------------------------------------


@pytest.mark.parametrize("outer", ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("inner", SCATTER_ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", range(1, 13), ids=lambda p: f"p{p}")
def test_plan_checks(p, kind, inner, outer):
    plan = hierarchical.plan(p, groups=grouping(kind, p), inner=inner, outer=outer)
    plan.check()
    assert plan.algorithm == "hierarchical" and plan.ranks == p


@pytest.mark.parametrize("radix", [2, 3, 4])
@pytest.mark.parametrize("p", range(1, 13), ids=lambda p: f"p{p}")
def test_plan_checks_radix(p, radix):
    hierarchical.plan(p, groups=grouping("three-and-rest", p), radix=radix, outer="recursive-doubling").check()
    hierarchical.plan(p, group_size=4, radix=radix).check()


@pytest.mark.parametrize("outer", ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("inner", SCATTER_ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", range(1, 13), ids=lambda p: f"p{p}")
def test_bytes_between_and_within_groups(p, kind, inner, outer):
    """Between groups: the outer all-reduce of n in all (a 1/g share per
    rank); within: 2(g-1)·n per group (reduce-scatter + all-gather)."""
    n = 1.0e6
    groups = groups_or_singletons(grouping(kind, p), p)
    plan = hierarchical.plan(p, groups=grouping(kind, p), inner=inner, outer=outer)
    inter, intra, _ = split_bytes(plan, groups, n)
    assert inter == pytest.approx(outer_bytes(outer, len(groups), n))
    assert intra == pytest.approx(sum(2 * (len(g) - 1) * n for g in groups))
    assert plan.cost(n).bytes_on_wire == pytest.approx(inter + intra)


def _power_of_two(k: int) -> bool:
    return k & (k - 1) == 0


# every member owns a shard (ring inside, or a butterfly over a power of two)
# and the outer algorithm folds nobody (ring, or m a power of two)
EQUAL_SHARES = [
    (g, m, inner, outer)
    for g, m in [(1, 2), (2, 2), (4, 2), (2, 4), (3, 2), (4, 4), (6, 2), (2, 3), (3, 4)]
    for inner in SCATTER_ALGORITHMS
    for outer in ("butterfly", "ring")
    if (inner == "ring" or _power_of_two(g)) and (outer == "ring" or _power_of_two(m))
]


@pytest.mark.parametrize("g,m,inner,outer", EQUAL_SHARES, ids=["g{}-m{}-{}-{}".format(*c) for c in EQUAL_SHARES])
def test_each_rank_sends_a_one_over_g_share(g, m, inner, outer):
    """The cost card's outer term: every rank sends 2(m-1)/m·(n/g) between hosts."""
    n = 1.0e6
    groups = [list(range(h * g, (h + 1) * g)) for h in range(m)]
    plan = hierarchical.plan(g * m, groups=groups, inner=inner, outer=outer)
    _, _, sent = split_bytes(plan, groups, n)
    expected = 2 * (m - 1) / m * n / g
    assert sent == pytest.approx({r: expected for r in range(g * m)})


@pytest.mark.parametrize("g,m", [(2, 2), (4, 2), (2, 4), (8, 1), (1, 8)], ids=str)
def test_steps_add_up_per_level(g, m):
    """Latency term: lg g + 2 lg m + lg g dependent levels (+1 split), the
    flat butterfly's 2 lg p + 1 when g·m = p."""
    plan = hierarchical.plan(g * m, group_size=g)
    assert plan.depth == 2 * math.log2(g) + 2 * math.log2(m) + 1
    assert plan.depth == butterfly.plan(g * m).depth


@pytest.mark.parametrize("outer", ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("p", range(1, 13), ids=lambda p: f"p{p}")
def test_singleton_groups_are_the_flat_outer_algorithm(p, outer):
    flat = FLAT[outer].plan(p)
    assert hierarchical.plan(p, outer=outer).cost(1e6) == flat.cost(1e6)
    assert hierarchical.plan(p, group_size=1, outer=outer).cost(1e6) == flat.cost(1e6)


@pytest.mark.parametrize("inner", SCATTER_ALGORITHMS)
@pytest.mark.parametrize("p", range(1, 13), ids=lambda p: f"p{p}")
def test_one_host_is_the_flat_inner_algorithm(p, inner):
    assert hierarchical.plan(p, group_size=p, inner=inner).cost(1e6) == FLAT[inner].plan(p).cost(1e6)


def test_uneven_hosts_cut_at_shard_intersections():
    """[3, 5] with ring inside: 15 shard bounds, x2 for the outer ring."""
    plan = hierarchical.plan(8, groups=[[0, 1, 2], [3, 4, 5, 6, 7]], inner="ring", outer="ring")
    assert plan.segments == 30
    plan.check()


@pytest.mark.parametrize("outer", ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("inner", SCATTER_ALGORITHMS)
def test_three_levels(inner, outer):
    hosts = [[0, 1], [2, 3, 4], [5], [6, 7], [8, 9, 10, 11]]
    racks = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]
    plan = hierarchical.plan(12, levels=[hosts, racks], inner=inner, outer=outer)
    plan.check()
    n = 1.0e6
    inter_rack, _, _ = split_bytes(plan, racks, n)
    assert inter_rack == pytest.approx(outer_bytes(outer, len(racks), n))


@st.composite
def nested_groupings(draw):
    p = draw(st.integers(1, 12))
    order = draw(st.permutations(range(p)))
    cuts = sorted(draw(st.sets(st.integers(1, p - 1), max_size=p - 1))) if p > 1 else []
    hosts = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, p], strict=True)]
    h = len(hosts)
    rack_cuts = sorted(draw(st.sets(st.integers(1, h - 1), max_size=h - 1))) if h > 1 else []
    racks = [sum(hosts[a:b], []) for a, b in zip([0, *rack_cuts], [*rack_cuts, h], strict=True)]
    return p, hosts, racks


@settings(max_examples=150, deadline=None)
@given(
    nested_groupings(),
    st.sampled_from(SCATTER_ALGORITHMS),
    st.sampled_from(ALLREDUCE_ALGORITHMS),
    st.integers(2, 4),
    st.booleans(),
)
def test_random_groupings(case, inner, outer, radix, with_racks):
    p, hosts, racks = case
    levels = [hosts, racks] if with_racks else [hosts]
    plan = hierarchical.plan(p, levels=levels, inner=inner, outer=outer, radix=radix)
    plan.check()
    top = levels[-1]
    n = 1.0e6
    inter, _, _ = split_bytes(plan, top, n)
    if outer in BANDWIDTH_OPTIMAL:
        assert inter == pytest.approx(2 * (len(top) - 1) * n)
    within_hosts = sum(2 * (len(g) - 1) * n for g in hosts)
    assert split_bytes(plan, hosts, n)[1] == pytest.approx(within_hosts)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"groups": [[0, 1], [1, 2, 3]]}, r"ranks \[1\] in more than one group"),
        ({"groups": [[0, 1], [2]]}, r"missing \[3\]"),
        ({"groups": [[0, 1, 2, 3], []]}, "empty group"),
        ({"groups": [[0, 1, 2, 3, 4]]}, r"outside 0..3: \[4\]"),
        ({"groups": [[0, 1], [2, 3]], "group_size": 2}, "pass one of groups, group_size, levels"),
        ({"group_size": 0}, "group_size must be a positive integer"),
        ({"levels": [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]}, "must be a union of finer ones"),
        ({"inner": "recursive-doubling"}, "inner must be one of butterfly, ring"),
        ({"outer": "tree"}, "outer must be one of butterfly, ring, recursive-doubling, reduce-broadcast"),
        ({"radix": 1}, "radix must be at least 2"),
    ],
    ids=["overlap", "missing", "empty", "outside", "both", "size0", "not-nested", "inner", "outer", "radix"],
)
def test_bad_options_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hierarchical.plan(4, **kwargs)


# -- topology ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, host",
    [("tcp://10.0.0.5:40123", "10.0.0.5"), ("tls://[::1]:8786", "::1"), ("inproc://10.0.0.5/77/3", "10.0.0.5"),
     ("ucx://node-7:1234", "node-7"), ("node-7:1234", "node-7")],
)
def test_host_of(address, host):
    assert host_of(address) == host


def test_topology_from_addresses_groups_ranks_by_host():
    a1, a2, b1, c1 = "tcp://a:1", "tcp://a:2", "tcp://b:1", "tcp://[fe80::1]:3"
    topo = Topology.from_addresses([a1, b1, a2, c1])
    assert topo.groups() == {"a": [a1, a2], "b": [b1], "fe80::1": [c1]}
    # ranks 0 and 4 share worker a1; groups come in order of their first rank
    assert topo.for_ranks([a1, b1, a2, c1, a1]) == [[0, 2, 4], [1], [3]]
    assert hierarchical.plan(5, groups=topo.for_ranks([a1, b1, a2, c1, a1])).ranks == 5


def test_topology_from_groups_with_racks():
    topo = Topology.from_groups({"h1": ["w1", "w2"], "h2": ["w3"], "h3": ["w4"]},
                                {"rack1": ["w1", "w2", "w3"], "rack2": ["w4"]})
    assert topo.levels_for_ranks(["w4", "w1", "w3", "w2"]) == [[[0], [1, 3], [2]], [[0], [1, 2, 3]]]
    with pytest.raises(ValueError, match="levels must nest"):
        Topology.from_groups([["w1", "w2"]], [["w1"], ["w2"]])
    with pytest.raises(ValueError, match="is in groups"):
        Topology.from_groups([["w1"], ["w1"]])


def test_topology_from_worker_info():
    info = {
        "tcp://n1:1": {"name": "SLURMCluster-0-0", "host": "n1", "resources": {"host-a": 1}},
        "tcp://n1:2": {"name": "SLURMCluster-0-1", "host": "n1", "resources": {"host-a": 1}},
        "tcp://n2:1": {"name": "SLURMCluster-1-0", "host": "n2", "resources": {"host-b": 1, "GPU": 1}},
    }
    by_job = Topology.from_info(info, by_name_prefix())
    assert by_job.groups() == {"SLURMCluster-0": ["tcp://n1:1", "tcp://n1:2"], "SLURMCluster-1": ["tcp://n2:1"]}
    assert Topology.from_info(info, by_resource("host-")).for_ranks(list(info)) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="resources starting with 'rack-'"):
        Topology.from_info(info, by_resource("rack-"))
    with pytest.raises(ValueError, match="not in this topology"):
        by_job.for_ranks(["tcp://elsewhere:1"])


def test_planner_and_topology_import_without_dask():
    import subprocess
    import sys

    code = ("import sys\nfor m in ('distributed', 'dask'): sys.modules[m] = None\n"
            "import flowreduce.grouping\nfrom flowreduce.algorithms import hierarchical\n"
            "hierarchical.plan(5, groups=[[0, 1], [2, 3, 4]]).check()\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- numbers on an in-process cluster ------------------------------------------------


def _scatter(client, p: int, shape: tuple[int, ...], seed: int):
    """Integer inputs (exact sums), rank r on worker r mod W."""
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(-1000, 1000, size=shape, dtype=np.int64) for _ in range(p)]
    workers = workers_of(client)
    placed = [workers[r % len(workers)] for r in range(p)]
    return arrays, scatter_ranks(client, arrays, workers), placed


def _run_plan(client, plan, futures, placed, shape):
    """What flowreduce.schedule.call does: lower, pin every key, submit."""
    import dask

    from flowreduce.lower.graph import build_graph
    from flowreduce.ops import resolve_op

    in_place = not any(w.startswith("inproc://") for w in placed)  # inproc hands over the sender's object
    graph = build_graph(plan, futures, placed, size=math.prod(shape), shape=shape, op=resolve_op("sum"),
                        in_place=in_place)
    with dask.annotate(workers=graph.placement.get, allow_other_workers=False):
        outs = client.get(graph.tasks, graph.outputs, sync=False)
    results = client.gather(outs)
    holders = client.who_has(outs)
    assert [sorted(holders[f.key]) for f in outs] == [[w] for w in placed]  # each result on its rank's worker
    return results


COMBOS = [("butterfly", "butterfly"), ("ring", "ring"), ("butterfly", "recursive-doubling"),
          ("ring", "reduce-broadcast")]
# every grouping with two (inner, outer) pairs, every pair with three groupings
CASES = [(kind, *COMBOS[(i + j) % 4]) for i, kind in enumerate(KINDS) for j in (0, 2)]


@pytest.mark.parametrize("chunks", [1, 3], ids=lambda c: f"chunks{c}")
@pytest.mark.parametrize("kind,inner,outer", CASES, ids=["-".join(c) for c in CASES])
@pytest.mark.parametrize("p", range(1, 9), ids=lambda p: f"p{p}")
def test_numbers_match_numpy(inproc_client, p, kind, inner, outer, chunks):
    from dataclasses import replace

    shape = (37,)  # fewer elements than segments for some groupings: empty pieces too
    client = inproc_client
    arrays, futures, placed = _scatter(client, p, shape, seed=p)
    plan = replace(hierarchical.plan(p, groups=grouping(kind, p), inner=inner, outer=outer), chunks=chunks)
    expected = np.sum(arrays, axis=0)
    for r, got in enumerate(_run_plan(client, plan, futures, placed, shape)):
        np.testing.assert_array_equal(got, expected, err_msg=f"rank {r}")


@pytest.mark.parametrize("cluster", ["inproc_client", "proc_client"])
@pytest.mark.parametrize("size", [1, 5, 1000], ids=lambda s: f"n{s}")
def test_three_levels_numbers(request, size, cluster):
    client = request.getfixturevalue(cluster)
    hosts = [[0, 1], [2, 3, 4], [5], [6, 7]]
    racks = [[0, 1, 2, 3, 4], [5, 6, 7]]
    arrays, futures, placed = _scatter(client, 8, (size,), seed=size)
    plan = hierarchical.plan(8, levels=[hosts, racks], inner="ring", outer="butterfly")
    for got in _run_plan(client, plan, futures, placed, (size,)):
        np.testing.assert_array_equal(got, np.sum(arrays, axis=0))


@pytest.mark.parametrize(
    "groups", [[[0, 1, 2], [3, 4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]], [[0], [1, 2, 3, 4, 5, 6, 7]]],
    ids=["3+5", "by-worker", "1+7"],
)
@pytest.mark.parametrize("cluster", ["inproc_client", "proc_client"])
def test_through_allreduce(request, cluster, groups):
    """End to end, on threads and on processes (real copies, so received
    buffers are reduced into in place)."""
    import flowreduce

    client = request.getfixturevalue(cluster)
    arrays, futures, _ = _scatter(client, 8, (4, 9), seed=8)
    out = flowreduce.allreduce(client, futures, algorithm="hierarchical", groups=groups, chunks=2,
                               inner="ring", outer="butterfly")
    ran = flowreduce.describe(out).plan
    assert ran.algorithm == "hierarchical" and ran.options["groups"] == groups
    for got in client.gather(out):
        np.testing.assert_array_equal(got, np.sum(arrays, axis=0))
    for before, after in zip(arrays, client.gather(futures), strict=True):
        np.testing.assert_array_equal(before, after)  # inputs untouched
    del out
    assert_clean(client)


def test_topology_of_a_live_cluster(inproc_client):
    from flowreduce import rank_groups, topology

    client = inproc_client
    topo = topology(client)
    workers = workers_of(client)
    assert sorted(topo.workers) == workers
    assert len(topo.groups()) == 1  # in-process workers share one host
    assert topology(client, workers[:2]).workers == tuple(workers[:2])
    with pytest.raises(ValueError, match="not in the cluster"):
        topology(client, ["tcp://nowhere:1"])
    _, futures, _ = _scatter(client, 5, (3,), seed=0)
    assert rank_groups(client, futures) == [[0, 1, 2, 3, 4]]


# -- three levels: the 1/∏ share -----------------------------------------------------


@pytest.mark.parametrize("g1,g2,m", [(2, 2, 2), (2, 3, 2), (3, 2, 3)], ids=str)
def test_each_rank_sends_a_one_over_product_share_across_the_top(g1, g2, m):
    """Hosts of g1 ranks, racks of g2 hosts, m racks (ring inside, ring
    across): every rank sends 2(m-1)/m · n/(g1·g2) between racks, and
    within a rack the hosts' links carry the next level's share."""
    n = 1.0e6
    p = g1 * g2 * m
    hosts = [list(range(h * g1, (h + 1) * g1)) for h in range(g2 * m)]
    racks = [sum(hosts[k * g2:(k + 1) * g2], []) for k in range(m)]
    plan = hierarchical.plan(p, levels=[hosts, racks], inner="ring", outer="ring")
    plan.check()
    _, _, sent = split_bytes(plan, racks, n)
    assert sent == pytest.approx({r: 2 * (m - 1) / m * n / (g1 * g2) for r in range(p)})
    inter_host, _, _ = split_bytes(plan, hosts, n)
    # between hosts: each rack's reduce-scatter + all-gather over g2 hosts (n/g1 per owner), plus the top
    assert inter_host == pytest.approx(m * 2 * (g2 - 1) * n + 2 * (m - 1) * n)


def test_inner_algorithm_per_level():
    hosts = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    racks = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    plan = hierarchical.plan(10, levels=[hosts, racks], inner=["ring", "butterfly"], outer="ring")
    plan.check()
    assert plan.options["inner"] == ["ring", "butterfly"]
    with pytest.raises(ValueError, match="inner names 3 algorithms for 2 levels"):
        hierarchical.plan(10, levels=[hosts, racks], inner=["ring", "ring", "ring"])
    with pytest.raises(ValueError, match="inner must be one of butterfly, ring"):
        hierarchical.plan(10, levels=[hosts, racks], inner=["ring", "tree"])


# -- hosts found by allreduce: in-process workers with faked host names ----------------


@pytest.fixture(scope="module")
def twelve_client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=12, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client


@pytest.fixture
def fake_hosts(monkeypatch):
    """``fake_hosts({worker: host})``: in-process workers report these hosts
    (what ``allreduce`` learns from each worker's address or batch node)."""
    import flowreduce.schedule.hosts as hosts

    def install(table: dict[str, str]) -> None:
        monkeypatch.setattr(hosts, "place_of", lambda dask_worker=None: (table[dask_worker.address], ""))

    return install


LAYOUTS = ["three-and-rest", "interleaved", "ragged"]


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("p", range(1, 13), ids=lambda p: f"p{p}")
def test_hierarchical_groups_ranks_by_faked_host(twelve_client, fake_hosts, p, kind):
    """Rank r on worker r; the workers' hosts make uneven groups; allreduce
    finds them and every rank gets the numpy sum on its own worker."""
    import flowreduce

    client = twelve_client
    workers = workers_of(client)[:p]
    groups = groups_or_singletons(grouping(kind, p), p)
    fake_hosts({workers[r]: f"host-{h}" for h, g in enumerate(groups) for r in g}
               | {w: "spare" for w in workers_of(client)[p:]})
    rng = np.random.default_rng(p)
    arrays = [rng.integers(-1000, 1000, size=(23,), dtype=np.int64) for _ in range(p)]
    futures = scatter_ranks(client, arrays, workers)
    out = flowreduce.allreduce(client, futures, algorithm="hierarchical")
    ran = flowreduce.describe(out).plan
    assert ran.algorithm == "hierarchical" and ran.options["groups"] == groups
    for r, got in enumerate(client.gather(out)):
        np.testing.assert_array_equal(got, np.sum(arrays, axis=0), err_msg=f"rank {r}")
    holders = client.who_has(out)
    assert [sorted(holders[f.key]) for f in out] == [[w] for w in workers]
    del out
    assert_clean(client)


def test_topology_and_rank_groups_group_ranks_as_allreduce_does(twelve_client, fake_hosts):
    """One rule decides which ranks share a host (the node each worker runs
    on): ``flowreduce.topology(client)``, ``flowreduce.rank_groups`` and
    ``allreduce`` agree, a replicated input counting where it was pinned."""
    from distributed import wait

    import flowreduce

    client = twelve_client
    ws = workers_of(client)
    table = {w: f"node-{i % 3}" for i, w in enumerate(ws)}
    fake_hosts(table)
    topo = flowreduce.topology(client)
    assert sorted(map(sorted, topo.groups().values())) == sorted(
        sorted(w for w in ws if table[w] == node) for node in set(table.values()))
    # rank 1's input is pinned to ws[4] (node-1) with a replica on ws[2] (node-2), which sorts first
    pins = [ws[0], ws[4], ws[1], ws[3]]  # nodes 0, 1, 1, 0
    xs = [client.submit(np.full, 4, r, workers=[w], pure=False) for r, w in enumerate(pins)]
    wait(xs)
    client.submit(len, xs[1], workers=[ws[2]], pure=False).result()
    assert sorted(client.who_has([xs[1]])[xs[1].key]) == sorted([ws[2], ws[4]])
    assert flowreduce.rank_groups(client, xs) == [[0, 3], [1, 2]]
    out = flowreduce.allreduce(client, xs, algorithm="hierarchical")
    assert flowreduce.describe(out).plan.options["groups"] == [[0, 3], [1, 2]]
    np.testing.assert_array_equal(client.gather(out[1]), np.full(4, 6))
    del out, xs
    assert_clean(client)


def _slow_links():
    from flowreduce.cost import CostModel, Link

    return CostModel(inter=Link(5e-3, 1 / 12.5e6), intra=Link(4e-3, 1 / 1e9))


@pytest.mark.parametrize("hosts,picks_hierarchical", [(4, True), (1, False)], ids=["4-hosts", "1-host"])
def test_auto_considers_hierarchical_when_ranks_span_hosts(twelve_client, fake_hosts, hosts, picks_hierarchical):
    import flowreduce

    client = twelve_client
    workers = workers_of(client)
    fake_hosts({w: f"host-{i % hosts}" for i, w in enumerate(workers)})  # ranks of a host are not consecutive
    arrays = [np.full(2_000_000, r, dtype=np.int64) for r in range(12)]  # 16 MB: the network term dominates
    futures = scatter_ranks(client, arrays, workers)
    out = flowreduce.allreduce(client, futures, model=_slow_links())
    ran = flowreduce.describe(out).plan
    assert (ran.algorithm == "hierarchical") is picks_hierarchical, ran
    if picks_hierarchical:
        assert ran.options["groups"] == [list(range(h, 12, hosts)) for h in range(hosts)]
    np.testing.assert_array_equal(client.gather(out[5]), np.full(2_000_000, 66))
    del out
    assert_clean(client)


def test_topology_argument_takes_a_topology_or_a_key(twelve_client):
    import flowreduce

    client = twelve_client
    workers = workers_of(client)[:6]
    arrays = [np.arange(10, dtype=np.int64) * (r + 1) for r in range(6)]
    futures = scatter_ranks(client, arrays, workers)
    topo = Topology.from_groups({"a": workers[:2], "b": workers[2:3], "c": workers[3:]})
    by_key = {w: "left" if i < 4 else "right" for i, w in enumerate(workers)}
    for topology, groups in [(topo, [[0, 1], [2], [3, 4, 5]]),
                             (lambda addr, info: by_key[addr], [[0, 1, 2, 3], [4, 5]])]:
        out = flowreduce.allreduce(client, futures, algorithm="hierarchical", topology=topology)
        assert flowreduce.describe(out).plan.options["groups"] == groups
        for got in client.gather(out):
            np.testing.assert_array_equal(got, np.sum(arrays, axis=0))
    with pytest.raises(TypeError, match="topology must be"):
        flowreduce.allreduce(client, futures, algorithm="hierarchical", topology="hosts")
    del out
    assert_clean(client)


def test_flowreduce_topology_shows_the_hosts(twelve_client):
    import flowreduce

    topo = flowreduce.topology(twelve_client)
    assert isinstance(topo, flowreduce.Topology) and sorted(topo.workers) == workers_of(twelve_client)
    text = str(topo)
    assert text.startswith("Topology: 12 workers, 1 host group") and workers_of(twelve_client)[0] in text
