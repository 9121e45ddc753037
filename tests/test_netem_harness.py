"""End-to-end test of the emulated multi-host cluster (benchmarks/netem).

Needs root and a working ``ip netns``; skipped otherwise.  Brings up 2 hosts x
1 worker behind 1 Gbit/s tbf-shaped veths, moves 5 MB between the hosts with
probe_transfer.py (run inside the head namespace) and checks that teardown
leaves no namespace, process or qdisc behind.  Takes ~5-10 s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated-network harness needs root (ip netns / veth / tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not installed"
    name = "fr-probe"
    add = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if add.returncode != 0:
        return f"'ip netns add' does not work here: {add.stderr.strip()}"
    try:
        up = subprocess.run(
            ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
            capture_output=True,
            text=True,
        )
        if up.returncode != 0:
            return f"'ip netns exec' does not work here: {up.stderr.strip()}"
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
