"""What each rank's input is, and whether the ranks agree: checked once,
into typed descriptions.

A worker reports what it holds for an input key as a :data:`Meta` (one of
:class:`ArrayMeta`, :class:`SparseMeta`, :class:`TreeMeta`,
:class:`OtherMeta`, built by :func:`meta_of` without sending the value);
the functions below turn the ranks' metas into the one description a
call lowers from (an :class:`ArrayMeta` for numpy arrays, a
:class:`~flowreduce.lower.sparse.SparseInputs`, a
:class:`~flowreduce.fusion.Layout` of tensors), or raise an error naming
the ranks that disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowreduce import arrays
from flowreduce.arrays import ArrayKind
from flowreduce.errors import InputError, InputTypeError
from flowreduce.fusion import Layout
from flowreduce.lower.sparse import SparseInputs
from flowreduce.ops import Op
from flowreduce.pytree import LEAF, TensorSpec, TreeDef, flatten, is_node, leaves_as, paths, same_structure

#: Formats a sparse all-reduce takes (others convert with ``.tocsr()``).
SPARSE_FORMATS: tuple[str, ...] = ("csr", "csc", "coo")


@dataclass(frozen=True)
class ArrayMeta:
    """A numpy array (a numpy scalar counts as a 0-d array), or an array of
    another library (``native``: a torch tensor) reduced as one of ``dtype``."""

    shape: tuple[int, ...]
    dtype: str  # numpy's dtype.str
    native: ArrayKind | None = None  # what flowreduce.arrays converts it back to

    kind = "ndarray"


@dataclass(frozen=True)
class SparseMeta:
    """A scipy.sparse array or matrix."""

    format: str
    container: str  # "array" or "matrix"
    shape: tuple[int, ...]
    dtype: str
    nnz: int

    kind = "scipy.sparse"


@dataclass(frozen=True)
class OtherMeta:
    """Anything else, by its type's name."""

    kind: str


@dataclass(frozen=True)
class TreeMeta:
    """A pytree (dict / list / tuple, nested): its structure and each leaf's meta."""

    tree: TreeDef
    leaves: tuple[ArrayMeta | OtherMeta, ...]

    kind = "pytree"


Meta = ArrayMeta | SparseMeta | TreeMeta | OtherMeta
META_TYPES = (ArrayMeta, SparseMeta, TreeMeta, OtherMeta)


def meta_of(x: Any) -> Meta:
    """What ``x`` is, without its data. Runs on the workers."""
    if isinstance(x, (np.ndarray, np.generic)):
        return ArrayMeta(tuple(np.shape(x)), x.dtype.str)
    if is_node(x) or arrays.is_foreign(x):  # a tensor takes the pytree path, whose tasks convert it
        leaves, tree = flatten(x)
        return TreeMeta(tree, tuple(_leaf_meta(v) for v in leaves))
    if type(x).__module__.startswith("scipy.sparse"):
        import scipy.sparse as sp

        if sp.issparse(x):
            container = "array" if isinstance(x, sp.sparray) else "matrix"
            return SparseMeta(x.format, container, tuple(x.shape), x.dtype.str, int(x.nnz))
    return OtherMeta(type(x).__name__)


def _leaf_meta(x: Any) -> ArrayMeta | OtherMeta:
    if isinstance(x, (np.ndarray, np.generic)) or arrays.is_foreign(x):
        try:
            return ArrayMeta(*arrays.describe(x))
        except TypeError as e:  # a tensor of a dtype numpy cannot reduce: named, not sent
            return OtherMeta(f"{type(x).__name__} ({e})")
    return OtherMeta(type(x).__name__)


def check_cluster(client: Any, futures: Sequence[Sequence[Any]]) -> None:
    """Refuse futures of another cluster's client: their keys would be looked
    up on this cluster, and a key that happens to exist here too would be
    reduced silently in place of the real input.

    Raises
    ------
    InputError
        Naming the ranks and the scheduler their futures belong to.
    """
    here = client.scheduler.address
    foreign: dict[str, list[int]] = {}
    for r, fs in enumerate(futures):
        for f in fs:
            there = f.client.scheduler.address
            if there != here:
                foreign.setdefault(there, []).append(r)
                break
    if foreign:
        detail = "; ".join(f"ranks {rs} belong to {addr}" for addr, rs in foreign.items())
        raise InputError(f"inputs must be futures of this client's cluster ({here}); {detail}")


