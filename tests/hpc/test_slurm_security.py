"""A batch cluster started with flowreduce's defaults on a real SLURM is
safe on a shared network: scheduler and workers talk TLS with certificates
of the run, clients without them are refused while the cluster runs, the
dashboards listen on 127.0.0.1, the workers' certificates sit in a directory
only the user can read that is gone afterwards, and the jobs' logs go to a
directory of the run in the user's cache, nothing into the working
directory. ``flowreduce bench``'s defaults are checked end to end in
``test_slurm_allreduce.test_cli_bench_on_slurm``.

Needs the single-machine SLURM of ``tests/infra/slurm/up.sh``; skips with
the reason otherwise."""

from __future__ import annotations

import re
import stat
import uuid
from pathlib import Path

import pytest

from flowreduce import launch
from hpc.conftest import REPO_ROOT, _jobs, _leftovers_cancelled
from hpc.test_slurm_allreduce import _assert_released


def _listening_hosts(port: int) -> set[str]:
    """The addresses this process listens on at ``port``, as the OS says."""
    import psutil

    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.timeout(300)
def test_default_batch_cluster_refuses_clients_without_its_certificates(dask_jobqueue, tmp_path, monkeypatch):
    from distributed import Client
    from distributed.comm.core import CommClosedError
    from distributed.security import Security

    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # sbatch's default output, dask-jobqueue's default certificate files: both land here
    name = f"flowreduce-tls-{uuid.uuid4().hex[:8]}"
    # flowreduce's defaults: no security, interface, log or dashboard option
    options = dict(cores=1, processes=1, memory="1GB", walltime="00:10:00", job_name=name,
                   job_script_prologue=[f"export PYTHONPATH={REPO_ROOT}"])
    try:
        with launch.cluster("slurm", jobs=1, timeout=120, progress=False, **options) as client:
            ids = [jid for jid, _ in _jobs(name)]
            address = client.scheduler.address
            assert address.startswith("tls://"), address
            assert [w for w in client.scheduler_info()["workers"] if not w.startswith("tls://")] == []
            # plain TCP to the scheduler's port, and TLS with certificates of another authority: refused
            with pytest.raises(CommClosedError):
                Client(address.replace("tls://", "tcp://", 1), timeout=5)
            with pytest.raises(CommClosedError, match="TLS certificate does not match"):
                Client(address, security=Security.temporary(), timeout=5)
            with Client(address, security=client.cluster.security, timeout=30) as ours:  # the run's: accepted
                assert len(ours.nthreads()) == 1

            dashboard = client.cluster.scheduler.http_server.port
            assert _listening_hosts(dashboard) == {"127.0.0.1"}

            def worker_dashboard_hosts(dask_worker) -> set[str]:  # local: cloudpickle ships it by value
                import psutil

                return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN and c.laddr.port == dask_worker.http_server.port}

            assert list(client.run(worker_dashboard_hosts).values()) == [{"127.0.0.1"}]

            certificates = Path(client.cluster.security.tls_worker_key).parent
            assert certificates.parent == cache / "flowreduce" / "tls"
            assert stat.S_IMODE(certificates.stat().st_mode) == 0o700
            assert {stat.S_IMODE(p.stat().st_mode) for p in certificates.iterdir()} == {0o600}
            logs = Path(re.search(r"#SBATCH -e (\S+)/", client.cluster.job_script()).group(1))
            assert logs.parent == cache / "flowreduce" / "jobs"
        assert not certificates.exists()
        _assert_released(name, ids, logs, "after the cluster closed")
        assert sorted(p.name for p in logs.iterdir()) == [f"{name}-{ids[0]}.err", f"{name}-{ids[0]}.out"]
        assert list(cwd.iterdir()) == []
    finally:
        _leftovers_cancelled(name)
