"""Reduction operators: names, numpy ufuncs or callables, resolved once.

Every operator is assumed associative and commutative: algorithms combine
contributions in different orders, so a non-associative callable gives
rank-dependent results (and floating-point sums may differ in the last
bits between algorithms, as in MPI).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

_NAMED = {
    "sum": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "mean": np.add,  # summed, then divided by the rank count
}


#: Bytes of the result :meth:`Op.fold` finishes before moving on: that block
#: stays in cache while every part's block is combined into it, so each part
#: is read from memory once and the result written once (a part at a time
#: would read and write the whole result once per part).
FOLD_BLOCK_BYTES = 256 << 10


@dataclass(frozen=True)
class Op:
    """A resolved operator. ``combine(a, b, out)`` writes into ``out`` when it
    is given and the operator supports it (ufuncs), otherwise returns new."""

    name: str
    func: Callable[..., Any]
    mean: bool = False
    #: ``deterministic="exact"``'s sum (or mean): folded over every rank at once, correctly rounded
    #: (:func:`flowreduce.reproducible.exact_fold`), never two values at a time
    exact: bool = False

    def __dask_tokenize__(self):
        # keys never derive from tokens here; skip pickling the function
        return ("flowreduce.Op", self.name, id(self.func), self.mean, self.exact)

    def exactly(self) -> Op:
        """This sum or mean, correctly rounded over all ranks (:attr:`exact`)."""
        if self.name not in ("sum", "mean"):
            raise ValueError(f"only sums and means have an exact form, not {self.name!r}")
        return replace(self, exact=True)

    @property
    def in_place(self) -> bool:
        return isinstance(self.func, np.ufunc)

    def combine(self, a, b, out=None):
        if self.exact:
            raise RuntimeError("an exact sum is correctly rounded over all ranks at once, not two values at a time")
        if out is not None and self.in_place:
            return self.func(a, b, out=out)
        return self.func(a, b)

    def fold(self, parts: Sequence[Any], out: np.ndarray) -> np.ndarray:
        """``parts[0] op parts[1] op ...``, left to right, into ``out`` (a
        C-contiguous array of their size, in the op's accumulating dtype; it
        may be ``parts[0]`` itself), block by block (:data:`FOLD_BLOCK_BYTES`):
        the bits of combining one part at a time. For ufuncs only
        (:attr:`in_place`); returns ``out``."""
        if not self.in_place or self.exact:
            raise TypeError(f"fold needs a ufunc; op {self.name!r} cannot write into an array")
        if not out.flags.c_contiguous:
            raise ValueError("fold writes into a C-contiguous array")
        flat = out.reshape(-1)
        xs = [np.asarray(x).reshape(-1) for x in parts]
        step = max(1, FOLD_BLOCK_BYTES // max(out.dtype.itemsize, 1))
        for lo in range(0, flat.size, step):
            o = flat[lo:lo + step]
            np.copyto(o, xs[0][lo:lo + step], casting="unsafe")
            for x in xs[1:]:
                self.func(o, x[lo:lo + step], out=o)
        return out

    def accumulator(self, dtype: np.dtype) -> np.dtype | None:
        """The dtype to combine in, if not the input's (it is then the
        result's dtype too, before ``finish``): integer means sum in 64-bit
        integers (exact, like ``np.mean``'s result) before dividing; the sum
        and product of booleans count in ``int64``, as ``np.sum`` and
        ``np.prod`` over the ranks do (``np.add`` alone would be a logical
        OR; ``op="max"`` or ``"logical_or"`` is that)."""
        dtype = np.dtype(dtype)
        if self.mean and dtype.kind in "iu" and dtype.itemsize < 8:
            return np.dtype(np.int64 if dtype.kind == "i" else np.uint64)
        if dtype == np.bool_ and self.name in ("sum", "prod"):
            return np.dtype(np.int64)
        return None

    def finish(self, x: np.ndarray, ranks: int, owned: bool) -> np.ndarray:
        """Apply what remains once all ranks are combined (mean's division)."""
        if not self.mean:
            return x
        if owned and np.issubdtype(x.dtype, np.inexact):
            return np.divide(x, ranks, out=x)
        return np.true_divide(x, ranks)


def valid_ops() -> list[str]:
    return [*_NAMED, "<any binary numpy ufunc or its name>", "<callable(a, b)>"]


def resolve_op(op: Any) -> Op:
    """Turn ``"sum"``, ``np.maximum``, ``"logaddexp"`` or a callable into an Op.

    Raises
    ------
    ValueError
        For an unknown name or a ufunc that does not take two inputs.
    """
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        if op in _NAMED:
            return Op(op, _NAMED[op], mean=op == "mean")
        ufunc = getattr(np, op, None)
        if isinstance(ufunc, np.ufunc) and ufunc.nin == 2 and ufunc.nout == 1:
            return Op(op, ufunc)
        raise ValueError(f"unknown op {op!r}; valid: {', '.join(valid_ops())}")
    if isinstance(op, np.ufunc):
        if op.nin != 2 or op.nout != 1:
            raise ValueError(f"op {op.__name__} is not a binary ufunc (it takes {op.nin} inputs)")
        return Op(op.__name__, op)
    if callable(op):
        return Op(getattr(op, "__name__", "callable"), op)
    raise ValueError(f"op must be a name, a numpy ufunc or a callable, got {op!r}; valid: {', '.join(valid_ops())}")
