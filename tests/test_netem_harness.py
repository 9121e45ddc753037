"""End-to-end test of the emulated multi-host cluster (benchmarks/netem).

Needs root, iproute2, and a kernel and container that allow network
namespaces, veth pairs, a bridge and the tbf qdisc (probed first); skipped,
saying which is missing, otherwise.  Brings up 2 hosts x 1 worker behind
1 Gbit/s tbf-shaped veths, moves 5 MB between the hosts with
probe_transfer.py (run inside the head namespace), runs a hierarchical
all-reduce across 2 hosts x 2 workers, and checks that teardown leaves no
namespace, veth, qdisc or dask process behind: on normal exit, on an
exception, and -- with the harness in a driver process -- on SIGINT, on
SIGTERM and from the atexit hook.  Takes ~15-30 s.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from utils import wait_until

from flowreduce.shm import pool as shm_pool

NETEM_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "netem"
PROBE = NETEM_DIR / "probe_transfer.py"


def _load_cluster_module():
    spec = importlib.util.spec_from_file_location(
        "flowreduce_netem_cluster", NETEM_DIR / "cluster.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _netns_skip_reason() -> str | None:
    """Why the harness cannot run here, or None. Beyond root and iproute2,
    builds what ``netns.sh up`` builds -- a namespace, a veth pair, a bridge,
    a tbf qdisc -- in a private probe namespace (not named ``fr-*``, so no
    harness run mistakes it for its own), so a container or kernel lacking
    any of them skips with the reason instead of failing mid-test."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated-network harness needs root (ip netns / veth / tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not installed"
    name = f"frprobe-{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if add.returncode != 0:
        return f"'ip netns add' does not work here: {add.stderr.strip()}"
    steps = [
        ("'ip netns exec' does not work here", ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]),
        ("veth pairs cannot be created here", ["ip", "-n", name, "link", "add", "frpa", "type", "veth",
                                               "peer", "name", "frpb"]),
        ("a Linux bridge cannot be created here", ["ip", "-n", name, "link", "add", "frbr", "type", "bridge"]),
        ("the tbf qdisc cannot be created here (kernel without sch_tbf?)",
         ["tc", "-n", name, "qdisc", "add", "dev", "frpa", "root", "tbf", "rate", "1gbit", "burst", "256kb",
          "latency", "25ms"]),
    ]
    try:
        for why, argv in steps:
            run = subprocess.run(argv, capture_output=True, text=True)
            if run.returncode != 0:
                return f"{why}: {run.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@pytest.fixture(scope="module")
def netem():
    reason = _netns_skip_reason()
    if reason:
        pytest.skip(reason)
    return _load_cluster_module()


def _ip_out(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True).stdout