def rank_futures(inputs: Sequence[Any]) -> tuple[TreeDef, list[list[Any]]]:
    """The structure of every rank's futures and, per rank, its futures in
    that structure's order.

    Raises
    ------
    InputError
        No inputs; ranks whose futures are arranged differently.
    InputTypeError
        A leaf that is not a Future (naming the rank and where).
    """
    from distributed import Future

    if not inputs:
        raise InputError("allreduce needs one input future per rank; got an empty list")
    trees, leaves_by_rank = [], []
    for r, x in enumerate(inputs):
        leaves, tree = ([x], LEAF) if isinstance(x, Future) else flatten(x)
        for path, f in zip(paths(tree), leaves):
            if not isinstance(f, Future):
                at = f" at {path}" if path else ""
                raise InputTypeError(f"input of rank {r}{at} is a {type(f).__name__}, not a distributed.Future; "
                                     "scatter or submit it first")
        trees.append(tree)
        leaves_by_rank.append(leaves)
    outer = trees[0]
    _same_structure(list(enumerate(trees)), "the structure of their inputs")
    ranks = [leaves if t == outer else leaves_as(x, outer) for x, t, leaves in zip(inputs, trees, leaves_by_rank)]
    return outer, ranks


def _same_structure(trees: list[tuple[int, TreeDef]], what: str) -> None:
    groups: dict[TreeDef, list[int]] = {}
    for r, t in trees:
        key = next((g for g in groups if same_structure(g, t)), t)
        groups.setdefault(key, []).append(r)
    if len(groups) > 1:
        detail = "; ".join(f"ranks {rs}: {t}" for t, rs in groups.items())
        raise InputError(f"ranks disagree on {what}: {detail}")


def agreed_spec(metas: Sequence[tuple[int, ArrayMeta]], tensor: str = "") -> TensorSpec:
    """The shape and dtype all ranks' arrays share (``metas`` are ``(rank,
    meta)``), or an error naming the ranks of each; ``tensor`` names the
    tensor in the message."""
    seen: dict[TensorSpec, list[int]] = {}
    for r, m in metas:  # native: a tensor's library, dtype and device type must agree too
        seen.setdefault(TensorSpec(tuple(m.shape), m.dtype, m.native), []).append(r)
    if len(seen) > 1:
        what = "shapes" if len({s.shape for s in seen}) > 1 else "dtypes"
        detail = "; ".join(f"ranks {rs}: {s}" for s, rs in seen.items())
        of = f" of tensor {tensor}" if tensor else ""
        raise InputError(f"ranks disagree on {what}{of}: {detail}")
    (spec,) = seen
    return spec


def check_dtype(dtype: np.dtype, op: Op, tensor: str = "") -> None:
    """An error unless ``op`` can reduce arrays of ``dtype``."""
    where = f" (tensor {tensor})" if tensor else ""
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
        raise InputTypeError(f"inputs must have a numeric or boolean dtype, got {dtype}{where}")
    if op.mean and dtype == np.bool_:
        raise InputTypeError(f"op='mean' of boolean arrays is ambiguous; cast them to a number type first{where}")


def common_array(metas: Sequence[Meta]) -> ArrayMeta:
    """The numpy array every rank holds (one future each).

    Raises
    ------
    InputTypeError
        A rank holding something else; a dtype neither numeric nor boolean.
    InputError
        Ranks disagreeing on shape or dtype (naming the ranks).
    """
    bad = [r for r, m in enumerate(metas) if not isinstance(m, ArrayMeta)]
    if bad:
        raise InputTypeError(f"inputs must be numpy arrays; ranks {bad} hold {({r: metas[r].kind for r in bad})}")
    spec = agreed_spec([(r, m) for r, m in enumerate(metas) if isinstance(m, ArrayMeta)])
    dtype = np.dtype(spec.dtype)
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
        raise InputTypeError(f"inputs must have a numeric or boolean dtype, got {dtype}")
    return ArrayMeta(tuple(spec.shape), np.dtype(spec.dtype).str)


def checked_array(metas: Sequence[Meta], op: Op) -> ArrayMeta:
    """:func:`common_array`, and a dtype ``op`` can reduce (:func:`check_dtype`)."""
    held = common_array(metas)
    check_dtype(np.dtype(held.dtype), op)
    return held


def check_values(values: Sequence[Any], op: Op) -> None:
    """:func:`checked_array` on the ranks' values themselves, or what a peer
    worker said they are (a :data:`Meta`), in rank order: the same errors,
    naming the same ranks. Runs in the tasks of a call that did not ask the
    workers what they hold (:mod:`flowreduce.lower.direct`)."""
    checked_array([v if isinstance(v, META_TYPES) else meta_of(v) for v in values], op)


