"""The plan: a pure description of an all-reduce, with no Dask in it.

A plan cuts every rank's vector (or each chunk of it) into ``segments`` equal
pieces and lists *nodes*: one node is one task on one rank, holding the values
of a contiguous segment range ``[lo, hi)``.

* ``view``   -- the rank's own input over ``[lo, hi)`` (a zero-copy slice).
* ``reduce`` -- the elementwise reduction of its inputs over ``[lo, hi)``;
  every input covers at least that range.
* ``gather`` -- its inputs side by side; their ranges tile ``[lo, hi)``.

An edge whose input sits on another rank is a *transfer*. Chunks repeat the
same plan independently, so they pipeline. The builder lowers nodes to tasks;
the planners in :mod:`flowreduce.algorithms` only decide who sends which
segment range to whom at each step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from flowreduce import phases

VIEW, REDUCE, GATHER = "view", "reduce", "gather"


@dataclass(frozen=True)
class Node:
    id: int
    kind: str
    rank: int
    lo: int
    hi: int
    inputs: tuple[int, ...]
    step: int
    phase: str

    @property
    def width(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Transfer:
    """One message: node ``src`` (on rank ``source``) is fetched by ``dest``."""

    src: int
    source: int
    dest: int
    lo: int
    hi: int


@dataclass(frozen=True)
class CostCard:
    """What a plan costs, counted from its nodes (per call, all chunks)."""

    steps: int  # dependent task levels, the latency term
    tasks: int
    messages: int
    bytes_on_wire: float
    max_rank_bytes: float  # the busiest rank's bytes sent + received
    reduce_bytes: float  # bytes combined by the busiest rank
    total_reduce_bytes: float = 0.0  # bytes combined by all ranks
    copy_bytes: float = 0.0  # bytes copied by all ranks to assemble their outputs
    critical_bytes: float = 0.0  # bytes moved one after another on the longest chain of one chunk

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Structure:
    """What a plan's cost card and lowering read off its nodes, computed once
    per plan (in segment units, one chunk) and shared by its chunk variants:
    :meth:`Plan.cost` is then arithmetic, so the cost model can price dozens
    of (algorithm, chunks) candidates for thousands of ranks quickly."""

    consumers: dict[int, list[int]]
    transfers: list[Transfer]
    levels: list[int]
    final_read_remotely: tuple[bool, ...]  # per rank: another rank reads its final node
    wire_width: int  # segments on the wire, all messages
    max_rank_width: int  # the busiest rank's segments sent + received
    max_reduce_width: int  # segments combined by the busiest rank
    total_reduce_width: int
    chain_width: int  # segments moved one after another on the longest chain
    pieced_finals: int  # finals assembled from several pieces (one chunk)

    @classmethod
    def of(cls, nodes: tuple[Node, ...], finals: tuple[int, ...]) -> Structure:
        consumers: dict[int, list[int]] = {n.id: [] for n in nodes}
        transfers, seen = [], set()
        levels = [0] * len(nodes)
        chain = [0] * len(nodes)
        per_rank: Counter = Counter()
        reduced: Counter = Counter()
        for n in nodes:  # nodes are topologically ordered
            for i in n.inputs:
                consumers[i].append(n.id)
                src = nodes[i]
                if src.rank != n.rank and (i, n.rank) not in seen:
                    seen.add((i, n.rank))
                    transfers.append(Transfer(i, src.rank, n.rank, src.lo, src.hi))
                    per_rank[src.rank] += src.width
                    per_rank[n.rank] += src.width
            levels[n.id] = 1 + max((levels[i] for i in n.inputs), default=0)
            chain[n.id] = max((chain[i] + (nodes[i].width if nodes[i].rank != n.rank else 0) for i in n.inputs),
                              default=0)
            if n.kind == REDUCE:
                reduced[n.rank] += max(len(n.inputs) - 1, 0) * n.width
        return cls(
            consumers=consumers,
            transfers=transfers,
            levels=levels,
            final_read_remotely=tuple(any(nodes[c].rank != r for c in consumers[f]) for r, f in enumerate(finals)),
            wire_width=sum(t.hi - t.lo for t in transfers),
            max_rank_width=max(per_rank.values(), default=0),
            max_reduce_width=max(reduced.values(), default=0),
            total_reduce_width=sum(reduced.values()),
            chain_width=max((chain[f] for f in finals), default=0),
            pieced_finals=sum(nodes[f].kind == GATHER and len(nodes[f].inputs) > 1 for f in finals),
        )


@dataclass(frozen=True)
class Plan:
    algorithm: str
    ranks: int
    segments: int
    nodes: tuple[Node, ...]
    finals: tuple[int, ...]
    chunks: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)
    #: In one chunk, the lowering reads the views inside the tasks that consume
    #: them (``direct``): views are neither tasks nor a level of their own.
    fused_views: bool = field(default=False, compare=False)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return (
            f"Plan({self.algorithm!r}, ranks={self.ranks}, chunks={self.chunks}"
            f"{opts}, steps={self.depth}, tasks={self.cost().tasks})"
        )

    # -- structure ----------------------------------------------------------
    @cached_property
    def structure(self) -> Structure:
        return Structure.of(self.nodes, self.finals)

    def with_chunks(self, chunks: int) -> Plan:
        """The same plan over ``chunks`` independent chunks (sharing the
        structure already computed)."""
        out = replace(self, chunks=chunks)
        out.__dict__["structure"] = self.structure  # what cached_property would store
        return out

    def consumers(self) -> dict[int, list[int]]:
        """Node id -> ids of the nodes that read it (shared: do not modify)."""
        return self.structure.consumers

    def transfers(self) -> list[Transfer]:
        """Messages of one chunk: one per (node, remote rank that reads it)."""
        return list(self.structure.transfers)

    def output_is_separate(self, rank: int) -> bool:
        """Whether rank's output needs its own task (the final is read remotely
        or the vector is chunked), rather than being the final node itself."""
        return self.chunks > 1 or self.structure.final_read_remotely[rank]

    @property
    def levels(self) -> list[int]:
        return list(self.structure.levels)

    @property
    def depth(self) -> int:
        """Dependent task levels, the views' level included unless they are fused."""
        lv = self.structure.levels
        return max(lv[f] + self.output_is_separate(r) for r, f in enumerate(self.finals)) - self._fused

    @property
    def _fused(self) -> bool:
        """Views fused into their readers: one chunk only (more are lowered as any plan)."""
        return self.fused_views and self.chunks == 1

    def cost(self, nbytes: float = 0.0) -> CostCard:
        """Counts for a vector of ``nbytes`` bytes per rank (all chunks)."""
        st, c = self.structure, self.chunks
        unit = nbytes / self.segments if self.segments else 0.0  # bytes of one segment over all chunks
        outputs = sum(self.output_is_separate(r) for r in range(self.ranks))
        # an output made of several pieces is concatenated once (a fresh copy)
        pieced = self.ranks if c > 1 else st.pieced_finals
        views = sum(n.kind == VIEW for n in self.nodes) if self._fused else 0
        return CostCard(
            steps=self.depth,
            tasks=c * (len(self.nodes) - views) + outputs,
            messages=c * len(st.transfers),
            bytes_on_wire=st.wire_width * unit,
            max_rank_bytes=st.max_rank_width * unit,
            reduce_bytes=st.max_reduce_width * unit,
            total_reduce_bytes=st.total_reduce_width * unit,
            copy_bytes=pieced * nbytes,
            critical_bytes=st.chain_width * unit / c,
        )

    # -- checking -----------------------------------------------------------
    def check(self) -> None:
        """Raise ValueError unless every rank ends with every segment reduced
        over all ranks exactly once. Pure bookkeeping: no data moves."""
        contrib: list[dict[int, Counter]] = []
        for n in self.nodes:
            if not 0 <= n.lo < n.hi <= self.segments:
                raise ValueError(f"node {n.id} has an empty or bad range {n.lo, n.hi}")
            per_seg: dict[int, Counter] = {}
            if n.kind == VIEW:
                for s in range(n.lo, n.hi):
                    per_seg[s] = Counter({n.rank: 1})
            elif n.kind == REDUCE:
                for s in range(n.lo, n.hi):
                    total: Counter = Counter()
                    for i in n.inputs:
                        if s not in contrib[i]:
                            raise ValueError(f"node {n.id} reads segment {s} from node {i}, which lacks it")
                        total += contrib[i][s]
                    per_seg[s] = total
            elif n.kind == GATHER:
                for s in range(n.lo, n.hi):
                    having = [i for i in n.inputs if s in contrib[i]]
                    if len(having) != 1:
                        raise ValueError(f"gather node {n.id}: segment {s} comes from {len(having)} inputs")
                    per_seg[s] = contrib[having[0]][s]
            else:
                raise ValueError(f"unknown node kind {n.kind!r}")
            contrib.append(per_seg)
        everyone = Counter(range(self.ranks))
        for r, f in enumerate(self.finals):
            node = self.nodes[f]
            if node.rank != r or (node.lo, node.hi) != (0, self.segments):
                raise ValueError(f"rank {r}'s final node {f} is not its full vector")
            for s in range(self.segments):
                if contrib[f][s] != everyone:
                    raise ValueError(
                        f"rank {r} ends with segment {s} reduced over {dict(contrib[f][s])}"
                    )


