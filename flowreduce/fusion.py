"""Tensor fusion: which tensors of an all-reduce share a flat buffer.

An all-reduce of a model's gradients is an all-reduce of many tensors, most
of them small. Reducing each on its own pays the per-call and per-level
latency once per tensor; Horovod and PyTorch DDP instead copy tensors into
*buckets* of about ``bucket_bytes`` (Horovod's fusion buffer, 64 MB; DDP's
``bucket_cap_mb``, 25 MB), reduce each bucket as one dense vector and split
it back. Pure Python: this module only decides; :mod:`flowreduce.lower.buckets`
lowers the decision to tasks.

Rules (DDP's, with Horovod's grouping by dtype):

* tensors are taken in *reverse* registration order (the last layer's
  gradients first, because back-propagation produces them first), so the
  first bucket can be reduced while earlier layers are still computing;
* a bucket holds tensors of one dtype; a tensor joins the open bucket of its
  dtype unless that would take the bucket past ``bucket_bytes`` (then the
  bucket closes and a new one opens); a tensor larger than ``bucket_bytes``
  gets a bucket of its own;
* ``bucket_bytes=0`` or ``None``: no fusion, every tensor is reduced on its own.

Empty tensors join a bucket without taking room; 0-d arrays count one element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowreduce.pytree import LEAF, TensorSpec, TreeDef, flatten, leaves_as, paths, spec_of

#: Default bucket size: PyTorch DDP's ``bucket_cap_mb=25``. Horovod's fusion
#: threshold is 64 MB; both are "tens of MB", large enough that a bucket's
#: reduction is bandwidth-bound, small enough that the first bucket starts
#: while back-propagation is still running.
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Tensor:
    """One tensor of a rank's input: inside the ``outer``-th future, the
    ``inner``-th leaf of what that future resolves to."""

    outer: int
    inner: int
    spec: TensorSpec
    path: str  # readable, e.g. "[2]['W']"


@dataclass(frozen=True)
class Layout:
    """What every rank passes to one all-reduce: a pytree of futures
    (``outer``), each resolving to a pytree of arrays (``inner[j]``), and the
    tensors in registration order (depth first through both)."""

    outer: TreeDef
    inner: tuple[TreeDef, ...]
    tensors: tuple[Tensor, ...]

    @property
    def single_array(self) -> bool:
        """One future per rank resolving to one array: the plain all-reduce."""
        return self.outer.is_leaf and self.inner[0].is_leaf

    def tensors_of(self, outer: int) -> list[int]:
        return [i for i, t in enumerate(self.tensors) if t.outer == outer]

    @classmethod
    def from_specs(cls, outer: TreeDef, inner: Sequence[TreeDef], specs: Sequence[Sequence[TensorSpec]]) -> Layout:
        """From each future's inner structure and the specs of its leaves."""
        opaths = paths(outer)
        tensors = []
        for j, (tree, leaf_specs) in enumerate(zip(inner, specs)):
            for i, (p, s) in enumerate(zip(paths(tree), leaf_specs)):
                tensors.append(Tensor(j, i, s, opaths[j] + p))
        return cls(outer, tuple(inner), tuple(tensors))

    @classmethod
    def from_template(cls, outer: TreeDef, like: Any) -> Layout:
        """From a template that has the full structure of one rank's input:
        the futures' structure with, at each future's place, what it resolves
        to (arrays, :class:`~flowreduce.pytree.TensorSpec` or anything with
        ``.shape`` and ``.dtype``).

        Raises
        ------
        ValueError
            The template's structure does not fit the futures' structure.
        TypeError
            A template leaf that has no shape and dtype.
        """
        try:
            parts = leaves_as(like, outer, subtrees=True)
        except ValueError as e:
            raise ValueError(f"like= does not have the structure of the inputs {outer}: {e}") from None
        inner, specs = [], []
        for j, part in enumerate(parts):
            leaves, tree = flatten(part)
            try:
                specs.append([spec_of(x) for x in leaves])
            except TypeError as e:
                raise TypeError(f"like= leaf under input {paths(outer)[j] or '(the future)'}: {e}; "
                                "use arrays or flowreduce.pytree.spec(shape, dtype)") from None
            inner.append(tree)
        return cls.from_specs(outer, inner, specs)


@dataclass(frozen=True)
class Bucket:
    """Tensors reduced together as one flat vector of ``dtype``: tensor
    ``tensors[k]`` occupies elements ``offsets[k]`` to ``offsets[k] + size``."""

    dtype: str
    tensors: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def fused(self) -> bool:
        """More than one tensor: needs a copy into a buffer and views out."""
        return len(self.tensors) > 1


def make_buckets(specs: Sequence[TensorSpec], bucket_bytes: int | None) -> list[Bucket]:
    """Buckets for tensors ``specs`` (in registration order), in the order
    they fill (the last tensors' bucket first).

    Raises
    ------
    ValueError
        ``bucket_bytes`` is negative.
    """
    if bucket_bytes is not None and bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0 (0 or None: no fusion), got {bucket_bytes!r}")
    order = list(reversed(range(len(specs))))
    if not bucket_bytes:
        return [Bucket(specs[i].dtype, (i,), (0,), specs[i].size) for i in order]
    groups: list[list[int]] = []
    open_: dict[str, list[int]] = {}
    used: dict[str, int] = {}
    for i in order:
        s = specs[i]
        cur = open_.get(s.dtype)
        if cur is not None and cur and used[s.dtype] + s.nbytes > bucket_bytes and s.nbytes > 0:
            cur = None
        if cur is None:
            cur = open_[s.dtype] = []
            used[s.dtype] = 0
            groups.append(cur)
        cur.append(i)
        used[s.dtype] += s.nbytes
    out = []
    for g in groups:
        offsets, n = [], 0
        for i in g:
            offsets.append(n)
            n += specs[i].size
        out.append(Bucket(specs[g[0]].dtype, tuple(g), tuple(offsets), n))
    return out


def single(spec: TensorSpec) -> Layout:
    """The layout of the plain all-reduce (one array per rank)."""
    return Layout(LEAF, (LEAF,), (Tensor(0, 0, spec, ""),))
