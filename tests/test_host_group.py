"""A host group on its own (no cluster): two ranks of one process, each on
a thread, exchanging through a control segment in a temporary directory.
A rank that waits for its peer longer than a collective takes sleeps on the
peer's step counter (a futex) rather than polling, and is woken by it."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from utils import wait_until

from flowreduce.ops import resolve_op
from flowreduce.shm import futex, host_group
from flowreduce.shm.host_group import HostGroup


def _in_syscall(tid: int) -> tuple[int, int] | None:
    """(syscall number, first argument) of thread ``tid`` of this process if it is blocked in one."""
    fields = open(f"/proc/self/task/{tid}/syscall").read().split()
    return (int(fields[0]), int(fields[1], 16)) if fields and fields[0].isdigit() else None


def test_a_rank_waiting_for_its_peer_sleeps_on_the_peers_stamp_and_is_woken(tmp_path, monkeypatch):
    assert futex.AVAILABLE  # Linux on x86-64 or aarch64, where the host groups run
    # a sleep's own timeout (the periodic check of the abort word and deadline) longer than the test:
    # only the peer's wake can end it
    monkeypatch.setattr(host_group, "CHECK_EVERY", 600.0)
    groups = [HostGroup(str(tmp_path), "fr-test-g0", [0, 1], r, lambda: None) for r in (0, 1)]
    x = [np.arange(1000, dtype=np.int64), np.arange(1000, dtype=np.int64) * 3]
    got: dict[str, object] = {}

    def rank0() -> None:
        got["tid"] = threading.get_native_id()
        try:
            got["out"] = groups[0].allreduce(x[0], resolve_op("sum"), np.dtype(np.int64), "allreduce #1",
                                             time.monotonic() + 60)
        except BaseException as e:  # noqa: BLE001 - shown by the assertion below
            got["out"] = e

    waiting = threading.Thread(target=rank0)
    waiting.start()
    # rank 1's step counter, where rank 0 sleeps once it has waited past its yielding time
    stamp = groups[0].base_address + 8 * groups[0].stamp_at[1]
    assert wait_until(lambda: "tid" in got and _in_syscall(got["tid"]) == (futex.SYS_FUTEX, stamp), 30), \
        _in_syscall(got["tid"])
    mine = groups[1].allreduce(x[1], resolve_op("sum"), np.dtype(np.int64), "allreduce #1", time.monotonic() + 60)
    waiting.join(30)
    assert not waiting.is_alive()
    for out in (got["out"], mine):
        np.testing.assert_array_equal(out, x[0] + x[1])
    for g in groups:
        g.close(failed=False)
    assert os.listdir(tmp_path) == []
