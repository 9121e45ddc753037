"""The ``flowreduce`` command. Each subcommand lives in its own module with
``add_arguments(parser)`` and ``run(args) -> int``; this file only routes."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "bench": ("flowreduce.cli.bench", "sweep sizes and algorithms against the hand-written baseline"),
    "trace": ("flowreduce.cli.trace", "run one all-reduce and write its trace, pictures and summary"),
    "draw": ("flowreduce.cli.draw", "draw an algorithm's plan or its Dask task graph"),
    "calibrate": ("flowreduce.cli.calibrate", "measure latency and bandwidth of each link class; write a cost model file"),
    "train": ("flowreduce.cli.train", "data-parallel training of a numpy MLP on digits, one all-reduce per step"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowreduce", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ImportError as e:  # a subcommand whose optional parts are missing still lists
            p.set_defaults(_import_error=e)
    args = parser.parse_args(argv)
    if getattr(args, "_import_error", None):
        parser.error(f"{args.command} is unavailable: {args._import_error}")
    return importlib.import_module(args._module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
