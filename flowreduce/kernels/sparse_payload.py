"""What sparse all-reduce tasks pass each other, and how it is sized and
quantised. numpy, scipy and dask's ``sizeof`` only.

Pieces of an element-sparse value: a ``scipy.sparse.csr_array`` of shape
``(1, W)`` (index+value pairs of ``W`` consecutive elements of the index
space) or a dense ``numpy`` array of ``W`` elements (after the dense switch).
Block-sparse values are :class:`BlockPack`. Any of them may travel as
:class:`Encoded` (values quantised; indices exact).

Dask sizes what it stores and moves with ``dask.sizeof``; traces report
transfer bytes from those sizes, so every type here registers one that counts
its buffers. Dask registers scipy's ``spmatrix`` but not the newer
``sparray`` classes (which it would count as ~50 bytes): that rule is
registered here too, the same as dask's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import scipy.sparse as sp
from dask.sizeof import sizeof

from flowreduce.algorithms.sparse import INT8_BUCKET

_OVERHEAD = 64  # bytes of Python object around the buffers, as dask counts tuples

#: A piece of an element-sparse value: a ``(1, W)`` ``scipy.sparse.csr_array`` or a dense array.
Piece: TypeAlias = "np.ndarray | sp.csr_array"


def _sizeof_sparray(x: Any) -> int:
    return sum(sizeof(v) for v in x.__dict__.values())


# Concrete classes, not the ``sparray`` base: dask caches the rule it found for
# a class (``object``'s, if one was sized before this module was imported, as
# a scattered input is), and only a registration of the class itself replaces it.
for _cls in (sp.sparray, sp.csr_array, sp.csc_array, sp.coo_array, sp.bsr_array, sp.dia_array, sp.dok_array,
             sp.lil_array):
    sizeof.register(_cls, _sizeof_sparray)


# -- quantisation -------------------------------------------------------------------


@dataclass(frozen=True)
class Wire:
    """How a task encodes its value for the wire: ``codec`` and the seed
    of its stochastic rounding (None: fresh entropy)."""

    codec: str
    seed: tuple[int, ...] | None = None


@dataclass
class Quantized:
    """Values as they travel: float16, or int8 codes with one float32 scale
    per bucket of :data:`INT8_BUCKET` values."""

    codes: np.ndarray
    scales: np.ndarray | None
    dtype: np.dtype

    def decode(self) -> np.ndarray:
        if self.scales is None:
            return self.codes.astype(self.dtype)
        per = np.repeat(self.scales, INT8_BUCKET)[: self.codes.size]
        return (self.codes * per).astype(self.dtype, copy=False)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + (self.scales.nbytes if self.scales is not None else 0)


def quantize(values: np.ndarray, wire: Wire) -> Quantized:
    """Encode ``values`` (any float dtype) with ``wire.codec``.

    ``"fp16"`` rounds to nearest. ``"int8"`` rounds stochastically to
    ``q·scale``, ``scale = max|bucket| / 127``, ``q = floor(x/scale + u)`` with
    ``u ~ U[0, 1)``: unbiased, and off by less than one ``scale``.

    Raises
    ------
    OverflowError
        ``"fp16"`` and a value beyond float16's range (±65504).
    """
    values = np.ascontiguousarray(values).reshape(-1)
    if wire.codec == "fp16":
        peak = float(np.max(np.abs(values))) if values.size else 0.0
        if peak > float(np.finfo(np.float16).max):
            raise OverflowError(f"compression='fp16': a value of magnitude {peak:.4g} exceeds float16's "
                                f"range (65504); use compression='int8' (scaled per bucket) or None")
        return Quantized(values.astype(np.float16), None, values.dtype)
    if wire.codec != "int8":
        raise ValueError(f"unknown compression {wire.codec!r}")
    n = values.size
    starts = np.arange(0, n, INT8_BUCKET)
    peaks = np.maximum.reduceat(np.abs(values), starts) if n else np.zeros(0, values.dtype)
    scales = (peaks / 127.0).astype(np.float32)
    per = np.repeat(np.where(scales > 0, scales, 1.0).astype(np.float32), INT8_BUCKET)[:n]
    rng = np.random.default_rng(wire.seed)
    codes = np.floor(values / per + rng.random(n, dtype=np.float32))
    np.clip(codes, -127, 127, out=codes)
    return Quantized(codes.astype(np.int8), scales, values.dtype)


# -- element-sparse pieces ------------------------------------------------------------


@dataclass
class Encoded:
    """A piece on the wire with quantised values: a sparse piece keeps its
    indices (``indices`` of a ``(1, width)`` row), a dense one has none."""

    width: int
    indices: np.ndarray | None
    values: Quantized

    def decode(self) -> Piece:
        vals = self.values.decode()
        if self.indices is None:
            return vals
        out = sp.csr_array((vals, self.indices, np.array([0, self.indices.size])), shape=(1, self.width))
        out.has_canonical_format = True  # encoded from a canonical piece
        return out


def encode_piece(piece: Piece | Encoded, wire: Wire | None) -> Piece | Encoded:
    """A piece for the wire: quantised under ``wire``, unchanged without one
    (or when it is encoded already: forwarding does not re-quantise)."""
    if wire is None or isinstance(piece, Encoded):
        return piece
    if isinstance(piece, np.ndarray):
        return Encoded(piece.size, None, quantize(piece, wire))
    piece.sum_duplicates()
    return Encoded(piece.shape[1], piece.indices, quantize(piece.data, wire))


def decode_piece(piece: Piece | Encoded) -> Piece:
    return piece.decode() if isinstance(piece, Encoded) else piece


def piece_width(piece: Piece | Encoded) -> int:
    if isinstance(piece, Encoded):
        return piece.width
    if isinstance(piece, np.ndarray):
        return piece.size
    return piece.shape[1]


# -- blocks ---------------------------------------------------------------------------


@dataclass
class BlockPack:
    """The non-zero blocks of ``nblocks`` consecutive blocks.

    ``ids`` (int32, sorted, relative to the first block) and ``values`` of
    shape ``(len(ids), block)``; or ``ids=None`` when every block is
    non-zero, with ``values`` the flat elements themselves (the last block
    may be short). ``values`` may be :class:`Quantized` on the wire."""

    nblocks: int
    ids: np.ndarray | None
    values: Any

    @property
    def full(self) -> bool:
        return self.ids is None


def encode_pack(pack: BlockPack, wire: Wire | None) -> BlockPack:
    if wire is None or isinstance(pack.values, Quantized):
        return pack
    return BlockPack(pack.nblocks, pack.ids, quantize(pack.values, wire))


def decode_pack(pack: BlockPack, block: int) -> BlockPack:
    if not isinstance(pack.values, Quantized):
        return pack
    vals = pack.values.decode()
    return BlockPack(pack.nblocks, pack.ids, vals if pack.full else vals.reshape(-1, block))


@sizeof.register(Encoded)
def _sizeof_encoded(x: Encoded) -> int:
    return _OVERHEAD + x.values.nbytes + (x.indices.nbytes if x.indices is not None else 0)


@sizeof.register(BlockPack)
def _sizeof_pack(x: BlockPack) -> int:
    vals = x.values.nbytes if isinstance(x.values, Quantized) else np.asarray(x.values).nbytes
    return _OVERHEAD + vals + (x.ids.nbytes if x.ids is not None else 0)
