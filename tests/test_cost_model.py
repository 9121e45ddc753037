"""The cost model: link classes, ``auto`` over several hosts, model files.

Pure (no cluster): the model reads everything off plans, so the checks
compare it with counts made here by hand from ``plan.transfers()`` and check
that each price term moves the prediction as the plan's card says.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import flowreduce
from flowreduce.cost import (
    CONFIG_KEY,
    CostModel,
    Link,
    candidates,
    card_at,
    choose,
    choose_sparse,
    configured_model,
    link_loads,
    tune,
    unit_price,
)

DENSE = [a for a in flowreduce.ALGORITHMS if a != "auto"]


def hosts_of(kind: str, p: int, g: int) -> list[list[int]]:
    if kind == "blocks":  # consecutive ranks share a host
        return [list(range(i, min(i + g, p))) for i in range(0, p, g)]
    return [list(range(h, p, p // g)) for h in range(p // g)]  # "interleaved": host = rank mod (p/g)


# -- the one-host model reads the plan's card ---------------------------------------------


@pytest.mark.parametrize("cores", [None, 2], ids=["core-each", "2-cores"])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("algorithm", DENSE)  # a plan's own card (routes price their lowering)
def test_one_host_predictions_follow_the_card(algorithm, chunks, cores):
    """On one host the α-β-γ terms come from the plan's card: a host link
    never matters, each level, task and call adds its price exactly as often
    as the card counts them, and a slower link, reduce or copy rate never
    predicts less (a slower link strictly more once bytes count)."""
    m = CostModel(cores=cores)
    plan = flowreduce.plan(algorithm, 6, chunks=chunks)
    for n in (8e3, 8e7):
        t = m.predict(plan, n)
        card = plan.cost(n)
        assert replace(m, inter=Link(1e-3, 1e-6)).predict(plan, n) == pytest.approx(t)
        assert m.predict(plan, n, [list(range(6))]) == pytest.approx(t)
        assert replace(m, level=m.level + 1).predict(plan, n) == pytest.approx(t + card.steps)
        assert replace(m, task=m.task + 1).predict(plan, n) == pytest.approx(t + card.tasks)
        assert replace(m, call=m.call + 1).predict(plan, n) == pytest.approx(t + 1)
        for rate in ("bandwidth", "reduce_rate", "copy_rate"):
            assert replace(m, **{rate: getattr(m, rate) / 10}).predict(plan, n) >= t * (1 - 1e-12), rate
    big = 8e8  # bytes dominate: a link ten times slower costs at least the busiest rank's bytes once more
    slower = replace(m, bandwidth=m.bandwidth / 10).predict(plan, big)
    assert slower > m.predict(plan, big) + plan.cost(big).max_rank_bytes / m.bandwidth


def test_shm_direct_is_priced_on_the_shared_memory_link():
    """Three levels, 2 tasks per worker and one per rank, bytes at the shm
    link's rate: a faster link predicts less; big vectors beat the Dask
    plans, small ones do not (one level more than recursive doubling).
    ``predict`` is the plan's card as a task graph: the collective is its
    route's price (flowreduce.schedule.routes)."""
    from flowreduce.cost import DEFAULT_SHM

    plan = flowreduce.plan("shm-direct", 4)
    m = CostModel(cores=2)
    fast = CostModel(cores=2, shm=Link(DEFAULT_SHM.alpha, DEFAULT_SHM.beta / 2))
    assert fast.shm_direct_time(plan, 8e7) < m.shm_direct_time(plan, 8e7)
    assert m.shm_direct_time(plan, 0) == pytest.approx(m.call + 3 * DEFAULT_SHM.alpha + 12 * m.task)
    assert m.shm_direct_time(plan, 8e7) < m.predict(flowreduce.choose(4, 8e7, model=m), 8e7)
    assert m.shm_direct_time(plan, 8e3) > m.predict(flowreduce.choose(4, 8e3, model=m), 8e3)


