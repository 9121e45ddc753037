"""``flowreduce draw``: draw an algorithm's plan or its Dask task graph
with :mod:`flowreduce.draw`, or rebuild the gallery in ``graphs/``.

Example::

    flowreduce draw butterfly --ranks 8 -o butterfly-8.svg
    flowreduce draw ring --ranks 4 --chunks 2 --tasks -o ring.svg
    python -m flowreduce.draw --regenerate graphs
"""

from __future__ import annotations

import argparse
import sys

from flowreduce import draw
from flowreduce.algorithms import ALGORITHMS
from flowreduce.algorithms import plan as make_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flowreduce draw``."""
    parser.add_argument("algorithm", nargs="?", choices=[a for a in ALGORITHMS if a != "auto"],
                        help="the algorithm to draw")
    parser.add_argument("--ranks", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--chunks", type=int, default=1, help="chunks the vector is cut into (default 1)")
    parser.add_argument("--radix", type=int, help="butterfly / recursive-doubling: ranks per step group")
    parser.add_argument("--fan-in", type=int, dest="fan_in", help="tree: children per parent")
    parser.add_argument("--tasks", action="store_true", help="draw the Dask task graph instead of the plan")
    parser.add_argument("-o", "--output", help="file to write: .svg, .png, .pdf or .dot "
                        "(default <algorithm>-<ranks>.svg)")
    parser.add_argument("--regenerate", metavar="DIR",
                        help=f"write the whole gallery (DOT, SVG, README.md, {draw.MANIFEST}) into DIR and exit")


def run(args: argparse.Namespace) -> int:
    """Run ``flowreduce draw``; returns the exit status."""
    try:
        if args.regenerate:
            for path in draw.regenerate(args.regenerate):
                print(path)
            return 0
        if not args.algorithm:
            print("flowreduce draw: give an algorithm or --regenerate DIR", file=sys.stderr)
            return 2
        options = {k: v for k, v in (("radix", args.radix), ("fan_in", args.fan_in)) if v is not None}
        p = make_plan(args.algorithm, args.ranks, chunks=args.chunks, **options)
        out = args.output or f"{args.algorithm}-{args.ranks}{'-tasks' if args.tasks else ''}.svg"
        (draw.draw_tasks if args.tasks else draw.draw_plan)(p, out)
    except (ImportError, RuntimeError, ValueError) as e:
        print(f"flowreduce draw: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flowreduce.draw``: the same as ``flowreduce draw``."""
    parser = argparse.ArgumentParser(prog="python -m flowreduce.draw", description=draw.__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