def _alive(pid: int) -> bool:
    """True if pid runs and is not a zombie (ignores pid reuse by non-dask)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z" and (b"dask" in cmdline or b"distributed" in cmdline
                             or b"multiprocessing" in cmdline)


def _assert_clean(netem, pids):
    assert netem.fr_namespaces() == [], _ip_out("ip", "netns", "list")
    assert "fr-" not in _ip_out("ip", "netns", "list")
    assert "fr-" not in _ip_out("ip", "-o", "link", "show")
    assert "fr-" not in _ip_out("tc", "qdisc", "show")
    survivors = [p for p in pids if _alive(p)]
    assert survivors == [], f"processes still alive after teardown: {survivors}"
    orphans = [s for s in shm_pool.segments() if not shm_pool.owner_alive(s)]
    assert orphans == [], f"shared-memory segments of stopped workers left: {orphans}"


def test_two_hosts_transfer_and_clean_teardown(netem):
    all_pids: list[int] = []
    with netem.EmulatedCluster(
        hosts=2, workers_per_host=1, rate="1gbit", startup_timeout=30
    ) as c:
        log_dir = c.log_dir
        assert c.scheduler_address == "tcp://10.77.0.10:8786"
        assert sorted(c.hosts) == ["h0", "h1"]
        assert all(len(v) == 1 for v in c.hosts.values())
        assert c.hosts["h0"][0].startswith("tcp://10.77.0.10:")
        assert c.hosts["h1"][0].startswith("tcp://10.77.0.11:")
        # tbf on both ends of host 1's link
        assert "tbf" in _ip_out("tc", "-n", "fr-h1", "qdisc", "show", "dev", "fr-eth1")
        assert "tbf" in _ip_out("tc", "-n", "fr-sw", "qdisc", "show", "dev", "fr-sp1")

        proc = c.run(PROBE, "--mbytes", "5", timeout=60)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        res = json.loads(proc.stdout)

        # every process in the namespaces (incl. nanny children) right now
        all_pids += c.pids
        for ns in c.namespaces.values():
            all_pids += [int(p) for p in _ip_out("ip", "netns", "pids", ns).split()]

    src_ip = res["src_worker"].split("://")[1].rsplit(":", 1)[0]
    dst_ip = res["dst_worker"].split("://")[1].rsplit(":", 1)[0]
    assert src_ip.startswith("10.77.0.") and dst_ip.startswith("10.77.0.")
    assert src_ip != dst_ip
    assert res["src_worker"] in c.hosts["h0"] and res["dst_worker"] in c.hosts["h1"]
    assert res["bytes"] == 5_000_000
    assert res["ok"] is True
    run = res["runs"][0]
    assert run["checksum"] == run["expected_checksum"]
    assert res["dst_worker"] in run["holders_after"]
    # shaped to 1 Gbit/s: the transfer cannot be (much) faster than the link
    assert 0 < res["gbit_per_s"] < 1.5, res

    _assert_clean(netem, all_pids)
    assert not log_dir.exists()


def test_teardown_on_exception(netem):
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        with netem.EmulatedCluster(hosts=2, workers_per_host=1, startup_timeout=30) as c:
            pids += c.pids
            assert len(netem.fr_namespaces()) == 3  # fr-h0, fr-h1, fr-sw
            raise RuntimeError("boom")
    _assert_clean(netem, pids)


# A driver in its own process, as campaign.sh and users run the harness: it brings up
# 2 hosts x 1 worker, reports what it started, then waits (bounded) to be signalled --
# or, with "atexit", for a go-file, and leaves without __exit__ so that only the
# harness's atexit hook can tear down.
DRIVER = """
import importlib.util, json, os, subprocess, sys, time

cluster_py, how, state, go = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("netem_cluster", cluster_py)
netem = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netem)


