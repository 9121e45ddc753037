"""Command-line helpers shared by several ``flowreduce`` commands: an
algorithm spec from ``--algorithm NAME:OPTION=VALUE``, and the
``--cost-model`` option. The cluster options live with the launcher
(:func:`flowreduce.launch.add_cluster_arguments`), which maps them to
dask-jobqueue keywords."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowreduce.cost import CostModel


def spec_from_arg(text: str) -> tuple[str, dict[str, Any]]:
    """An algorithm and its options from the command line
    (:func:`flowreduce.algorithms.parse_spec`); a bad name or option exits
    with the message naming it, before any cluster starts."""
    from flowreduce.algorithms import parse_spec

    try:
        return parse_spec(text)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def add_cost_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost-model", metavar="PATH", help="a cost model file written by `flowreduce calibrate` "
                   "(default: the dask config key flowreduce.cost-model, else the built-in constants)")


def model_from_args(args: argparse.Namespace) -> CostModel | None:
    """The :class:`CostModel` named by ``--cost-model``, or None (the configured default)."""
    from flowreduce.cost import CostModel

    return CostModel.from_file(args.cost_model) if getattr(args, "cost_model", None) else None