def common_sparse(metas: Sequence[Meta]) -> SparseInputs:
    """The common description of all ranks' sparse inputs.

    Raises
    ------
    InputTypeError
        Some ranks hold numpy arrays (or anything else) and others scipy.sparse
        ones; a format other than CSR, CSC, COO; a non-numeric dtype. The
        message names the ranks.
    InputError
        Ranks disagree on format, container (sparse array vs matrix), shape
        or dtype; the message names the ranks of each kind.
    """
    kinds: dict[str, list[int]] = {}
    for r, m in enumerate(metas):
        what = {"scipy.sparse": "scipy.sparse", "ndarray": "numpy arrays"}.get(m.kind, m.kind)
        kinds.setdefault(what, []).append(r)
    if len(kinds) > 1:
        detail = "; ".join(f"ranks {rs} hold {k}" for k, rs in kinds.items())
        raise InputTypeError(f"all ranks must hold scipy.sparse inputs or all numpy arrays, not a mix: {detail}; "
                             "convert with x.toarray() or scipy.sparse.csr_array(x)")
    sparse = [m for m in metas if isinstance(m, SparseMeta)]
    if len(sparse) < len(metas):
        raise InputTypeError(f"sparse algorithms need scipy.sparse inputs; ranks "
                             f"{sorted(sum(kinds.values(), []))} hold {', '.join(kinds)}")
    bad = [r for r, m in enumerate(sparse) if m.format not in SPARSE_FORMATS]
    if bad:
        held = sorted({sparse[r].format for r in bad})
        raise InputTypeError(f"sparse all-reduce takes formats {', '.join(SPARSE_FORMATS)}; ranks {bad} hold "
                             f"{', '.join(held)} (convert with .tocsr())")
    for field in ("format", "container", "shape", "dtype"):
        groups: dict[Any, list[int]] = {}
        for r, m in enumerate(sparse):
            groups.setdefault(getattr(m, field), []).append(r)
        if len(groups) > 1:
            shown = {"container": lambda v: f"sparse {v}s", "dtype": lambda v: str(np.dtype(v))}.get(field, str)
            detail = "; ".join(f"ranks {rs}: {shown(v)}" for v, rs in groups.items())
            raise InputError(f"ranks disagree on {field}: {detail}")
    first = sparse[0]
    dtype = np.dtype(first.dtype)
    if dtype.kind not in "iufc":
        raise InputTypeError(f"sparse inputs must have a numeric dtype, got {dtype}")
    return SparseInputs(first.format, first.container, tuple(first.shape), dtype.str, tuple(m.nnz for m in sparse))


def common_layout(outer: TreeDef, metas: Sequence[Sequence[Meta]], op: Op) -> Layout:
    """The tensors every rank holds, from what the workers reported
    (``metas[rank][j]`` for the rank's ``j``-th future).

    Raises
    ------
    InputTypeError
        A value that is not an array or a pytree of arrays (naming the
        ranks); a dtype ``op`` cannot reduce.
    InputError
        Ranks disagreeing on structure, shapes or dtypes (naming the ranks
        and the tensor).
    """
    opaths = paths(outer)
    inner: list[TreeDef] = []
    specs: list[list[TensorSpec]] = []
    for j in range(outer.num_leaves):
        trees: list[tuple[int, TreeDef]] = []
        by_path: list[tuple[int, dict[str, ArrayMeta]]] = []
        bad: dict[int, str] = {}
        leaves_bad: dict[int, str] = {}
        for r, rank_metas in enumerate(metas):
            m = rank_metas[j]
            leaf_metas: tuple[ArrayMeta | OtherMeta, ...]
            if isinstance(m, ArrayMeta):
                tree, leaf_metas = LEAF, (m,)
            elif isinstance(m, TreeMeta):
                tree, leaf_metas = m.tree, m.leaves
            else:
                bad[r] = m.kind
                continue
            odd = [f"{lm.kind} at {p}" for p, lm in zip(paths(tree), leaf_metas) if not isinstance(lm, ArrayMeta)]
            if odd:
                bad[r] = tree.node_type.__name__ if tree.node_type is not None else tree.kind
                leaves_bad[r] = odd[0]
                continue
            trees.append((r, tree))
            by_path.append((r, {p: lm for p, lm in zip(paths(tree), leaf_metas) if isinstance(lm, ArrayMeta)}))
        where = f" (input {opaths[j]})" if opaths[j] else ""
        if bad:
            detail = "".join(f"; rank {r}: {what}" for r, what in leaves_bad.items())
            raise InputTypeError(f"inputs must be numpy arrays or pytrees of them{where}; ranks {sorted(bad)} hold "
                                 f"{bad}{detail}")
        _same_structure(trees, f"structure{where}")
        tree = trees[0][1]
        inner.append(tree)
        specs.append([agreed_spec([(r, d[p]) for r, d in by_path], opaths[j] + p) for p in paths(tree)])
    layout = Layout.from_specs(outer, inner, specs)
    check_dtypes(layout, op)
    return layout


def check_dtypes(layout: Layout, op: Op) -> None:
    """An error unless ``op`` can reduce every tensor of ``layout``."""
    if not layout.tensors:
        raise InputError("nothing to reduce: the inputs hold no arrays")
    for t in layout.tensors:
        check_dtype(np.dtype(t.spec.dtype), op, t.path or "0")
