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
says which jobs are still pending and why, from the queue: ``squeue``,
``qstat``, ``bjobs``), and released when the block ends, also on error or
Ctrl-C, and in the commands on SIGTERM. Options left out come from
dask-jobqueue's configuration (``~/.config/dask/jobqueue.yaml``), including
``python`` and ``scheduler-options``.

Batch clusters are safe to start on a shared network by default: scheduler,
workers and client talk TLS with temporary certificates made for the run
(the workers read theirs from a directory only the user can read, removed
when the cluster closes); the dashboards listen on 127.0.0.1 unless told
otherwise; the jobs write their logs to a directory of the run under the
user's cache, never the current directory (docs/hpc.md has the table).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, NamedTuple

#: ``--cluster`` choices beyond ``local``, and dask-jobqueue's class for each.
JOBQUEUE = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster", "lsf": "LSFCluster",
            "htcondor": "HTCondorCluster", "moab": "MoabCluster", "oar": "OARCluster"}

# argparse dest -> dask-jobqueue keyword, for the options passed through when given
_PASSED = {"cores": "cores", "memory": "memory", "processes": "processes", "walltime": "walltime",
           "queue": "queue", "account": "account", "interface": "interface", "job_name": "job_name",
           "job_extra": "job_extra_directives", "prologue": "job_script_prologue",
           "python": "python", "log_directory": "log_directory", "local_directory": "local_directory",
           "tls": "security", "tls_directory": "shared_temp_directory", "dashboard_address": "dashboard_address"}

#: Where the dashboards listen unless told otherwise: this machine only (reach it with ``ssh -L``).
LOOPBACK = "127.0.0.1"


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
    g.add_argument("--log-directory", help="where the jobs write their output (default: a new directory of "
                   "the run under $XDG_CACHE_HOME/flowreduce/jobs, else ~/.cache/flowreduce/jobs, named on "
                   "stderr when the command ends; never the current directory)")
    g.add_argument("--local-directory", help="worker scratch space on the nodes")
    tls = g.add_mutually_exclusive_group()
    tls.add_argument("--tls", dest="tls", action="store_true", default=True,
                     help="batch clusters: encrypt and authenticate scheduler, workers and client with TLS, "
                          "using temporary certificates made for this run (the default)")
    tls.add_argument("--no-tls", dest="tls", action="store_false",
                     help="batch clusters: plain TCP. The scheduler then accepts any client that reaches its "
                          "port and runs whatever pickled function it sends: anyone on the cluster's network "
                          "who finds the port runs code as you. Only on a network nobody else uses")
    g.add_argument("--tls-directory", help="where the workers' certificates are written, in a new directory "
                                           "only you can read, removed when the command ends: a directory the "
                                           "compute nodes see (default: jobqueue.yaml's shared-temp-directory, "
                                           "else $XDG_CACHE_HOME/flowreduce/tls or ~/.cache/flowreduce/tls)")
    g.add_argument("--dashboard-address", help="where the scheduler's dashboard listens (default: a free port "
                                               "on --interface's address, else on 127.0.0.1: reach it with "
                                               "ssh -L, as the command prints)")
    g.add_argument("--wait-timeout", type=float, default=300.0,
                   help="seconds to wait for the jobs' workers before giving up (default 300)")


