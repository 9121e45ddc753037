"""flowreduce on a real SLURM through ``flowreduce.launch``: two batch jobs
of two worker processes each, every dense algorithm checked against numpy,
hierarchical groups following the jobs; a request the queue cannot satisfy
times out naming the pending job and why; the commands end normally, on
SIGINT and on SIGTERM; an exception inside the block.

Every test checks that flowreduce released its jobs by itself: squeue has
none of them left *before* any test-side ``scancel`` (that only cleans up
after a failed check), and each job's log says slurmstepd cancelled it, which
tells a release apart from workers that exit on their own once the
scheduler's process is gone.

Needs the single-machine SLURM of ``tests/infra/slurm/up.sh`` (``.ci/run``
starts it); skips with the reason otherwise."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from utils import terminal_signals, wait_until

import flowreduce
from flowreduce import launch
from hpc.conftest import REPO_ROOT, _cancelled, _gone, _job_ids_in_logs, _jobs, _leftovers_cancelled


def _options(tmp_path, name: str, **extra) -> dict:
    return dict(cores=2, processes=2, memory="2GB", walltime="00:10:00", interface="lo", job_name=name,
                log_directory=str(tmp_path / "logs"), local_directory=str(tmp_path / "space"),
                job_script_prologue=[f"export PYTHONPATH={REPO_ROOT}"], **extra)


def _assert_released(name: str, ids: list[str], logs, what: str) -> None:
    """The jobs named ``name`` left squeue, and by ``scancel``."""
    left = _gone(name)
    assert left == [], f"jobs left in squeue {what}: {left}"
    assert ids, "no job id found for this test"
    cancelled = _cancelled(logs, ids)
    assert all(cancelled.values()), f"jobs that ended without being cancelled {what}: {cancelled}"


def _cli(name: str, tmp_path, *args: str, defaults: bool = False) -> list[str]:
    """``python -m flowreduce ARGS`` on two SLURM jobs of two workers;
    ``defaults``: without --interface and --log-directory (TLS is on unless
    ARGS say --no-tls)."""
    return [sys.executable, "-m", "flowreduce", *args, "--cluster", "slurm", "--jobs", "2", "--cores", "2",
            "--processes", "2", "--memory", "2GB", "--walltime", "00:10:00", "--job-name", name,
            "--prologue", f"export PYTHONPATH={REPO_ROOT}", "--wait-timeout", "120",
            *([] if defaults else ["--interface", "lo", "--log-directory", str(tmp_path / "logs")])]


def test_every_algorithm_across_two_jobs(dask_jobqueue, tmp_path):
    from distributed import wait

    name = f"flowreduce-ar-{uuid.uuid4().hex[:8]}"
    try:
        with launch.cluster("slurm", jobs=2, timeout=120, progress=False, **_options(tmp_path, name)) as client:
            ids = [jid for jid, _ in _jobs(name)]
            workers = launch.ranked_workers(client)
            assert len(workers) == 4
            jobs = client.run(lambda: __import__("os").environ["SLURM_JOB_ID"])
            assert sorted(set(jobs.values())) == sorted(ids)
            # ranked_workers keeps each job's workers together
            assert [jobs[w] for w in workers] in ([jobs[workers[0]]] * 2 + [jobs[workers[2]]] * 2,)
            assert jobs[workers[0]] != jobs[workers[2]]
            rng = np.random.default_rng(7)
            arrays = [rng.integers(-1000, 1000, size=1001) for _ in workers]
            expected = np.sum(arrays, axis=0)
            inputs = [client.scatter(a, workers=[w], hash=False) for a, w in zip(arrays, workers)]
            for algorithm in flowreduce.ALGORITHMS:
                out = flowreduce.allreduce(client, inputs, algorithm=algorithm)
                wait(out)
                for r, f in enumerate(out):
                    assert client.who_has([f])[f.key] == (workers[r],), algorithm
                    np.testing.assert_array_equal(f.result(), expected, err_msg=algorithm)
                if algorithm == "hierarchical":  # the groups are the nodes (each job on its own node)
                    assert flowreduce.describe(out).plan.options["groups"] == [[0, 1], [2, 3]]
                del out
            del inputs
        _assert_released(name, ids, tmp_path / "logs", "after the cluster closed")
    finally:
        _leftovers_cancelled(name)


def test_error_inside_the_block_releases_the_jobs(dask_jobqueue, tmp_path):
    """An exception raised inside ``with launch.cluster(...)`` propagates
    unchanged, and the jobs are cancelled on the way out."""

    class Failure(Exception):
        pass

    name = f"flowreduce-err-{uuid.uuid4().hex[:8]}"
    ids: list[str] = []
    try:
        with pytest.raises(Failure, match="inside the block"):
            with launch.cluster("slurm", jobs=2, timeout=120, progress=False, **_options(tmp_path, name)) as client:
                ids = [jid for jid, state in _jobs(name) if state == "RUNNING"]
                assert len(ids) == 2 and len(client.nthreads()) == 4
                raise Failure("inside the block")
        _assert_released(name, ids, tmp_path / "logs", "after an exception inside the block")
    finally:
        _leftovers_cancelled(name)


def test_unsatisfiable_request_times_out_with_the_queue_reason(dask_jobqueue, tmp_path):
    name = f"flowreduce-pend-{uuid.uuid4().hex[:8]}"
    # a job not allowed to start for an hour stays PENDING with reason BeginTime
    opts = _options(tmp_path, name, job_extra_directives=["--begin=now+1hour"])
    try:
        with pytest.raises(TimeoutError) as caught:
            with launch.cluster("slurm", jobs=1, timeout=8, progress=False, **opts):
                pass  # pragma: no cover - must not be reached
        msg = str(caught.value)
        assert "0 of 2 workers up" in msg and "PENDING" in msg and "BeginTime" in msg, msg
        # a job that never ran has no log to say it was cancelled: squeue is the witness
        left = _gone(name)
        assert left == [], f"the pending job was not released after the timeout: {left}"
    finally:
        _leftovers_cancelled(name)


@pytest.mark.timeout(900)  # the command may take up to 600 s
def test_cli_bench_on_slurm(dask_jobqueue, tmp_path):
    """``flowreduce bench --cluster slurm`` with the defaults: correct rows,
    TLS (the workers' own logs say they registered with the tls:// scheduler
    the command named), the dashboard on 127.0.0.1, the jobs' logs in a
    directory of the run under the user's cache that the command names at
    the end, nothing written to the working directory, jobs released."""
    name = f"flowreduce-cli-{uuid.uuid4().hex[:8]}"
    cmd = _cli(name, tmp_path, "bench", defaults=True) + [
        "--sizes", "1000", "--algorithms", "butterfly,hierarchical", "--repeat", "1", "--warmup", "0",
        "--no-progress", "--json", str(tmp_path / "rows.json")]
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd,
                             env={**os.environ, "XDG_CACHE_HOME": str(cache)})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "4 ranks on 4 workers" in out.stdout
        rows = json.loads((tmp_path / "rows.json").read_text())
        assert {r["algorithm"] for r in rows} == {"butterfly", "hierarchical", "baseline"}
        assert all(r["correct"] for r in rows)
        hier = next(r for r in rows if r["algorithm"] == "hierarchical")
        assert "groups=[[0, 1], [2, 3]]" in hier["plan"]

        scheduler = re.search(r"^flowreduce: scheduler (\S+); dashboard http://127\.0\.0\.1:(\d+)/status "
                              r"\(from your machine: ssh -L (\d+):127\.0\.0\.1:(\d+) ", out.stderr, re.M)
        assert scheduler, out.stderr
        address, port = scheduler.group(1), scheduler.group(2)
        assert address.startswith("tls://") and scheduler.group(3) == scheduler.group(4) == port, out.stderr
        named = re.findall(r"^flowreduce: the batch jobs' logs are in (\S+)$", out.stderr, re.M)
        assert len(named) == 1, out.stderr
        logs = Path(named[0])
        assert logs.parent == cache / "flowreduce" / "jobs", logs
        ids = _job_ids_in_logs(logs)
        assert len(ids) == 2, sorted(p.name for p in logs.iterdir())
        for log in logs.glob("*.err"):  # four workers, each registered over TLS with the scheduler named
            assert len(re.findall(rf"Registered to: +{re.escape(address)}$", log.read_text(), re.M)) == 2, \
                log.read_text()[-3000:]
        _assert_released(name, ids, logs, "after the command ended")
        assert list(cwd.iterdir()) == []  # no slurm-<id>.out, no certificate
        assert list((cache / "flowreduce" / "tls").iterdir()) == []  # the run's certificates are gone
    finally:
        _leftovers_cancelled(name)


@pytest.mark.timeout(900)  # the command may take up to 600 s
def test_cli_train_on_slurm(dask_jobqueue, tmp_path):
    """``flowreduce train`` takes the same cluster options: one epoch of the
    digits MLP on 4 ranks in 2 SLURM jobs learns (far above chance) and
    leaves no job behind."""
    pytest.importorskip("sklearn", reason="flowreduce train needs scikit-learn: pip install 'flowreduce[train]'")
    name = f"flowreduce-train-{uuid.uuid4().hex[:8]}"
    cmd = _cli(name, tmp_path, "train") + ["--ranks", "4", "--epochs", "1", "--json", str(tmp_path / "train.json")]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads((tmp_path / "train.json").read_text())
        assert report["config"]["ranks"] == 4
        assert report["final"]["test_acc"] > 0.5  # ten classes: chance is 0.1
        _assert_released(name, _job_ids_in_logs(tmp_path / "logs"), tmp_path / "logs",
                         "after the command ended")
    finally:
        _leftovers_cancelled(name)


@pytest.mark.timeout(600)  # up to 180 s for the jobs, 120 s to exit, 60 s to leave the queue
@pytest.mark.parametrize("signum, exit_codes", [
    # KeyboardInterrupt: Python ends by re-raising SIGINT (not 0: dask_jobqueue's import makes Ctrl-C
    # sys.exit(), which launch undoes)
    (signal.SIGINT, (-signal.SIGINT, 128 + signal.SIGINT)),
    (signal.SIGTERM, (128 + signal.SIGTERM,)),  # what batch systems and kill send: SystemExit(143)
], ids=["SIGINT", "SIGTERM"])
def test_cli_releases_its_jobs_when_interrupted(dask_jobqueue, tmp_path, signum, exit_codes):
    """``flowreduce bench --cluster slurm`` interrupted while its jobs run
    (Ctrl-C, or SIGTERM from a batch system): it exits and its jobs are
    cancelled, by the command itself."""
    name = f"flowreduce-{signal.Signals(signum).name.lower()}-{uuid.uuid4().hex[:8]}"
    cmd = _cli(name, tmp_path, "bench") + [  # far more repetitions than the test waits for
        "--sizes", "100000", "--algorithms", "butterfly", "--repeat", "100000", "--warmup", "0", "--no-progress"]
    stdout, stderr = open(tmp_path / "stdout", "w"), open(tmp_path / "stderr", "w")
    # as from a terminal: SIGINT and SIGTERM neither ignored nor blocked, whatever runs the tests;
    # PYTHONFAULTHANDLER so that a hung command's threads can be dumped (SIGABRT) for the message
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=REPO_ROOT, preexec_fn=terminal_signals,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        def running(jobs):
            return len(jobs) == 2 and all(state == "RUNNING" for _, state in jobs)

        wait_until(lambda: running(_jobs(name)) or proc.poll() is not None, 180, step=0.5)
        jobs = _jobs(name)
        assert proc.poll() is None, f"the command ended early: {(tmp_path / 'stderr').read_text()[-3000:]}"
        assert running(jobs), jobs
        ids = [jid for jid, _ in jobs]
        # the workers connected and the sweep started: bench prints its table header (flushed) then
        wait_until(lambda: "algbw" in (tmp_path / "stdout").read_text() or proc.poll() is not None, 180, step=0.5)
        assert proc.poll() is None, f"the command ended early: {(tmp_path / 'stderr').read_text()[-3000:]}"
        assert "algbw" in (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()[-3000:]
        proc.send_signal(signum)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            proc.wait(timeout=30)
            pytest.fail(f"still running 120 s after {signal.Signals(signum).name}; "
                        f"{[line for line in status.splitlines() if line.startswith('Sig')]}; stderr:\n"
                        f"{(tmp_path / 'stderr').read_text()[-6000:]}")
        assert rc in exit_codes, (rc, (tmp_path / "stderr").read_text()[-3000:])
        _assert_released(name, ids, tmp_path / "logs", f"after {signal.Signals(signum).name}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stdout.close()
        stderr.close()
        _leftovers_cancelled(name)
