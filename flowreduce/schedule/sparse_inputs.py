"""What a sparse input is, and whether all ranks' inputs agree. Pure Python
(scipy is imported only when an input is a scipy.sparse object)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The tag :func:`describe_input` puts first, beside ``"ndarray"`` for numpy inputs.
SPARSE = "scipy.sparse"
#: Formats a sparse all-reduce takes (others convert with ``.tocsr()``).
FORMATS: tuple[str, ...] = ("csr", "csc", "coo")


@dataclass(frozen=True)
class SparseInputs:
    """What every rank holds: the same format, container, shape and dtype;
    ``nnz`` per rank (stored entries)."""

    format: str
    container: str  # "array" or "matrix"
    shape: tuple[int, ...]
    dtype: str
    nnz: tuple[int, ...]

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def density(self) -> tuple[float, ...]:
        return tuple(min(k / self.size, 1.0) if self.size else 0.0 for k in self.nnz)

    @property
    def order(self) -> str:
        """How the index space numbers elements: column-major for CSC."""
        return "F" if self.format == "csc" else "C"


def describe_input(x: Any) -> tuple | None:
    """``(SPARSE, format, container, shape, dtype, nnz)`` for a scipy.sparse
    object, None for anything else. Runs on the workers."""
    if not type(x).__module__.startswith("scipy.sparse"):
        return None
    import scipy.sparse as sp

    if not sp.issparse(x):
        return None
    container = "array" if isinstance(x, sp.sparray) else "matrix"
    return (SPARSE, x.format, container, tuple(x.shape), x.dtype.str, int(x.nnz))


def is_sparse(meta: tuple | None) -> bool:
    return bool(meta) and meta[0] == SPARSE


def check_sparse(metas: list[tuple | None]) -> SparseInputs:
    """The common description of all ranks' sparse inputs.

    Raises
    ------
    TypeError
        Some ranks hold numpy arrays (or anything else) and others scipy.sparse
        ones; a format other than CSR, CSC, COO; a non-numeric dtype. The
        message names the ranks.
    ValueError
        Ranks disagree on format, container (sparse array vs matrix), shape
        or dtype; the message names the ranks of each kind.
    """
    import numpy as np

    kinds: dict[str, list[int]] = {}
    for r, m in enumerate(metas):
        what = "scipy.sparse" if is_sparse(m) else ("numpy arrays" if m and m[0] == "ndarray"
                                                    else (m[0] if m else "missing"))
        kinds.setdefault(what, []).append(r)
    if len(kinds) > 1:
        detail = "; ".join(f"ranks {rs} hold {k}" for k, rs in kinds.items())
        raise TypeError(f"all ranks must hold scipy.sparse inputs or all numpy arrays, not a mix: {detail}; "
                        "convert with x.toarray() or scipy.sparse.csr_array(x)")
    if "scipy.sparse" not in kinds:
        raise TypeError(f"sparse algorithms need scipy.sparse inputs; ranks {sorted(sum(kinds.values(), []))} "
                        f"hold {', '.join(kinds)}")
    bad = [r for r, m in enumerate(metas) if m[1] not in FORMATS]
    if bad:
        held = sorted({metas[r][1] for r in bad})
        raise TypeError(f"sparse all-reduce takes formats {', '.join(FORMATS)}; ranks {bad} hold {', '.join(held)} "
                        "(convert with .tocsr())")
    for field, i in (("format", 1), ("container", 2), ("shape", 3), ("dtype", 4)):
        groups: dict[Any, list[int]] = {}
        for r, m in enumerate(metas):
            groups.setdefault(m[i], []).append(r)
        if len(groups) > 1:
            shown = {"container": lambda v: f"sparse {v}s", "dtype": lambda v: str(np.dtype(v))}.get(field, str)
            detail = "; ".join(f"ranks {rs}: {shown(v)}" for v, rs in groups.items())
            raise ValueError(f"ranks disagree on {field}: {detail}")
    _, fmt, container, shape, dt, _ = metas[0]
    dtype = np.dtype(dt)
    if dtype.kind not in "iufc":
        raise TypeError(f"sparse inputs must have a numeric dtype, got {dtype}")
    return SparseInputs(fmt, container, tuple(shape), dtype.str, tuple(m[5] for m in metas))
