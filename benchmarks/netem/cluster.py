"""Emulated multi-host Dask cluster built from Linux network namespaces.

``netns.sh up HOSTS RATE`` builds one namespace per "host" (``fr-h0`` ...),
joined through a bridge in ``fr-sw``, each host link shaped with tbf to RATE in
both directions.  This module starts a Dask scheduler in ``fr-h0`` (the head
host) and ``workers_per_host`` Dask workers in every host namespace, and tears
everything down again on exit.

The 10.77.0.x addresses exist only inside the namespaces, so a client in the
root namespace cannot reach the cluster: run the code that talks to Dask inside
the head namespace with :meth:`EmulatedCluster.run`, which sets
``DASK_SCHEDULER_ADDRESS`` for it.

Library use::

    from cluster import EmulatedCluster
    with EmulatedCluster(hosts=2, workers_per_host=1, rate="1gbit") as c:
        print(c.scheduler_address, c.hosts)
        proc = c.run("probe_transfer.py", "--mbytes", "100")
        print(proc.stdout)

CLI::

    python benchmarks/netem/cluster.py --hosts 2 --workers-per-host 1 \\
        --rate 1gbit -- SCRIPT.py ARGS...

Requires root, iproute2 (``ip``, ``tc``).
"""
from __future__ import annotations

import argparse
import atexit
import errno
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = [
    "EmulatedCluster",
    "ClusterStartError",
    "NETNS_SH",
    "HEAD_NS",
    "host_ns",
    "host_ip",
    "fr_namespaces",
    "netns_usable",
    "rate_bytes",
]

logger = logging.getLogger("flowreduce.netem")

HERE = Path(__file__).resolve().parent
NETNS_SH = HERE / "netns.sh"
PREFIX = "fr-"
HEAD_NS = "fr-h0"
SUBNET = "10.77.0"
BASE_OCTET = 10
SCHEDULER_PORT = 8786
LOCK_PATH = Path(tempfile.gettempdir()) / "flowreduce-netem.lock"

_REGISTER_RE = re.compile(r"Register worker addr: (\S+) name: (\S+)")

#: Dask settings that cut what every idle process costs (the statistical
#: profiler samples every thread each 10 ms, the event-loop watchdog ticks
#: every 20 ms, the system and memory monitors poll psutil 2-10 times a
#: second). On real hosts each process pays that on its own CPU; here 16+
#: processes pay it on the machine's shared cores, and it would be counted
#: against the links. Work stealing is off: flowreduce pins every task. The
#: active memory manager is off: its ReduceReplicas policy drops the copies
#: that ``client.replicate`` (the hand-written baseline) makes while
#: replicate is still making them, and on slow links the two never finish.
QUIET_ENV = {
    "DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False",
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "5s",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__GIL__ENABLED": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "1s",
    "DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False",
}


def host_ns(i: int) -> str:
    """Namespace name of host ``i``."""
    return f"{PREFIX}h{i}"


def host_ip(i: int) -> str:
    """Address of host ``i`` inside the emulated network."""
    return f"{SUBNET}.{BASE_OCTET + i}"


def rate_bytes(rate: str) -> float:
    """A tc rate in bytes/s: ``100mbit`` -> 12.5e6 (k/m/g ``bit``; ``bps``
    means bytes; a bare number is bits, as tc reads it)."""
    text = rate.lower().strip()
    for unit, scale in (
        ("gbit", 1e9 / 8),
        ("mbit", 1e6 / 8),
        ("kbit", 1e3 / 8),
        ("bit", 1 / 8),
        ("gbps", 1e9),
        ("mbps", 1e6),
        ("kbps", 1e3),
        ("bps", 1.0),
    ):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text) / 8


def fr_namespaces() -> list[str]:
    """Names of all ``fr-*`` network namespaces currently present."""
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX))


