"""End-to-end test of Dask on a real SLURM cluster via dask-jobqueue.

Needs a running SLURM (``bash tests/infra/slurm/up.sh`` as root starts a
single-machine one). Every test here skips, with the reason, when SLURM is not
running or ``dask_jobqueue`` is not installed.
"""

from __future__ import annotations

import os
import sys
import uuid

from hpc.conftest import REPO_ROOT, _gone, _jobs, _leftovers_cancelled


def test_slurm_cluster_runs_tasks_on_two_jobs(dask_jobqueue, tmp_path):
    from distributed import Client

    # A name unique to this run, so that other jobs on the same SLURM do not
    # disturb the squeue checks.
    job_name = f"flowreduce-test-{uuid.uuid4().hex[:8]}"
    cluster = dask_jobqueue.SLURMCluster(
        cores=1,
        processes=1,
        memory="1GB",
        walltime="00:05:00",
        interface="lo",
        python=sys.executable,
        job_name=job_name,
        log_directory=str(tmp_path / "slurm-logs"),
        local_directory=str(tmp_path / "worker-space"),
        job_script_prologue=[f"export PYTHONPATH={REPO_ROOT}"],
        scheduler_options={"dashboard_address": ":0"},
    )
    closed = False
    try:
        script = cluster.job_script()
        assert f"#SBATCH -J {job_name}" in script
        assert sys.executable in script

        client = Client(cluster)
        try:
            cluster.scale(jobs=2)
            client.wait_for_workers(2, timeout=60)

            workers = sorted(client.nthreads())
            assert len(workers) == 2, workers

            # one task pinned on each worker
            futures = {
                w: client.submit(sum, [1, 2, 3], workers=[w], allow_other_workers=False, pure=False)
                for w in workers
            }
            assert {w: f.result(timeout=30) for w, f in futures.items()} == {w: 6 for w in workers}
            for w, f in futures.items():
                assert client.who_has(f)[f.key] == (w,)

            # workers run this interpreter, with the prologue's PYTHONPATH, inside SLURM jobs.
            # (A local function: cloudpickle ships it by value, as the workers
            # cannot import this test module.)
            def worker_env() -> dict:
                import os
                import sys

                return {
                    "python": sys.executable,
                    "pythonpath": os.environ.get("PYTHONPATH", ""),
                    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                }

            envs = client.run(worker_env)
            assert sorted(envs) == workers
            job_ids = set()
            for env in envs.values():
                assert env["python"] == sys.executable, env
                assert str(REPO_ROOT) in env["pythonpath"].split(os.pathsep), env
                assert env["slurm_job_id"], env
                job_ids.add(env["slurm_job_id"])
            assert len(job_ids) == 2, envs

            jobs = _jobs(job_name)
            assert len(jobs) == 2, jobs
            assert all(state == "RUNNING" for _, state in jobs), jobs
            assert {job_id for job_id, _ in jobs} == job_ids
        finally:
            client.close()
        cluster.close()
        closed = True

        jobs = _gone(job_name)
        assert jobs == [], f"jobs left in squeue after cluster.close(): {jobs}"
    finally:
        if not closed:
            cluster.close()
        _leftovers_cancelled(job_name)
