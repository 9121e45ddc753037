"""The planners, pure: every rank ends with every segment reduced over all
ranks exactly once, and the cost cards say what the docstrings promise."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowreduce
from flowreduce.algorithms import plan

DENSE = [a for a in flowreduce.ALGORITHMS if a != "auto"]
OPTIONS = {
    "reduce-broadcast": [{}, {"root": 2}],
    "tree": [{"fan_in": 1}, {"fan_in": 2}, {"fan_in": 3}, {"fan_in": 16}],
    "recursive-doubling": [{"radix": 2}, {"radix": 3}, {"radix": 4}, {"radix": 17}],
    "butterfly": [{"radix": 2}, {"radix": 3}, {"radix": 4}, {"radix": 8}, {"radix": 17}],
    "ring": [{}],
    "hierarchical": [{}, {"group_size": 2}, {"group_size": 3, "inner": "ring"},
                     {"group_size": 4, "outer": "ring", "radix": 3}],
}
CASES = [(a, p, o) for a in DENSE for p in range(1, 17) for o in OPTIONS[a]
         if not (a == "reduce-broadcast" and o.get("root", 0) >= p)]


@pytest.mark.parametrize("algorithm,ranks,options", CASES,
                         ids=[f"{a}-p{p}-{o}" for a, p, o in CASES])
def test_every_rank_gets_every_segment_once(algorithm, ranks, options):
    plan(algorithm, ranks, **options).check()


@given(
    algorithm=st.sampled_from(DENSE),
    ranks=st.integers(1, 40),
    knob=st.integers(1, 9),
    chunks=st.integers(1, 5),
)
@settings(max_examples=150, deadline=None)
def test_plans_are_complete_property(algorithm, ranks, knob, chunks):
    opts = {"tree": {"fan_in": knob}, "butterfly": {"radix": knob + 1},
            "recursive-doubling": {"radix": knob + 1}}.get(algorithm, {})
    p = plan(algorithm, ranks, chunks=chunks, **opts)
    p.check()
    card = p.cost(1000.0)
    assert card.tasks >= chunks * ranks  # at least one view per rank and chunk
    assert card.messages == chunks * len(p.transfers())


@pytest.mark.parametrize("p", [2, 4, 8, 16])
@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
def test_bandwidth_optimal_algorithms_move_the_lower_bound(algorithm, p):
    n = 1 << 20
    card = plan(algorithm, p).cost(n)
    # each rank sends and receives 2(p-1)/p·n: the all-reduce lower bound
    assert card.max_rank_bytes == pytest.approx(2 * 2 * (p - 1) / p * n)
    assert card.bytes_on_wire == pytest.approx(p * 2 * (p - 1) / p * n)
    assert card.reduce_bytes == pytest.approx((p - 1) / p * n)
    assert card.total_reduce_bytes == pytest.approx((p - 1) * n)
    # the chain of dependent transfers: halving then doubling (butterfly), 2(p-1) hops of n/p (ring)
    assert card.critical_bytes == pytest.approx(2 * (p - 1) / p * n)
    assert card.copy_bytes == pytest.approx(p * n)  # every rank concatenates its gathered pieces


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_butterfly_steps_and_tasks(p):
    lg = int(math.log2(p))
    card = plan("butterfly", p).cost(1.0)
    assert card.steps == 2 * lg + 1  # split + lg p halving + lg p doubling (output merged)
    radix4 = plan("butterfly", p, radix=4).cost(1.0)
    assert radix4.steps <= card.steps and radix4.tasks <= card.tasks


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_reduce_broadcast_loads_the_root(p):
    n = 1000.0
    card = plan("reduce-broadcast", p).cost(n)
    assert card.max_rank_bytes == pytest.approx(2 * (p - 1) * n)  # (p-1)·n in and out of the root
    assert card.steps == 3
    assert card.critical_bytes == pytest.approx(2 * n)  # in to the root, out again
    assert card.copy_bytes == 0  # the root reduces into a received buffer; others keep theirs


def test_direct_exchange_is_two_levels():
    assert plan("recursive-doubling", 8, radix=8).cost(1.0).steps == 2


def test_chunks_multiply_tasks_not_bytes():
    one, four = plan("ring", 5).cost(1e6), plan("ring", 5, chunks=4).cost(1e6)
    assert four.bytes_on_wire == pytest.approx(one.bytes_on_wire)
    assert four.tasks == 4 * (one.tasks) + 5  # + one output task per rank


def test_unknown_algorithm_lists_valid_names():
    with pytest.raises(ValueError, match="unknown algorithm 'bogus'; valid: reduce-broadcast, tree"):
        plan("bogus", 4)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_rank_count(bad):
    with pytest.raises(ValueError, match="at least one rank"):
        plan("ring", bad)


def test_bad_option_is_named():
    with pytest.raises(ValueError, match="bad option for algorithm 'ring'"):
        plan("ring", 4, radix=2)
    with pytest.raises(ValueError, match="radix must be at least 2"):
        plan("butterfly", 4, radix=1)


@pytest.mark.parametrize("algorithm", DENSE)
def test_chunk_variants_share_one_structure(algorithm):
    base = plan(algorithm, 6)
    for c in (1, 2, 7):
        variant, fresh = base.with_chunks(c), plan(algorithm, 6, chunks=c)
        assert variant.structure is base.structure  # priced without walking the nodes again
        assert variant.cost(12345.0) == fresh.cost(12345.0)
        assert variant.chunks == c and variant.nodes is base.nodes


def test_plans_are_built_once_per_algorithm_ranks_and_options():
    assert plan("butterfly", 12, radix=4).nodes is plan("butterfly", 12, radix=4, chunks=3).nodes
    assert plan("butterfly", 12, radix=4).nodes is not plan("butterfly", 12, radix=2).nodes
    groups = [[0, 1, 2], [3, 4, 5]]
    assert plan("hierarchical", 6, groups=groups).nodes is plan("hierarchical", 6, groups=[[0, 1, 2], [3, 4, 5]]).nodes
    assert plan("hierarchical", 6, groups=groups).options["groups"] == groups  # options as given


@pytest.mark.parametrize("p", [2, 16, 17, 64])
def test_auto_prices_quadratic_plans_only_for_few_ranks(p):
    from flowreduce.cost import QUADRATIC_PLANS_UP_TO, candidates

    names = candidates(p)
    quadratic = [(a, o) for a, o in names if a == "ring" or (a == "butterfly" and o.get("radix") == p)]
    assert bool(quadratic) == (p <= QUADRATIC_PLANS_UP_TO)
    assert ("butterfly", {"radix": 4}) in names and ("recursive-doubling", {"radix": p}) in names


@pytest.mark.parametrize("text,want", [
    ("butterfly", ("butterfly", {})),
    ("butterfly:radix=4", ("butterfly", {"radix": 4})),
    ("tree:fan-in=3", ("tree", {"fan_in": 3})),
    ("hierarchical:group_size=2:inner=ring", ("hierarchical", {"group_size": 2, "inner": "ring"})),
    ("block-sparse:block_size=64", ("block-sparse", {"block_size": 64})),
])
def test_parse_spec_reads_options_the_planner_takes(text, want):
    from flowreduce.algorithms import format_spec, parse_spec

    assert parse_spec(text) == want
    name, options = want
    assert parse_spec(format_spec(name, options)) == want
    expected = {**plan(name, 4).options, **options}
    if "group_size" in expected:  # hierarchical records the groups it makes of it
        expected["groups"] = [list(range(g, g + 2)) for g in range(0, 4, expected.pop("group_size"))]
    assert plan(name, 4, **options).options == expected


@pytest.mark.parametrize("text,message", [
    ("butterflies", "unknown algorithm 'butterflies'; valid: reduce-broadcast"),
    ("butterfly:radx=4", "butterfly takes no option radx; it takes: radix"),
    ("ring:radix=2", "ring takes no option radix; it takes: none"),
    ("butterfly:radix", "expected OPTION=VALUE after 'butterfly', got 'radix'"),
    ("auto:radix=2", "options need a named algorithm, not 'auto'"),
])
def test_parse_spec_names_what_is_wrong(text, message):
    from flowreduce.algorithms import parse_spec

    with pytest.raises(ValueError, match=message):
        parse_spec(text)
