"""Data-parallel training: same weights as single-process training on the
global batch for every algorithm, the reference and data-parallel training
through flowreduce reach the accuracy, the straggler option delays the named
rank (seen in a trace), the command runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from utils import cli_args, workers_of

import flowreduce
from flowreduce.tracing.registry import lookup
from flowreduce.train import DataParallel, TrainConfig, timing, train_reference
from flowreduce.train.config import parse_straggler

SMALL = dict(hidden=(16, 8), batch=8, dtype="float64", epochs=1, lr=0.1, momentum=0.9)


def run_steps(client, config: TrainConfig, steps: int) -> DataParallel:
    dp = DataParallel(client, config, workers_of(client)[:config.ranks])
    for i in range(steps):
        dp.step(0, i)
    dp.finish()
    return dp


def assert_same_weights(got, want, rtol=1e-9, atol=1e-12):
    assert len(got) == len(want)
    for layer, (g, w) in enumerate(zip(got, want)):
        for k in ("W", "b"):
            np.testing.assert_allclose(g[k], w[k], rtol=rtol, atol=atol, err_msg=f"layer {layer} {k}")


#: One in-process host would make hierarchical its flat inner algorithm: two "hosts" of 2 ranks.
OPTIONS = {"hierarchical": {"group_size": 2}}


def plans_ran(dp: DataParallel) -> list:
    return [lookup(t).plan for rec in dp.steps for t in rec.tokens]


@pytest.mark.parametrize("algorithm", [a for a in flowreduce.ALGORITHMS])
def test_same_weights_as_single_process(inproc_client, algorithm):
    config = TrainConfig(ranks=4, algorithm=algorithm, bucket_bytes=600, options=OPTIONS.get(algorithm, {}),
                         **SMALL)  # several buckets
    dp = run_steps(inproc_client, config, 2)  # the second step uses the momentum
    plans = plans_ran(dp)
    assert len(plans) > 2 and all(p.algorithm != "auto" for p in plans)
    if algorithm != "auto":
        assert {p.algorithm for p in plans} == {algorithm}
    if algorithm == "hierarchical":
        assert all(p.options["groups"] == [[0, 1], [2, 3]] for p in plans)
    want = train_reference(config, steps=2)["params"]
    for r in range(config.ranks):
        assert_same_weights(dp.weights(r), want)
    assert not np.allclose(want[0]["W"], train_reference(config, steps=0)["params"][0]["W"])  # it did train


@pytest.mark.parametrize("mode", [dict(overlap=False), dict(bucket_bytes=0), dict(ranks=3, algorithm="butterfly"),
                                  dict(dtype="float32")],
                         ids=["no-overlap", "unfused", "three-ranks", "float32"])
def test_same_weights_in_every_mode(inproc_client, mode):
    kw = {**SMALL, "algorithm": "ring", "ranks": 4, **mode}
    config = TrainConfig(**kw)
    dp = run_steps(inproc_client, config, 2)
    tol = dict(rtol=1e-4, atol=1e-6) if config.dtype == "float32" else {}
    assert_same_weights(dp.weights(config.ranks - 1), train_reference(config, steps=2)["params"], **tol)


def test_reference_reaches_the_accuracy():
    from flowreduce.train import data, mlp

    config = TrainConfig(ranks=4, epochs=20)  # the command's defaults
    params = train_reference(config)["params"]
    _, _, Xt, yt = data.load_digits(config.seed, dtype=config.dtype)
    _, acc = mlp.evaluate(params, Xt, yt)
    assert acc > 0.95


def test_data_parallel_reaches_the_accuracy(inproc_client):
    """The command's defaults (auto, one 25 MiB bucket, overlap, float32) on
    4 ranks through flowreduce: past 95% test accuracy within 4 epochs (88
    steps; the reference gets 97.8% there). About 25 s on the shared 2-core
    machine."""
    config = TrainConfig(ranks=4, epochs=4)
    dp = DataParallel(inproc_client, config, workers_of(inproc_client)[:4])
    for epoch in range(config.epochs):
        dp.run_epoch(epoch)
    dp.finish()
    assert len(dp.steps) == 88
    metrics = dp.evaluate()
    assert metrics["test_acc"] > 0.95, metrics


def test_straggler_delays_the_named_rank(proc_client):
    # 1.2 s, not less: late in a full CI run on 2 cores, ranks 0 and 1 were
    # once each seen 0.6 s late in some buckets (the other tests' load)
    delay = 1.2
    config = TrainConfig(ranks=4, algorithm="ring", straggler=(2, delay), bucket_bytes=600, **SMALL)
    ws = workers_of(proc_client)
    dp = DataParallel(proc_client, config, ws[:4])
    dp.step(0, 0)
    dp.finish()
    with flowreduce.trace(proc_client) as tr:
        dp.step(0, 1)
        dp.finish()
    first = [e for e in tr.events if e.phase == "user-compute" and "train-grad" in e.key
             and e.key.endswith(f", {dp.layers - 1})")]
    by_rank = {ws.index(e.worker): e.duration for e in first}
    assert set(by_rank) == {0, 1, 2, 3}
    assert by_rank[2] >= delay and all(by_rank[r] < delay for r in (0, 1, 3)), by_rank
    # every bucket all-reduce of those steps saw rank 2's input last
    late = {max(range(4), key=lambda r: ready[r]) for ready in tr.input_ready.values() if None not in ready}
    assert late == {2}


def test_command_trains_and_writes(proc_client, tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "flowreduce", "train", "--ranks", "2", "--epochs", "1", "--hidden", "8",
           "--batch-size", "128", "--bucket-bytes", "1kB", "--scheduler", proc_client.scheduler.address,
           "--trace", str(tmp_path / "trace"), "--trace-steps", "1", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "epoch   1" in run.stdout and "test acc" in run.stdout and "compute" in run.stdout
    report = json.loads(out.read_text())
    steps = report["epochs"][0]["steps"]
    assert len(steps) == 5  # 718 samples per rank // 128
    for s in steps:
        assert s["compute"] > 0 and s["compute"] + s["comm"] == pytest.approx(s["seconds"])
    names = {p.name for p in (tmp_path / "trace").iterdir()}
    assert {"trace.json", "trace.csv", "steps.png", "steps.svg", "timeline.png"} <= names


def test_elastic_command_trains_and_writes(proc_client, tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "flowreduce", "train", "--elastic", "--max-ranks", "2", "--ranks", "2", "--epochs", "1",
           "--hidden", "8", "--batch-size", "128", "--scheduler", proc_client.scheduler.address, "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "elastic training" in run.stdout and "epoch   1" in run.stdout and "final test accuracy" in run.stdout
    report = json.loads(out.read_text())
    assert [e["ranks"] for e in report["epochs"]] == [2] and report["changes"] == []


def test_finish_waits_for_the_step_records(inproc_client):
    """A step's ``done`` is set by done callbacks on the client's single
    callback thread; held up there, they used to run after ``finish``
    returned, and the step read as -perf_counter() seconds long."""
    from distributed import Future

    dp = DataParallel(inproc_client, TrainConfig(ranks=4, algorithm="ring", **SMALL), workers_of(inproc_client)[:4])
    inproc_client.submit(int, 0).add_done_callback(lambda f: None)  # dask makes its callback thread on first use
    gate = threading.Event()
    Future._cb_executor.submit(gate.wait, 10)  # queued before the step: all its callbacks wait behind this
    threading.Timer(1.0, gate.set).start()
    dp.step(0, 0)
    dp.finish()
    assert dp.steps[0].done > dp.steps[0].submitted


def test_step_breakdown_takes_the_busiest_rank():
    tok = "abc"
    rec = [SimpleNamespace(step=0, epoch=0, submitted=0.0, done=1.0, tokens=("t0",)),
           SimpleNamespace(step=1, epoch=0, submitted=0.5, done=1.5, tokens=("t1",))]
    trainer = SimpleNamespace(token=tok, workers=["w0", "w1"], steps=rec)

    def task(key, worker, seconds):
        return {"key": key, "worker": worker, "startstops": [{"action": "compute", "start": 0.0, "stop": seconds},
                                                             {"action": "transfer", "start": 0.0, "stop": 9.0}]}

    records = [task((f"train-forward-{tok}", 1, 0), "w0", 0.1), task((f"train-grad-{tok}", 1, 0, 0), "w0", 0.1),
               task((f"train-forward-{tok}", 1, 1), "w1", 0.3),
               task(("flowreduce-ring-reduce-t1", 0, 1, 0, 3), "w1", 0.05)]
    (t,) = timing.breakdown(records, trainer, rec[1:])
    assert t.seconds == pytest.approx(0.5) and t.compute == pytest.approx(0.3)
    assert t.comm == pytest.approx(0.2) and t.allreduce_work == pytest.approx(0.05)


@pytest.mark.parametrize("text,want", [("2:0.05", (2, 0.05)), ("1", (1, 0.1)), (None, None)])
def test_parse_straggler(text, want):
    assert parse_straggler(text) == want


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="RANK:SECONDS"):
        parse_straggler("two:1")
    with pytest.raises(ValueError, match="straggler rank 5 is not one of the 4 ranks"):
        TrainConfig(ranks=4, straggler=(5, 0.1))


def test_missing_scikit_learn_says_how_to_install():
    code = ("import sys; sys.modules['sklearn'] = None\n"
            "from flowreduce.train.data import load_digits\n"
            "try:\n    load_digits()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install 'flowreduce[train]'" in out.stdout, out.stderr


def test_command_line_algorithm_options_reach_the_config():
    from flowreduce.cli import train as cli

    config = cli.config_from_args(cli_args(cli, "--algorithm", "hierarchical:group_size=2:inner=ring"))
    assert (config.algorithm, config.options) == ("hierarchical", {"group_size": 2, "inner": "ring"})
    with pytest.raises(SystemExit, match="unknown algorithm 'rng'"):
        cli.config_from_args(cli_args(cli, "--algorithm", "rng"))


@pytest.mark.parametrize("argv, message", [
    (("--framework", "torch", "--elastic", "--trace", "out"), "--trace is not supported with --elastic"),
    (("--save", "model.pt"), "--save saves a torch model"),
])
def test_command_line_refuses_options_its_trainer_would_ignore(no_cluster, argv, message):
    from flowreduce.cli import train as cli

    with pytest.raises(SystemExit, match=message):
        cli.run(cli_args(cli, *argv))


# -- elastic training (issue #15) -------------------------------------------------------------------


def test_elastic_run_loses_a_worker_grows_again_and_reaches_the_accuracy():
    """4 ranks on a LocalCluster with nannies: the worker of rank 1 is
    SIGKILLed when plan step 1 of step KILL's all-reduce reaches it (FailAt,
    no sleeps); the run goes on on 3 ranks, and at step GROW a fifth worker is
    added and both it and the killed worker's restarted process join. At the
    end: the accuracy target of the numpy study, every rank's weights and
    momentum bitwise identical, no flowreduce key left."""
    import gc

    import faults
    from distributed import Client, LocalCluster
    from utils import assert_clean

    from flowreduce.train.loop import ElasticDataParallel

    KILL, GROW = 10, 30
    with LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ws = sorted(client.nthreads())
        # the killed worker's nanny restarts it at once: keep it out until GROW
        dp = ElasticDataParallel(client, TrainConfig(ranks=4, epochs=4, algorithm="butterfly"), ws, max_ranks=4)
        committed = lambda: sum(not s.failed for s in dp.steps)  # noqa: E731

        def on_step(rec):
            if committed() == KILL:
                dp.membership.max_ranks = 3
                faults.fail_at(client, rank=1, step=1, action="kill")
            elif committed() == GROW:
                cluster.scale(5)
                client.wait_for_workers(5, timeout=120)
                dp.membership.max_ranks = None

        dp.train(on_step)
        (key, killed), = faults.fired(client)
        assert killed == ws[1]
        history = [(step, c.before, c.after) for step, c in dp.membership.history]
        assert history[0] == (KILL, tuple(ws), (ws[0], ws[2], ws[3])), history
        assert history[1][0] == GROW and history[1][2][:3] == (ws[0], ws[2], ws[3]) and len(history[1][2]) == 5
        assert len(history) == 2, history
        failed = [s for s in dp.steps if s.failed]
        assert [(s.ranks, s.step) for s in failed] == [(4, KILL)]  # the step that lost the worker, re-run
        assert {s.ranks for s in dp.steps if not s.failed} == {4, 3, 5}
        metrics = dp.evaluate()
        assert metrics["test_acc"] > 0.95, metrics
        states = client.gather([client.submit(lambda s: s, x, workers=[w], pure=False)
                                for x, w in zip(dp.state, dp.workers)])
        assert len(states) == 5
        for r, st in enumerate(states[1:], 1):
            for part in ("params", "velocity"):
                for layer, (a, b) in enumerate(zip(states[0][part], st[part])):
                    for k in ("W", "b"):
                        assert np.array_equal(a[k], b[k]), f"rank {r} {part} layer {layer} {k} differs from rank 0"
        faults.disarm(client)
        dp.close()
        del states
        gc.collect()
        assert_clean(client)
