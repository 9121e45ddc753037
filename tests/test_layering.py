"""Layering: planners import without dask or distributed, the builder
without distributed."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCK = "import sys\nfor m in {mods!r}: sys.modules[m] = None\n"


@pytest.mark.parametrize(
    "blocked,imports",
    [
        (["distributed", "dask"], "import flowreduce, flowreduce.algorithms, flowreduce.cost, flowreduce.algorithms.ir; "
                                  "flowreduce.plan('butterfly', 6).check(); flowreduce.choose(6, 1e6)"),
        (["distributed"], "import flowreduce.lower.graph"),
        (["distributed", "dask"], "import flowreduce.grouping, flowreduce.cost; "
                                  "flowreduce.choose(6, 1e6, groups=[[0, 1, 2], [3, 4, 5]]); "
                                  "flowreduce.grouping.Topology.from_addresses(['tcp://a:1'])"),
        (["distributed"], "import flowreduce.cli.calibrate, flowreduce.calibration, flowreduce.cli.bench, flowreduce.cli.trace, "
                          "flowreduce.cli.draw, flowreduce.cli.args, flowreduce.cli.trace_files"),
        (["distributed", "dask"], "import flowreduce.pytree, flowreduce.fusion; "
                                  "flowreduce.fusion.make_buckets([flowreduce.pytree.spec(3)], 0)"),
        (["distributed"], "import flowreduce.lower.buckets, flowreduce.train, flowreduce.cli.train"),
        (["distributed", "dask", "scipy"],
         "import flowreduce.algorithms.sparse, flowreduce.cost; from dataclasses import replace; "
         "[flowreduce.plan(a, 5).check() for a in flowreduce.SPARSE_ALGORITHMS]; "
         "flowreduce.cost.choose_sparse(5, 10**6, 4, [1e-3] * 5).cost(4e6)"),
        (["distributed"], "import flowreduce.lower.sparse"),
        (["distributed", "dask", "bokeh"], "import flowreduce.dashboard"),
        (["bokeh"], "import flowreduce.dashboard.store, flowreduce.dashboard.views, flowreduce.schedule.call"),
    ],
    ids=["planners-without-dask", "builder-without-distributed", "topology-and-cost-without-dask",
         "commands-import-distributed-lazily", "fusion-plan-without-dask",
         "fusion-builder-and-trainer-without-distributed", "sparse-planners-without-dask-or-scipy",
         "sparse-builder-without-distributed", "dashboard-hook-without-distributed-or-bokeh",
         "dashboard-store-without-bokeh"],
)
def test_imports_without(blocked, imports):
    code = BLOCK.format(mods=blocked) + imports + "\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_blocking_really_blocks():
    """The harness above would pass vacuously if blocking did nothing."""
    code = BLOCK.format(mods=["distributed"]) + "import flowreduce.schedule.call"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "distributed" in out.stderr
