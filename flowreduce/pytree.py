"""Nested containers of arrays ("pytrees"): a model's gradients as one value.

A pytree is a ``dict``, ``list`` or ``tuple`` (namedtuples included) whose
items are pytrees or *leaves*; anything else is a leaf. :func:`flatten`
turns one into its leaves (depth first, dicts in insertion order) and a
:class:`TreeDef` that :func:`unflatten` turns back into the same structure.
Pure Python, no Dask: the planners, the builder and the tasks on the workers
share it.

>>> leaves, tree = flatten({"W": 1, "b": [2, 3]})
>>> leaves, unflatten(tree, [10, 20, 30])
([1, 2, 3], {'W': 10, 'b': [20, 30]})

Two dicts with the same keys in another order have the same structure
(:func:`same_structure`); :func:`leaves_as` reads a tree in the order of a
given :class:`TreeDef`, so ranks that built their dicts differently still
agree tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TreeDef:
    """The structure of a pytree without its leaves.

    ``kind`` is ``"leaf"``, ``"list"``, ``"tuple"`` or ``"dict"``;
    ``keys`` are a dict's keys (in its order); ``node_type`` is a
    namedtuple's class (None for plain tuples).
    """

    kind: str
    children: tuple[TreeDef, ...] = ()
    keys: tuple[Any, ...] = ()
    node_type: Any = None

    @property
    def num_leaves(self) -> int:
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)

    @property
    def is_leaf(self) -> bool:
        return self.kind == "leaf"

    def __str__(self) -> str:
        if self.kind == "leaf":
            return "*"
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.keys, self.children)) + "}"
        inner = ", ".join(str(c) for c in self.children)
        if self.kind == "list":
            return f"[{inner}]"
        name = self.node_type.__name__ if self.node_type is not None else ""
        return f"{name}({inner}{',' if len(self.children) == 1 and not name else ''})"


#: The structure of a bare leaf (one array).
LEAF = TreeDef("leaf")


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Leaves of ``tree`` (depth first, dicts in insertion order) and its structure.

    Parameters
    ----------
    tree : dict, list, tuple or anything else (a leaf)

    Returns
    -------
    leaves : list
    treedef : TreeDef
        What :func:`unflatten` needs to rebuild ``tree`` from ``leaves``.
    """
    leaves: list[Any] = []

    def walk(x: Any) -> TreeDef:
        if isinstance(x, dict):
            return TreeDef("dict", tuple(walk(v) for v in x.values()), tuple(x.keys()))
        if isinstance(x, list):
            return TreeDef("list", tuple(walk(v) for v in x))
        if isinstance(x, tuple):
            return TreeDef("tuple", tuple(walk(v) for v in x), node_type=type(x) if _is_namedtuple(x) else None)
        leaves.append(x)
        return LEAF

    return leaves, walk(tree)


def unflatten(treedef: TreeDef, leaves: Any) -> Any:
    """The pytree of structure ``treedef`` holding ``leaves`` (in flatten order).

    Raises
    ------
    ValueError
        More leaves than the structure holds.
    StopIteration
        Fewer.
    """
    it = iter(leaves)

    def build(t: TreeDef) -> Any:
        if t.kind == "leaf":
            return next(it)
        items = [build(c) for c in t.children]
        if t.kind == "dict":
            return dict(zip(t.keys, items))
        if t.kind == "list":
            return items
        return t.node_type(*items) if t.node_type is not None else tuple(items)

    out = build(treedef)
    if next(it, _END) is not _END:
        raise ValueError(f"too many leaves for structure {treedef}")
    return out


_END = object()


def paths(treedef: TreeDef) -> list[str]:
    """A readable path per leaf, e.g. ``[1]['W']`` (``""`` for a bare leaf)."""
    out: list[str] = []

    def walk(t: TreeDef, prefix: str) -> None:
        if t.kind == "leaf":
            out.append(prefix)
        elif t.kind == "dict":
            for k, c in zip(t.keys, t.children):
                walk(c, f"{prefix}[{k!r}]")
        else:
            for i, c in enumerate(t.children):
                walk(c, f"{prefix}[{i}]")

    walk(treedef, "")
    return out