@contextmanager
def from_args(args: argparse.Namespace, *, workers: int | None = None, progress: bool = True) -> Iterator[Any]:
    """A :class:`distributed.Client` for the cluster ``args`` describe
    (see :func:`add_cluster_arguments`); the cluster is closed and its jobs
    released when the block ends."""
    from distributed import Client

    with interrupts_unwind():  # a batch system's SIGTERM releases the jobs as Ctrl-C does
        if getattr(args, "scheduler", None) or getattr(args, "scheduler_file", None):
            with Client(args.scheduler, scheduler_file=args.scheduler_file) as client:
                yield client
            return
        kind = getattr(args, "cluster", "local") or "local"
        if kind == "local":
            with cluster("local", workers=args.workers or workers, memory_limit=args.memory_limit) as client:
                yield client
            return
        options = jobqueue_arguments(args)
        made = not _given(kind, options, "log_directory")  # a directory of the run: the user's is never removed
        options["log_directory"] = log_directory(kind, options)  # here, so that the command can name it
        try:
            with cluster(kind, jobs=args.jobs, timeout=args.wait_timeout, progress=progress,
                         release_within=RELEASE_WITHIN, **options) as client:
                print(f"flowreduce: scheduler {client.scheduler.address}; {dashboard_note(client.cluster)}",
                      file=sys.stderr, flush=True)
                yield client
        finally:
            if not (made and _removed_if_empty(options["log_directory"])):
                print(f"flowreduce: the batch jobs' logs are in {options['log_directory']}", file=sys.stderr,
                      flush=True)


