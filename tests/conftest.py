"""Shared fixtures: one in-process cluster for the big conformance matrix,
one multi-process LocalCluster for what needs real transfers, both started
for real once per session, and a check that no flowreduce key survives."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from distributed import Client, LocalCluster


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


@pytest.fixture(scope="session")
def inproc_client():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client


@pytest.fixture(scope="session")
def proc_client():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client


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


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if the command under test starts or joins a cluster
    (for errors that must come before that)."""
    monkeypatch.setattr("flowreduce.launch.from_args", lambda *a, **k: pytest.fail("a cluster was started"))


@pytest.fixture(scope="module")
def shm_dir():
    """A fresh directory for a module's shared-memory segments, removed after it."""
    d = f"/dev/shm/flowreduce-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


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


# -- test tiers ------------------------------------------------------------------------------------------------
#
# Markers (registered in pyproject.toml) put on at collection, so that no test
# has to be annotated by hand: ``-m "not cluster"`` is the fast tier (pure
# plans, cost model, conformance through dask.get, codecs, option plumbing).
# A test is ``cluster`` when it, a fixture it uses (at any depth) or a helper
# of its module one of those calls, names something that starts or joins a
# dask cluster, or runs a ``flowreduce`` command (which starts one).

CLUSTER_FIXTURES = {"inproc_client", "proc_client", "dask_jobqueue"}
_STARTS_A_CLUSTER = re.compile(
    r"\b(?:LocalCluster|SLURMCluster|SpecCluster)\b|\b(?:Client|Scheduler|Worker|Nanny)\(|\bfrom_args\("
    r"|\b(?:jobqueue_cluster|launch\.cluster)\(|[\"']-m[\"'],\s*[\"']flowreduce[\"']")
_TESTS = Path(__file__).resolve().parent
_sources: dict = {}
_helpers: dict = {}


def _source(obj) -> str:
    obj = inspect.unwrap(obj)
    if obj not in _sources:
        try:
            _sources[obj] = inspect.getsource(obj)
        except (OSError, TypeError):
            _sources[obj] = ""
    return _sources[obj]


def _cluster_helpers(module) -> re.Pattern:
    """A pattern matching a call of any function of ``module`` whose source
    (transitively through the module's other functions) starts a cluster."""
    if module not in _helpers:
        funcs = {n: f for n, f in vars(module).items()
                 if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("test_")}
        found: set = set()
        while True:
            names = "|".join(map(re.escape, sorted(found)))
            pattern = _STARTS_A_CLUSTER if not found else re.compile(
                _STARTS_A_CLUSTER.pattern + rf"|\b(?:{names})\(")
            more = {n for n, f in funcs.items() if n not in found and pattern.search(_source(f))}
            if not more:
                break
            found |= more
        _helpers[module] = pattern
    return _helpers[module]


def _starts_a_cluster(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})  # request.getfixturevalue(param)
    if CLUSTER_FIXTURES & (set(item.fixturenames) | {v for v in params.values() if isinstance(v, str)}):
        return True
    source = _source(item.function)
    if "no_cluster" in item.fixturenames:  # launch.from_args is made to fail there
        source = source.replace("from_args(", "")
    if _cluster_helpers(item.module).search(source):
        return True
    for name in item.fixturenames:
        for fdef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            module = inspect.getmodule(fdef.func)
            if (_cluster_helpers(module) if module else _STARTS_A_CLUSTER).search(_source(fdef.func)):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        where = Path(str(item.path)).resolve()
        if _TESTS / "hpc" in where.parents:
            item.add_marker(pytest.mark.hpc)
            item.add_marker(pytest.mark.slow)
        if where.name == "test_netem_harness.py":  # dask schedulers and workers in namespaces
            item.add_marker(pytest.mark.netem)
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.cluster)
        source = _source(item.function)
        if re.search(r"\bchromium\(", source):
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.slow)
        if _starts_a_cluster(item):
            item.add_marker(pytest.mark.cluster)
