"""Kernels of the element-sparse all-reduce (SparCML): what the tasks run.

A node's value is a tuple of pieces (see :mod:`flowreduce.kernels.sparse_payload`), each covering a
contiguous range of the *index space*: the input's elements numbered in the
order its format stores them (row-major for CSR and COO, column-major for
CSC), so a range is a slice of rows (columns) and cutting it is cheap.
Merges are scipy.sparse operations; the builder decides every range
statically, as for dense plans.

The dense switch: a pack or merge whose result holds more than
``threshold·W`` non-zeros (of ``W`` elements) returns it dense, and a merge
with a dense input is dense: once dense, the pipeline stays dense.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import scipy.sparse as sp

from flowreduce.kernels.dense import Pick
from flowreduce.kernels.sparse_payload import Encoded, Piece, Wire, decode_piece, encode_piece, piece_width
from flowreduce.ops import Op

#: A node's value: pieces covering consecutive ranges of the index space.
Value: TypeAlias = "tuple[Piece | Encoded, ...]"

#: Ops a sparse all-reduce supports (f(0, 0) = 0, so implicit zeros stay zero).
SPARSE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")


@dataclass(frozen=True)
class SegmentSpec:
    """What every task of one call needs to know about the data."""

    format: str  # "csr", "csc" or "coo": the input's format
    container: str  # "array" (scipy.sparse.*_array) or "matrix" (*_matrix)
    shape: tuple[int, ...]
    order: str  # index-space order: "C" (row-major) or "F" (column-major, CSC)
    threshold: float  # density above which a piece is dense
    dtype: str  # the result's dtype
    accumulate: str | None = None  # dtype to reduce in, if not the input's
    dense_output: bool = False  # output="dense"
    output_format: str | None = None  # output="csr"/"csc"/"coo"; None: the input's


# -- selecting a rank's non-zeros --------------------------------------------------------


def _select(x: Any, start: int, stop: int, spec: SegmentSpec) -> tuple[np.ndarray, np.ndarray, bool]:
    """Positions (relative to ``start``) and values of ``x``'s stored entries
    with index in ``[start, stop)``, and whether they are already canonical
    (sorted, no duplicates)."""
    if x.format in ("csr", "csc") and x.ndim == 2:
        minor = x.shape[1] if x.format == "csr" else x.shape[0]
        r0, r1 = start // minor, -(-stop // minor)
        a, b = int(x.indptr[r0]), int(x.indptr[r1])
        major = np.repeat(np.arange(r0, r1, dtype=np.int64), np.diff(x.indptr[r0:r1 + 1]))
        pos = major * minor + x.indices[a:b] - start
        data = x.data[a:b]
        if start % minor or stop % minor:
            keep = (pos >= 0) & (pos < stop - start)
            pos, data = pos[keep], data[keep]
        return pos, data, x.has_canonical_format
    if x.format == "csr":  # 1-D: one row of indices
        idx = x.indices
        if x.has_canonical_format:
            a, b = np.searchsorted(idx, [start, stop])
            return idx[a:b].astype(np.int64) - start, x.data[a:b], True
        keep = (idx >= start) & (idx < stop)
        return idx[keep].astype(np.int64) - start, x.data[keep], False
    # COO, 1-D or 2-D: row-major positions
    lin = x.coords[0].astype(np.int64) if x.ndim == 1 else np.ravel_multi_index(x.coords, x.shape)
    keep = (lin >= start) & (lin < stop)
    return lin[keep] - start, x.data[keep], False


def _segment(pos: np.ndarray, data: np.ndarray, width: int, canonical: bool) -> sp.csr_array:
    index = np.int32 if max(width, pos.size) < 2**31 else np.int64  # 4-byte indices when they fit
    seg = sp.csr_array((data, pos.astype(index, copy=False), np.array([0, pos.size], dtype=index)),
                       shape=(1, width))
    if canonical:
        seg.has_canonical_format = True
    else:
        if np.may_share_memory(seg.data, data):
            seg.data = data.copy()  # data may be a view of the rank's input: sort a copy
        seg.sum_duplicates()  # sorts, and adds up repeated entries (COO semantics)
    return seg


def _switch(seg: sp.csr_array, threshold: float) -> Piece:
    """The dense switch: ``seg`` as a dense array when it is denser than
    ``threshold`` (or full), else unchanged."""
    width = seg.shape[1]
    if seg.nnz and (seg.nnz > threshold * width or seg.nnz >= width):
        return seg.toarray().reshape(-1)
    return seg


def pack(x: Any, start: int, stop: int, spec: SegmentSpec, wire: Wire | None) -> Value:
    """The rank's non-zeros in ``[start, stop)`` of the index space: one piece."""
    pos, data, canonical = _select(x, start, stop, spec)
    if spec.accumulate is not None:
        data = data.astype(spec.accumulate)
    piece = _switch(_segment(pos, data, stop - start, canonical), spec.threshold)
    return (encode_piece(piece, wire),)


