"""The registry of all-reduce algorithms: one module each, one ``plan``.

Every planner takes the number of ranks and its own keyword options and
returns a :class:`~flowreduce.algorithms.ir.Plan`. Nothing here imports Dask.
The k-ary tree algorithm lives in :mod:`~flowreduce.algorithms.kary_tree`
(registered as ``"tree"``), so that "tree" in a module name never means a
pytree (:mod:`flowreduce.pytree`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from flowreduce.algorithms import (
    block_sparse,
    butterfly,
    direct,
    hierarchical,
    kary_tree,
    recursive_doubling,
    reduce_broadcast,
    ring,
    shm_direct,
    sparse_recursive_doubling,
    sparse_split_allgather,
)
from flowreduce.algorithms.ir import Plan

_PLANNERS: dict[str, Callable[..., Plan]] = {
    m.NAME: m.plan for m in (reduce_broadcast, kary_tree, recursive_doubling, butterfly, ring, hierarchical, shm_direct,
                             direct)
}
_SPARSE_PLANNERS: dict[str, Callable[..., Plan]] = {
    m.NAME: m.plan for m in (sparse_recursive_doubling, sparse_split_allgather, block_sparse)
}

#: Registered algorithm names, plus ``"auto"`` (chosen by the cost model).
ALGORITHMS: tuple[str, ...] = (*_PLANNERS, "auto")
#: Algorithms that move only non-zeros (:mod:`flowreduce.algorithms.sparse`, docs/sparse.md): the first two
#: take scipy.sparse inputs, ``block-sparse`` dense numpy inputs with zero blocks.
SPARSE_ALGORITHMS: tuple[str, ...] = tuple(_SPARSE_PLANNERS)


def plan(algorithm: str, ranks: int, chunks: int = 1, **options: Any) -> Plan:
    """The pure plan of ``algorithm`` over ``ranks`` ranks and ``chunks``
    independent chunks, with its cost card (``plan(...).cost(nbytes)``).

    Raises
    ------
    ValueError
        Unknown algorithm (the message lists the valid names), fewer than
        one rank or chunk, or an option the algorithm does not take.
    """
    if algorithm == "auto":
        raise ValueError("plan() needs a concrete algorithm; use flowreduce.choose() for 'auto'")
    if algorithm not in _PLANNERS and algorithm not in _SPARSE_PLANNERS:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS + SPARSE_ALGORITHMS)}"
        )
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"an all-reduce needs at least one rank, got {ranks!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    frozen = frozen_options(options)
    try:
        hash(frozen)
    except TypeError:  # an option we cannot key a cache on: plan afresh
        return _build(algorithm, ranks, options).with_chunks(chunks)
    return _base_plan(algorithm, ranks, frozen).with_chunks(chunks)


def parse_spec(text: str) -> tuple[str, dict[str, Any]]:
    """An algorithm and its options from one command-line word:
    ``NAME[:OPTION=VALUE]...``, e.g. ``butterfly:radix=4``, ``tree:fan_in=4``,
    ``hierarchical:group_size=2``. Values are ints, floats or strings;
    ``-`` in an option name reads as ``_``.

    Raises
    ------
    ValueError
        Unknown algorithm (listing the valid names), a part without ``=``,
        an option the algorithm does not take (listing those it does), or
        options on ``auto``.
    """
    name, *parts = text.strip().split(":")
    valid = (*ALGORITHMS, *SPARSE_ALGORITHMS)
    if name not in valid:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(valid)}")
    options: dict[str, Any] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"{text!r}: expected OPTION=VALUE after {name!r}, got {part!r}")
        options[key.strip().replace("-", "_")] = _scalar(value.strip())
    if options:
        if name == "auto":
            raise ValueError(f"{text!r}: options need a named algorithm, not 'auto'")
        takes = [k for k, prm in inspect.signature(_PLANNERS.get(name) or _SPARSE_PLANNERS[name]).parameters.items()
                 if prm.kind is prm.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise ValueError(f"{text!r}: {name} takes no option {', '.join(unknown)}; "
                             f"it takes: {', '.join(takes) or 'none'}")
    return name, options


def format_spec(algorithm: str, options: dict[str, Any]) -> str:
    """The inverse of :func:`parse_spec`: ``butterfly:radix=4``."""
    return ":".join([algorithm, *(f"{k}={v}" for k, v in options.items())])


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def frozen_options(value: Any) -> Any:
    """A hashable copy of planner options (lists of groups become tuples): plans and p2p specs key caches by it."""
    if isinstance(value, dict):
        return tuple(sorted((k, frozen_options(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(frozen_options(v) for v in value)
    return value


@functools.lru_cache(maxsize=256)
def _base_plan(algorithm: str, ranks: int, options: tuple) -> Plan:
    """Plans are pure and immutable, and the cost model asks for the same
    ones on every call: build each (algorithm, ranks, options) once."""
    return _build(algorithm, ranks, {k: _thawed(v) for k, v in options})


def _build(algorithm: str, ranks: int, options: dict) -> Plan:
    try:
        return (_PLANNERS.get(algorithm) or _SPARSE_PLANNERS[algorithm])(ranks, **options)
    except TypeError as e:
        raise ValueError(f"bad option for algorithm {algorithm!r}: {e}") from None


def _thawed(value: Any) -> Any:
    return [_thawed(v) for v in value] if isinstance(value, tuple) else value
