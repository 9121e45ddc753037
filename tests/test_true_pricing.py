"""``algorithm="auto"`` prices ``deterministic=True``'s partial sums (issue #28).

Under True a value a plan moves carries the partial sums of the reference
tree that cover the ranks it combines (docs/reproducibility.md, "Cost of
``True``"). The library counts them (:mod:`flowreduce.algorithms.partials`);
here they are counted again independently -- segment by segment from the
ranks each node's value combines, as :meth:`Plan.check` tracks them, by
hand for two small plans, and against the ordered lowering's layout -- and the cost model, ``choose_plan`` and a call's
record are checked to price them under True, and only then.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

import flowreduce
from flowreduce.algorithms import partials
from flowreduce.algorithms.partials import carried, wire_factor
from flowreduce.cost import CostModel, choose
from flowreduce.lower.graph import piece_layout, tree_nodes
from flowreduce.reproducible import tree_cover
from flowreduce.schedule.call import Settings, choose_plan, pricing

#: six hosts of one rank each, 10 MB per rank, the default model: ``auto``'s pick for the default is
#: recursive doubling of radix 4, whose messages carry 1.67x the bytes under True (docs table, p=6)
P, NBYTES = 6, 10**7
HOSTS = [[r] for r in range(P)]


def segment_partials(plan) -> list[int]:
    """Per transfer of ``plan`` (``plan.transfers()``'s order): the partial
    sums it carries, segment by segment: for each segment the ranks summed
    into it at the sending node (tracked per segment, as Plan.check does),
    and the tree nodes covering them."""
    ranks: list[dict[int, frozenset[int]]] = []
    for n in plan.nodes:
        if n.kind == "view":
            ranks.append({s: frozenset((n.rank,)) for s in range(n.lo, n.hi)})
        elif n.kind == "reduce":
            ranks.append({s: frozenset().union(*(ranks[i][s] for i in n.inputs)) for s in range(n.lo, n.hi)})
        else:
            ranks.append({s: next(ranks[i][s] for i in n.inputs if s in ranks[i]) for s in range(n.lo, n.hi)})
    return [sum(len(tree_cover(plan.ranks, sorted(ranks[t.src][s]))) for s in range(t.lo, t.hi))
            for t in plan.transfers()]


VARIANTS = [("ring", {}), ("tree", {}), ("tree", {"fan_in": 3}), ("butterfly", {}), ("butterfly", {"radix": 4}),
            ("recursive-doubling", {}), ("recursive-doubling", {"radix": 4}), ("reduce-broadcast", {}),
            ("hierarchical", {}), ("hierarchical", {"group_size": 2}), ("direct", {}), ("shm-direct", {})]


@pytest.mark.parametrize("algorithm,options", VARIANTS)
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 12])
def test_factor_is_the_partials_counted_segment_by_segment(algorithm, options, p):
    plan = flowreduce.plan(algorithm, p, **options)
    counted = segment_partials(plan)
    plain = sum(t.hi - t.lo for t in plan.transfers())
    assert carried(plan).wire_width == sum(counted)
    assert wire_factor(plan) == (sum(counted) / plain if plain else 1.0)
    per_rank = Counter()
    for t, k in zip(plan.transfers(), counted):
        per_rank[t.source] += k
        per_rank[t.dest] += k
    assert carried(plan).max_rank_width == max(per_rank.values(), default=0)
    # and what the ordered lowering lays out for each node's value, the bytes it sends
    layout = piece_layout(plan, [len(c) for c in tree_nodes(plan)])
    assert list(carried(plan).widths) == [sum(b - a for a, b in pieces) for pieces in layout]


@pytest.mark.parametrize("algorithm,options", VARIANTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8, 12, 17])
def test_partials_of_every_node_are_the_cover_of_its_ranks(algorithm, options, p):
    """The one walk the cost model counts by and the ordered lowering adds by
    (partials merged reduce by reduce) gives each node the reference tree's
    cover of the ranks it combines, computed here from scratch."""
    plan = flowreduce.plan(algorithm, p, **options)
    ranks: list[frozenset[int]] = []
    for n in plan.nodes:
        ranks.append(frozenset((n.rank,)) if n.kind == "view" else
                     frozenset().union(*(ranks[i] for i in n.inputs)) if n.kind == "reduce" else ranks[n.inputs[0]])
    expected = [tree_cover(p, sorted(r)) for r in ranks]
    assert tree_nodes(plan) == expected
    assert partials.tree_nodes(plan) == expected


def test_ring_of_four_by_hand():
    """Ring, p=4, tree ((0,1),(2,3)): the reduce-scatter's step k sends each
    segment summed over k consecutive ranks: k=1 one partial each (4); k=2
    {0,1}, {2,3} one, {1,2}, {3,0} two (6); k=3 any three ranks are a pair
    and a single (8); the all-gather's 12 messages carry whole sums (12).
    30 partials where the default sends 24 values: 1.25 (docs table)."""
    plan = flowreduce.plan("ring", 4)
    assert len(plan.transfers()) == 24 and all(t.hi - t.lo == 1 for t in plan.transfers())
    assert wire_factor(plan) == 30 / 24 == 1.25


def test_binary_tree_of_four_by_hand():
    """tree (fan_in 2, a heap), p=4: 3 -> 1 carries {3}; 1 -> 0 carries
    {1, 3}, not siblings in ((0,1),(2,3)): two partials; 2 -> 0 carries {2};
    the broadcast's 3 messages carry the whole sum: 7 partials for 6 values."""
    assert wire_factor(flowreduce.plan("tree", 4)) == 7 / 6


def test_docs_table_values():
    """The rows of docs/reproducibility.md's table, from the independent count."""
    expected = {("ring", (), 3): 1.17, ("ring", (), 4): 1.25, ("ring", (), 8): 1.57, ("ring", (), 32): 2.37,
                ("tree", (), 16): 1.70, ("butterfly", (("radix", 4),), 6): 1.20,
                ("recursive-doubling", (("radix", 4),), 6): 1.67, ("butterfly", (), 6): 1.00,
                ("reduce-broadcast", (), 32): 1.00}
    for (algorithm, options, p), factor in expected.items():
        plan = flowreduce.plan(algorithm, p, **dict(options))
        counted = sum(segment_partials(plan)) / sum(t.hi - t.lo for t in plan.transfers())
        assert round(counted, 2) == factor
        assert wire_factor(plan) == pytest.approx(counted)


def test_model_weighs_bytes_by_the_partials():
    """A plan whose messages carry one partial each is priced the same; one
    that carries more costs more under True, on one host and across hosts."""
    model, priced = CostModel(), CostModel().carrying_partials()
    flat = flowreduce.plan("butterfly", P)
    assert priced.predict(flat, NBYTES, HOSTS) == model.predict(flat, NBYTES, HOSTS)
    assert priced.predict(flat, NBYTES) == model.predict(flat, NBYTES)
    ring = flowreduce.plan("ring", 4)
    card, weighed = model.card(ring, 4e6), priced.card(ring, 4e6)
    assert weighed.bytes_on_wire == pytest.approx(1.25 * card.bytes_on_wire)
    assert weighed.steps == card.steps and weighed.tasks == card.tasks
    assert priced.predict(ring, 4e6) > model.predict(ring, 4e6)
    assert priced.predict(ring, 4e6, [[0], [1], [2], [3]]) > model.predict(ring, 4e6, [[0], [1], [2], [3]])
    assert CostModel.from_dict(priced.to_dict()) == model  # per call, never in a file


def settings(deterministic: bool, op: str = "sum") -> Settings:
    return replace(Settings.check(op, "auto", None, None, None, None, None, {}), deterministic=deterministic)


def test_auto_under_true_avoids_the_plan_whose_messages_carry_more():
    model = CostModel()
    levels = [HOSTS]
    default = choose_plan(P, NBYTES, levels, model, settings(False))
    assert (default.algorithm, default.options.get("radix")) == ("recursive-doubling", 4)
    assert wire_factor(default) > 1.6

    true = settings(True)
    picked = choose_plan(P, NBYTES, levels, pricing(model, true, np.float64), true)
    assert picked != default
    assert wire_factor(picked) == 1.0
    priced = model.carrying_partials()
    # under True the default's pick costs more than predicted for it, and more than the new pick
    assert priced.predict(default, NBYTES, HOSTS) > model.predict(default, NBYTES, HOSTS)
    assert priced.predict(picked, NBYTES, HOSTS) < priced.predict(default, NBYTES, HOSTS)
    assert picked == choose(P, NBYTES, model=priced, groups=HOSTS)


@pytest.mark.parametrize("deterministic,op,dtype", [(False, "sum", np.float64), (True, "sum", np.int64),
                                                    (True, "max", np.float64), (False, "mean", np.float32)])
def test_choice_unchanged_where_values_carry_one_partial(deterministic, op, dtype):
    """deterministic=False, and True on what it does not reorder (integers, max): the default's pricing."""
    model, s = CostModel(), settings(deterministic, op)
    assert pricing(model, s, dtype) == model
    assert choose_plan(P, NBYTES, [HOSTS], pricing(model, s, dtype), s) == \
        choose_plan(P, NBYTES, [HOSTS], model, settings(False))


def test_float32_under_true_is_priced():
    s = settings(True, "mean")
    assert pricing(CostModel(), s, np.float32).partials
    assert pricing(CostModel(), s, "complex128").partials


def test_record_predicts_the_partials(inproc_client):
    """A call under True records the priced prediction (describe()), the default's call the default's:
    ring over four workers, each its own host (topology=), whose messages carry 1.25x the bytes."""
    client = inproc_client
    workers = sorted(client.nthreads())
    model = CostModel(cores=4)
    hosts = [[r] for r in range(4)]
    futures = [client.scatter(np.full(1000, float(r)), workers=[w], hash=False) for r, w in enumerate(workers)]
    for deterministic in (False, True):
        outs = flowreduce.allreduce(client, futures, algorithm="ring", chunks=1, model=model, method="tasks",
                                    topology=lambda addr, info: addr, deterministic=deterministic)
        record = flowreduce.describe(outs)
        assert record.plan.algorithm == "ring" and record.nbytes == 8000
        judge = model.carrying_partials() if deterministic else model
        assert record.predicted == pytest.approx(judge.predict(record.plan, 8000, hosts))
        np.testing.assert_array_equal(outs[0].result(), np.full(1000, 6.0))
    assert model.carrying_partials().predict(record.plan, 8000, hosts) > model.predict(record.plan, 8000, hosts)
