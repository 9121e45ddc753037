"""Every error flowreduce raises on purpose, in one place.

Each is a :class:`FlowreduceError` and also the built-in type users already
catch (``ValueError``, ``TypeError``, ``RuntimeError``), so ``except
ValueError`` keeps working and ``except flowreduce.FlowreduceError`` catches
ours alone. Pure Python: the scheduler plugin pickles :class:`WorkerLostError`
to the clients, and this module imports nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["AllreduceTimeoutError", "FlowreduceError", "InputError", "InputStateError", "InputTypeError", "OptionError",
           "WorkerLostError",
           "raised_as"]


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
    """A value of the wrong kind: an input that is not a future, not a numpy
    array (or a pytree of them, or a scipy.sparse matrix), a dtype that
    cannot be reduced; a ``topology=`` that is neither a Topology nor keys."""


class InputStateError(FlowreduceError, RuntimeError):
    """An input future that failed, was cancelled or whose data was lost."""


class WorkerLostError(FlowreduceError, RuntimeError):
    """A worker holding part of an all-reduce left the cluster and the call
    could not recover (an input without lineage, or too many attempts)."""


class AllreduceTimeoutError(FlowreduceError, TimeoutError):
    """An all-reduce did not finish within its timeout; the message says
    what it waits for (rank, plan step, key, state on the scheduler, worker)."""


@contextmanager
def raised_as(value_error: type[ValueError], type_error: type[TypeError] = InputTypeError) -> Iterator[None]:
    """Re-raise the built-in ``ValueError`` and ``TypeError`` of a check made
    by a layer that knows nothing of these classes (the planners, the
    template reader) as ``value_error`` and ``type_error``: the same
    message, still a ValueError or TypeError, and now a FlowreduceError."""
    try:
        yield
    except FlowreduceError:
        raise
    except ValueError as e:
        raise value_error(*e.args) from e
    except TypeError as e:
        raise type_error(*e.args) from e


def refused(handler: str, why: str) -> dict[str, str]:
    """What a flowreduce handler answers a request flowreduce does not send:
    logged as an error on the ``flowreduce`` logger, naming the handler and
    why, and the reply ``{"status": "error", "message": why}``."""
    logging.getLogger("flowreduce").error("flowreduce: %s refused a request: %s", handler, why)
    return {"status": "error", "message": why}
