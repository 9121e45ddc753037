"""Where a command runs: an embedded ``LocalCluster``, batch jobs started by
dask-jobqueue (SLURM, PBS, SGE, LSF, HTCondor, Moab, OAR), or a scheduler
that is already running (``--scheduler ADDRESS``, ``--scheduler-file``, as
dask-mpi launches write).

``flowreduce bench`` and ``flowreduce trace`` share these options; from
Python::

    with flowreduce.launch.cluster("slurm", jobs=4, cores=8, memory="32GB",
                                   processes=8, walltime="00:30:00") as client:
        ...

Jobs are submitted, waited for (with a progress line, and a timeout that
says which jobs are still pending and why, from the queue), and released
when the block ends, also on error or Ctrl-C. Options left out come from
dask-jobqueue's configuration (``~/.config/dask/jobqueue.yaml``).
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

#: ``--cluster`` choices beyond ``local``, and dask-jobqueue's class for each.
JOBQUEUE = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster", "lsf": "LSFCluster",
            "htcondor": "HTCondorCluster", "moab": "MoabCluster", "oar": "OARCluster"}

# argparse dest -> dask-jobqueue keyword, for the options passed through when given
_PASSED = {"cores": "cores", "memory": "memory", "processes": "processes", "walltime": "walltime",
           "queue": "queue", "account": "account", "interface": "interface", "job_name": "job_name",
           "job_extra": "job_extra_directives", "prologue": "job_script_prologue",
           "python": "python", "log_directory": "log_directory", "local_directory": "local_directory"}


def add_cluster_arguments(p: argparse.ArgumentParser, *, workers_default: int | None = 4) -> None:
    g = p.add_argument_group("cluster (default: an embedded LocalCluster)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--cluster", choices=["local", *JOBQUEUE], default="local",
                       help="start workers here (local) or as batch jobs through dask-jobqueue")
    where.add_argument("--scheduler", help="address of a running scheduler")
    where.add_argument("--scheduler-file", help="scheduler file of a running cluster (dask-mpi style)")
    g.add_argument("--workers", type=int, default=workers_default,
                   help="worker processes of the LocalCluster" + (f" (default {workers_default})" if workers_default
                                                                  else " (default: one per rank)"))
    g.add_argument("--memory-limit", default="system",
                   help="LocalCluster memory limit per worker: 'system' (default: the machine's memory, so "
                        "spilling to disk does not swamp 1e8 rows), 'auto' (dask's share) or a size")
    g.add_argument("--jobs", type=int, default=1, help="batch jobs to submit (default 1)")
    g.add_argument("--cores", type=int, help="cores per job")
    g.add_argument("--memory", help="memory per job, e.g. 16GB")
    g.add_argument("--processes", type=int, help="worker processes per job (ranks per job)")
    g.add_argument("--walltime", help="job time limit, e.g. 00:30:00")
    g.add_argument("--queue", help="queue or partition")
    g.add_argument("--account", help="account or project to charge")
    g.add_argument("--interface", help="network interface for workers and scheduler, e.g. ib0 for IPoIB")
    g.add_argument("--job-name", help="job name (default: dask-jobqueue's)")
    g.add_argument("--job-extra", action="append", help="extra scheduler directive, e.g. --job-extra=--exclusive "
                   "(repeatable)")
    g.add_argument("--prologue", action="append", help="shell line run in the job before the worker (repeatable)")
    g.add_argument("--python", help="python on the compute nodes (default: this one)")
    g.add_argument("--log-directory", help="where the jobs write their output")
    g.add_argument("--local-directory", help="worker scratch space on the nodes")
    g.add_argument("--wait-timeout", type=float, default=300.0,
                   help="seconds to wait for the jobs' workers before giving up (default 300)")


@contextmanager
def from_args(args: argparse.Namespace, *, workers: int | None = None, progress: bool = True) -> Iterator[Any]:
    """A :class:`distributed.Client` for the cluster ``args`` describe
    (see :func:`add_cluster_arguments`); the cluster is closed and its jobs
    released when the block ends."""
    from distributed import Client

    if getattr(args, "scheduler", None) or getattr(args, "scheduler_file", None):
        with Client(args.scheduler, scheduler_file=args.scheduler_file) as client:
            yield client
        return
    kind = getattr(args, "cluster", "local") or "local"
    if kind == "local":
        with cluster("local", workers=args.workers or workers, memory_limit=args.memory_limit) as client:
            yield client
        return
    options = {kw: getattr(args, dest) for dest, kw in _PASSED.items() if getattr(args, dest, None) is not None}
    with cluster(kind, jobs=args.jobs, timeout=args.wait_timeout, progress=progress, **options) as client:
        yield client


@contextmanager
def cluster(kind: str = "local", *, jobs: int = 1, workers: int | None = None, timeout: float = 300.0,
            progress: bool = True, memory_limit: Any = "system", **options: Any) -> Iterator[Any]:
    """Start a cluster, wait for its workers, yield a Client, release it all.

    ``kind="local"``: a LocalCluster of ``workers`` single-threaded worker
    processes. Otherwise one of :data:`JOBQUEUE`: ``jobs`` batch jobs of
    dask-jobqueue's cluster class, ``options`` passed to it (``cores``,
    ``memory``, ``processes``, ``walltime``, ``queue``, ``interface``, ...;
    the rest from ``jobqueue.yaml``). Waits for ``jobs × processes`` workers
    or raises :class:`TimeoutError` naming the jobs still pending and why.
    """
    from distributed import Client, LocalCluster

    with ExitStack() as stack:
        if kind == "local":
            c = stack.enter_context(LocalCluster(
                n_workers=workers or 4, threads_per_worker=1, processes=True, dashboard_address=None,
                memory_limit=_memory_limit(memory_limit)))
            yield stack.enter_context(Client(c))
            return
        c = _jobqueue_cluster(kind, options)
        stack.callback(_release, c)  # runs on error and Ctrl-C too
        client = stack.enter_context(Client(c))
        c.scale(jobs=jobs)
        expected = jobs * _processes(c)
        wait_for_workers(client, c, expected, timeout=timeout, progress=progress)
        yield client


def _jobqueue_cluster(kind: str, options: dict) -> Any:
    if kind not in JOBQUEUE:
        raise ValueError(f"unknown cluster kind {kind!r}; valid: local, {', '.join(JOBQUEUE)}")
    try:
        import dask_jobqueue
    except ImportError:
        raise ImportError(f"--cluster {kind} needs dask-jobqueue: pip install 'flowreduce[hpc]'") from None
    import sys

    options.setdefault("python", sys.executable)
    options.setdefault("scheduler_options", {"dashboard_address": ":0"})
    if "interface" in options:  # the scheduler listens where the workers can reach it
        options["scheduler_options"] = {**options["scheduler_options"], "interface": options["interface"]}
    return getattr(dask_jobqueue, JOBQUEUE[kind])(**options)


def _processes(c: Any) -> int:
    # dask-jobqueue keeps the per-job worker count on the job template
    return max(1, int(c._dummy_job.worker_processes))


def _memory_limit(text: Any) -> Any:
    # dask's default ('auto') gives each of 4 workers a quarter of the machine and
    # spills at 60% of that: a 1e8 float64 row then times disk writes, not all-reduce
    if text == "system":
        from distributed.system import MEMORY_LIMIT

        return MEMORY_LIMIT
    return text


def ranked_workers(client: Any) -> list[str]:
    """The cluster's workers in rank order: those sharing a node (and a job)
    next to each other, so consecutive ranks share a node and the
    hierarchical algorithm's groups follow the jobs."""
    from flowreduce.schedule import place_of

    places = client.run(place_of)
    return sorted(places, key=lambda w: (places[w], w))