def test_p2p_on_one_host_is_priced_as_one_collective_of_a_host_group():
    """method="p2p" with shm-direct over workers of one host (flowreduce.shm.host_group): the task
    levels of any p2p run, then one step under ``split_bytes`` and two from it, bytes at the shm link's
    rate: less than the engine's plans through messages (a message per dependent step) at every size."""
    from flowreduce.cost import HOST_GROUP_STEP

    m = CostModel(cores=2)
    plan = flowreduce.plan("shm-direct", 4)
    split = 64 << 10
    assert m.p2p_host_time(plan, 0, 4, split) == pytest.approx(m.call + 3 * m.level + 9 * m.task + HOST_GROUP_STEP)
    jump = m.p2p_host_time(plan, split, 4, split) - m.p2p_host_time(plan, split - 8, 4, split)
    eight_bytes = m.p2p_host_time(plan, split - 8, 4, split) - m.p2p_host_time(plan, split - 16, 4, split)
    assert jump > 100 * eight_bytes  # the second step
    for nbytes in (8e3, 8e5, 8e7):
        messages = flowreduce.choose(4, nbytes, model=m)
        assert m.p2p_host_time(plan, nbytes, 4, split) < m.p2p_time(messages, nbytes, 4), nbytes
    assert m.p2p_host_time(plan, 8e7, 8, split) > m.p2p_host_time(plan, 8e7, 4, split)  # ranks sharing a worker


@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("algorithm,opts", [("hierarchical", {"groups": [[0, 1, 2], [3, 4]]}),
                                            *[(a, {}) for a in DENSE if a != "hierarchical"]])
def test_cards_derived_for_any_chunk_count_match_the_plan(algorithm, opts, chunks):
    """``auto`` prices chunk counts from the cards at 1 and 2 chunks."""
    key = json.dumps(opts, sort_keys=True)
    one, two, _ = unit_price(algorithm, 5, key, None)
    base = flowreduce.plan(algorithm, 5, **opts)
    assert card_at(one, two, chunks, len(base.nodes), 3e6).as_dict() == pytest.approx(
        replace(base, chunks=chunks).cost(3e6).as_dict())


# -- link loads ------------------------------------------------------------------------------


def hand_count(plan, groups, n):
    """Bytes in and out of every host link, counted from plan.transfers()."""
    host = {r: h for h, g in enumerate(groups) for r in g}
    seg = n / plan.segments
    inn, out = [0.0] * len(groups), [0.0] * len(groups)
    for t in plan.transfers():
        if host[t.source] != host[t.dest]:
            out[host[t.source]] += (t.hi - t.lo) * seg
            inn[host[t.dest]] += (t.hi - t.lo) * seg
    return inn, out


@pytest.mark.parametrize("kind", ["blocks", "interleaved"])
@pytest.mark.parametrize("algorithm", DENSE)
def test_link_loads_agree_with_the_transfers(algorithm, kind):
    n, groups = 1e6, hosts_of(kind, 8, 2)
    plan = flowreduce.plan(algorithm, 8, chunks=3)
    loads = link_loads(plan, groups, n)
    inn, out = hand_count(plan, groups, n)  # per chunk: the chunks together carry n
    assert loads.host_max == pytest.approx(3 * max(inn + out) / 3)
    assert loads.inter_total == pytest.approx(sum(out))
    assert sum(loads.inter) >= loads.host_max * (1 - 1e-9)  # each level's busiest link, summed, bounds the total
    assert len(loads.inter) == len(loads.intra)


def test_link_loads_of_textbook_cases():
    n, p = 1e6, 8
    singletons = [[r] for r in range(p)]
    rb = link_loads(flowreduce.plan("reduce-broadcast", p), singletons, n)
    assert rb.host_max == pytest.approx((p - 1) * n)  # the root's link, each way
    assert max(rb.inter) == pytest.approx((p - 1) * n)  # all at one level: the root's inbound
    ring = link_loads(flowreduce.plan("ring", p), singletons, n)
    assert ring.host_max == pytest.approx(2 * (p - 1) / p * n)
    assert sum(ring.inter) == pytest.approx(2 * (p - 1) / p * n)  # full duplex: each step costs n/p once
    with pytest.raises(ValueError, match="must partition ranks 0..7"):
        link_loads(flowreduce.plan("ring", p), [[0, 1]], n)


