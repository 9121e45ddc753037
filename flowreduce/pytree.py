"""Nested containers of arrays ("pytrees"): a model's gradients as one value.

A pytree is a ``dict`` (``OrderedDict`` and other dict subclasses built
from pairs included), ``list``, ``tuple`` (namedtuples included) or
dataclass instance (unless it has a ``shape`` and a ``dtype``, like a
:class:`TensorSpec`) whose items (fields) are pytrees or *leaves*; anything
else is a leaf. :func:`flatten` turns one into its leaves (depth first,
dicts in insertion order, dataclasses in field order) and a
:class:`TreeDef` that :func:`unflatten` turns back into the same
structure, of the same types. Pure Python, no Dask: the planners, the
builder and the tasks on the workers share it.

>>> leaves, tree = flatten({"W": 1, "b": [2, 3]})
>>> leaves, unflatten(tree, [10, 20, 30])
([1, 2, 3], {'W': 10, 'b': [20, 30]})

Two dicts with the same keys in another order have the same structure
(:func:`same_structure`); :func:`leaves_as` reads a tree in the order of a
given :class:`TreeDef`, so ranks that built their dicts differently still
agree tensor by tensor.

Leaves that are arrays of other libraries (torch tensors) are described by
:mod:`flowreduce.arrays`: a :class:`TensorSpec` says what they are reduced
as and what they come back as.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowreduce import arrays
from flowreduce.arrays import ArrayKind


@dataclass(frozen=True)
class TreeDef:
    """The structure of a pytree without its leaves.

    ``kind`` is ``"leaf"``, ``"list"``, ``"tuple"``, ``"dict"`` or
    ``"dataclass"``; ``keys`` are a dict's keys (in its order) or a
    dataclass's field names; ``node_type`` is the class to rebuild: a
    namedtuple's, a dict subclass's (``OrderedDict``), a dataclass's (None
    for plain tuples and dicts).
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
            inner = "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.keys, self.children)) + "}"
            return inner if self.node_type is None else f"{self.node_type.__name__}({inner})"
        if self.kind == "dataclass":
            return f"{self.node_type.__name__}(" + ", ".join(f"{k}={c}" for k, c in zip(self.keys, self.children)) + ")"
        inner = ", ".join(str(c) for c in self.children)
        if self.kind == "list":
            return f"[{inner}]"
        name = self.node_type.__name__ if self.node_type is not None else ""
        return f"{name}({inner}{',' if len(self.children) == 1 and not name else ''})"


#: The structure of a bare leaf (one array).
LEAF = TreeDef("leaf")


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_dataclass(x: Any) -> bool:
    """A dataclass instance that is not array-like (a :class:`TensorSpec` is a leaf)."""
    return (dataclasses.is_dataclass(x) and not isinstance(x, type)
            and not (hasattr(x, "shape") and hasattr(x, "dtype")))


def _fields(x: Any) -> tuple[str, ...]:
    """A dataclass's fields that its constructor takes (the others it derives)."""
    return tuple(f.name for f in dataclasses.fields(x) if f.init)


def is_node(x: Any) -> bool:
    """``x`` is a container that :func:`flatten` opens (not a leaf)."""
    return isinstance(x, (dict, list, tuple)) or _is_dataclass(x)


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Leaves of ``tree`` (depth first, dicts in insertion order) and its structure.

    Parameters
    ----------
    tree : dict, list, tuple, dataclass or anything else (a leaf)

    Returns
    -------
    leaves : list
    treedef : TreeDef
        What :func:`unflatten` needs to rebuild ``tree`` from ``leaves``.
    """
    leaves: list[Any] = []

    def walk(x: Any) -> TreeDef:
        if isinstance(x, dict):
            return TreeDef("dict", tuple(walk(v) for v in x.values()), tuple(x.keys()),
                           node_type=None if type(x) is dict else type(x))
        if _is_dataclass(x):
            names = _fields(x)
            return TreeDef("dataclass", tuple(walk(getattr(x, k)) for k in names), names, node_type=type(x))
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
            return (t.node_type or dict)(zip(t.keys, items))
        if t.kind == "dataclass":
            return t.node_type(**dict(zip(t.keys, items)))
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
        elif t.kind == "dataclass":
            for k, c in zip(t.keys, t.children):
                walk(c, f"{prefix}.{k}")
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
        return TreeDef("dict", tuple(children[i] for i in order), tuple(treedef.keys[i] for i in order),
                       node_type=treedef.node_type)
    return TreeDef(treedef.kind, children, treedef.keys, node_type=treedef.node_type)


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
            if not subtrees and is_node(x):
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
        if t.kind == "dataclass":
            if not isinstance(x, t.node_type):
                raise ValueError(f"expected a {t.node_type.__name__} at {where or 'the top'}, got a {type(x).__name__}")
            for k, c in zip(t.keys, t.children):
                walk(getattr(x, k), c, f"{where}.{k}")
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
    numpy array, a torch tensor or parameter, ``jax.ShapeDtypeStruct``)
    works as a template leaf too.

    ``dtype`` is the numpy dtype the tensor is reduced in; ``native`` what
    it is when it is not a numpy array (a torch ``bfloat16`` tensor is
    reduced as float32 and comes back as a ``bfloat16`` tensor)."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype string, e.g. '<f8'
    native: ArrayKind | None = None

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
        dtype = np.dtype(self.dtype) if self.native is None else self.native
        return f"shape {self.shape}, dtype {dtype}"


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
    arrays, tensors of other libraries as :mod:`flowreduce.arrays` reads
    them) or of any object with ``.shape`` and ``.dtype``.

    Raises
    ------
    TypeError
        ``x`` has no shape and dtype, or a dtype that cannot be reduced.
    """
    if isinstance(x, TensorSpec):
        return x
    if isinstance(x, (np.ndarray, np.generic)) or arrays.is_foreign(x):
        return TensorSpec(*arrays.describe(x))
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