@contextmanager
def interrupts_unwind() -> Iterator[None]:
    """Inside the block, Ctrl-C and SIGTERM unwind it, and neither is lost.

    SIGTERM raises :class:`SystemExit` (exit status 143) instead of killing
    the process outright, so ``with`` blocks unwind and a jobqueue cluster's
    jobs are cancelled, as they are on Ctrl-C. Batch systems send SIGTERM
    before SIGKILL (``scancel``, a job's time limit, preemption), and so does
    ``kill``. Further SIGTERMs are ignored until the block has ended, so they
    cannot cut the release short. Only in the main thread, and only when
    nobody installed a SIGTERM handler already; the previous handler is
    restored afterwards.

    Python runs a signal's handler wherever the main thread happens to be,
    and an exception raised inside a garbage-collector callback or a
    ``__del__`` is printed ("Exception ignored in ...") and dropped. A Ctrl-C
    that landed in distributed's GC diagnostics was lost so, and the command
    waited for its futures forever (seen in CI). Inside the block an
    interrupt dropped that way is sent to the main thread again, from
    another thread, until it is raised where it unwinds the block.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.get_ident()  # this is the main thread
    catch_term = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def unwind(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    def send_again(unraisable: Any) -> None:
        previous_hook(unraisable)
        exc = unraisable.exc_value
        if threading.current_thread() is not threading.main_thread():
            return  # signals raise in the main thread only: this is not one
        if isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signum = signal.SIGINT
        elif (isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM and catch_term
              and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):
            signal.signal(signal.SIGTERM, unwind)  # it never unwound: the first SIGTERM is still to come
            signum = signal.SIGTERM
        else:
            return
        # not from here: this runs inside whatever dropped it, which would drop it again
        again = threading.Timer(0.05, deliver, (signum,))
        again.daemon = True
        again.start()

    def deliver(signum: int) -> None:
        with suppress(ProcessLookupError):  # the main thread has ended meanwhile: nothing to unwind
            signal.pthread_kill(main, signum)

    previous_term = signal.signal(signal.SIGTERM, unwind) if catch_term else None
    previous_hook = sys.unraisablehook
    sys.unraisablehook = send_again
    try:
        yield
    finally:
        if sys.unraisablehook is send_again:
            sys.unraisablehook = previous_hook
        if catch_term:
            signal.signal(signal.SIGTERM, previous_term)


@contextmanager
def cluster(kind: str = "local", *, jobs: int = 1, workers: int | None = None, timeout: float = 300.0,
            progress: bool = True, memory_limit: Any = "system", release_within: float | None = None,
            **options: Any) -> Iterator[Any]:
    """Start a cluster, wait for its workers, yield a Client, release it all.

    ``kind="local"``: a LocalCluster of ``workers`` single-threaded worker
    processes, scheduler, workers and dashboard listening on 127.0.0.1 only.
    Otherwise one of :data:`JOBQUEUE`: ``jobs`` batch jobs of
    dask-jobqueue's cluster class, ``options`` passed to it (``cores``,
    ``memory``, ``processes``, ``walltime``, ``queue``, ``interface``, ...;
    the rest from ``jobqueue.yaml``). Waits for ``jobs × processes`` workers
    or raises :class:`TimeoutError` naming the jobs still pending and why.

    Batch clusters talk TLS unless ``security=False``: ``security=True``
    (the default) makes temporary certificates for the run; a
    :class:`distributed.security.Security` is used as it is. Certificates
    the workers must read from files (temporary ones: the key too) are
    written to a new directory only the user can read, inside
    ``shared_temp_directory`` (a path the compute nodes see; default
    :func:`cache_directory`'s ``tls``), removed after the cluster closes.
    The jobs' logs go to ``log_directory`` (default :func:`log_directory`:
    a new directory of the run under the user's cache).

    ``release_within`` (for commands, not for library callers: it ends the
    process): when Ctrl-C or SIGTERM unwinds the block, closing the client
    and the cluster gets that many seconds; if they are not done by then,
    the jobs are cancelled with the queue's own command and the process
    exits, so an interrupted command never hangs.
    """
    from distributed import Client, LocalCluster

    with ExitStack() as stack:
        if kind == "local":
            c = stack.enter_context(LocalCluster(
                n_workers=workers or 4, threads_per_worker=1, processes=True, host=LOOPBACK,
                dashboard_address=None, memory_limit=_memory_limit(memory_limit)))
            yield stack.enter_context(Client(c))
            return
        options = dict(options)
        if not options.get("log_directory"):
            ours = not _given(kind, options, "log_directory")
            options["log_directory"] = log_directory(kind, options)
            if ours:  # a directory of the run, empty if no job wrote to it (never the user's own)
                stack.callback(_removed_if_empty, options["log_directory"])
        security = options.pop("security", True)
        made: list[str] = []
        if security:  # removed last, once the cluster has closed
            options["security"] = stack.enter_context(
                private_certificates(security, tls_directory(kind, options), made=made))
        options.pop("shared_temp_directory", None)
        c = jobqueue_cluster(kind, options)
        deadline = ReleaseDeadline(c, release_within, remove=made)
        stack.callback(deadline.disarm)  # the last to run: the release ended in time
        stack.callback(_release, c)  # runs on error and Ctrl-C too
        try:
            client = stack.enter_context(Client(c))
            c.scale(jobs=jobs)
            expected = jobs * _processes(c)
            wait_for_workers(client, c, expected, timeout=timeout, progress=progress)
            yield client
        except KeyboardInterrupt:
            deadline.arm(128 + 2)  # the shell's status for SIGINT
            raise
        except SystemExit as e:
            deadline.arm(e.code if isinstance(e.code, int) else 1)
            raise


def cache_directory() -> str:
    """flowreduce's directory in the user's cache: ``$XDG_CACHE_HOME/flowreduce``
    (when set to an absolute path, as the XDG spec asks), else
    ``~/.cache/flowreduce``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flowreduce")


def run_directory(parent: str) -> str:
    """A new directory for one run in ``parent`` (made if missing), only the
    user can read (0700): ``<YYYYmmdd-HHMMSS>-<pid>-<random>``."""
    parent = os.path.expanduser(os.path.expandvars(parent))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-", dir=parent)


def _config_name(kind: str, options: dict) -> str:
    return options.get("config_name") or _cluster_class(kind).job_cls.default_config_name()


def _given(kind: str, options: dict, option: str) -> str | None:
    """``options[option]``, else ``jobqueue.<config>.<option>`` from the dask configuration."""
    import dask

    return options.get(option) or dask.config.get(
        f"jobqueue.{_config_name(kind, options)}.{option.replace('_', '-')}", None)


def log_directory(kind: str, options: dict) -> str:
    """Where the jobs of a ``kind`` cluster write their output: ``options``'
    ``log_directory``, else ``jobqueue.<config>.log-directory``, else a new
    directory of the run (:func:`run_directory`) in :func:`cache_directory`'s
    ``jobs``. Without one, sbatch and qsub write ``slurm-<id>.out`` (or
    ``<name>.o<id>``) into the directory the command runs in."""
    return _given(kind, options, "log_directory") or run_directory(os.path.join(cache_directory(), "jobs"))


def tls_directory(kind: str, options: dict) -> str:
    """Where a run's directory of worker certificates goes: ``options``'
    ``shared_temp_directory``, else ``jobqueue.<config>.shared-temp-directory``,
    else :func:`cache_directory`'s ``tls``."""
    return _given(kind, options, "shared_temp_directory") or os.path.join(cache_directory(), "tls")


def _removed_if_empty(directory: str) -> bool:
    try:
        os.rmdir(directory)
    except OSError:  # not empty, or gone
        return False
    return True


@contextmanager
def private_certificates(security: Any, parent: str, made: list[str] | None = None) -> Iterator[Any]:
    """``security`` (``True``: :meth:`Security.temporary()
    <distributed.security.Security.temporary>`) with the workers'
    in-memory certificates and key written to files in a new directory in
    ``parent`` that only the user can read (0700, files 0600), which is
    removed when the block ends (and appended to ``made``, if given). The batch jobs read the files (their
    command line names them); scheduler and client keep theirs in memory.

    dask-jobqueue would write them itself, but into the current directory
    unless told otherwise, and remove them only when the cluster object is
    garbage-collected."""
    from distributed.security import Security

    if security is True:
        security = Security.temporary()
    in_memory = {k: v for k, v in security.get_tls_config_for_role("worker").items()
                 if isinstance(v, str) and "\n" in v}
    if not in_memory:  # files already: the user's own certificates
        yield security
        return
    directory = run_directory(parent)
    if made is not None:
        made.append(directory)
    try:
        security = copy.copy(security)
        for key, pem in in_memory.items():  # ca_file, cert, key
            path = os.path.join(directory, f"{ {'ca_file': 'ca'}.get(key, key)}.pem")
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(pem)
            setattr(security, "tls_ca_file" if key == "ca_file" else f"tls_worker_{key}", path)
        yield security
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def dashboard_note(c: Any) -> str:
    """Where the scheduler of cluster ``c`` serves its dashboard, as bound,
    and the ``ssh -L`` line that reaches it from another machine."""
    import socket

    server = getattr(getattr(c, "scheduler", None), "http_server", None)
    if server is None or not getattr(server, "port", None):
        return "no dashboard"
    host, port = server.address, server.port
    if host in ("", "0.0.0.0", "::"):
        return f"dashboard on port {port} of every interface: anyone on the network can read it"
    url_host = f"[{host}]" if ":" in host else host
    return (f"dashboard http://{url_host}:{port}/status (from your machine: "
            f"ssh -L {port}:{url_host}:{port} {socket.gethostname()})")


#: How long an interrupted command's client and cluster may take to close
#: before its jobs are cancelled directly (:class:`ReleaseDeadline`).
RELEASE_WITHIN = 60.0


class ReleaseDeadline:
    """Once armed, a timer: unless disarmed within ``seconds``, it cancels
    every job of the dask-jobqueue cluster ``c`` with the queue's own
    command (``scancel``, ``qdel``, ...), says so on stderr, removes the
    directories in ``remove`` (the run's certificates: nothing else would)
    and ends the process with the given status. ``seconds=None`` never arms."""

    def __init__(self, c: Any, seconds: float | None, remove: list[str] | None = None):
        self.c, self.seconds = c, seconds
        self.remove = remove if remove is not None else []
        self._timer: Any = None

    def arm(self, status: int) -> None:
        import threading

        if self.seconds is None or self._timer is not None:
            return
        self._timer = threading.Timer(self.seconds, self._cut_short, args=(status,))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _cut_short(self, status: int) -> None:
        import shlex

        ids: list[str] = []
        with suppress(Exception):  # the cluster's state is read from another thread, mid-close
            ids = [str(j.job_id) for j in list(self.c.workers.values()) if getattr(j, "job_id", None)]
        command = shlex.split(self.c.job_cls.cancel_command)
        print(f"flowreduce: the cluster did not close within {self.seconds:g} s of the interrupt; "
              f"cancelling its jobs ({' '.join(command + ids) if ids else 'none known'}) and exiting",
              file=sys.stderr, flush=True)
        if ids:
            with suppress(Exception):
                subprocess.run(command + ids, timeout=30, capture_output=True)
        for directory in self.remove:
            shutil.rmtree(directory, ignore_errors=True)
        os._exit(status)


def jobqueue_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The dask-jobqueue keywords the command line gives (only those given)."""
    return {kw: getattr(args, dest) for dest, kw in _PASSED.items() if getattr(args, dest, None) is not None}


def jobqueue_cluster(kind: str, options: dict) -> Any:
    """A dask-jobqueue cluster of ``kind`` (slurm, pbs, ...) built from
    ``options`` over jobqueue.yaml's settings; jobs are not started yet.
    ``security`` and ``log_directory`` go to dask-jobqueue as they are
    (:func:`cluster` sets them up)."""
    cls = _cluster_class(kind)
    config_name = _config_name(kind, options)
    options = jobqueue_options(config_name, options)
    if kind == "oar" and options.get("log_directory"):
        options["job_extra_directives"] = _oar_log_directives(config_name, options)
    return cls(**options)


def _oar_log_directives(config_name: str, options: dict) -> list[str]:
    """OAR's ``job_extra_directives`` with the job's output in ``log_directory``:
    dask-jobqueue ignores that option for OAR, and oarsub would write
    ``OAR.<id>.stdout``/``.stderr`` into the current directory. Kept as they
    are when they name ``-O``/``-E`` themselves."""
    import dask

    extra = options.get("job_extra_directives")
    if extra is None:  # dask-jobqueue's own lookup
        extra = dask.config.get(f"jobqueue.{config_name}.job-extra-directives", None) or []
    if any(str(d).split()[:1] in (["-O"], ["-E"]) for d in extra):
        return list(extra)
    logs = options["log_directory"]
    return [*extra, f"-O {logs}/%jobname%-%jobid%.out", f"-E {logs}/%jobname%-%jobid%.err"]


def _cluster_class(kind: str) -> Any:
    if kind not in JOBQUEUE:
        raise ValueError(f"unknown cluster kind {kind!r}; valid: local, {', '.join(JOBQUEUE)}")
    return getattr(import_dask_jobqueue(kind), JOBQUEUE[kind])


def import_dask_jobqueue(kind: str) -> Any:
    """``import dask_jobqueue``, keeping Ctrl-C a KeyboardInterrupt.

    Its first import replaces the SIGINT handler with ``sys.exit()``
    (``dask_jobqueue.runner``, meant for its batch-job runners): a Ctrl-C'd
    command would still unwind, but exit with status 0, as if it had
    succeeded. Whatever was there before is put back: Python's own handler,
    or ``SIG_IGN`` for a command started in the background or under
    ``nohup``, where SIGINT is meant to be ignored."""
    import signal
    import threading

    before = signal.getsignal(signal.SIGINT)
    try:
        import dask_jobqueue
    except ImportError:
        raise ImportError(f"--cluster {kind} needs dask-jobqueue: pip install 'flowreduce[hpc]'") from None
    if (before is not None and signal.getsignal(signal.SIGINT) is not before
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGINT, before)
    return dask_jobqueue


def jobqueue_options(config_name: str, options: dict) -> dict:
    """The keywords for dask-jobqueue's cluster class: ``options`` (given
    explicitly, they win), then ``jobqueue.<config_name>.*`` from the dask
    configuration (``jobqueue.yaml``), then flowreduce's defaults, which
    apply only where the configuration says nothing: workers run this
    Python; the scheduler's dashboard takes a free port on 127.0.0.1
    (``127.0.0.1:0``), not 8787 on every interface; each worker's own
    dashboard listens on its node's 127.0.0.1 (``--dashboard-address``
    added to the workers' arguments unless they set one or
    ``--no-dashboard``). ``scheduler_options`` are merged key by key in that order;
    an explicit ``interface`` also makes the scheduler listen there (the
    workers must reach it), replacing a configured scheduler ``host`` or
    ``interface`` unless the explicit ``scheduler_options`` name one, and
    puts flowreduce's default dashboard on that interface's address.
    ``dashboard_address`` sets the dashboard's address outright; ``security``
    and ``shared_temp_directory`` (TLS) go to dask-jobqueue as they are."""
    import dask

    options = dict(options)
    if options.get("python") is None and dask.config.get(f"jobqueue.{config_name}.python", None) is None:
        options["python"] = sys.executable
    configured = dask.config.get(f"jobqueue.{config_name}.scheduler-options", None) or {}
    explicit = options.get("scheduler_options") or {}
    scheduler = {"dashboard_address": f"{LOOPBACK}:0", **configured, **explicit}
    if options.get("interface") is not None and not {"host", "interface"} & set(explicit):
        scheduler.pop("host", None)
        scheduler["interface"] = options["interface"]
        if "dashboard_address" not in {**configured, **explicit}:  # the interface the user chose
            from distributed.utils import get_ip_interface

            with suppress(ValueError):  # not on this host: the scheduler will say so itself
                scheduler["dashboard_address"] = f"{get_ip_interface(options['interface'])}:0"
    if options.get("dashboard_address") is not None:
        scheduler["dashboard_address"] = options.pop("dashboard_address")
    options["scheduler_options"] = scheduler
    worker_args = options.get("worker_extra_args")
    if worker_args is None:  # dask-jobqueue's own lookup, including the deprecated name
        worker_args = (dask.config.get(f"jobqueue.{config_name}.worker-extra-args", None)
                       or dask.config.get(f"jobqueue.{config_name}.extra", None) or [])
    if not any(str(a).split("=")[0] in ("--dashboard-address", "--dashboard", "--no-dashboard")
               for a in worker_args):  # dask worker's default is ':0', every interface of the node
        worker_args = [*worker_args, "--dashboard-address", f"{LOOPBACK}:0"]
    options["worker_extra_args"] = list(worker_args)
    return options


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
    from flowreduce.schedule.hosts import place_of

    places = client.run(place_of)
    return sorted(places, key=lambda w: (places[w], w))


def job_ids(c: Any) -> list[str]:
    return sorted(str(j.job_id) for j in getattr(c, "workers", {}).values() if getattr(j, "job_id", None))


def pending_report(c: Any) -> str:
    """What the queue says about the cluster's jobs: state, why a job is
    not running yet, where it runs. SLURM (``squeue``), PBS (``qstat -f``),
    SGE (``qstat -j``) and LSF (``bjobs -UF``); other systems, or a query
    that cannot run, list the job ids."""
    ids = job_ids(c)
    if not ids:
        return "no job was accepted by the queue (see the cluster's job script: cluster.job_script())"
    system = next((QUERIES[k.__name__] for k in type(c).__mro__ if k.__name__ in QUERIES), None)
    if system is None:
        return f"jobs {', '.join(ids)} (ask the queue: condor_q / oarstat / showq)"
    command, parse = system
    cmd = command(ids)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"jobs {', '.join(ids)} ({cmd[0]} failed: {e})"
    return describe_jobs(ids, parse(out.stdout), complaint=out.stderr if out.returncode else "")


class JobStatus(NamedTuple):
    """One job as its queue reports it."""

    state: str  # RUNNING, PENDING, HELD, ... (the queue's word, spelt out)
    reason: str = ""  # why it is not running yet, when the queue says
    node: str = ""  # where it runs (the first node)


def describe_jobs(ids: list[str], status: dict[str, JobStatus], complaint: str = "") -> str:
    """``job 12 PENDING (Resources); job 13 RUNNING on n2; job 14 no longer
    queued ...`` for the cluster's job ``ids``; ``status`` is keyed by the
    queue's job ids, which may carry a server suffix (``12.pbs01``)."""
    by_number = {jid.split(".")[0]: st for jid, st in status.items()}
    parts = []
    for jid in ids:
        st = status.get(jid) or by_number.get(jid.split(".")[0])
        if st is None:
            why = complaint.strip().splitlines()[0] if complaint.strip() else ""
            parts.append(f"job {jid} no longer queued (ended or failed: see its log)"
                         + (f" [{why}]" if why else ""))
            continue
        parts.append(f"job {jid} {st.state}" + (f" ({st.reason})" if st.reason else "")
                     + (f" on {st.node}" if st.node else ""))
    return "; ".join(parts)


