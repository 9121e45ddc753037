"""What the fusion tasks run on the workers: take tensors out of a rank's
input (checking them against the template when the call had one), copy a
bucket's tensors into one flat buffer, and cut the reduced buffer back into
tensors (views, no copy). numpy only; :mod:`flowreduce.build.buckets` decides
every offset statically.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flowreduce.pytree import TensorSpec, TreeDef, leaves_as, paths, unflatten


def _where(where: str, path: str) -> str:
    return (where + path) or "(the future's value)"


def check_leaf(x: Any, spec: TensorSpec | None, rank: int, where: str) -> np.ndarray:
    """``x`` as an array; with a ``spec``, raise unless it matches."""
    if spec is None:
        return np.asarray(x)
    if not isinstance(x, (np.ndarray, np.generic)):
        raise TypeError(f"rank {rank}: input {where or '(the future)'} is a {type(x).__name__}, "
                        f"not a numpy array as like= says ({spec})")
    x = np.asarray(x)
    if x.shape != spec.shape or x.dtype.str != spec.dtype:
        got = TensorSpec(x.shape, x.dtype.str)
        raise ValueError(f"rank {rank}: input {where or '(the future)'} does not match like=: got {got}, "
                         f"expected {spec}")
    return x


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
        return [np.asarray(x) for x in leaves]
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
    ``(bucket, offset, size, shape)`` of its k-th tensor; each tensor is a
    view of its bucket (the bucket is this rank's own result)."""
    views = [np.asarray(buckets[b]).reshape(-1)[off:off + n].reshape(shape) for b, off, n, shape in parts]
    return unflatten(tree, views)
