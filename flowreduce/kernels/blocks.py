"""Kernels of the block-sparse all-reduce (OmniReduce): what the tasks run.

The index space counts blocks of ``block`` elements of the flattened input
(the last block may be short). A rank packs the blocks of a range that hold
any non-zero (:class:`~flowreduce.kernels.sparse_payload.BlockPack`); an aggregator adds the packs of
all ranks over the union of their blocks; every rank unpacks the sums into a
dense array. Only ``sum`` and ``mean`` (OmniReduce's aggregation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowreduce.kernels.dense import Pick
from flowreduce.kernels.sparse_payload import BlockPack, Wire, decode_pack, encode_pack
from flowreduce.ops import Op

BLOCK_OPS: tuple[str, ...] = ("sum", "mean")


@dataclass(frozen=True)
class BlockSpec:
    block: int  # elements per block
    size: int  # elements of the flattened input
    shape: tuple[int, ...]
    dtype: str  # the result's dtype
    accumulate: str | None = None  # dtype to add in, if not the input's


def nonzero_blocks(seg: np.ndarray, block: int, nblocks: int) -> np.ndarray:
    """Which of the ``nblocks`` blocks of ``seg`` hold a non-zero bit pattern
    (a negative zero counts: it merely travels). Dense data is recognised from
    the first element of every block, without reading the rest."""
    if nblocks == 0:
        return np.zeros(0, bool)
    if seg[::block].all():
        return np.ones(nblocks, bool)
    k = seg.dtype.itemsize
    bits = seg.view(np.dtype(f"u{k}") if k in (1, 2, 4, 8) else np.uint8)
    per = bits.size // seg.size  # code units per element
    full = seg.size // block
    out = np.empty(nblocks, bool)
    out[:full] = (bits[: full * block * per].reshape(full, block * per) != 0).any(axis=1)
    if full < nblocks:
        out[full] = bool(bits[full * block * per:].any())
    return out


def _take(seg: np.ndarray, ids: np.ndarray, block: int) -> np.ndarray:
    """Blocks ``ids`` of ``seg`` as a ``(len(ids), block)`` array (a short
    last block padded with zeros)."""
    full = seg.size // block
    rows = seg[: full * block].reshape(full, block)
    inner = ids[ids < full]
    if inner.size == ids.size:
        return rows[ids]
    out = np.zeros((ids.size, block), seg.dtype)
    out[: inner.size] = rows[inner]
    tail = seg[full * block:]
    out[inner.size, : tail.size] = tail
    return out


def pack(x: Any, start: int, stop: int, spec: BlockSpec, wire: Wire | None) -> tuple[BlockPack]:
    """The rank's non-zero blocks ``[start, stop)``: every block (a zero-copy
    view) when all are non-zero, else their ids and values."""
    flat = np.asarray(x).reshape(-1)
    seg = flat[start * spec.block: min(stop * spec.block, spec.size)]
    if spec.accumulate is not None:
        seg = seg.astype(spec.accumulate)
    nblocks = stop - start
    nz = nonzero_blocks(seg, spec.block, nblocks)
    if nz.all():
        p = BlockPack(nblocks, None, seg)
    else:
        ids = np.flatnonzero(nz).astype(np.int32)
        p = BlockPack(nblocks, ids, _take(seg, ids, spec.block))
    return (encode_pack(p, wire),)


def aggregate(spec: BlockSpec, op: Op, ranks: int, finish: bool, inputs: Sequence[tuple[BlockPack, ...]],
              picks: Sequence[Sequence[Pick]], owned: Sequence[bool], wire: Wire | None,
              out: bool) -> tuple[BlockPack] | np.ndarray:
    """Add the packs of one range over the union of their blocks. With every
    pack full (dense data) this is a dense sum, accumulated into a received
    buffer no other task here reads (``owned``) when there is one."""
    B = spec.block
    packs = [decode_pack(v[0], B) for v in inputs]
    nblocks = packs[0].nblocks
    writable = [o and isinstance(p.values, np.ndarray) and p.values.flags.writeable for p, o in zip(packs, owned)]
    if all(p.full for p in packs):
        mine = next((i for i, w in enumerate(writable) if w), None)
        acc = packs[mine].values if mine is not None else packs[0].values.copy()
        for i, p in enumerate(packs):
            if i != (mine if mine is not None else 0):
                acc += p.values
        result = BlockPack(nblocks, None, acc)
    elif any(p.full for p in packs):
        width = next(p.values.size for p in packs if p.full)
        padded = np.zeros(nblocks * B, packs[0].values.dtype)
        rows = padded.reshape(nblocks, B)
        for p in packs:
            if p.full:
                padded[:width] += p.values
            else:
                rows[p.ids] += p.values
        result = BlockPack(nblocks, None, padded[:width])
    else:
        ids = [p.ids for p in packs if p.ids is not None]  # every pack's: none is full here
        union = np.unique(np.concatenate(ids))
        mine = next((i for i, p in enumerate(packs) if writable[i] and ids[i].size == union.size), None)
        acc = packs[mine].values if mine is not None else np.zeros((union.size, B), packs[0].values.dtype)
        for i, p in enumerate(packs):
            if i != mine:
                acc[np.searchsorted(union, ids[i])] += p.values
        result = BlockPack(nblocks, union.astype(np.int32), acc)
    if finish and op.mean:
        result = BlockPack(result.nblocks, result.ids, op.finish(result.values, ranks, owned=True))
    if out:
        return output(spec, [(result,)])
    return (encode_pack(result, wire),)


def gather(spec: BlockSpec, inputs: Sequence[tuple[BlockPack, ...]], picks: Sequence[Sequence[Pick]],
           wire: Wire | None, out: bool) -> tuple[BlockPack, ...] | np.ndarray:
    """The aggregators' sums side by side (encoded ones stay encoded)."""
    packs = tuple(v[i] for v, p in zip(inputs, picks) for i, _, _ in p)
    if out:
        return output(spec, [packs])
    return tuple(encode_pack(p, wire) for p in packs)


def output(spec: BlockSpec, chunks: Sequence[tuple[BlockPack, ...]]) -> np.ndarray:
    """The rank's dense result: the summed blocks in place, zeros elsewhere."""
    B = spec.block
    packs = [decode_pack(p, B) for c in chunks for p in c]
    total = sum(p.nblocks for p in packs)
    alloc = np.empty if all(p.full for p in packs) else np.zeros
    flat = alloc(total * B, dtype=spec.dtype)
    rows = flat.reshape(total, B)
    first = 0
    for p in packs:
        if p.ids is None:  # full
            flat[first * B: first * B + p.values.size] = p.values
        elif p.ids.size:
            rows[first + p.ids] = p.values
        first += p.nblocks
    return flat[: spec.size].reshape(spec.shape)