def netns_usable() -> tuple[bool, str]:
    """(ok, reason): whether this process can build the emulated network."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (install iproute2)"
    return True, ""


class ClusterStartError(RuntimeError):
    """The emulated cluster did not come up."""


class _Proc:
    """A process started inside a namespace, with its log file."""

    def __init__(self, name: str, ns: str, argv: list[str], log_path: Path, env):
        self.name = name
        self.ns = ns
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.argv = ["ip", "netns", "exec", ns, *argv]
        # own session => own process group, unaffected by a terminal's ^C and
        # killable as a group; `ip netns exec` execs the command, so
        # popen.pid is the dask process itself.
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        except OSError as e:  # pragma: no cover
            if e.errno != errno.ESRCH:
                raise

    def close_log(self) -> None:
        try:
            self._log.close()
        except Exception:  # pragma: no cover
            pass

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        lines = self.log_text().splitlines()[-n:]
        return "\n".join(f"    [{self.name}] {line}" for line in lines)


class EmulatedCluster:
    """Context manager: emulated hosts (netns + shaped veths) running Dask.

    Attributes after ``__enter__``:

    ``scheduler_address``  ``tcp://10.77.0.10:8786``
    ``hosts``              ``{"h0": ["tcp://10.77.0.10:PORT", ...], "h1": [...]}``
    ``worker_names``       ``{"tcp://10.77.0.10:PORT": "h0-w0", ...}``
    ``namespaces``         ``{"h0": "fr-h0", ...}``
    ``log_dir``            directory with scheduler/worker logs
    ``pids``               pids of every process the harness started
    """

    def __init__(
        self,
        hosts: int = 2,
        workers_per_host: int = 1,
        rate: str = "1gbit",
        nthreads: int = 1,
        memory_limit: str = "2GB",
        *,
        nanny: bool = True,
        startup_timeout: float = 60.0,
        lock_timeout: float = 600.0,
        keep_logs: bool = False,
        clean_stale: bool = True,
        quiet: bool = True,
        extra_env: dict | None = None,
    ):
        if hosts < 1:
            raise ValueError("hosts must be >= 1")
        if workers_per_host < 1:
            raise ValueError("workers_per_host must be >= 1")
        self.n_hosts = int(hosts)
        self.workers_per_host = int(workers_per_host)
        self.rate = str(rate)
        self.nthreads = int(nthreads)
        self.memory_limit = str(memory_limit)
        self.nanny = nanny
        self.startup_timeout = startup_timeout
        self.lock_timeout = lock_timeout
        self.keep_logs = keep_logs or os.environ.get("FR_NETEM_KEEP_LOGS") == "1"
        self.clean_stale = clean_stale
        self.extra_env = {**(QUIET_ENV if quiet else {}), **(extra_env or {})}

        self.scheduler_address = f"tcp://{host_ip(0)}:{SCHEDULER_PORT}"
        self.namespaces = {f"h{i}": host_ns(i) for i in range(self.n_hosts)}
        self.hosts: dict[str, list[str]] = {}
        self.worker_names: dict[str, str] = {}
        self.log_dir: Path | None = None
        self.pids: list[int] = []

        self._procs: list[_Proc] = []
        self._scheduler: _Proc | None = None
        self._workers: list[_Proc] = []
        self._lock_fd: int | None = None
        self._old_handlers: dict[int, object] = {}
        self._net_up = False
        self._torn_down = True
        self._teardown_lock = threading.Lock()

    # ------------------------------------------------------------------ enter
    def __enter__(self) -> EmulatedCluster:
        ok, reason = netns_usable()
        if not ok:
            raise ClusterStartError(f"cannot build emulated cluster: {reason}")
        self._torn_down = False
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._acquire_lock()
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    # ----------------------------------------------------------- signal setup
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def on_signal(signum, frame):
            name = signal.Signals(signum).name
            logger.warning("netem: got %s, tearing the emulated cluster down", name)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, h in self._old_handlers.items():
            try:
                signal.signal(sig, h if h is not None else signal.SIG_DFL)
            except (TypeError, ValueError):  # pragma: no cover
                pass
        self._old_handlers.clear()

    # ------------------------------------------------------------------ lock
    def _acquire_lock(self) -> None:
        """Serialise harness users on this machine: namespace names are fixed."""
        fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ClusterStartError(
                        f"another emulated cluster holds {LOCK_PATH} "
                        f"(waited {self.lock_timeout:.0f} s)"
                    ) from None
                time.sleep(0.5)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    # ----------------------------------------------------------------- start
    def _env(self) -> dict:
        env = dict(os.environ)
        env.pop("DASK_SCHEDULER_ADDRESS", None)
        env["PYTHONUNBUFFERED"] = "1"
        # One BLAS thread per process, as dask's nanny sets for its workers: without
        # a nanny (--no-nanny) OpenBLAS starts a thread per core in every worker,
        # and several workers on 2 cores then slow each other's matmuls 10-30x.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
        env.update(self.extra_env)
        return env

    def _netns(self, *args: str) -> None:
        proc = subprocess.run(
            ["bash", str(NETNS_SH), *args], capture_output=True, text=True
        )
        for line in (proc.stdout + proc.stderr).splitlines():
            logger.info("%s", line)
        if proc.returncode != 0:
            raise ClusterStartError(
                f"netns.sh {' '.join(args)} failed (rc={proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}"
            )

    def _spawn(self, name: str, ns: str, argv: list[str]) -> _Proc:
        assert self.log_dir is not None
        p = _Proc(name, ns, argv, self.log_dir / f"{name}.log", self._env())
        self._procs.append(p)
        self.pids.append(p.pid)
        return p

    def _start(self) -> None:
        t0 = time.monotonic()
        self.log_dir = Path(tempfile.mkdtemp(prefix="fr-netem-"))

        stale = fr_namespaces()
        if stale:
            if not self.clean_stale:
                raise ClusterStartError(
                    f"stale fr-* namespaces exist: {stale}; run netns.sh down"
                )
            logger.warning("netem: removing stale namespaces %s", stale)
            self._netns("down")

        self._net_up = True  # from here on, teardown must run netns.sh down
        self._netns("up", str(self.n_hosts), self.rate)

        dask_cmd = [sys.executable, "-m", "dask"]
        self._scheduler = self._spawn(
            "scheduler",
            HEAD_NS,
            [
                *dask_cmd, "scheduler",
                "--host", host_ip(0),
                "--port", str(SCHEDULER_PORT),
                "--no-dashboard",
            ],
        )
        self._wait_for_log(self._scheduler, "Scheduler at:", self.startup_timeout)

        for i in range(self.n_hosts):
            for j in range(self.workers_per_host):
                name = f"h{i}-w{j}"
                wdir = self.log_dir / name
                wdir.mkdir()
                self._workers.append(
                    self._spawn(
                        name,
                        host_ns(i),
                        [
                            *dask_cmd, "worker", self.scheduler_address,
                            "--host", host_ip(i),
                            "--nthreads", str(self.nthreads),
                            "--memory-limit", self.memory_limit,
                            "--name", name,
                            "--no-dashboard",
                            "--local-directory", str(wdir),
                            "--nanny" if self.nanny else "--no-nanny",
                        ],
                    )
                )
        self._wait_for_workers(t0 + self.startup_timeout)
        logger.info(
            "netem: cluster up in %.1f s: %s", time.monotonic() - t0, self.hosts
        )

    def _check_alive(self) -> None:
        for p in self._procs:
            if not p.alive():
                raise ClusterStartError(
                    f"{p.name} (in {p.ns}) exited with rc={p.popen.returncode} "
                    f"during startup; log tail:\n{p.log_tail()}"
                )

    def _startup_failure(self, what: str) -> ClusterStartError:
        tails = "\n".join(p.log_tail(15) for p in self._procs)
        return ClusterStartError(f"{what}\n{tails}")

    def _wait_for_log(self, proc: _Proc, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in proc.log_text():
            self._check_alive()
            if time.monotonic() > deadline:
                raise self._startup_failure(
                    f"timed out after {timeout:.0f} s waiting for {proc.name}"
                )
            time.sleep(0.1)

    def _wait_for_workers(self, deadline: float) -> None:
        """Wait until the scheduler has registered every expected worker."""
        assert self._scheduler is not None
        expected = {w.name for w in self._workers}
        while True:
            registered = {
                name: addr
                for addr, name in _REGISTER_RE.findall(self._scheduler.log_text())
            }
            if expected <= registered.keys():
                break
            self._check_alive()
            if time.monotonic() > deadline:
                missing = sorted(expected - registered.keys())
                raise self._startup_failure(
                    f"timed out waiting for workers {missing} to register"
                )
            time.sleep(0.1)
        self.hosts = {f"h{i}": [] for i in range(self.n_hosts)}
        for i in range(self.n_hosts):
            for j in range(self.workers_per_host):
                addr = registered[f"h{i}-w{j}"]
                self.hosts[f"h{i}"].append(addr)
                self.worker_names[addr] = f"h{i}-w{j}"

    # ------------------------------------------------------------------- run
    def run(
        self,
        python_file: str | os.PathLike,
        *args: str,
        timeout: float | None = None,
        capture_output: bool = True,
        check: bool = False,
        env: dict | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``python_file args...`` inside the head namespace (fr-h0).

        ``DASK_SCHEDULER_ADDRESS`` is set to :attr:`scheduler_address`.
        Returns the ``subprocess.CompletedProcess`` (text mode); with
        ``capture_output=False`` the output goes to this process's stdout/err.
        """
        if self._torn_down or self._scheduler is None:
            raise RuntimeError("cluster is not running")
        run_env = self._env()
        run_env["DASK_SCHEDULER_ADDRESS"] = self.scheduler_address
        if env:
            run_env.update(env)
        argv = [
            "ip", "netns", "exec", HEAD_NS,
            sys.executable, os.fspath(python_file), *map(str, args),
        ]
        return subprocess.run(
            argv,
            env=run_env,
            text=True,
            capture_output=capture_output,
            timeout=timeout,
            check=check,
            stdin=subprocess.DEVNULL,
        )

    # -------------------------------------------------------------- teardown
    def close(self) -> None:
        """Stop every process, delete the namespaces. Idempotent."""
        with self._teardown_lock:
            if self._torn_down:
                return
            # a second ^C / SIGTERM must not interrupt the cleanup half-way
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    try:
                        signal.signal(sig, signal.SIG_IGN)
                    except ValueError:  # pragma: no cover
                        pass
            try:
                self._stop_processes()
                if self._net_up:
                    try:
                        self._netns("down")
                    except ClusterStartError as e:
                        logger.error("netem: %s", e)
                    self._net_up = False
                self._reclaim_segments()
            finally:
                for p in self._procs:
                    p.close_log()
                if self.log_dir is not None and not self.keep_logs:
                    shutil.rmtree(self.log_dir, ignore_errors=True)
                elif self.log_dir is not None:
                    logger.warning("netem: logs kept in %s", self.log_dir)
                self._release_lock()
                self._torn_down = True
                self._restore_signal_handlers()
                try:
                    atexit.unregister(self.close)
                except Exception:  # pragma: no cover
                    pass

    @staticmethod
    def _reclaim_segments() -> None:
        """Unlink the shared-memory segments of the workers just stopped: a
        worker killed with its process group cannot unlink its own, and
        flowreduce's pool unlinks those whose owner is gone."""
        try:
            from flowreduce.shm.pool import Pool, config

            Pool(config()["directory"]).reclaim_orphans()
        except Exception as e:  # the harness also runs without flowreduce; never stop a teardown for this
            logger.warning("netem: shared-memory segments not reclaimed: %r", e)

    def _stop_processes(self) -> None:
        def stop(procs: list[_Proc], grace: float) -> None:
            for p in procs:
                if p.alive():
                    p.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in procs:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            for p in procs:
                if p.alive():
                    logger.warning("netem: SIGKILL %s (pid %d)", p.name, p.pid)
                    p.signal_group(signal.SIGKILL)
                    try:
                        p.popen.wait(timeout=5)
                    except subprocess.TimeoutExpired:  # pragma: no cover
                        logger.error("netem: %s (pid %d) survives", p.name, p.pid)
            # reap whole group (e.g. nanny children) even if the leader is gone
            for p in procs:
                p.signal_group(signal.SIGKILL)

        # workers first (so they don't sit reconnecting), then the scheduler
        stop(self._workers, grace=10.0)
        if self._scheduler is not None:
            stop([self._scheduler], grace=5.0)