class Draft:
    """Collects nodes in topological order while a planner runs."""

    def __init__(self, algorithm: str, ranks: int, segments: int, **options: Any):
        self.algorithm = algorithm
        self.ranks = ranks
        self.segments = segments
        self.options = options
        self.nodes: list[Node] = []

    def _add(self, kind, rank, lo, hi, inputs, step, phase) -> int:
        n = Node(len(self.nodes), kind, rank, lo, hi, tuple(inputs), step, phase)
        self.nodes.append(n)
        return n.id

    def view(self, rank: int, lo: int = 0, hi: int | None = None) -> int:
        return self._add(VIEW, rank, lo, self.segments if hi is None else hi, (), 0, phases.SPLIT)

    def reduce(self, rank, lo, hi, inputs, step, phase=phases.REDUCE) -> int:
        return self._add(REDUCE, rank, lo, hi, inputs, step, phase)

    def gather(self, rank, lo, hi, inputs, step, phase=phases.ALL_GATHER) -> int:
        return self._add(GATHER, rank, lo, hi, inputs, step, phase)

    def range_of(self, node: int) -> tuple[int, int]:
        n = self.nodes[node]
        return n.lo, n.hi

    def finish(self, finals, *, fused_views: bool = False) -> Plan:
        return Plan(
            self.algorithm, self.ranks, self.segments, tuple(self.nodes),
            tuple(finals), options=dict(self.options), fused_views=fused_views,
        )