def job_ids(c: Any) -> list[str]:
    return sorted(str(j.job_id) for j in getattr(c, "workers", {}).values() if getattr(j, "job_id", None))


def pending_report(c: Any) -> str:
    """What the queue says about the cluster's jobs (SLURM: state and
    reason from ``squeue``; other systems: their job ids)."""
    ids = job_ids(c)
    if not ids:
        return "no job was accepted by the queue (see the cluster's job script: cluster.job_script())"
    if type(c).__name__ == "SLURMCluster":
        try:
            out = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T %r %N"],
                                 capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"jobs {', '.join(ids)} (squeue failed: {e})"
        lines = []
        for line in out.splitlines():
            jid, state, reason, *nodes = line.split()
            lines.append(f"job {jid} {state}" + (f" ({reason})" if reason not in ("None", "") else "")
                         + (f" on {nodes[0]}" if nodes and nodes[0] not in ("", "(null)") else ""))
        gone = set(ids) - {line.split()[0] for line in out.splitlines()}
        lines += [f"job {j} no longer queued (ended or failed: see its log)" for j in sorted(gone)]
        return "; ".join(lines)
    return f"jobs {', '.join(ids)} (ask the queue: qstat / bjobs / condor_q)"


def wait_for_workers(client: Any, c: Any, n: int, *, timeout: float = 300.0, progress: bool = True) -> None:
    """Wait until ``n`` workers are up, showing how many and what the queue
    says; raise TimeoutError with the queue's reasons after ``timeout``."""
    deadline = time.monotonic() + timeout
    with ExitStack() as stack:
        bar = task = None
        if progress:
            from rich.progress import Progress

            bar = stack.enter_context(Progress(transient=True))
            task = bar.add_task("waiting for workers", total=n)
        last_report = 0.0
        while True:
            up = len(client.nthreads())
            if bar is not None:
                now = time.monotonic()
                if now - last_report > 5:  # ask the queue now and then, not every poll
                    bar.update(task, description=f"workers {up}/{n}: {pending_report(c)}")
                    last_report = now
                bar.update(task, completed=up)
            if up >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{up} of {n} workers up after {timeout:g} s; {pending_report(c)}")
            time.sleep(0.5)


def _release(c: Any) -> None:
    c.close()  # dask-jobqueue cancels every job it submitted (scancel, qdel, ...)