def parse_squeue(out: str) -> dict[str, JobStatus]:
    """``squeue -h -j IDS -o '%i|%T|%r|%N'``: one line per job."""
    jobs = {}
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 2 or not fields[0]:
            continue
        jid, state, reason, node = (fields + ["", ""])[:4]
        running = state in ("RUNNING", "COMPLETING")
        jobs[jid] = JobStatus(state, "" if running or reason in ("None", "") else reason,
                              "" if node in ("", "(null)") else node.split(",")[0])
    return jobs


_PBS_STATES = {"Q": "QUEUED", "H": "HELD", "W": "WAITING", "R": "RUNNING", "E": "EXITING", "T": "MOVING",
               "S": "SUSPENDED", "U": "SUSPENDED", "B": "RUNNING", "F": "FINISHED", "X": "FINISHED",
               "C": "FINISHED", "M": "MOVED"}


def parse_pbs_qstat(out: str) -> dict[str, JobStatus]:
    """``qstat -f IDS`` (PBS Pro, OpenPBS, Torque): a ``Job Id: ...`` line
    per job, then ``    name = value`` attributes, long values continued on
    lines that start with a tab. Reads ``job_state``, ``comment`` (the
    scheduler's ``Not Running: ...``) and ``exec_host``."""
    jobs: dict[str, dict[str, str]] = {}
    attrs: dict[str, str] = {}
    key = None
    for line in out.splitlines():
        if line.startswith("Job Id:"):
            attrs = jobs.setdefault(line.split(":", 1)[1].strip(), {})
            key = None
        elif line.startswith("\t") and key is not None:  # wrapped at a fixed width, mid-word too
            attrs[key] += line[1:]
        elif " = " in line:
            key, value = line.strip().split(" = ", 1)
            attrs[key] = value
    status = {}
    for jid, a in jobs.items():
        state = _PBS_STATES.get(a.get("job_state", "?"), a.get("job_state", "UNKNOWN"))
        comment = a.get("comment", "").strip()
        if comment.startswith("Not Running: "):
            comment = comment[len("Not Running: "):]
        node = a.get("exec_host", "").strip().split("+")[0].split("/")[0]
        status[jid] = JobStatus(state, "" if state in ("RUNNING", "EXITING", "FINISHED") else comment, node)
    return status