def split_range(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``[lo, hi)`` into ``parts`` equal contiguous ranges (must divide)."""
    width = (hi - lo) // parts
    return [(lo + j * width, lo + (j + 1) * width) for j in range(parts)]


def mixed_radix(p: int, radix: int) -> tuple[int, list[int]]:
    """The largest ``core <= p`` that factors into stages of at most ``radix``
    ranks, and those stage sizes (largest first). Ranks beyond ``core`` are
    folded into partners (MPICH's trick for non-powers of two)."""
    if radix < 2:
        raise ValueError(f"radix must be at least 2, got {radix}")
    for core in range(p, 0, -1):
        n, factors = core, []
        while n > 1:
            f = next((d for d in range(min(radix, n), 1, -1) if n % d == 0), None)
            if f is None:
                break
            factors.append(f)
            n //= f
        if n == 1:
            return core, factors
    raise AssertionError("unreachable: core=1 always factors")


def digits(q: int, factors: list[int]) -> list[int]:
    out = []
    for f in factors:
        out.append(q % f)
        q //= f
    return out


def with_digit(q: int, factors: list[int], stage: int, value: int) -> int:
    """``q`` with its mixed-radix digit ``stage`` set to ``value``."""
    place = math.prod(factors[:stage])
    return q + (value - (q // place) % factors[stage]) * place


def folded(p: int, core: int) -> dict[int, list[int]]:
    """Extra ranks ``core..p-1`` ride along with partner ``extra - core``."""
    return {q: [e for e in range(core, p) if e - core == q] for q in range(core)}