def test_full_duplex_makes_the_butterfly_p_times_cheaper_than_reduce_broadcast_on_slow_links():
    """The bandwidth term alone (no latency, CPU free): T_rb / T_bf -> p/... on a network."""
    m = CostModel(call=0, level=0, task=0, reduce_rate=1e30, copy_rate=1e30, bandwidth=1e30,
                  intra=Link(0, 1e-30), inter=Link(0, 1e-7))
    p, n = 16, 1e8
    singletons = [[r] for r in range(p)]
    rb = m.predict(flowreduce.plan("reduce-broadcast", p), n, singletons)
    bf = m.predict(flowreduce.plan("butterfly", p), n, singletons)
    assert rb == pytest.approx(2 * (p - 1) * n * 1e-7)
    assert bf == pytest.approx(2 * (p - 1) / p * n * 1e-7)
    # chunks pipeline the reduce into the broadcast: the root link's two directions overlap
    rb8 = m.predict(flowreduce.plan("reduce-broadcast", p, chunks=8), n, singletons)
    assert rb8 == pytest.approx((p - 1) * n * 1e-7 * (1 + 1 / 8))
    # but no chunking beats a link's capacity: the butterfly's levels all use both directions
    bf8 = m.predict(flowreduce.plan("butterfly", p, chunks=8), n, singletons)
    assert bf8 == pytest.approx(2 * (p - 1) / p * n * 1e-7)


# -- auto over several hosts -----------------------------------------------------------------


def test_candidates_include_hierarchical_only_across_hosts():
    assert all(name != "hierarchical" for name, _ in candidates(8))
    assert all(name != "hierarchical" for name, _ in candidates(8, [list(range(8))]))
    hier = [o for name, o in candidates(8, hosts_of("blocks", 8, 4)) if name == "hierarchical"]
    assert {(o["inner"], o["outer"]) for o in hier} == {(i, o) for i in ("butterfly", "ring")
                                                       for o in ("butterfly", "ring", "recursive-doubling",
                                                                 "reduce-broadcast")}
    assert all(o["groups"] == hosts_of("blocks", 8, 4) for o in hier)


SLOW_NETWORK = CostModel(cores=None, inter=Link(5e-3, 1 / 12.5e6), intra=Link(4e-3, 1 / 1e9))


def test_auto_picks_hierarchical_when_hosts_interleave_on_slow_links():
    groups = hosts_of("interleaved", 16, 4)
    plan = choose(16, 4e7, model=SLOW_NETWORK, groups=groups)
    assert plan.algorithm == "hierarchical" and plan.options["groups"] == groups
    # the same vector on one host: no hierarchical, and the prediction says why
    assert choose(16, 4e7, model=SLOW_NETWORK).algorithm != "hierarchical"
    flat = choose(16, 4e7, model=SLOW_NETWORK, groups=groups, algorithms=["butterfly", "ring"])
    assert SLOW_NETWORK.predict(plan, 4e7, groups) < SLOW_NETWORK.predict(flat, 4e7, groups)


def test_a_calibrated_model_changes_the_choice():
    """Default inter link (10 GbE) vs a calibrated slow one: the pick moves to
    an algorithm that keeps bytes off the host links."""
    groups = hosts_of("interleaved", 8, 2)
    fast = choose(8, 8e6, groups=groups, model=CostModel())
    slow = choose(8, 8e6, groups=groups, model=SLOW_NETWORK)
    assert (fast.algorithm, fast.options, fast.chunks) != (slow.algorithm, slow.options, slow.chunks)
    for m, picked in ((CostModel(), fast), (SLOW_NETWORK, slow)):  # each is the best under its own model
        assert m.predict(picked, 8e6, groups) <= min(m.predict(flowreduce.plan(a, 8), 8e6, groups)
                                                     for a in DENSE if a != "hierarchical") + 1e-12