_SGE_STATES = {"r": "RUNNING", "t": "STARTING", "qw": "PENDING", "hqw": "HELD", "hRwq": "HELD",
               "Eqw": "ERROR", "s": "SUSPENDED", "dr": "DELETING"}


def parse_sge_qstat(out: str) -> dict[str, JobStatus]:
    """``qstat -j ID,ID`` (Grid Engine): per job a block of ``key: value``
    lines after a ``=====`` rule, ``scheduling info:`` continued on indented
    lines. A job with ``usage`` (or a ``job_state`` of ``r``) runs; else its
    scheduling info (queue instances dropped, grouped by why) and error
    reasons say why it waits."""
    blocks: list[dict[str, list[str]]] = []
    key = None
    for line in out.splitlines():
        if line.startswith("====="):
            blocks.append({})
            key = None
            continue
        if not line.strip():
            continue
        if not blocks:
            blocks.append({})
        m = re.match(r"(\S[^:]*?):\s+(.*)$", line)
        if m and not line[0].isspace():
            key = " ".join(m.group(1).split())
            blocks[-1].setdefault(key, []).append(m.group(2).strip())
        elif key is not None:
            blocks[-1][key].append(line.strip())
    status = {}
    for b in blocks:
        if "job_number" not in b:
            continue
        state_key = next((k for k in b if k.startswith("job_state")), None)
        if state_key:
            code = b[state_key][0].split()[-1]
            state = _SGE_STATES.get(code, code)
        elif any(k.startswith("usage") for k in b):
            state = "RUNNING"
        else:
            state = "PENDING"
        reasons = [r for k in b if k.startswith("error reason") for r in b[k]]
        dropped: dict[str, int] = {}
        for line in b.get("scheduling info", []):
            m = re.match(r'queue instance "[^"]*" dropped because (?:it is )?(.*)$', line)
            if m:
                dropped[m.group(1)] = dropped.get(m.group(1), 0) + 1
            elif line and line != "...":
                reasons.append(line)
        reasons += [f"{n} queue instance{'s' * (n > 1)} {why}" for why, n in dropped.items()]
        hosts = [v for k in b if k.startswith("exec_host_list") for v in b[k]]
        node = hosts[0].split(":")[0] if hosts else ""
        status[b["job_number"][0]] = JobStatus(state, "" if state == "RUNNING" else "; ".join(reasons), node)
    return status