def canonical(treedef: TreeDef) -> TreeDef:
    """The structure with every dict's keys sorted (by repr), for comparing."""
    if treedef.kind == "leaf":
        return treedef
    children = tuple(canonical(c) for c in treedef.children)
    if treedef.kind == "dict":
        order = sorted(range(len(children)), key=lambda i: repr(treedef.keys[i]))
        return TreeDef("dict", tuple(children[i] for i in order), tuple(treedef.keys[i] for i in order))
    return TreeDef(treedef.kind, children, node_type=treedef.node_type)


def same_structure(a: TreeDef, b: TreeDef) -> bool:
    """Equal structures, dict key order aside."""
    return a == b or canonical(a) == canonical(b)


def leaves_as(tree: Any, treedef: TreeDef, *, subtrees: bool = False) -> list[Any]:
    """The leaves of ``tree`` in the order of ``treedef`` (``subtrees=True``:
    whatever sits at each leaf position, containers included).

    Raises
    ------
    ValueError
        ``tree`` does not have that structure; the message names where.
    """
    out: list[Any] = []

    def walk(x: Any, t: TreeDef, where: str) -> None:
        if t.kind == "leaf":
            if not subtrees and isinstance(x, (dict, list, tuple)):
                raise ValueError(f"expected an array at {where or 'the top'}, got a {type(x).__name__}")
            out.append(x)
            return
        if t.kind == "dict":
            if not isinstance(x, dict):
                raise ValueError(f"expected a dict at {where or 'the top'}, got a {type(x).__name__}")
            if set(x) != set(t.keys):
                missing = [k for k in t.keys if k not in x]
                extra = [k for k in x if k not in t.keys]
                raise ValueError(f"dict at {where or 'the top'} has keys {sorted(map(repr, x))}; "
                                 f"missing {missing}, unexpected {extra}")
            for k, c in zip(t.keys, t.children):
                walk(x[k], c, f"{where}[{k!r}]")
            return
        want = list if t.kind == "list" else tuple
        if not isinstance(x, want) or (want is list and isinstance(x, tuple)):
            raise ValueError(f"expected a {t.kind} at {where or 'the top'}, got a {type(x).__name__}")
        if len(x) != len(t.children):
            raise ValueError(f"{t.kind} at {where or 'the top'} has {len(x)} items, expected {len(t.children)}")
        for i, (v, c) in enumerate(zip(x, t.children)):
            walk(v, c, f"{where}[{i}]")

    walk(tree, treedef, "")
    return out


# -- tensor specs ---------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor, as a template leaf (``like=``) or as
    what a worker reports. Any object with ``.shape`` and ``.dtype`` (a
    numpy array, ``jax.ShapeDtypeStruct``) works as a template leaf too."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype string, e.g. '<f8'

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"shape {self.shape}, dtype {np.dtype(self.dtype)}"


def spec(shape: Any, dtype: Any = "float64") -> TensorSpec:
    """A template leaf without data: ``flowreduce.pytree.spec((128, 64), "float32")``.

    Parameters
    ----------
    shape : int or tuple of int
    dtype : numpy dtype or its name

    Returns
    -------
    TensorSpec
    """
    dims = np.atleast_1d(np.asarray(shape))  # a bare length is a 1-d shape
    return TensorSpec(tuple(int(d) for d in dims), np.dtype(dtype).str)


def spec_of(x: Any) -> TensorSpec:
    """The :class:`TensorSpec` of an array (numpy scalars count as 0-d
    arrays) or of any object with ``.shape`` and ``.dtype``.

    Raises
    ------
    TypeError
        ``x`` has no shape and dtype.
    """
    if isinstance(x, TensorSpec):
        return x
    if isinstance(x, np.generic):
        return TensorSpec((), x.dtype.str)
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"a {type(x).__name__} is not an array (it has no shape and dtype)")
    return TensorSpec(tuple(int(d) for d in shape), np.dtype(dtype).str)


def describe_value(tree: Any) -> tuple[TreeDef, tuple[tuple, ...]]:
    """Structure of a pytree and, per leaf, ``("ndarray", shape, dtype)``
    (numpy scalars count as 0-d arrays) or ``(type name, None, None)``:
    what a worker reports about a value without sending it."""
    leaves, treedef = flatten(tree)
    metas: list[tuple[str, tuple[int, ...] | None, str | None]] = []
    for x in leaves:
        if isinstance(x, (np.ndarray, np.generic)):
            metas.append(("ndarray", tuple(np.shape(x)), x.dtype.str))
        else:
            metas.append((type(x).__name__, None, None))
    return treedef, tuple(metas)
