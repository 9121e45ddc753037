"""What the fusion tasks run on the workers: take tensors out of a rank's
input (checking them against the template when the call had one), copy a
bucket's tensors into one flat buffer, and cut the reduced buffer back into
tensors (views, no copy). Arrays of other libraries (torch) are read as numpy
here and the results turned back into them (:mod:`flowreduce.arrays`), so the
tasks between see numpy only. :mod:`flowreduce.lower.buckets` decides every
offset statically.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flowreduce import arrays
from flowreduce.pytree import TensorSpec, TreeDef, leaves_as, paths, spec_of, unflatten


def _where(where: str, path: str) -> str:
    return (where + path) or "(the future's value)"


def check_leaf(x: Any, spec: TensorSpec | None, rank: int, where: str) -> np.ndarray:
    """``x`` as a numpy array; with a ``spec``, raise unless it matches."""
    if spec is None:
        return arrays.to_numpy(x)
    is_array = isinstance(x, (np.ndarray, np.generic)) or arrays.is_foreign(x)
    if not is_array or (spec.native is not None) != arrays.is_foreign(x):
        want = "a numpy array" if spec.native is None else f"a {spec.native.library} array"
        raise TypeError(f"rank {rank}: input {where or '(the future)'} is a {type(x).__name__}, "
                        f"not {want} as like= says ({spec})")
    got = spec_of(x)
    if got != spec:
        raise ValueError(f"rank {rank}: input {where or '(the future)'} does not match like=: got {got}, "
                         f"expected {spec}")
    return arrays.to_numpy(x)


def leaves_of(value: Any, tree: TreeDef, specs: tuple[TensorSpec, ...] | None, rank: int,
              where: str) -> list[np.ndarray]:
    """The arrays of one future's value, in ``tree``'s order, checked
    against ``specs`` when given."""
    try:
        leaves = leaves_as(value, tree)
    except ValueError as e:
        raise ValueError(f"rank {rank}: input {where or '(the future)'} does not match the structure "
                         f"{tree} of like=: {e}") from None
    ps = paths(tree)
    if specs is None:
        return [arrays.to_numpy(x) for x in leaves]
    return [check_leaf(x, s, rank, _where(where, p)) for x, s, p in zip(leaves, specs, ps)]


def extract(value: Any, index: int, tree: TreeDef, specs: tuple[TensorSpec, ...] | None, rank: int,
            where: str) -> np.ndarray:
    """Tensor ``index`` of a future's value (the whole value is checked, so
    a mismatch anywhere in it fails the first task that reads it)."""
    if tree.is_leaf:
        return check_leaf(value, specs[0] if specs else None, rank, where)
    return leaves_of(value, tree, specs, rank, where)[index]


def pack(dtype: str, size: int, values: list, picks: tuple, sources: tuple, rank: int) -> np.ndarray:
    """Copy a bucket's tensors into one flat buffer (the fusion buffer).

    ``sources[v]`` is ``(tree, specs or None, where)`` for ``values[v]``;
    ``picks`` are ``(v, leaf, offset, size)``."""
    buf = np.empty(size, dtype=dtype)
    leaves: dict[int, list[np.ndarray]] = {}
    for v, leaf, off, n in picks:
        if v not in leaves:
            tree, specs, where = sources[v]
            leaves[v] = leaves_of(values[v], tree, specs, rank, where)
        x = leaves[v][leaf]
        if x.size != n:  # no template: ranks were checked upfront, so this is a value that changed since
            raise ValueError(f"rank {rank}: tensor has {x.size} elements, the bucket expected {n}")
        buf[off:off + n] = x.reshape(-1)
    return buf


def unpack(tree: TreeDef, buckets: list, parts: tuple) -> Any:
    """One future's value rebuilt from reduced buckets: ``parts[k]`` is
    ``(bucket, offset, size, shape, native)`` of its k-th tensor; each
    tensor is a view of its bucket (the bucket is this rank's own result),
    as the array of its ``native`` kind when it was not numpy."""
    views = [arrays.from_numpy(np.asarray(buckets[b]).reshape(-1)[off:off + n].reshape(shape), native)
             for b, off, n, shape, native in parts]
    return unflatten(tree, views)
