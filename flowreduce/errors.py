"""Every error flowreduce raises on purpose, in one place.

Each is a :class:`FlowreduceError` and also the built-in type users already
catch (``ValueError``, ``TypeError``, ``RuntimeError``), so ``except
ValueError`` keeps working and ``except flowreduce.FlowreduceError`` catches
ours alone. Pure Python: the scheduler plugin pickles :class:`WorkerLostError`
to the clients, and this module imports nothing else.
"""

from __future__ import annotations

__all__ = ["FlowreduceError", "InputError", "InputStateError", "InputTypeError", "OptionError", "WorkerLostError"]


class FlowreduceError(Exception):
    """Base of the errors flowreduce raises."""


class OptionError(FlowreduceError, ValueError):
    """A call's settings are invalid: an unknown algorithm or op, bad chunk or
    bucket settings, options that need a named algorithm."""


class InputError(FlowreduceError, ValueError):
    """The ranks' inputs do not fit together: no inputs, ranks disagreeing on
    structure, shape or dtype (the message names the ranks), a template that
    does not fit."""


class InputTypeError(FlowreduceError, TypeError):
    """An input of the wrong kind: not a future, not a numpy array (or a
    pytree of them, or a scipy.sparse matrix), a dtype that cannot be reduced."""


class InputStateError(FlowreduceError, RuntimeError):
    """An input future that failed, was cancelled or whose data was lost."""


class WorkerLostError(FlowreduceError, RuntimeError):
    """A worker holding part of an all-reduce left the cluster."""