def test_tune_chooses_hierarchical_levels_by_the_model():
    groups = hosts_of("blocks", 12, 3)
    plan = tune("hierarchical", 12, 4e7, model=SLOW_NETWORK, hosts=groups)
    assert plan.options["groups"] == groups
    fixed = [replace(flowreduce.plan("hierarchical", 12, groups=groups, inner=i, outer=o), chunks=c)
             for i in ("butterfly", "ring") for o in ("butterfly", "ring", "recursive-doubling", "reduce-broadcast")
             for c in (1, 2, 4, 8)]
    times = [SLOW_NETWORK.predict(f, 4e7, groups) for f in fixed]
    assert SLOW_NETWORK.predict(plan, 4e7, groups) == pytest.approx(min(times))
    assert min(times) < max(times) / 2  # the choice matters
    kept = tune("hierarchical", 12, 4e7, model=SLOW_NETWORK, hosts=groups, inner="butterfly", outer="ring")
    assert (kept.options["inner"], kept.options["outer"]) == ("butterfly", "ring")
    two_level = tune("hierarchical", 12, 4e7, model=SLOW_NETWORK,
                     levels=[groups, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]])
    assert isinstance(two_level.options["inner"], (str, list))
    two_level.check()


def test_auto_raises_for_an_empty_candidate_list():
    with pytest.raises(ValueError, match="no candidate algorithm"):
        choose(4, 1e6, algorithms=["nothing"])


# -- files and configuration -----------------------------------------------------------------


CALIBRATED = replace(SLOW_NETWORK, level=3e-3, call=12e-3)


def test_model_file_round_trip(tmp_path):
    path = tmp_path / "model.json"
    CALIBRATED.to_file(path, measured={"note": "synthetic"})
    assert CostModel.from_file(path) == CALIBRATED
    data = json.loads(path.read_text())
    assert data["format"] == "flowreduce-cost-model" and data["measured"] == {"note": "synthetic"}
    assert data["model"]["inter"] == {"alpha": 5e-3, "beta": 1 / 12.5e6}


@pytest.mark.parametrize("content, match", [
    ("not json", "is not JSON"),
    (json.dumps({"model": {}}), "not a flowreduce cost model file"),
    (json.dumps({"format": "flowreduce-cost-model", "model": {"speed": 1}}), r"unknown cost model keys \['speed'\]"),
    (json.dumps({"format": "flowreduce-cost-model", "model": {"inter": {"alpha": 1}}}), "link 'inter' must be"),
    (json.dumps({"format": "flowreduce-cost-model", "model": {"inter": {"alpha": 1, "beta": 0}}}), "beta > 0"),
], ids=["not-json", "no-format", "unknown-key", "half-link", "zero-beta"])
def test_bad_model_files_say_what_is_wrong(tmp_path, content, match):
    path = tmp_path / "model.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        CostModel.from_file(path)


def test_dask_config_names_the_model_for_every_call(tmp_path):
    import dask

    path = tmp_path / "model.json"
    CALIBRATED.to_file(path)
    groups = hosts_of("interleaved", 8, 2)
    assert configured_model() == CostModel()
    default_pick = choose(8, 8e6, groups=groups)
    with dask.config.set({CONFIG_KEY: str(path)}):
        assert configured_model() == CALIBRATED
        configured_pick = choose(8, 8e6, groups=groups)
    assert configured_pick == choose(8, 8e6, groups=groups, model=CALIBRATED)
    assert (configured_pick.algorithm, configured_pick.options) != (default_pick.algorithm, default_pick.options)


def test_dask_config_names_the_model_for_sparse_auto_too(tmp_path):
    """``choose_sparse`` (sparse ``auto``) reads the configured model as ``choose`` does."""
    import dask

    path = tmp_path / "model.json"
    slow_levels = CostModel(level=1.0)  # a level costs a second: the fewest levels win
    slow_levels.to_file(path)
    args = (8, 10**8, 4, [0.5] * 8)
    default_pick = choose_sparse(*args)
    with dask.config.set({CONFIG_KEY: str(path)}):
        configured_pick = choose_sparse(*args)
    assert configured_pick == choose_sparse(*args, model=slow_levels)
    assert (configured_pick.algorithm, configured_pick.options) != (default_pick.algorithm, default_pick.options)


def test_a_link_needs_a_positive_beta():
    with pytest.raises(ValueError, match="beta > 0"):
        Link(1e-3, 0.0)
