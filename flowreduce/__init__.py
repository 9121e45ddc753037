"""flowreduce: all-reduce as Dask task graphs.

>>> summed = flowreduce.allreduce(client, parts, op="sum", algorithm="butterfly")  # doctest: +SKIP

The planners (:mod:`flowreduce.algorithms`) are pure Python; the builder
(:mod:`flowreduce.lower`) imports dask only; :mod:`flowreduce.schedule` is
the one package that talks to distributed, imported lazily here so that
``import flowreduce`` works without it. Errors: :mod:`flowreduce.errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowreduce.algorithms import ALGORITHMS, SPARSE_ALGORITHMS, plan
from flowreduce.algorithms.ir import CostCard, Plan
from flowreduce.cost import CostModel, choose
from flowreduce.errors import AllreduceTimeoutError, FlowreduceError, WorkerLostError
from flowreduce.grouping import Topology, by_host, by_name_prefix, by_resource
from flowreduce.ops import resolve_op
from flowreduce.reproducible import reference_reduce
from flowreduce.tracing import trace

if TYPE_CHECKING:  # for type checkers; at run time see __getattr__ below
    from flowreduce.schedule.call import allreduce, describe
    from flowreduce.schedule.hosts import topology
    from flowreduce.schedule.placement import rank_groups
    from flowreduce.spmd import spmd

__all__ = ["ALGORITHMS", "SPARSE_ALGORITHMS", "AllreduceTimeoutError", "CostCard", "CostModel", "FlowreduceError", "Plan",
           "Topology", "WorkerLostError", "allreduce", "by_host", "by_name_prefix", "by_resource", "choose", "describe", "plan",
           "rank_groups", "reference_reduce", "resolve_op", "spmd", "topology", "trace"]
__version__ = "0.1.0"


_LAZY = {"allreduce", "describe", "topology", "rank_groups", "spmd"}  # from flowreduce.schedule (spmd: flowreduce.spmd), when first asked for


def __getattr__(name: str) -> Any:
    """``flowreduce.allreduce``, ``describe``, ``topology`` and
    ``rank_groups`` are the real functions of :mod:`flowreduce.schedule`
    (their signature and docstring), imported on first use (PEP 562) so
    that ``import flowreduce`` does not import distributed."""
    if name == "spmd":  # the package, callable as its function spmd (and flowreduce.spmd.collect ...)
        import flowreduce.spmd as package

        globals()[name] = package
        return package
    if name in _LAZY:
        from flowreduce.schedule import call, hosts, placement

        value = getattr(hosts if name == "topology" else placement if name == "rank_groups" else call, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flowreduce' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
