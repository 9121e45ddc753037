"""Run plans on a dask.distributed cluster: the only layer that talks to
the scheduler to place, submit, guard and record a call.

The package itself imports nothing heavy: ``allreduce`` and ``describe``
are loaded on first use, so a module here that needs no distributed at
import (``placement``) stays importable without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["allreduce", "describe"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from flowreduce.schedule import call

        return getattr(call, name)
    raise AttributeError(f"module 'flowreduce.schedule' has no attribute {name!r}")