_LSF_STATES = {"PEND": "PENDING", "PSUSP": "HELD", "RUN": "RUNNING", "USUSP": "SUSPENDED",
               "SSUSP": "SUSPENDED", "DONE": "FINISHED", "EXIT": "FAILED", "WAIT": "WAITING"}


def parse_lsf_bjobs(out: str) -> dict[str, JobStatus]:
    """``bjobs -UF IDS`` (LSF's long format, one line per event): per job a
    ``Job <12>, ..., Status <PEND>, ...`` line, a ``Started ... on <host>``
    line once it runs, and while it waits a ``PENDING REASONS:`` section of
    indented reasons ending in ``;`` (up to the next blank line or
    ``SECTION:`` heading). Jobs gone from the queue are only named on
    stderr (``Job <12> is not found``), so they are left out."""
    status: dict[str, JobStatus] = {}
    reasons: dict[str, list[str]] = {}
    current = None
    in_reasons = False
    for line in out.splitlines():
        text = line.strip()
        head = re.match(r"Job <([^>]+)>,.*?Status <(\w+)>", text)
        if head:
            current, code = head.groups()
            status[current] = JobStatus(_LSF_STATES.get(code, code))
            reasons[current] = []
            in_reasons = False
        elif current is None:
            continue
        elif text == "PENDING REASONS:":
            in_reasons = True
        elif not text or re.fullmatch(r"[A-Z][A-Z ()/_-]*:", text) or set(text) == {"-"}:
            in_reasons = False
        elif in_reasons:
            reasons[current].append(text.rstrip(";").strip())
        elif started := re.search(r"(?:Started|Dispatched)\b.*? on (?:Host\(s\) )?<([^>*]+\*)?([^>]+)>", text):
            if not status[current].node:
                status[current] = status[current]._replace(node=started.group(2))
    for jid, rs in reasons.items():
        if status[jid].state not in ("RUNNING", "FINISHED", "FAILED"):
            status[jid] = status[jid]._replace(reason="; ".join(r for r in rs if r))
    return status


#: cluster class -> (command for the job ids, parser of its stdout)
QUERIES: dict[str, tuple[Callable[[list[str]], list[str]], Callable[[str], dict[str, JobStatus]]]] = {
    "SLURMCluster": (lambda ids: ["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T|%r|%N"], parse_squeue),
    "PBSCluster": (lambda ids: ["qstat", "-f", *ids], parse_pbs_qstat),
    "SGECluster": (lambda ids: ["qstat", "-j", ",".join(ids)], parse_sge_qstat),
    "LSFCluster": (lambda ids: ["bjobs", "-UF", *ids], parse_lsf_bjobs),
}


def wait_for_workers(client: Any, c: Any, n: int, *, timeout: float = 300.0, progress: bool = True) -> None:
    """Wait until ``n`` workers are up, showing how many and what the queue
    says; raise TimeoutError with the queue's reasons after ``timeout``."""
    deadline = time.monotonic() + timeout
    with ExitStack() as stack:
        bar = None
        task: Any = None  # rich's TaskID, with a bar
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
