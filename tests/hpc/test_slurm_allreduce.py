"""flowreduce on a real SLURM through ``flowreduce.launch``: two batch jobs
of two worker processes each, every dense algorithm checked against numpy,
hierarchical groups following the jobs, the jobs gone afterwards; and a
request the queue cannot satisfy times out naming the pending job and why.

Needs the single-machine SLURM of ``tests/infra/slurm/up.sh`` (``.ci/run``
starts it); skips with the reason otherwise."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import flowreduce
from flowreduce import launch
from hpc.conftest import REPO_ROOT, _jobs


def _options(tmp_path, name: str, **extra) -> dict:
    return dict(cores=2, processes=2, memory="2GB", walltime="00:10:00", interface="lo", job_name=name,
                log_directory=str(tmp_path / "logs"), local_directory=str(tmp_path / "space"),
                job_script_prologue=[f"export PYTHONPATH={REPO_ROOT}"], **extra)


def _gone(name: str, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while (jobs := _jobs(name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return jobs


def test_every_algorithm_across_two_jobs(dask_jobqueue, tmp_path):
    from distributed import wait

    name = f"flowreduce-ar-{uuid.uuid4().hex[:8]}"
    try:
        with launch.cluster("slurm", jobs=2, timeout=120, progress=False, **_options(tmp_path, name)) as client:
            workers = launch.ranked_workers(client)
            assert len(workers) == 4
            jobs = client.run(lambda: __import__("os").environ["SLURM_JOB_ID"])
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
                if algorithm == "hierarchical":  # the groups are the jobs (each on its own node)
                    assert flowreduce.describe(out).plan.options["groups"] == [[0, 1], [2, 3]]
                del out
            del inputs
    finally:
        subprocess.run(["scancel", "-n", name], check=False, capture_output=True, timeout=30)
    assert _gone(name) == [], "jobs left in squeue after the cluster closed"


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
    finally:
        subprocess.run(["scancel", "-n", name], check=False, capture_output=True, timeout=30)
    assert _gone(name) == [], "the pending job was not released after the timeout"


def test_cli_bench_on_slurm(dask_jobqueue, tmp_path):
    name = f"flowreduce-cli-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "flowreduce", "bench", "--cluster", "slurm", "--jobs", "2", "--cores", "2",
           "--processes", "2", "--memory", "2GB", "--walltime", "00:10:00", "--interface", "lo",
           "--job-name", name, "--prologue", f"export PYTHONPATH={REPO_ROOT}",
           "--log-directory", str(tmp_path / "logs"), "--wait-timeout", "120",
           "--sizes", "1000", "--algorithms", "butterfly,hierarchical", "--repeat", "1", "--warmup", "0",
           "--no-progress", "--json", str(tmp_path / "rows.json")]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    finally:
        subprocess.run(["scancel", "-n", name], check=False, capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 ranks on 4 workers" in out.stdout
    import json

    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["algorithm"] for r in rows} == {"butterfly", "hierarchical", "baseline"}
    assert all(r["correct"] for r in rows)
    hier = next(r for r in rows if r["algorithm"] == "hierarchical")
    assert "groups=[[0, 1], [2, 3]]" in hier["plan"]
    assert _gone(name) == [], "jobs left in squeue after the command ended"


def test_cli_train_on_slurm(dask_jobqueue, tmp_path):
    """``flowreduce train`` takes the same cluster options: one epoch of the
    digits MLP on 4 ranks in 2 SLURM jobs learns (far above chance) and
    leaves no job behind."""
    pytest.importorskip("sklearn", reason="flowreduce train needs scikit-learn: pip install 'flowreduce[train]'")
    name = f"flowreduce-train-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "flowreduce", "train", "--cluster", "slurm", "--jobs", "2", "--cores", "2",
           "--processes", "2", "--memory", "2GB", "--walltime", "00:10:00", "--interface", "lo",
           "--job-name", name, "--prologue", f"export PYTHONPATH={REPO_ROOT}",
           "--log-directory", str(tmp_path / "logs"), "--wait-timeout", "120",
           "--ranks", "4", "--epochs", "1", "--json", str(tmp_path / "train.json")]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    finally:
        subprocess.run(["scancel", "-n", name], check=False, capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    import json

    report = json.loads((tmp_path / "train.json").read_text())
    assert report["config"]["ranks"] == 4
    assert report["final"]["test_acc"] > 0.5  # ten classes: chance is 0.1
    assert _gone(name) == [], "jobs left in squeue after the command ended"
