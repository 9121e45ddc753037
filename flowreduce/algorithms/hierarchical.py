"""Hierarchical all-reduce (BlueConnect): reduce-scatter inside each host,
all-reduce each shard across hosts, all-gather inside each host.

::

    host A: a0 a1 a2        host B: b0 b1            (groups [[0,1,2],[3,4]])

    1 reduce-scatter   a0:[0,1/3) a1:[1/3,2/3) a2:[2/3,1)   b0:[0,1/2) b1:[1/2,1)
      within a host    (inner: butterfly or ring; host-local links only)

    2 all-reduce of    [0,1/3)    a0 <-> b0      shards do not align across
      each shard range [1/3,1/2)  a1 <-> b0      uneven hosts: each range
      across hosts     [1/2,2/3)  a1 <-> b1      between two shard bounds is
                       [2/3,1)    a2 <-> b1      all-reduced among its owners
                       (outer algorithm; the only traffic between hosts)

    3 all-gather       every rank ends with the whole vector (inner, reversed)
      within a host

The vector is cut into ``segments`` = lcm of the shard counts times what the
outer algorithm needs, so every host's shards are unions of segments.
``levels`` nests this: reduce-scatter inside hosts, then inside racks among
the shard owners, ..., the outer algorithm among the owners at the top.

Cost (the α-β-γ model of Thakur et al. 2005, level i has p_i members per group, n_i = n/∏_{j<i} p_j
bytes enter it, level 1 = host):

    inner level i:  butterfly 2·log_k p_i·α_i, ring 2(p_i-1)·α_i
                    + 2(p_i-1)/p_i·n_i·β_i + (p_i-1)/p_i·n_i·γ_i
    outer (m groups, n/∏ p_j bytes per owner): the flat algorithm's card

Between hosts every rank sends (and receives) 2(m-1)/m·n/g with a
bandwidth-optimal outer algorithm (ring, butterfly with m a power of the
radix): a 1/g share of the flat algorithm's bytes, 2(m-1)·n over all links
together (also with uneven hosts, and for reduce-broadcast, all at the
root). A folded butterfly member (host size not a power of the radix)
owns no shard, so its host's owners carry n/core each. Tasks: the inner
algorithm's per host, plus the outer's per shard range.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from flowreduce import phases
from flowreduce.algorithms import butterfly, recursive_doubling, reduce_broadcast, ring
from flowreduce.algorithms.ir import REDUCE, VIEW, Draft, Plan, split_range
from flowreduce.algorithms.patterns import (
    Shards,
    Source,
    Tiles,
    check_members,
    finish,
    lcm,
    memoized,
    view_source,
)

NAME = "hierarchical"

Grouping = list[list[int]]

#: The patterns that split into a reduce-scatter and an all-gather (``inner``).
_SCATTER: dict[str, ModuleType] = {m.NAME: m for m in (butterfly, ring)}
#: The patterns that all-reduce a range among a subset of ranks (``outer``).
_ALLREDUCE: dict[str, ModuleType] = {m.NAME: m for m in (butterfly, ring, recursive_doubling, reduce_broadcast)}
#: The inner collective of workers that share memory (one level of hosts only).
DIRECT = "shm-direct"
#: Algorithms that split into a reduce-scatter and an all-gather.
SCATTER_ALGORITHMS: tuple[str, ...] = tuple(_SCATTER)
#: Algorithms :func:`all_reduce` runs on a subset of ranks.
ALLREDUCE_ALGORITHMS: tuple[str, ...] = tuple(_ALLREDUCE)


def plan(
    ranks: int,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    group_size: int | None = None,
    levels: Sequence[Sequence[Sequence[int]]] | None = None,
    inner: str | Sequence[str] = "butterfly",
    outer: str = "butterfly",
    radix: int = 2,
    workers: Sequence[Sequence[int]] | None = None,
) -> Plan:
    """The hierarchical plan over ``ranks`` ranks.

    Parameters
    ----------
    groups : list of lists of int, optional
        A partition of the ranks into hosts, sizes may differ. Default: one
        group per rank (the flat ``outer`` algorithm).
    group_size : int, optional
        Consecutive blocks of this many ranks (the last may be smaller).
    levels : list of groupings, optional
        Nested partitions, innermost (host) first; each coarser grouping is
        a union of finer groups (e.g. hosts, then racks).
    inner : {"butterfly", "ring", "shm-direct"} or a list of them, one per level
        Reduce-scatter / all-gather inside a group: one algorithm for every
        level, or one per level, innermost first. ``"shm-direct"`` (one level
        of hosts only): the one-level collective of workers sharing memory,
        see :func:`direct_inner`.
    outer : {"butterfly", "ring", "recursive-doubling", "reduce-broadcast"}
        All-reduce among the shard owners across the top-level groups.
    radix : int
        Radix of butterfly stages and of recursive doubling.
    workers : list of lists of int, optional
        With ``inner="shm-direct"``: the ranks of each worker process
        (default: a worker per rank); each worker's ranks are summed first.

    Raises
    ------
    ValueError
        More than one of ``groups``/``group_size``/``levels``, groupings that
        are not partitions of the ranks or not nested, unknown algorithms.
    """
    given = [name for name, v in (("groups", groups), ("group_size", group_size), ("levels", levels))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"pass one of groups, group_size, levels; got {' and '.join(given)}")
    if inner == DIRECT:
        if given and given != ["groups"]:
            raise ValueError(f"inner={DIRECT!r} takes the hosts as groups, not {given[0]}")
        return direct_inner(ranks, groups=groups, workers=workers, outer=outer, radix=radix)
    if workers is not None:
        raise ValueError(f"workers is an option of inner={DIRECT!r}, not of inner={inner!r}")
    inners = [inner] if isinstance(inner, str) else list(inner)
    bad = [i for i in inners if i not in SCATTER_ALGORITHMS]
    if bad or not inners:
        raise ValueError(f"inner must be one of {', '.join(SCATTER_ALGORITHMS)} (or a list of them, one per "
                         f"level); got {inner!r}")
    if outer not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"outer must be one of {', '.join(ALLREDUCE_ALGORITHMS)}; got {outer!r}")
    if radix < 2:
        raise ValueError(f"radix must be at least 2, got {radix}")
    if group_size is not None:
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        groups = [list(range(i, min(i + group_size, ranks))) for i in range(0, ranks, group_size)]
    if levels is None:
        levels = [groups if groups is not None else [[r] for r in range(ranks)]]
    nested = normalize_levels(ranks, levels)
    if len(inners) == 1:
        inners *= len(nested)
    elif len(inners) != len(nested):
        raise ValueError(f"inner names {len(inners)} algorithms for {len(nested)} levels; give one, or one per level")

    everyone = list(range(ranks))
    segments = required_segments(everyone, nested, inner=inners, outer=outer, radix=radix)
    options: dict = {"inner": inners[0] if len(set(inners)) == 1 else inners, "outer": outer, "radix": radix}
    if len(nested) == 1:
        options = {"groups": [list(g) for g in nested[0]], **options}
    else:
        options = {"levels": [[list(g) for g in lv] for lv in nested], **options}
    d = Draft(NAME, ranks, segments, **options)
    tiles, step = allreduce_levels(d, everyone, 0, segments, view_source(d), nested,
                                   inner=inners, outer=outer, radix=radix)
    return finish(d, tiles, step)


def direct_inner(ranks: int, *, groups: Sequence[Sequence[int]] | None, workers: Sequence[Sequence[int]] | None,
                 outer: str = "butterfly", radix: int = 2) -> Plan:
    """Hierarchical with ``inner="shm-direct"``: inside each host, the
    one-level collective of its workers (BlueConnect's layout, as NCCL runs
    it: every worker of a host owns a slice, so every worker's link works)::

        1 each worker sums its ranks' inputs            (in memory, one task)
        2 worker j of host h reduces slice j of h over  (reads every peer of
          its host                                       its host at once)
        3 slice ranges all-reduced across hosts among   (outer algorithm; the
          their owners, one per host                     only inter-host bytes)
        4 each owner publishes its finished slice       (one task per worker)
        5 each rank copies every slice of its host      (its result)

    Lowered over shared memory (:mod:`flowreduce.lower.shm_hierarchical`),
    steps 1, 2, 4 and 5 are one task per worker (5: per rank) reading
    peers' segments in place; the views and pre-reductions the plan lists
    per range (so that any lowering moves exact ranges) fuse into step 1."""
    hosts = normalize_levels(ranks, [groups if groups is not None else [[r] for r in range(ranks)]])[0]
    procs = normalize_levels(ranks, [workers if workers is not None else [[r] for r in range(ranks)]])[0]
    host_of = {r: h for h, g in enumerate(hosts) for r in g}
    split = [w for w in procs if len({host_of[r] for r in w}) > 1]
    if split:
        raise ValueError(f"workers {split} hold ranks of several groups (hosts); a worker is on one host")
    leaders = [[w[0] for w in sorted(procs, key=min) if host_of[w[0]] == h] for h in range(len(hosts))]
    ranks_of = {w[0]: sorted(w) for w in procs}
    segments = lcm([len(ls) for ls in leaders]) * divisor(outer, len(hosts), radix)
    options: dict = {"groups": [list(g) for g in hosts], "inner": DIRECT, "outer": outer, "radix": radix}
    if len(procs) < ranks:
        options["workers"] = [sorted(w) for w in sorted(procs, key=min)]
    d = Draft(NAME, ranks, segments, **options)
    owned = {}  # leader -> its slice of its host's vector
    for ls in leaders:
        for j, (a, b) in enumerate(split_range(0, segments, len(ls))):
            owned[ls[j]] = (a, b)

    def summed(leader: int, a: int, b: int) -> list[int]:  # step 1: the worker's ranks summed
        views = [d.view(r, a, b) for r in ranks_of[leader]]
        return views if len(views) == 1 else [d.reduce(leader, a, b, views, 1, phases.REDUCE)]

    local = memoized(summed)
    peers = {r: ls for ls in leaders for r in ls}

    def scattered(leader: int, a: int, b: int) -> list[int]:  # step 2: the slice over the host
        inputs = [n for w in [leader] + [p for p in peers[leader] if p != leader] for n in local(w, a, b)]
        return [d.reduce(leader, a, b, inputs, 2, phases.REDUCE_SCATTER)]

    source = memoized(scattered)
    cuts = sorted({x for ab in owned.values() for x in ab})
    held: Tiles = {o: [] for o in owned}
    end = 2
    for a, b in zip(cuts, cuts[1:]):
        owners = [next(o for o in ls if owned[o][0] <= a and b <= owned[o][1]) for ls in leaders]
        tiles, last = all_reduce(d, owners, a, b, source, algorithm=outer, radix=radix, step=2)
        end = max(end, last)
        for o in owners:
            held[o].extend(tiles[o])
    published = {o: d.gather(o, *owned[o], held[o], end + 1, phases.ALL_GATHER) for o in owned}
    finals = [d.gather(r, 0, segments, [published[o] for o in leaders[host_of[r]]], end + 2, phases.ALL_GATHER)
              for r in range(ranks)]
    return d.finish(finals)


def direct_fused(plan: Plan) -> dict[int, int]:
    """Of a :func:`direct_inner` plan lowered over shared memory: each
    publishing node whose one input is the outer algorithm's last reduction,
    read by nothing else, mapped to that reduction (it writes into the
    segment itself: a task and a level fewer)."""
    nodes, consumers = plan.nodes, plan.consumers()
    last = max(n.step for n in nodes)
    return {n.id: n.inputs[0] for n in nodes if n.step == last - 1 and len(n.inputs) == 1
            and nodes[n.inputs[0]].kind == REDUCE and consumers[n.inputs[0]] == [n.id]}


def direct_lowered(plan: Plan) -> tuple[int, int]:
    """(tasks, dependent levels) of a :func:`direct_inner` plan lowered over
    shared memory: the views and step-1 sums fuse into one task per worker,
    and :func:`direct_fused` publishes into their reductions."""
    workers = len(plan.options.get("workers") or range(plan.ranks))
    fused = direct_fused(plan)
    level: dict[int, int] = {}
    for n in plan.nodes:  # topological order
        if n.kind == VIEW or n.step == 1:
            level[n.id] = 1  # the worker's write
        elif n.id in fused:
            level[n.id] = level[fused[n.id]]
        else:
            level[n.id] = 1 + max(level[i] for i in n.inputs)
    kept = sum(1 for n in plan.nodes if n.kind != VIEW and n.step != 1)
    return workers + kept - len(fused), max(level[f] for f in plan.finals)


def normalize_levels(ranks: int, levels: Sequence[Sequence[Sequence[int]]]) -> list[Grouping]:
    """Check that every level partitions ``0..ranks-1`` and nests in the next."""
    out: list[Grouping] = []
    for i, level in enumerate(levels):
        grouping = [list(g) for g in level]
        where = f"levels[{i}]" if len(levels) > 1 else "groups"
        if any(len(g) == 0 for g in grouping):
            raise ValueError(f"{where} has an empty group: {grouping}")
        flat = [r for g in grouping for r in g]
        bad = [r for r in flat if not isinstance(r, int) or not 0 <= r < ranks]
        if bad:
            raise ValueError(f"{where} names ranks outside 0..{ranks - 1}: {bad}")
        dup = sorted({r for r in flat if flat.count(r) > 1})
        if dup:
            raise ValueError(f"{where} lists ranks {dup} in more than one group (or twice)")
        missing = sorted(set(range(ranks)) - set(flat))
        if missing:
            raise ValueError(f"{where} must partition ranks 0..{ranks - 1}; missing {missing}")
        if out:
            coarse = {r: j for j, g in enumerate(grouping) for r in g}
            for g in out[-1]:
                if len({coarse[r] for r in g}) > 1:
                    raise ValueError(f"{where} splits group {g} of the level below; "
                                     "each coarser group must be a union of finer ones")
        out.append(grouping)
    return out


def _restrict(grouping: Grouping, members: Sequence[int]) -> Grouping:
    keep = set(members)
    return [g for g in ([r for r in grp if r in keep] for grp in grouping) if g]


def required_segments(members: Sequence[int], levels: Sequence[Grouping], *, inner: Sequence[str], outer: str,
                      radix: int) -> int:
    """The segment count every range of the decomposition divides evenly:
    lcm of the groups' shard counts at each level (``inner[i]`` at level
    ``i``), times the outer divisor."""
    if not levels:
        return divisor(outer, len(members), radix)
    groups = _restrict(levels[0], members)
    shards = lcm([shard_count(inner[0], len(g), radix) for g in groups])
    # one owner per group of every segment; their next-level grouping has the
    # same shape whichever segment, so any member stands in for its group
    owners = [g[0] for g in groups]
    return shards * required_segments(owners, levels[1:], inner=inner[1:], outer=outer, radix=radix)


def allreduce_levels(
    d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, levels: Sequence[Grouping], *,
    inner: Sequence[str] = ("butterfly",), outer: str = "butterfly", radix: int = 2, step: int = 0,
) -> tuple[Tiles, int]:
    """Hierarchical all-reduce of ``[lo, hi)`` among ``members`` on a Draft:
    reduce-scatter within each group of ``levels[0]`` (with ``inner[0]``), all-reduce each
    shard-range intersection among its owners (recursively, with the next
    levels), then all-gather within each group. Returns every member's tiles
    of ``[lo, hi)`` and the last step used."""
    if not levels:
        return all_reduce(d, members, lo, hi, source, algorithm=outer, radix=radix, step=step)
    groups = _restrict(levels[0], members)
    scattered: list[Shards] = [
        reduce_scatter(d, g, lo, hi, source, algorithm=inner[0], radix=radix, step=step) for g in groups
    ]
    group_of = {r: s for s in scattered for r in s.owned}

    def owned(rank: int, a: int, b: int) -> list[int]:
        return group_of[rank].source(rank, a, b)

    cuts = sorted(set().union(*(s.bounds() for s in scattered)))
    held: Tiles = {r: [] for r in group_of}
    across = max(s.step for s in scattered)
    end = across
    for a, b in zip(cuts, cuts[1:], strict=False):
        owners = [s.owner_of(a, b) for s in scattered]
        result, last = allreduce_levels(d, owners, a, b, owned, levels[1:],
                                        inner=inner[1:], outer=outer, radix=radix, step=across)
        end = max(end, last)
        for o in owners:
            held[o].extend(result[o])
    out: Tiles = {}
    final = end
    for g, s in zip(groups, scattered, strict=True):
        tiles, last = all_gather(d, g, lo, hi, {o: held[o] for o in s.owned},
                                 algorithm=inner[0], radix=radix, step=end)
        out.update(tiles)
        final = max(final, last)
    return out, final


# -- the flat patterns, by name ----------------------------------------------------


def _radix(module: ModuleType, radix: int) -> dict[str, int]:
    """The ``radix`` keyword for the patterns that take one."""
    return {"radix": radix} if module in (butterfly, recursive_doubling) else {}


def _pattern(algorithm: str, valid: dict[str, ModuleType], what: str) -> ModuleType:
    if algorithm not in valid:
        raise ValueError(f"{algorithm!r} cannot run as a {what}; valid: {', '.join(valid)}")
    return valid[algorithm]


def shard_count(algorithm: str, members: int, radix: int = 2) -> int:
    """How many members own a shard after a reduce-scatter (butterfly folds
    the ranks beyond its largest factorable core into partners)."""
    m = _pattern(algorithm, _SCATTER, "reduce-scatter")
    return m.shard_count(members, **_radix(m, radix))


def divisor(algorithm: str, members: int, radix: int = 2) -> int:
    """The number of segments a range handed to :func:`all_reduce` (or a
    reduce-scatter) must be a multiple of."""
    _pattern(algorithm, _ALLREDUCE, "all-reduce")
    return shard_count(algorithm, members, radix) if algorithm in _SCATTER else 1


def reduce_scatter(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
                   algorithm: str = "butterfly", radix: int = 2, step: int = 0) -> Shards:
    """``algorithm``'s reduce-scatter of ``[lo, hi)`` among ``members``."""
    m = _pattern(algorithm, _SCATTER, "reduce-scatter")
    members = tuple(members)
    check_members(d, members)
    return m.reduce_scatter(d, members, lo, hi, source, step=step, **_radix(m, radix))


def all_gather(d: Draft, members: Sequence[int], lo: int, hi: int, held: Tiles, *,
               algorithm: str = "butterfly", radix: int = 2, step: int = 0) -> tuple[Tiles, int]:
    """The inverse of :func:`reduce_scatter` with the same arguments."""
    m = _pattern(algorithm, _SCATTER, "all-gather")
    members = tuple(members)
    check_members(d, members)
    return m.all_gather(d, members, lo, hi, held, step=step, **_radix(m, radix))


def all_reduce(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
               algorithm: str = "butterfly", radix: int = 2, step: int = 0) -> tuple[Tiles, int]:
    """``algorithm``'s all-reduce of ``[lo, hi)`` among ``members``; a
    lone member keeps its contribution (reduced to one node if several)."""
    m = _pattern(algorithm, _ALLREDUCE, "all-reduce")
    members = tuple(members)
    check_members(d, members)
    if len(members) == 1:
        r = members[0]
        nodes = source(r, lo, hi)
        if len(nodes) == 1:
            return {r: list(nodes)}, step
        return {r: [d.reduce(r, lo, hi, nodes, step + 1, phases.REDUCE)]}, step + 1
    return m.all_reduce(d, members, lo, hi, source, step=step, **_radix(m, radix))