# ----------------------------------------------------------------------- CLI
def _parse_cli(argv: list[str]):
    if "--" in argv:
        k = argv.index("--")
        opts, rest = argv[:k], argv[k + 1:]
    else:
        opts, rest = argv, []
    ap = argparse.ArgumentParser(
        prog="cluster.py",
        description="Bring up an emulated multi-host Dask cluster (network "
        "namespaces + tbf-shaped veths), run SCRIPT inside the head namespace "
        "with DASK_SCHEDULER_ADDRESS set, then tear everything down.",
        usage="%(prog)s [options] -- SCRIPT.py [ARGS...]",
    )
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--workers-per-host", type=int, default=1)
    ap.add_argument("--rate", default="1gbit", help="tbf rate per host link, e.g. 1gbit, 100mbit")
    ap.add_argument("--nthreads", type=int, default=1)
    ap.add_argument("--memory-limit", default="2GB")
    ap.add_argument("--no-nanny", action="store_true")
    ap.add_argument("--no-quiet", action="store_true",
                    help="keep dask's profiler and monitors at their defaults (see QUIET_ENV)")
    ap.add_argument("--startup-timeout", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=None, help="timeout for SCRIPT (s)")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    ns = ap.parse_args(opts)
    if not rest:
        ap.error("missing '-- SCRIPT.py [ARGS...]'")
    return ns, rest


def main(argv: list[str] | None = None) -> int:
    ns, rest = _parse_cli(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format="%(asctime)s %(message)s",
        stream=sys.stderr,
    )
    script, args = rest[0], rest[1:]
    with EmulatedCluster(
        hosts=ns.hosts,
        workers_per_host=ns.workers_per_host,
        rate=ns.rate,
        nthreads=ns.nthreads,
        memory_limit=ns.memory_limit,
        nanny=not ns.no_nanny,
        quiet=not ns.no_quiet,
        startup_timeout=ns.startup_timeout,
        keep_logs=ns.keep_logs,
    ) as cluster:
        print(
            f"# emulated cluster: {cluster.n_hosts} hosts x "
            f"{cluster.workers_per_host} workers @ {cluster.rate}; "
            f"scheduler {cluster.scheduler_address}; hosts {cluster.hosts}",
            file=sys.stderr,
            flush=True,
        )
        proc = cluster.run(script, *args, capture_output=False, timeout=ns.timeout)
        return proc.returncode


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("cluster.py: interrupted; emulated cluster torn down", file=sys.stderr)
        sys.exit(130)
