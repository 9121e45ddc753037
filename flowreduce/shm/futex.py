"""Sleeping on a word of shared memory until another process changes it: Linux futexes.

A rank of a host group waiting for its peers (:mod:`flowreduce.shm.host_group`)
first gives its core away at every poll; if the wait goes on, it sleeps in
the kernel on the peer's step counter (``FUTEX_WAIT``, shared: the word lies
in a mapping of several processes) and the peer wakes it as it bumps the
counter (``FUTEX_WAKE``) if the sleeper asked to be woken (a word it sets
before it sleeps: most steps have no sleeper, and then cost no system call;
should a sleeper and a peer's bump cross so that neither sees the other's
write, the sleep ends at its timeout: :data:`~flowreduce.shm.host_group.ASLEEP_SECONDS`, 100 ms, or
the deadline if sooner). On a host whose ranks outnumber its cores, a rank
that waits then takes no CPU from the peer it waits for. The counters are
64-bit little-endian words; a futex is the 32-bit word at the same address,
their low half, which changes at every step.

Through libc's ``syscall()`` (ctypes releases the GIL during the call). Where
there are no futexes (another OS, or an architecture whose syscall number is
not here) :data:`AVAILABLE` is False and the waiting rank sleeps between
polls instead.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from typing import Any

#: ``SYS_futex`` per machine (``platform.machine()``)
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "aarch64": 98, "arm64": 98}
_WAIT, _WAKE = 0, 1  # FUTEX_WAIT, FUTEX_WAKE (not _PRIVATE: the word is shared between processes)
_EVERY = 0x7FFFFFFF  # wake every waiter


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> tuple[Any, Any]:
    number = _SYS_FUTEX.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None, None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None, None
    call.restype = ctypes.c_long
    return call, ctypes.c_long(number)


_CALL, _NUMBER = _syscall()
AVAILABLE = _CALL is not None
#: the futex syscall's number here (None: no futexes), as ``/proc/<pid>/task/<tid>/syscall`` shows a sleeper
SYS_FUTEX: int | None = _NUMBER.value if _NUMBER is not None else None


def wait(address: int, expected: int, seconds: float) -> None:
    """Sleep while the 32-bit word at ``address`` holds the low half of
    ``expected``, at most ``seconds`` (a wake, a signal or a changed word
    returns at once; the caller reads the word again either way)."""
    whole = int(seconds)
    timeout = _Timespec(whole, int((seconds - whole) * 1e9))
    _CALL(_NUMBER, ctypes.c_void_p(address), ctypes.c_int(_WAIT), ctypes.c_uint32(expected & 0xFFFFFFFF),
          ctypes.byref(timeout), None, ctypes.c_int(0))


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    _CALL(_NUMBER, ctypes.c_void_p(address), ctypes.c_int(_WAKE), ctypes.c_int(_EVERY), None, None, ctypes.c_int(0))
