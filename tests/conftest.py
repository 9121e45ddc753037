"""Shared fixtures: one in-process cluster for the big conformance matrix,
one multi-process LocalCluster for what needs real transfers, both started
for real once per session; and the collection hook that puts the tier
markers on. The plain helpers (a check that no flowreduce key survives,
waiting, placing ranks...) are in utils.py."""

from __future__ import annotations

import gc
import inspect
import os
import re
import shutil
import uuid
from pathlib import Path

import dask
import pytest
from distributed import Client, LocalCluster

# A task fetching a value from a worker the test just killed retries its connection until Dask's connect
# timeout (30 s by default) before it asks the scheduler who else holds the value: recovery tests stalled
# 30 s whenever such a fetch was in flight. Local connections take milliseconds; 10 s keeps the retry and
# the suite's time (LocalCluster's workers get the parent's config). docs/failures.md says the same to users.
dask.config.set({"distributed.comm.timeouts.connect": "10s"})


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


@pytest.fixture(scope="session")
def gloo_ddp_results(tmp_path_factory):
    """Final parameters and buffers of real DDP over gloo, 4 processes
    (tests/ddp_reference.py), per run and rank: the reference both
    tests/test_torch.py and tests/test_torch_backend.py compare with, run once
    (8 s of 4 processes; the tests only read it)."""
    pytest.importorskip("torch", reason="torch tests need the extra: pip install -e '.[torch]'")
    import ddp_reference

    return ddp_reference.gloo_runs(str(tmp_path_factory.mktemp("ddp-gloo")))


@pytest.fixture
def method_tasks():
    """Calls run as a task per plan node and chunk (``method="tasks"``): for the modules that test that
    graph itself -- where each task runs, faults at a plan step, the same-host routes of the task graph.
    The default, ``"auto"``, may run a named algorithm in the p2p engine instead (tests/test_p2p.py)."""
    import dask

    with dask.config.set({"flowreduce.method": "tasks"}):
        yield


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
        hpc = _TESTS / "hpc" in where.parents
        # pytest-xdist (-n, pyproject's addopts) hands a group's tests to one process: a module's, so its
        # module-scoped clusters start once; tests/hpc's together, so two processes never queue on one SLURM.
        item.add_marker(pytest.mark.xdist_group("hpc" if hpc else where.name))
        if hpc:
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


def pytest_collection_finish(session):
    """Two things for the suite's time, once every test module is imported.

    The objects alive now (numpy, torch, distributed, every test module and
    its parameters: 340,000 objects) go to the garbage collector's permanent
    generation (``gc.freeze``): the fixtures' and tests' ``gc.collect()``
    (hundreds of calls, to drop the futures of reference cycles before a
    check that no key is left: once per test in several modules' fixtures)
    and Python's own full collections then scan only what the tests made,
    not them, every time (0.15-0.35 s a call saved). What the tests create is
    collected as before; only a reference cycle among the frozen objects
    that became garbage later would stay (memory, no future: none exists yet).

    And start mypy's run for ``test_architecture.py::test_types`` as the tests
    start, when it is among them: 30 s of a core in a fresh clone, spent while
    the tests before it wait on their clusters (the test reads its result)."""
    gc.collect()  # the collection's own garbage first: frozen objects are never collected
    gc.freeze()
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under xdist every process collects every test: test_types starts mypy where it runs
    for item in session.items:
        if isinstance(item, pytest.Function) and item.name == "test_types" \
                and Path(str(item.path)).name == "test_architecture.py":
            session.config._flowreduce_mypy = item.module.start_mypy(session.config)
            return