def report(c):
    ns_pids = [int(p) for ns in netem.fr_namespaces()
               for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
    with open(state + ".tmp", "w") as f:
        json.dump({"pids": c.pids, "ns_pids": ns_pids, "log_dir": str(c.log_dir)}, f)
    os.replace(state + ".tmp", state)


def wait(seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not os.path.exists(go):
        time.sleep(0.1)


c = netem.EmulatedCluster(hosts=2, workers_per_host=1, startup_timeout=60, lock_timeout=300)
if how == "atexit":
    c.__enter__()
    report(c)
    wait(60)
    sys.exit(0)  # no __exit__, no close(): the atexit hook must tear down
try:
    with c:
        report(c)
        wait(60)  # the test signals long before
    sys.exit(3)  # not interrupted
except KeyboardInterrupt:
    sys.exit(130)
"""

EXIT = {"SIGINT": 130, "SIGTERM": 128 + signal.SIGTERM, "atexit": 0}


def _force_down(netem) -> None:
    """After a failed run: take the harness's lock (so no other user's cluster
    is up), then remove whatever fr-* is left."""
    fd = os.open(netem.LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if wait_until(lambda: _try_lock(fd), timeout=600, step=0.5):
            subprocess.run(["bash", str(netem.NETNS_SH), "down"], capture_output=True, timeout=120)
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "atexit"])
def test_teardown_on_signal_or_exit_of_the_driver(netem, tmp_path, how):
    """The harness in a driver process: once its 2 hosts are up, SIGINT (a
    user's ^C), SIGTERM (a job scheduler's kill), or leaving without
    ``__exit__`` (atexit) stops every dask process and removes the
    namespaces, veths and tbf qdiscs; the driver exits as the handlers say
    (130 / 143 / 0)."""
    state, go, err = tmp_path / "state.json", tmp_path / "go", tmp_path / "driver.err"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(driver), str(NETEM_DIR / "cluster.py"), how, str(state), str(go)],
                                stdin=subprocess.DEVNULL, stdout=stderr, stderr=subprocess.STDOUT)
    came_up = False
    try:
        # bounded: the lock (another user of the harness) plus startup
        assert wait_until(lambda: state.exists() or proc.poll() is not None, timeout=420), "driver never came up"
        assert state.exists(), f"driver exited with {proc.returncode} before its cluster was up:\n{err.read_text()}"
        came_up = True
        up = json.loads(state.read_text())
        # it is up: namespaces, the veths with their tbf qdiscs, the dask processes
        assert netem.fr_namespaces() == ["fr-h0", "fr-h1", "fr-sw"]
        assert "tbf" in _ip_out("tc", "-n", "fr-h1", "qdisc", "show", "dev", "fr-eth1")
        assert "tbf" in _ip_out("tc", "-n", "fr-sw", "qdisc", "show", "dev", "fr-sp1")
        pids = up["pids"] + up["ns_pids"]
        assert len(up["pids"]) == 3 and all(_alive(p) for p in up["pids"])  # scheduler + 2 workers

        if how == "atexit":
            go.touch()
        else:
            proc.send_signal(getattr(signal, how))
        rc = proc.wait(timeout=120)
        log = err.read_text()
        assert rc == EXIT[how], f"driver exited with {rc}:\n{log}"
        if how != "atexit":
            assert f"got {how}, tearing the emulated cluster down" in log, log
        _assert_clean(netem, pids)
        assert not Path(up["log_dir"]).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if came_up and netem.fr_namespaces():
            _force_down(netem)


def test_hierarchical_allreduce_crosses_the_shaped_links_as_planned(netem):
    """2 hosts x 2 workers: hierarchical groups the ranks by host (from the
    workers' addresses), every rank gets the numpy sum on its own worker, the
    trace's bytes between hosts are the plan's -- fewer than a flat ring
    would send across -- and the shaped links' own counters saw them go
    through. Teardown leaves no namespace, process or qdisc."""
    import flowreduce

    pids: list[int] = []
    with netem.EmulatedCluster(hosts=2, workers_per_host=2, rate="1gbit", startup_timeout=60) as c:
        proc = c.run(NETEM_DIR / "allreduce_probe.py", "--size", "100000", timeout=120)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        pids += c.pids
        for ns in c.namespaces.values():
            pids += [int(p) for p in _ip_out("ip", "netns", "pids", ns).split()]
    _assert_clean(netem, pids)
    host = {w: h for h, ws in c.hosts.items() for w in ws}
    assert res["ok"] and res["placed"]
    assert [[host[res["workers"][r]] for r in g] for g in res["groups"]] == [["h0", "h0"], ["h1", "h1"]]

    def across(links):
        return sum(x["bytes"] for x in links if host[x["source"]] != host[x["dest"]])

    measured, planned = across(res["links"]), across(res["planned_links"])
    assert planned > 0 and measured == pytest.approx(planned, rel=0.01, abs=2048)
    # every worker address in the trace's links is on the emulated network, and the
    # bytes between hosts went through the tbf qdiscs (headers and the scheduler's
    # messages on top: at most 10% + 300 kB more)
    assert all(x["source"].startswith("tcp://10.77.0.") for x in res["links"])
    assert planned <= sum(res["link_sent"]) <= 1.1 * planned + 300_000
    assert min(res["link_sent"]) >= planned / 2  # both hosts sent their half
    # the cost card's share: p ranks each send 2(h-1)/h of their 1/g shard across (h=2 hosts, g=2)
    assert planned == pytest.approx(4 * 2 * (2 - 1) / 2 * res["nbytes"] / 2)
    # a flat ring over the same ranks sends more across the hosts
    flat = flowreduce.plan("ring", 4)
    rank_host = [host[w] for w in res["workers"]]
    flat_across = sum((t.hi - t.lo) / flat.segments * res["nbytes"]
                      for t in flat.transfers() if rank_host[t.source] != rank_host[t.dest])
    assert planned < flat_across
