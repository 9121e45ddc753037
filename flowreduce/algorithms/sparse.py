"""Sparse plans: the dense plans, with messages whose bytes depend on density.

A :class:`SparsePlan` is an ordinary :class:`~flowreduce.algorithms.ir.Plan` (same
nodes, same :meth:`~flowreduce.algorithms.ir.Plan.check`) that also knows what its
messages carry: index+value pairs (SparCML) or non-zero blocks (OmniReduce),
values possibly quantised. Pure Python, no dask.

Expected bytes of a node (one chunk), for ``W`` elements of the index space:

* a rank's input over the node's range has the rank's density ``d_r``
  (non-zeros / elements; for blocks, non-zero blocks / blocks);
* a merge of inputs with densities ``d_i`` has density ``1 - prod(1 - d_i)``
  (non-zeros at independent random places; identical patterns give less,
  disjoint ones more, up to ``sum(d_i)``);
* a node is *sparse* while its density ``d <= delta`` and ``d < 1``, and then
  costs ``d·W·(v + i/b)`` bytes (``v`` value bytes on the wire, ``i`` index
  bytes, ``b`` elements per index: 1, or the block size); otherwise it is
  *dense* and costs ``W·v`` (the dense switch, DSAR). Merging grows density,
  so once dense a pipeline stays dense;
* a gather costs what its pieces cost.

``delta`` defaults to the byte break-even ``v / (v + i)`` (index+value pairs
cost more than the dense form above it). Block plans never switch before
density 1 (an index per block is ``i/b`` bytes per element: a rounding error).

:meth:`SparsePlan.cost` is the dense card with these bytes in place of
``width·nbytes/segments`` (and sparse merges weighted by
:data:`SPARSE_MERGE_COST` in the bytes reduced); :class:`~flowreduce.cost.CostModel` reads it as it
reads any card, so ``auto`` (:func:`flowreduce.cost.choose_sparse`, next to
``choose``) compares sparse plans with the same model as dense ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

from flowreduce import phases
from flowreduce.algorithms.ir import GATHER, REDUCE, VIEW, CostCard, Plan

#: Value codecs for the wire (``compression=``): None sends values as they are.
CODECS: tuple[str | None, ...] = (None, "fp16", "int8")
#: Values per int8 bucket (one float32 scale each).
INT8_BUCKET = 512
#: Bytes of one stored index (scipy's int32 indices, numpy int32 block ids).
INDEX_BYTES = 4
#: How many times more a byte of index+value pairs costs to merge (scipy's
#: sorted merge, ~0.5 GB/s on this project's machine) than a byte of dense
#: arrays to add (numpy, in place, ~4 GB/s): sparse merges count this many
#: times their bytes in a card's ``reduce_bytes``.
SPARSE_MERGE_COST = 8.0


def wire_value_bytes(itemsize: int, codec: str | None) -> float:
    """Bytes one value costs on the wire under ``codec``."""
    if codec is None:
        return float(itemsize)
    if codec == "fp16":
        return 2.0
    if codec == "int8":
        return 1.0 + 4.0 / INT8_BUCKET  # the code, plus its share of the bucket's float32 scale
    raise ValueError(f"unknown compression {codec!r}; valid: {', '.join(map(str, CODECS))}")


def switch_density(itemsize: int, codec: str | None = None, index_bytes: int = INDEX_BYTES) -> float:
    """The density above which index+value pairs cost more bytes than the
    dense form: ``v / (v + i)`` (0.5 for float32 with int32 indices)."""
    v = wire_value_bytes(itemsize, codec)
    return v / (v + index_bytes)


@dataclass(frozen=True, repr=False)
class SparsePlan(Plan):
    """A plan whose messages carry only non-zeros.

    Attributes
    ----------
    density : tuple of float
        Each rank's density (non-zeros / elements, or non-zero blocks /
        blocks); empty means unknown, taken as 1 (the dense upper bound).
    value_bytes : int
        Bytes per value in memory (the dtype's itemsize).
    block : int
        Elements per index: 1 for element-sparse plans, the block size for
        block-sparse ones.
    delta : float or None
        Density above which a node goes dense; None is the byte break-even
        (:func:`switch_density`). Block plans use 1.
    codec : {None, "fp16", "int8"}
        How values travel (:data:`CODECS`).
    """

    density: tuple[float, ...] = ()
    value_bytes: int = 8
    block: int = 1
    delta: float | None = None
    codec: str | None = None

    def __repr__(self) -> str:
        extra = []
        if self.block > 1:
            extra.append(f"block={self.block}")
        if self.density:
            extra.append("density=" + "/".join(f"{d:.3g}" for d in self.density))
        extra.append(f"delta={self.threshold:.3g}")
        if self.codec:
            extra.append(f"compression={self.codec!r}")
        base = super().__repr__()
        return base[:-1] + ", " + ", ".join(extra) + ")"

    # -- representation --------------------------------------------------------
    @property
    def wire_bytes(self) -> float:
        return wire_value_bytes(self.value_bytes, self.codec)

    @property
    def threshold(self) -> float:
        """The density above which a node is dense (the DSAR switch)."""
        if self.block > 1:
            return 1.0
        if self.delta is not None:
            return self.delta
        return switch_density(self.value_bytes, self.codec)

    def is_dense(self, density: float) -> bool:
        return density >= 1.0 or density > self.threshold

    def densities(self) -> list[float]:
        """Expected density of every node's value (see the module docstring)."""
        d_rank = list(self.density) or [1.0] * self.ranks
        out: list[float] = []
        for n in self.nodes:
            if n.kind == VIEW:
                out.append(min(max(d_rank[n.rank], 0.0), 1.0))
            elif n.kind == REDUCE:
                out.append(1.0 - math.prod(1.0 - out[i] for i in n.inputs))
            else:
                out.append(sum(out[i] * _overlap(self.nodes[i], n) for i in n.inputs) / n.width)
        return out

    def node_bytes(self, nbytes: float) -> list[float]:
        """Expected wire bytes of every node's value, one chunk, for
        ``nbytes`` dense bytes per rank."""
        return self._sizes(nbytes)[0]

    def _sizes(self, nbytes: float) -> tuple[list[float], list[bool]]:
        """Every node's expected bytes and whether it is dense."""
        elems = nbytes / self.value_bytes / self.segments / self.chunks if self.segments else 0.0
        v, per_index = self.wire_bytes, INDEX_BYTES / self.block
        dens = self.densities()
        out: list[float] = []
        dense: list[bool] = []  # once dense, every merge downstream is dense
        for n, d in zip(self.nodes, dens):
            if n.kind == GATHER:
                out.append(sum(out[i] * _overlap(self.nodes[i], n) / self.nodes[i].width for i in n.inputs))
                dense.append(any(dense[i] for i in n.inputs))
                continue
            dense.append(self.is_dense(d) or any(dense[i] for i in n.inputs))
            out.append(n.width * elems * (v if dense[-1] else d * (v + per_index)))
        return out, dense

    def cost(self, nbytes: float = 0.0) -> CostCard:
        """The dense card's counts with the expected bytes of sparse messages."""
        base = super().cost(nbytes)
        size, dense = self._sizes(nbytes)
        msgs = self.transfers()
        per_rank: defaultdict[int, float] = defaultdict(float)  # bytes each rank sends and receives
        for t in msgs:
            per_rank[t.source] += size[t.src]
            per_rank[t.dest] += size[t.src]
        reduced: defaultdict[int, float] = defaultdict(float)  # bytes each rank merges
        for n in self.nodes:
            if n.kind == REDUCE and len(n.inputs) > 1:
                ins = [size[i] * _overlap(self.nodes[i], n) / self.nodes[i].width for i in n.inputs]
                # merging index+value pairs costs more per byte than adding arrays
                reduced[n.rank] += (sum(ins) - max(ins)) * (1.0 if dense[n.id] else SPARSE_MERGE_COST)
        chain = [0.0] * len(self.nodes)
        for n in self.nodes:
            chain[n.id] = max((chain[i] + (size[i] if self.nodes[i].rank != n.rank else 0.0) for i in n.inputs),
                              default=0.0)
        c = self.chunks
        out_bytes = max((size[f] for f in self.finals), default=0.0) * c
        return replace(
            base,
            bytes_on_wire=c * sum(size[t.src] for t in msgs),
            max_rank_bytes=c * max(per_rank.values(), default=0.0),
            reduce_bytes=c * max(reduced.values(), default=0.0),
            total_reduce_bytes=c * sum(reduced.values()),
            copy_bytes=min(base.copy_bytes, self.ranks * out_bytes),
            critical_bytes=max((chain[f] for f in self.finals), default=0.0),
        )

    # -- quantisation ----------------------------------------------------------
    def encoded_nodes(self) -> set[int]:
        """Nodes whose value is encoded for the wire: those read on another rank."""
        return {t.src for t in self.transfers()}

    def encodings(self) -> int:
        """The most quantisation steps any element of any rank's result went
        through: over the nodes that fed it, each encoding (a node read on
        another rank, or a gather forwarding a piece that was not yet
        encoded) counts once. Decoding is exact, so the result's error is at
        most the sum of these steps' errors (:func:`quantisation_bound`)."""
        enc = self.encoded_nodes()
        steps: list[dict[int, int]] = []  # node -> {segment: encodings so far}
        raw: list[dict[int, bool]] = []  # node -> {segment: value not yet encoded}
        for n in self.nodes:
            e: dict[int, int] = {}
            r: dict[int, bool] = {}
            for s in range(n.lo, n.hi):
                if n.kind == VIEW:
                    e[s], r[s] = int(n.id in enc), n.id not in enc
                elif n.kind == REDUCE:
                    e[s], r[s] = sum(steps[i][s] for i in n.inputs) + (n.id in enc), n.id not in enc
                else:
                    i = next(i for i in n.inputs if s in steps[i])
                    fresh = n.id in enc and raw[i][s]
                    e[s], r[s] = steps[i][s] + fresh, raw[i][s] and not fresh
            steps.append(e)
            raw.append(r)
        return max((v for f in self.finals for v in steps[f].values()), default=0)


def _overlap(src, node) -> int:
    return max(0, min(src.hi, node.hi) - max(src.lo, node.lo))


def quantisation_bound(codec: str | None, encodings: int, magnitude):
    """Largest error of a quantised all-reduce's result, per element.

    Parameters
    ----------
    codec : {None, "fp16", "int8"}
    encodings : int
        :meth:`SparsePlan.encodings` of the plan that ran.
    magnitude : float or numpy array
        For ``"fp16"``: ``sum_r |x_r|`` per element (a bound on every
        partial sum of that element). For ``"int8"``: the largest such sum
        over all elements (a bound on every bucket's largest value).

    Returns
    -------
    float or array
        ``int8``: ``encodings · magnitude / 127`` (stochastic rounding to
        ``scale = max|bucket| / 127`` errs by less than one ``scale`` per
        encoding). ``fp16``: ``encodings · (magnitude · 2**-11 + 2**-25)``
        (round to nearest: relative 2**-11 for normal numbers, absolute
        2**-25 below float16's smallest normal). None: 0.
    """
    if codec is None:
        return 0.0 * magnitude
    if codec == "int8":
        return encodings * magnitude / 127.0
    if codec == "fp16":
        return encodings * (magnitude * 2.0**-11 + 2.0**-25)
    raise ValueError(f"unknown compression {codec!r}; valid: {', '.join(map(str, CODECS))}")


def sparse_plan(base: Plan, name: str, **fields) -> SparsePlan:
    """``base``'s nodes as a :class:`SparsePlan` called ``name``; its views
    become ``pack`` nodes (they select the non-zeros of a range)."""
    nodes = tuple(replace(n, phase=phases.COMPACT) if n.kind == VIEW else n for n in base.nodes)
    return SparsePlan(name, base.ranks, base.segments, nodes, base.finals, base.chunks,
                      dict(base.options), **fields)
