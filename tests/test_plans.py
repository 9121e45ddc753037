"""The planners, pure: every rank ends with every segment reduced over all
ranks exactly once, and the cost cards say what the docstrings promise."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

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
    "shm-direct": [{}],
    "direct": [{}],
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


# -- one phase vocabulary -----------------------------------------------------------------------

PHASE_OPTIONS = {
    **OPTIONS,
    "hierarchical": [*OPTIONS["hierarchical"], *({"group_size": 2, "inner": i, "outer": o}
                                                 for i in ("butterfly", "ring")
                                                 for o in ("butterfly", "ring", "recursive-doubling", "reduce-broadcast"))],
    "sparse-recursive-doubling": [{"radix": 2}, {"radix": 3}],
    "sparse-split-allgather": [{"inner": "butterfly"}, {"inner": "ring"}],
    "block-sparse": [{"aggregators": 0}, {"aggregators": 2}],
}


def emitted_phases() -> dict[str, set[str]]:
    """Phase -> the algorithms whose plans give a node that phase (every
    dense, sparse, block-sparse and hierarchical planner, p = 1..9)."""
    out: dict[str, set[str]] = {}
    for algorithm in (*DENSE, *flowreduce.SPARSE_ALGORITHMS):
        for options in PHASE_OPTIONS[algorithm]:
            for p in range(1, 10):
                if options.get("root", 0) < p:
                    for n in plan(algorithm, p, **options).nodes:
                        out.setdefault(n.phase, set()).add(algorithm)
    return out


def test_every_phase_a_planner_emits_is_known_to_keys_tracer_and_drawer():
    from flowreduce import draw, keys, phases
    from flowreduce.tracing import events

    emitted = emitted_phases()
    unknown = {ph: sorted(a) for ph, a in emitted.items() if ph not in phases.PLAN_PHASES}
    assert not unknown, f"phases missing from flowreduce.phases.PLAN_PHASES: {unknown}"
    assert set(emitted) == set(phases.PLAN_PHASES), "a plan phase no planner emits"
    token = keys.new_token()
    made = {ph: (a, keys.node_key(a, ph, token, 1, 0, 0, 3)) for ph, algs in emitted.items() for a in algs}
    made[phases.OUTPUT] = ("ring", keys.output_key("ring", token, 2))
    made[phases.PACK] = ("butterfly", keys.pack_key("butterfly", token, 1))
    made[phases.UNPACK] = ("butterfly", keys.unpack_key("butterfly", token, 1, 4))
    made[phases.HAND_IN] = ("tree", keys.hand_in_key("tree", token, 3))
    made[phases.ARRIVE] = ("auto", keys.arrive_key("auto", token, 2))
    made[phases.BARRIER] = ("reduce-broadcast", keys.barrier_key("reduce-broadcast", token))
    assert set(made) == set(phases.KEY_PHASES)
    for ph, (algorithm, key) in made.items():
        parsed = keys.parse(key)
        assert parsed is not None and (parsed["algorithm"], parsed["phase"], parsed["token"]) == (algorithm, ph, token)
        assert events.KEY_PHASE.get(ph) in events.PHASES, f"the tracer drops key phase {ph!r}"
        assert ph in draw.PHASE_COLOURS, f"the drawer has no colour for phase {ph!r}"


#: a process that makes 1,000 tokens, forks, and prints 1,000 more of each side: parent's line, child's line
_FORKING = """
import os, sys
from flowreduce import keys
before = [keys.new_token() for _ in range(1000)]
r, w = os.pipe()
if os.fork() == 0:
    os.write(w, " ".join(keys.new_token() for _ in range(1000)).encode())
    os._exit(0)
