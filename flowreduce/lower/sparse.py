"""Lower a sparse plan to a Dask task graph. Imports dask, never distributed.

The plans are the dense ones (:mod:`flowreduce.algorithms`); only the
kernels differ: ``pack`` (a rank's non-zeros of a range) in place of the
zero-copy view, ``merge``/``aggregate`` (scipy.sparse merges with the dense
switch; block unions) in place of the dense reduction, ``gather`` and
``output`` that assemble the rank's result in the user's format. As in
:mod:`flowreduce.lower.graph`, every range is decided here, statically.

:func:`lower_sparse` takes scipy.sparse inputs (SparCML's algorithms),
:func:`lower_blocks` dense numpy inputs (OmniReduce's block-sparse).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import numpy as np
from dask.task_spec import Task

from flowreduce import keys
from flowreduce.algorithms.block_sparse import DEFAULT_BLOCK
from flowreduce.algorithms.ir import REDUCE, VIEW
from flowreduce.algorithms.sparse import CODECS, SparsePlan
from flowreduce.kernels import blocks as _blocks
from flowreduce.kernels import sparse as _kernels
from flowreduce.kernels.sparse_payload import Wire
from flowreduce.lower.graph import Graph, Site, contributions, lower, owned_inputs
from flowreduce.ops import Op

#: ``allreduce`` options of the sparse algorithms (beside the planners' own).
SPARSE_CALL_OPTIONS = ("delta", "output", "compression", "seed")
BLOCK_CALL_OPTIONS = ("compression", "seed")
OUTPUTS = (None, "dense", "csr", "csc", "coo")
_UFUNC_NAMES = {"add": "sum", "maximum": "max", "minimum": "min", "multiply": "prod"}


@dataclass(frozen=True)
class SparseInputs:
    """What every rank holds, checked to agree by the caller: the same
    format, container (``"array"`` or ``"matrix"``), shape and dtype;
    ``nnz`` per rank (stored entries)."""

    format: str
    container: str
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


@dataclass(frozen=True)
class Lowered:
    """A sparse call ready to submit: its plan, graph, the dense bytes per
    rank its cost card takes, and the shape and dtype of a rank's input."""

    plan: SparsePlan
    graph: Graph
    nbytes: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class SparseCall:
    """A scipy.sparse call's own options, checked: what its plan needs
    (``delta``, ``codec``, the named planner's options) and how it is
    lowered (``op``, ``output``, ``seed``)."""

    op: Op
    info: SparseInputs
    delta: float | None
    output: str | None
    codec: str | None
    seed: int | np.integer | None
    planner: dict[str, Any]

    def plan_fields(self) -> dict[str, Any]:
        """What a sparse plan carries of the inputs and options (its cost card depends on them)."""
        return dict(density=self.info.density, value_bytes=np.dtype(self.info.dtype).itemsize, delta=self.delta,
                    codec=self.codec)


def sparse_call(info: SparseInputs, *, op: Op, algorithm: str, options: Mapping[str, Any]) -> SparseCall:
    """Check a call of scipy.sparse inputs described by ``info`` (checked to
    agree by :func:`flowreduce.schedule.inputs.common_sparse`); ``options``
    are the call's algorithm options (``radix``, ``inner``) and sparse
    options (``delta``, ``output``, ``compression``, ``seed``).

    Raises
    ------
    TypeError, ValueError
        A dense algorithm or ``block-sparse`` for sparse inputs, an op
        without ``f(0, 0) = 0``, bad sparse options.
    """
    if algorithm not in ("auto", "sparse-recursive-doubling", "sparse-split-allgather"):
        raise ValueError(f"scipy.sparse inputs need a sparse algorithm, not {algorithm!r}; valid: auto, "
                         "sparse-recursive-doubling, sparse-split-allgather (or pass x.toarray() to a dense one)")
    op = _check_op(op, _kernels.SPARSE_OPS, "sparse")
    options = dict(options)
    call = {k: options.pop(k) for k in SPARSE_CALL_OPTIONS if k in options}
    delta, output = call.get("delta"), call.get("output")
    codec, seed = _check_wire(call.get("compression"), call.get("seed"), np.dtype(info.dtype))
    if delta is not None and not (isinstance(delta, (int, float)) and 0 <= delta <= 1):
        raise ValueError(f"delta is a density in [0, 1] (None: the byte break-even), got {delta!r}")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {', '.join(map(str, OUTPUTS))}; got {output!r}")
    if output in ("csc",) and len(info.shape) == 1:
        raise ValueError("output='csc' needs 2-D inputs: scipy has no 1-D CSC")
    if algorithm == "auto" and options:
        raise ValueError(f"options {sorted(options)} need a named algorithm, not 'auto'")
    return SparseCall(op, info, delta, output, codec, seed, options)


def lower_sparse(plan: SparsePlan, inputs: Sequence[Any], workers: Sequence[str], call: SparseCall, *,
                 in_place: bool) -> Lowered:
    """Lower ``plan`` (chosen for ``call``) for scipy.sparse inputs."""
    info, op = call.info, call.op
    dtype = np.dtype(info.dtype)
    accumulate = op.accumulator(dtype)
    spec = _kernels.SegmentSpec(
        format=info.format, container=info.container, shape=info.shape, order=info.order,
        threshold=plan.threshold, dtype=_result_dtype(op, dtype).str,
        accumulate=accumulate.str if accumulate is not None else None,
        dense_output=call.output == "dense", output_format=call.output if call.output != "dense" else None,
    )
    graph = _lower(plan, inputs, list(workers), _kernels, _kernels.merge, spec, size=info.size, op=op,
                   in_place=in_place, codec=call.codec, seed=call.seed)
    return Lowered(plan, graph, info.size * dtype.itemsize, info.shape, dtype)


