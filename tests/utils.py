"""Helpers the tests share (plain functions; the fixtures and the collection
hook that puts tier markers on are in conftest.py): waiting for a cluster
to settle, checking that no flowreduce key survives a call, placing ranks on
workers, child processes, parsed command lines, the levels of built graphs.

``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject's
``[tool.pytest.ini_options]``): tests import these as ``from utils import ...``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time


@contextlib.contextmanager
def ready_child(code: str):
    """A Python process running ``code`` (dedented), once it has printed
    ``ready``: a real process to kill with SIGKILL; killed at the end."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.kill()
        child.wait()


def flowreduce_keys(client) -> list:
    return client.run_on_scheduler(
        lambda dask_scheduler: [k for k in dask_scheduler.tasks if "flowreduce-" in str(k)]
    )


def wait_until(ready, timeout: float, step: float = 0.1) -> bool:
    """Poll ``ready()`` every ``step`` s until it is true (True) or
    ``timeout`` s have passed (False)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def flush(client, timeout: float = 10.0) -> None:
    """Wait until the scheduler has handled every message this client sent
    on its batched stream so far (graphs, cancels, releases): a task sent
    after them on that ordered stream, and its result. Without it a poll
    through a separate comm can run before a just-submitted graph arrives,
    see no keys, and pass. Bounded: a cluster with no worker able to run it
    (all dead or paused) only skips the barrier."""
    marker = client.submit(int, 0, pure=False)
    try:
        marker.result(timeout=timeout)
    except TimeoutError:
        pass
    finally:
        del marker


def assert_clean(client, timeout: float = 10.0) -> None:
    """Poll (bounded) until the scheduler holds no flowreduce key."""
    flush(client, timeout)
    wait_until(lambda: not flowreduce_keys(client), timeout, step=0.05)
    left = flowreduce_keys(client)
    assert not left, f"{len(left)} flowreduce keys leaked, e.g. {left[:3]}"


def workers_of(client) -> list[str]:
    return sorted(client.nthreads())


def scatter_ranks(client, arrays, workers=None):
    """Rank r's array on worker r mod W (so ranks share workers when p > W)."""
    ws = workers or workers_of(client)
    return [client.scatter(a, workers=[ws[r % len(ws)]], hash=False) for r, a in enumerate(arrays)]


def transfer_bytes(tr, token) -> dict:
    """(key, destination worker) -> bytes, for every message of call
    ``token`` in trace ``tr``."""
    import ast

    out = {}
    for e in tr.iter_events(token):
        if e.phase == "transfer":
            for k, b in zip(e.keys, e.key_bytes):
                out[(ast.literal_eval(k), e.dest)] = b
    return out


def terminal_signals() -> None:
    """For ``preexec_fn``: SIGINT and SIGTERM at their defaults and unblocked,
    as from a terminal, whatever runs the tests (a background job of a
    script ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def cli_args(module, *argv):
    """The parsed command line of a ``flowreduce`` subcommand module."""
    import argparse

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def task_levels(graph) -> dict:
    """The dependent level of each task a built graph's outputs need: 1 for
    a task that reads only inputs (keys outside the graph)."""
    depth: dict = {}

    def level(key):
        if key not in depth:
            deps = [d for d in graph.tasks[key].dependencies if d in graph.tasks]
            depth[key] = 1 + max((level(d) for d in deps), default=0)
        return depth[key]

    for k in graph.outputs:
        level(k)
    return depth


def graph_depth(graph) -> int:
    """How many dependent levels a built graph has."""
    return max(task_levels(graph).values())


def error_of(call) -> BaseException | None:
    """The error of an all-reduce call: raised by the call (an option) or by
    its first result (an input: they come on the results). None if neither."""
    try:
        out = call()
    except Exception as e:
        return e
    first = out[0] if isinstance(out, list) else out
    e = first.exception(timeout=60)
    del out, first
    return e


def asleep_until_woken(dask_worker=None) -> None:
    """On a worker (``client.run``): a host-group rank asleep in a step sleeps an hour between its own
    checks of the job's failure, so only a wake (a peer's bump, an abort) can end its sleep in a test."""
    from flowreduce.shm import host_group

    host_group.ASLEEP_SECONDS = 3600.0
