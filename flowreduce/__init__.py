"""flowreduce: all-reduce as Dask task graphs.

>>> summed = flowreduce.allreduce(client, parts, op="sum", algorithm="butterfly")  # doctest: +SKIP

The planners (:mod:`flowreduce.algorithms`) are pure Python; the builder
(:mod:`flowreduce.build`) imports dask only; :mod:`flowreduce.schedule` is
the one package that talks to distributed, imported lazily here so that
``import flowreduce`` works without it. Errors: :mod:`flowreduce.errors`.
"""

from __future__ import annotations

from typing import Any

from flowreduce import topology  # callable: flowreduce.topology(client) shows which workers share a host
from flowreduce.algorithms import ALGORITHMS, SPARSE_ALGORITHMS, plan
from flowreduce.algorithms.ir import CostCard, Plan
from flowreduce.cost import CostModel, choose
from flowreduce.errors import AllreduceTimeoutError, FlowreduceError, WorkerLostError
from flowreduce.ops import resolve_op
from flowreduce.reproducible import reference_reduce
from flowreduce.tracing import trace

__all__ = ["ALGORITHMS", "SPARSE_ALGORITHMS", "AllreduceTimeoutError", "CostCard", "CostModel", "FlowreduceError", "Plan",
           "WorkerLostError", "allreduce", "choose", "describe", "plan", "reference_reduce", "resolve_op", "topology",
           "trace"]
__version__ = "0.1.0"


def allreduce(client: Any, inputs: Any, **kwargs: Any) -> list[Any]:
    from flowreduce.schedule.call import allreduce as _allreduce

    return _allreduce(client, inputs, **kwargs)


def describe(futures: Any) -> Any:
    from flowreduce.schedule.call import describe as _describe

    return _describe(futures)


allreduce.__doc__ = ("All-reduce numpy arrays (or pytrees of them) held by futures; "
                     "see flowreduce.schedule.call.allreduce.")
describe.__doc__ = "What the allreduce call that made these futures ran; see flowreduce.schedule.call.describe."