@dataclass(frozen=True)
class BlockCall:
    """A block-sparse call's own options, checked."""

    op: Op
    shape: tuple[int, ...]
    dtype: np.dtype
    block: int
    codec: str | None
    seed: int | np.integer | None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def block_call(*, shape: tuple[int, ...], dtype: np.dtype, op: Op, options: Mapping[str, Any]) -> BlockCall:
    """Check a block-sparse call of dense numpy inputs; ``options``:
    ``block_size``, ``compression``, ``seed``.

    Raises
    ------
    TypeError, ValueError
        An op other than sum or mean, bad options.
    """
    op = _check_op(op, _blocks.BLOCK_OPS, "block-sparse")
    options = dict(options)
    call = {k: options.pop(k) for k in BLOCK_CALL_OPTIONS if k in options}
    codec, seed = _check_wire(call.get("compression"), call.get("seed"), dtype)
    block = options.pop("block_size", DEFAULT_BLOCK)
    if options:
        raise ValueError(f"block-sparse takes options block_size, aggregators, compression, seed; "
                         f"got {sorted(options)}")
    if dtype.kind not in "iufc":
        raise TypeError(f"block-sparse needs a numeric dtype, got {dtype}")
    return BlockCall(op, tuple(shape), dtype, block, codec, seed)


def lower_blocks(plan: SparsePlan, inputs: Sequence[Any], workers: Sequence[str], call: BlockCall, *,
                 in_place: bool, aggregators: Sequence[str]) -> Lowered:
    """Lower a block-sparse ``plan`` for dense numpy inputs; ``aggregators``
    are the workers that add the packs (empty: co-located on the ranks)."""
    op, dtype, size = call.op, call.dtype, call.size
    accumulate = op.accumulator(dtype)
    spec = _blocks.BlockSpec(block=call.block, size=size, shape=call.shape, dtype=_result_dtype(op, dtype).str,
                             accumulate=accumulate.str if accumulate is not None else None)
    nblocks = -(-size // call.block)
    graph = _lower(plan, inputs, [*workers, *aggregators], _blocks, _blocks.aggregate, spec, size=nblocks,
                   op=op, in_place=in_place, codec=call.codec, seed=call.seed)
    return Lowered(plan, graph, size * dtype.itemsize, call.shape, dtype)


def _check_op(op: Op, valid: tuple[str, ...], what: str) -> Op:
    name = _UFUNC_NAMES.get(op.name, op.name) if op.name not in valid else op.name
    if name not in valid:
        raise ValueError(f"{what} all-reduce supports ops {', '.join(valid)}; got {op.name!r} (only these keep "
                         "implicit zeros zero)")
    return op if name == op.name else replace(op, name=name)


def _check_wire(codec: str | None, seed: Any, dtype: np.dtype) -> tuple[str | None, int | np.integer | None]:
    if codec not in CODECS:
        raise ValueError(f"compression must be one of {', '.join(map(str, CODECS))}; got {codec!r}")
    if codec is not None and dtype.kind != "f":
        raise TypeError(f"compression={codec!r} quantises floating-point values; the inputs are {dtype}")
    if seed is not None and not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    return codec, seed


def _result_dtype(op: Op, dtype: np.dtype) -> np.dtype:
    acc = op.accumulator(dtype) or dtype
    return np.true_divide(np.zeros(1, acc), 1).dtype if op.mean else acc


def _lower(plan: SparsePlan, inputs: Sequence[Any], workers: list[str], kernels: ModuleType,
           reduce_kernel: Callable[..., Any], spec: _kernels.SegmentSpec | _blocks.BlockSpec, *, size: int, op: Op,
           in_place: bool, codec: str | None, seed: int | np.integer | None) -> Graph:
    """One task per node and chunk, pinned to its rank's worker (plan ranks
    beyond the inputs are aggregators: ``workers[rank]`` all the same)."""
    owned = owned_inputs(plan, workers, in_place)
    count = contributions(plan)
    encoded = plan.encoded_nodes() if codec else set()

    def task_for(s: Site) -> Task:
        n = s.node
        wire = Wire(codec, None if seed is None else (int(seed), s.chunk, n.id)) if codec and n.id in encoded else None
        if n.kind == VIEW:
            if s.final:
                raise ValueError(f"plan {plan.algorithm!r}: rank {n.rank}'s result is its own input")
            return Task(s.key, kernels.pack, inputs[n.rank], s.start, s.stop, spec, wire)
        if n.kind == REDUCE:
            return Task(s.key, reduce_kernel, spec, op, plan.ranks, count[n.id] == plan.ranks, s.deps, s.picks,
                        owned[n.id], wire, s.final)
        return Task(s.key, kernels.gather, spec, s.deps, s.picks, wire, s.final)

    return lower(plan, workers, size=size, token=keys.new_token(), task_for=task_for,
                 output_for=lambda key, refs, r: Task(key, kernels.output, spec, refs))
