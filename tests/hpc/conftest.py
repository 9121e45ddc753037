"""Fixtures of the HPC tests: a running SLURM (or a skip saying why not)
and dask-jobqueue."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from utils import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]

IDLE_WAIT_SECONDS = 5.0


def slurm_skip_reason(wait: float = IDLE_WAIT_SECONDS) -> str | None:
    """Return why SLURM is unusable here, or None when it has an idle node.

    Polls ``sinfo -h -o %T`` for up to ``wait`` seconds for a node in state
    ``idle`` (or ``mixed``, which still has free CPUs).
    """
    if shutil.which("sinfo") is None:
        return "SLURM not installed: no `sinfo` on PATH (run tests/infra/slurm/up.sh as root)"
    deadline = time.monotonic() + wait
    last = ""
    while True:
        try:
            proc = subprocess.run(
                ["sinfo", "-h", "-o", "%T"],
                check=False,
                capture_output=True,
                text=True,
                timeout=max(1.0, wait),
            )
        except subprocess.TimeoutExpired:
            last = "`sinfo -h -o %T` timed out (slurmctld unreachable?)"
        else:
            if proc.returncode != 0:
                last = f"`sinfo -h -o %T` failed (rc={proc.returncode}): {proc.stderr.strip()[:200]}"
            else:
                states = proc.stdout.split()
                if any(s in ("idle", "mixed") for s in states):
                    return None
                last = f"no idle SLURM node (states: {', '.join(states) or 'none'})"
        if time.monotonic() >= deadline:
            return f"SLURM not running: {last} (run tests/infra/slurm/up.sh as root)"
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """flowreduce's directories of a run (the workers' certificates, the
    jobs' logs) under the test's tmp_path, not in the cache of whoever runs
    the tests; commands started by the tests inherit it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def slurm() -> None:
    reason = slurm_skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def dask_jobqueue(slurm):
    return pytest.importorskip("dask_jobqueue", reason="dask-jobqueue not installed")


def _jobs(name: str) -> list[tuple[str, str]]:
    """(job id, state) of queued jobs with this job name, via `squeue -h`."""
    out = subprocess.run(
        ["squeue", "-h", "-n", name, "-o", "%i %T"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [tuple(line.split()) for line in out.splitlines() if line.strip()]


def _gone(name: str, timeout: float = 60.0) -> list[tuple[str, str]]:
    """Wait up to ``timeout`` s for jobs named ``name`` to leave squeue;
    return those still queued (empty when all are gone)."""
    wait_until(lambda: not _jobs(name), timeout, step=0.5)
    return _jobs(name)


def _leftovers_cancelled(name: str) -> list[tuple[str, str]]:
    """Test-side cleanup, for ``finally`` blocks that run after a test's own
    check that the jobs are gone: cancel the jobs named ``name`` that are
    still queued (none when flowreduce released them) and return them."""
    left = _jobs(name)
    if left:
        subprocess.run(["scancel", "-n", name], check=False, capture_output=True, timeout=30)
    return left


def _cancelled(log_directory: Path, ids: list[str]) -> dict[str, bool]:
    """For each job id, whether its stderr log (dask-jobqueue writes
    ``<log_directory>/<name>-<id>.err``) has slurmstepd's ``*** JOB <id> ON
    <node> CANCELLED AT ... ***``: the job was ended by ``scancel``. A job
    whose workers exit on their own (as they do soon after the scheduler
    process dies) ends without it, so this tells a release apart from an
    abandoned job that merely left squeue."""
    out = {}
    for jid in ids:
        text = "".join(p.read_text(errors="replace") for p in Path(log_directory).glob(f"*-{jid}.err"))
        out[jid] = re.search(rf"\*\*\* JOB {jid} ON \S+ CANCELLED AT ", text) is not None
    return out


def _job_ids_in_logs(log_directory: Path) -> list[str]:
    """Ids of the jobs that wrote logs there (``<name>-<id>.err``, as
    :func:`_cancelled` reads them)."""
    return sorted({p.stem.rsplit("-", 1)[1] for p in Path(log_directory).glob("*.err")})