# -- merging -------------------------------------------------------------------------------


def _pick(value: Value, picks: Sequence[Pick]) -> Piece:
    """The part of a node's value that covers one input's range."""
    parts = []
    for i, a, b in picks:
        piece = value[i]
        if a == 0 and b == piece_width(piece):
            parts.append(decode_piece(piece))
            continue
        piece = decode_piece(piece)
        parts.append(piece[a:b] if isinstance(piece, np.ndarray) else piece[:, a:b])
    if len(parts) == 1:
        return parts[0]
    if any(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate([p if isinstance(p, np.ndarray) else p.toarray().reshape(-1) for p in parts])
    return sp.hstack(parts, format="csr")


_SPARSE_COMBINE = {
    "sum": operator.add,
    "mean": operator.add,
    "max": lambda a, b: a.maximum(b),
    "min": lambda a, b: a.minimum(b),
    "prod": lambda a, b: a.multiply(b),
}


def _combine_dense(op: Op, acc: np.ndarray, x: Piece) -> np.ndarray:
    """``op(acc, x)`` into ``acc`` (owned by the caller); ``x`` dense or sparse."""
    if isinstance(x, np.ndarray):
        return op.combine(acc, x, out=acc)
    if op.name in ("sum", "mean"):
        x.sum_duplicates()
        acc[x.indices] += x.data  # indices are unique: a scatter-add
        return acc
    return op.combine(acc, x.toarray().reshape(-1), out=acc)  # implicit zeros take part


def merge(spec: SegmentSpec, op: Op, ranks: int, finish: bool, inputs: Sequence[Value],
          picks: Sequence[Sequence[Pick]], owned: Sequence[bool], wire: Wire | None, out: bool) -> Any:
    """Combine inputs over one range. Sparse inputs merge with scipy.sparse;
    a dense input (or a result denser than the threshold) makes the result
    dense, accumulated into a received dense buffer no other task here reads
    (``owned``) when there is one."""
    arrays: list[Any] = [_pick(v, p) for v, p in zip(inputs, picks)]  # scipy's or numpy's, see `dense`
    dense = [i for i, a in enumerate(arrays) if isinstance(a, np.ndarray)]
    width = piece_width(arrays[0])
    if not dense and op.name in ("sum", "mean") and len(arrays) > 1 and \
            max(a.nnz for a in arrays) > spec.threshold * width:
        # the union holds at least the largest input: dense for sure, so add densely
        # rather than merge pairs with scipy and then expand them
        big = max(range(len(arrays)), key=lambda i: arrays[i].nnz)
        arrays[big] = arrays[big].toarray().reshape(-1)
        dense, owned = [big], tuple(o or i == big for i, o in enumerate(owned))
    if dense:
        mine = next((i for i in dense if owned[i] and arrays[i].flags.writeable), None)
        first = mine if mine is not None else dense[0]
        acc = arrays[first] if mine is not None else arrays[first].copy()
        for i, a in enumerate(arrays):
            if i != first:
                acc = _combine_dense(op, acc, a)
        result = acc
    else:
        result = functools.reduce(_SPARSE_COMBINE[op.name], arrays)
        if not isinstance(result, sp.csr_array):
            result = sp.csr_array(result)
        if result is arrays[0]:
            result = result.copy()  # one input: a fresh value, never an input's
        result.sum_duplicates()
        result = _switch(result, spec.threshold)
    if finish:
        result = _finish(op, result, ranks)
    if out:
        return output(spec, [(result,)])
    return (encode_piece(result, wire),)


def _finish(op: Op, x: Piece, ranks: int) -> Piece:
    if not op.mean:
        return x
    if isinstance(x, np.ndarray):
        return op.finish(x, ranks, owned=True)
    y = x.astype(np.result_type(x.dtype, np.float64) if x.dtype.kind in "iub" else x.dtype)
    y.data /= ranks
    return y


def gather(spec: SegmentSpec, inputs: Sequence[Value], picks: Sequence[Sequence[Pick]], wire: Wire | None,
           out: bool) -> Any:
    """Inputs side by side (pieces pass through, encoded ones stay encoded)."""
    pieces = []
    for v, p in zip(inputs, picks):
        for i, a, b in p:
            piece = v[i]
            if a or b != piece_width(piece):
                piece = _pick(v, [(i, a, b)])
            pieces.append(piece)
    if out:
        return output(spec, [tuple(pieces)])
    return tuple(encode_piece(x, wire) for x in pieces)


# -- the rank's result ----------------------------------------------------------------------


def output(spec: SegmentSpec, chunks: Sequence[Value]) -> Any:
    """The rank's result from its pieces (in index-space order): the input's
    format, shape and container, or a dense array (``output="dense"``)."""
    size = int(np.prod(spec.shape))
    index = np.int32 if size < 2**31 else np.int64
    pos_parts, val_parts = [], []
    offset = 0
    fresh = True  # whether a single part is ours to return (not a piece another rank may share)
    for chunk in chunks:
        for piece in chunk:
            piece = decode_piece(piece)
            start = offset
            if isinstance(piece, np.ndarray):
                nz = np.flatnonzero(piece != 0)  # 4x faster than on the values themselves
                pos = nz.astype(index, copy=False)
                val_parts.append(np.take(piece, nz))
                offset += piece.size
            else:
                piece.sum_duplicates()
                pos = piece.indices.astype(index, copy=False)
                val_parts.append(piece.data)
                fresh = False
                offset += piece.shape[1]
            pos_parts.append(pos + start if start else pos)
    if len(pos_parts) == 1:
        pos, vals = pos_parts[0], val_parts[0]
        if not fresh:  # a piece may be another rank's too (in-process clusters pass objects by reference)
            pos, vals = pos.copy(), vals.copy()
    else:
        pos, vals = np.concatenate(pos_parts), np.concatenate(val_parts)
    vals = vals.astype(spec.dtype, copy=False)
    shape = spec.shape
    if spec.dense_output:
        result = np.zeros(size, dtype=vals.dtype)
        result[pos] = vals
        return result.reshape(shape, order="F" if spec.order == "F" else "C")
    return _assemble(spec, pos, vals)


def _assemble(spec: SegmentSpec, pos: np.ndarray, vals: np.ndarray) -> Any:
    """The sparse result from sorted, unique positions in the index space:
    built directly in the compressed format whose order the index space
    follows (no sort), converted by scipy for the other formats."""
    shape, fmt = spec.shape, spec.output_format or spec.format
    array = spec.container == "array"
    index = np.int32 if max(int(np.prod(shape)), pos.size) < 2**31 else np.int64
    if len(shape) == 1:
        if fmt == "csr":
            out = sp.csr_array((vals, pos.astype(index, copy=False), np.array([0, pos.size], dtype=index)),
                               shape=shape)
            out.has_canonical_format = True
            return out
        return sp.coo_array((vals, (pos.astype(index, copy=False),)), shape=shape)
    major_n, minor_n = (shape[0], shape[1]) if spec.order == "C" else (shape[1], shape[0])
    major, minor = np.divmod(pos, minor_n)
    natural = "csr" if spec.order == "C" else "csc"
    if fmt == "coo":
        rows, cols = (major, minor) if spec.order == "C" else (minor, major)
        cls = sp.coo_array if array else sp.coo_matrix
        return cls((vals, (rows.astype(index), cols.astype(index))), shape=shape)
    indptr = np.searchsorted(major, np.arange(major_n + 1)).astype(index)
    cls = {("csr", True): sp.csr_array, ("csr", False): sp.csr_matrix,
           ("csc", True): sp.csc_array, ("csc", False): sp.csc_matrix}[natural, array]
    out = cls((vals, minor.astype(index), indptr), shape=shape)
    out.has_canonical_format = True
    return out if fmt == natural else out.asformat(fmt)