os.close(w)
child = b"".join(iter(lambda: os.read(r, 1 << 16), b"")).decode()
os.wait()
print(" ".join(before + [keys.new_token() for _ in range(1000)]))
print(child)
"""


def test_call_tokens_are_unique_in_a_process_its_fork_and_another_process_and_split_from_key_names():
    """Tokens are 32 hex digits, none repeated among 100,000 of one process, nor between processes
    (a parent and a child it forked making as many since the fork, another process); no two of one
    process share their first 8 digits (what the dashboard shows); ``dask.utils.key_split`` drops them."""
    import subprocess

    from dask.utils import key_split

    from flowreduce import keys

    here = [keys.new_token() for _ in range(100_000)]
    parent, child = (line.split() for line in subprocess.run(
        [sys.executable, "-c", _FORKING], capture_output=True, text=True, check=True).stdout.splitlines())
    assert len(parent) == 2000 and len(child) == 1000
    every = here + parent + child
    assert len(set(every)) == len(every)
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in every)
    assert len({t[:8] for t in here}) == len(here)
    assert key_split(keys.output_key("ring", here[0], 3)) == "flowreduce-ring-output"


# -- fingerprints: proof that a refactoring changed no plan ------------------------------------------

#: Hashes of every plan of :func:`fingerprint_cases` (nodes, finals, segments,
#: options, cost cards at 1..3 chunks) and of its DOT drawing, by family
#: (algorithm and options) and rank count. Rewrite with
#: ``PYTHONPATH=$PWD python tests/test_plans.py --write`` only when a plan is meant to change.
FINGERPRINTS = Path(__file__).resolve().parent / "data" / "plan_fingerprints.json"
RANKS = range(1, 25)
KNOBS = range(2, 9)  # radix / fan_in
HIERARCHICAL_RANKS = [*range(1, 13), 16, 24]
HIERARCHICAL_PAIRS = [(i, o, 2) for i in ("butterfly", "ring")
                      for o in ("butterfly", "ring", "recursive-doubling", "reduce-broadcast")]
HIERARCHICAL_PAIRS += [("butterfly", "butterfly", 3), ("butterfly", "recursive-doubling", 3)]


def _blocks(sizes: list[int]) -> list[list[int]]:
    out, r = [], 0
    for s in sizes:
        out.append(list(range(r, r + s)))
        r += s
    return out


def _groupings(p: int) -> list[tuple[str, dict]]:
    """(family name, options) of the hierarchical groupings tried at ``p`` ranks."""
    out = [("flat", {})] + [(f"group_size={g}", {"group_size": g}) for g in (2, 3, 4) if g < p]
    out += [(f"blocks{s}", {"groups": _blocks(s)}) for s in ([p - p // 2, p // 2], [1, p - 1], [p - 3, 2, 1])
            if min(s) > 0]
    out = [(name.replace(str([p - p // 2, p // 2]), "[halves]").replace(str([1, p - 1]), "[1,rest]")
            .replace(str([p - 3, 2, 1]), "[rest,2,1]"), o) for name, o in out]
    if p % 2 == 0 and p >= 4:
        out.append(("interleaved", {"groups": [list(range(0, p, 2)), list(range(1, p, 2))]}))
    if p % 4 == 0 and p >= 8:
        out.append(("levels=2,4", {"levels": [_blocks([2] * (p // 2)), _blocks([4] * (p // 4))]}))
    return out


def fingerprint_cases():
    """(family, algorithm, ranks, options, drawn): every flat algorithm at
    p = 1..24 with radix / fan_in 2..8, hierarchical with several groupings
    (even, uneven, interleaved, two levels) and inner/outer pairs, and the
    sparse plans. ``drawn``: the plan's DOT is fingerprinted too."""
    for p in RANKS:
        yield "ring", "ring", p, {}, True
        yield "direct", "direct", p, {}, True
        yield "reduce-broadcast root=0", "reduce-broadcast", p, {"root": 0}, True
        yield "reduce-broadcast root=last", "reduce-broadcast", p, {"root": p - 1}, True
        for k in KNOBS:
            yield f"tree fan_in={k}", "tree", p, {"fan_in": k}, True
            yield f"recursive-doubling radix={k}", "recursive-doubling", p, {"radix": k}, True
            yield f"butterfly radix={k}", "butterfly", p, {"radix": k}, True
        for k in (2, 3, 4, 8):
            yield f"sparse-recursive-doubling radix={k}", "sparse-recursive-doubling", p, {"radix": k}, False
            yield (f"sparse-split-allgather butterfly radix={k}", "sparse-split-allgather", p,
                   {"inner": "butterfly", "radix": k}, False)
        yield "sparse-split-allgather ring", "sparse-split-allgather", p, {"inner": "ring"}, False
        for a in range(3):
            yield f"block-sparse aggregators={a}", "block-sparse", p, {"aggregators": a}, False
    for p in HIERARCHICAL_RANKS:
        for name, g in _groupings(p):
            for inner, outer, radix in HIERARCHICAL_PAIRS:
                yield (f"hierarchical {name} {inner}/{outer} radix={radix}", "hierarchical", p,
                       {**g, "inner": inner, "outer": outer, "radix": radix}, p <= 6)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _card(p) -> dict[str, str]:
    return {k: repr(v) for k, v in p.cost(1e6).as_dict().items()}


def _plan_text(p) -> str:
    doc = {
        "algorithm": p.algorithm, "ranks": p.ranks, "segments": p.segments, "options": p.options,
        "nodes": [[n.kind, n.rank, n.lo, n.hi, list(n.inputs), n.step, n.phase] for n in p.nodes],
        "finals": list(p.finals),
        "cost": [_card(p.with_chunks(c)) for c in (1, 2, 3)],
    }
    if hasattr(p, "density"):  # sparse: the card at a density, where message bytes depend on it
        doc["sparse-cost"] = _card(replace(p, density=tuple(0.001 * (r + 1) for r in range(p.ranks)), value_bytes=4))
    return json.dumps(doc, sort_keys=True)


def fingerprints(dot: bool = True) -> dict[str, dict[str, dict[str, str]]]:
    """``{"plans"|"dot": {family: {ranks: hash}}}`` of :func:`fingerprint_cases`
    (``dot=False``: the plans only, no graphviz needed)."""
    out: dict[str, dict[str, dict[str, str]]] = {"plans": {}, "dot": {}}
    if dot:
        from flowreduce.draw import plan_graph
    for family, algorithm, ranks, options, drawn in fingerprint_cases():
        p = plan(algorithm, ranks, **options)
        out["plans"].setdefault(family, {})[str(ranks)] = _digest(_plan_text(p))
        if dot and drawn:  # more chunks change only the subtitle, read off the cards above
            out["dot"].setdefault(family, {})[str(ranks)] = _digest(plan_graph(p).source)
    return out


def test_no_plan_changed():
    """Every plan, cost card and plan drawing is what it was when the
    fingerprints were written (the proof a refactoring changed nothing)."""
    try:
        import graphviz  # noqa: F401
        dot = True
    except ImportError:  # the plans alone
        dot = False
    want = json.loads(FINGERPRINTS.read_text())
    got = fingerprints(dot=dot)
    for kind in ("plans", "dot") if dot else ("plans",):
        changed = sorted(f"{family} p={r}" for family in want[kind].keys() | got[kind].keys()
                         for r in want[kind].get(family, {}).keys() | got[kind].get(family, {}).keys()
                         if want[kind].get(family, {}).get(r) != got[kind].get(family, {}).get(r))
        assert not changed, (f"{len(changed)} {kind} fingerprints changed (if meant: "
                             f"PYTHONPATH=$PWD python tests/test_plans.py --write), e.g. {changed[:5]}")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FINGERPRINTS.write_text(json.dumps(fingerprints(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FINGERPRINTS}")
