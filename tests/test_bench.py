"""``flowreduce bench``: rows, JSON, the baseline and ``--trace DIR``, run
for real against the multi-process cluster."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from utils import cli_args

from flowreduce.cli import bench

_args = functools.partial(cli_args, bench)


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_check_accepts_the_reduction_and_rejects_anything_else(op):
    ranks, n = 3, 11
    xs = [bench.make_input(n, r, "int64") for r in range(ranks)]
    ref = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}[op](np.stack(xs), axis=0)
    assert bench.check(ref, n, ranks, "int64", op)
    wrong = ref.copy()
    wrong[4] += 1
    assert not bench.check(wrong, n, ranks, "int64", op)
    assert not bench.check(ref[:-1], n, ranks, "int64", op)


def test_sizes_parse_and_sweep():
    assert bench.parse_sizes("1e3, 1001,") == [1000, 1001]
    assert bench.sweep_sizes(1e3, 1e5, 10) == [1000, 10000, 100000]


def test_bench_rows_json_and_traces(proc_client, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_json, trace_dir = tmp_path / "rows.json", tmp_path / "traces"
    args = _args("--scheduler", proc_client.scheduler.address, "--sizes", "1000,20001",
                 "--algorithms", "ring,auto", "--repeat", "2", "--warmup", "1", "--no-progress",
                 "--json", str(out_json), "--trace", str(trace_dir))
    assert bench.run(args) == 0
    rows = json.loads(out_json.read_text())
    got = {(r["size"], r["algorithm"]) for r in rows}
    assert got == {(n, a) for n in (1000, 20001) for a in ("ring", "auto", bench.BASELINE)}
    for r in rows:
        assert r["correct"] and len(r["times"]) == 2
        assert r["median"] == pytest.approx(float(np.median(r["times"])))
        assert r["speedup"] == pytest.approx(next(
            b["median"] for b in rows if b["size"] == r["size"] and b["algorithm"] == bench.BASELINE) / r["median"])
        # one trace directory per row, with the Perfetto JSON naming what ran
        d = trace_dir / f"{r['size']}-{r['algorithm']}-auto"
        assert r["trace"] == str(d)
        events = json.loads((d / "trace.json").read_text())["traceEvents"]
        assert events and (d / "trace.csv").stat().st_size > 0 and (d / "timeline.png").stat().st_size > 0
        if r["algorithm"] != bench.BASELINE:  # only flowreduce calls have a summary against the plan
            assert json.loads((d / "summary.json").read_text())["algorithm"] == r["plan"].split("'")[1]
    printed = capsys.readouterr().out
    for n in (1000, 20001):  # the summary line names the fastest flowreduce row
        fastest = min((r for r in rows if r["size"] == n and r["algorithm"] != bench.BASELINE),
                      key=lambda r: r["median"])
        assert f"# size {n}: best {fastest['algorithm']} {fastest['median'] * 1e3:.2f} ms" in printed


def test_bench_sweeps_rank_counts_and_dtypes(proc_client, tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    args = _args("--scheduler", proc_client.scheduler.address, "--sizes", "1001", "--ranks", "2,3",
                 "--dtype", "int32,float32", "--algorithms", "butterfly", "--repeat", "1", "--warmup", "0",
                 "--no-progress", "--json", str(out_json))
    assert bench.run(args) == 0
    rows = json.loads(out_json.read_text())
    got = sorted((r["ranks"], r["dtype"], r["algorithm"]) for r in rows)
    assert got == sorted((p, d, a) for p in (2, 3) for d in ("int32", "float32")
                         for a in ("butterfly", bench.BASELINE))
    assert all(r["correct"] and r["nbytes"] == 1001 * np.dtype(r["dtype"]).itemsize for r in rows)
    printed = capsys.readouterr().out
    for p in (2, 3):
        for d in ("int32", "float32"):
            assert f"# {p} ranks, {d}" in printed
            assert f"# size 1001 ({p} ranks, {d}): best butterfly" in printed




def test_bench_runs_algorithm_options(proc_client, tmp_path):
    """``--algorithms`` takes ``NAME:OPTION=VALUE``: each spec is its own row,
    and the plan that ran has the option."""
    out_json = tmp_path / "rows.json"
    specs = ["butterfly", "butterfly:radix=4", "tree:fan_in=3"]
    args = _args("--scheduler", proc_client.scheduler.address, "--sizes", "1001", "--algorithms", ",".join(specs),
                 "--repeat", "1", "--warmup", "0", "--no-progress", "--no-baseline", "--json", str(out_json))
    assert bench.run(args) == 0
    rows = {r["algorithm"]: r for r in json.loads(out_json.read_text())}
    assert sorted(rows) == sorted(specs) and all(r["correct"] for r in rows.values())
    assert "radix=2," in rows["butterfly"]["plan"] and "radix=4," in rows["butterfly:radix=4"]["plan"]
    assert "fan_in=3," in rows["tree:fan_in=3"]["plan"]


@pytest.mark.parametrize("argv,error,message", [
    (["--dtype", "float64,nodtype"], TypeError, "nodtype"),
    (["--algorithms", "butterfly:radx=4"], SystemExit, "takes no option radx"),
    (["--algorithms", "sparse-recursive-doubling"], SystemExit, "bench runs dense algorithms"),
])
def test_bench_rejects_bad_arguments_before_starting(no_cluster, argv, error, message):
    with pytest.raises(error, match=message):
        bench.run(_args("--sizes", "10", "--no-progress", *argv))


def test_bench_refuses_to_time_inputs_that_are_not_only_on_their_workers(proc_client):
    """A copy of a rank's input on another worker would let a run start
    ahead: the bench checks before the clock starts."""
    from distributed import wait

    workers = sorted(proc_client.nthreads())[:2]
    inputs = [proc_client.submit(bench.make_input, 10, r, "float64", workers=[w], pure=False)
              for r, w in enumerate(workers)]
    wait(inputs)
    bench.check_placed(proc_client, inputs, workers)  # each on its own worker: fine
    proc_client.replicate([inputs[1]], workers=workers)
    with pytest.raises(RuntimeError, match="input of rank 1 is on"):
        bench.check_placed(proc_client, inputs, workers)


def test_bench_stops_naming_a_worker_that_left_instead_of_waiting_for_it():
    """Inputs are pinned to the workers the ranks were given: a worker lost
    mid-benchmark (e.g. killed out of memory) must stop the bench with its
    name, not leave the next inputs waiting for it forever."""
    from types import SimpleNamespace

    client = SimpleNamespace(nthreads=lambda: {"tcp://a:1": 1, "tcp://c:3": 1})
    bench.check_workers(client, ["tcp://a:1", "tcp://c:3"])
    with pytest.raises(RuntimeError, match="tcp://b:2 left the cluster"):
        bench.check_workers(client, ["tcp://a:1", "tcp://b:2", "tcp://c:3"])
