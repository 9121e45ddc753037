"""The house rules, checked by well-kept tools instead of by hand: the layer
contracts of import-linter (``[tool.importlinter]`` in pyproject.toml), no
import cycle inside flowreduce (grimp, import-linter's graph library) and the
types (mypy, ``[tool.mypy]``). Imports inside functions count as imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grimp
import pytest
from importlinter.api import read_configuration

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
CONTRACTS = read_configuration(str(PYPROJECT))["contracts_options"]


def _this_checkout() -> dict[str, str]:
    """The environment of a child Python that imports this checkout's flowreduce."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("contract", [c["id"] for c in CONTRACTS])
def test_import_contract_is_kept(contract):
    # in a child process: import-linter finds the package by importing it
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports({str(PYPROJECT)!r}, limit_to_contracts=({contract!r},), no_cache=True, no_logo=True))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_this_checkout(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _graph_without_allowed_imports() -> grimp.ImportGraph:
    """flowreduce's import graph without the imports the layers contract allows
    (``ignore_imports``, each with its reason in pyproject.toml)."""
    import flowreduce

    # grimp reads the flowreduce that imports: it must be this checkout's
    assert Path(flowreduce.__file__).resolve().parents[1] == ROOT, \
        f"flowreduce imports from {flowreduce.__file__}; put {ROOT} first on PYTHONPATH"
    graph = grimp.build_graph("flowreduce", cache_dir=None)
    allowed = [e for c in CONTRACTS if c["id"] == "layers" for e in c.get("ignore_imports", [])]
    for expression in allowed:
        for imp in graph.find_matching_direct_imports(expression):
            graph.remove_import(importer=imp["importer"], imported=imp["imported"])
    return graph


def test_no_import_cycles():
    """Every cycle between flowreduce's modules, a package's ``__init__``
    included (import-linter's acyclic_siblings contract cannot see those:
    ``algorithms/__init__`` -> a planner -> ``algorithms``)."""
    graph = _graph_without_allowed_imports()
    cycles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycle = (importer, *back[:-1])
                first = cycle.index(min(cycle))  # one spelling per cycle, whichever import found it
                cycles.add(cycle[first:] + cycle[:first])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join((*c, c[0])) for c in sorted(cycles))


def start_mypy(config) -> subprocess.Popen:
    """mypy over flowreduce/ with pyproject's [tool.mypy], started in a child
    process (tests/conftest.py starts it as the session's tests start, when
    ``test_types`` is among them: a cold run, 30 s of a core, then overlaps
    the tests that wait on clusters instead of adding to the suite's time).
    Its cache lives in pytest's cache directory, so a second run takes a
    second, not a minute. In a child process: mypy raises the garbage
    collector's thresholds for its own speed, which would leave the futures
    of later tests' reference cycles (and so their keys on the scheduler)
    uncollected."""
    if getattr(config, "cache", None):
        cache = str(config.cache.mkdir("mypy"))
    else:  # -p no:cacheprovider: a cold run's 60 MB, removed after the session
        cache = tempfile.mkdtemp(prefix="flowreduce-mypy-")
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    child = subprocess.Popen([sys.executable, "-m", "mypy", "--config-file", str(PYPROJECT), "--cache-dir", cache,
                              "--no-error-summary", str(ROOT / "flowreduce")], cwd=ROOT, env=_this_checkout(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def reap() -> None:  # the session ended before test_types read it (-x, ^C)
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()

    config.add_cleanup(reap)  # runs before the cache's removal above (cleanups run last in, first out)
    return child


def test_types(request):
    """mypy finds no error in flowreduce/ (the run :func:`start_mypy` started,
    or one started here when this module's tests run without the conftest's
    hook)."""
    child = getattr(request.config, "_flowreduce_mypy", None) or start_mypy(request.config)
    out, _ = child.communicate(timeout=600)
    assert child.returncode == 0, out


def _private_names_reached(source: str) -> list[str]:
    """``flowreduce`` names starting with ``_`` that a test module imports or
    reads off a flowreduce module it imported (``mod._name``)."""
    import ast

    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to flowreduce modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flowreduce"):
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{node.module}.{a.name}")
                modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("flowreduce"):
                    modules.add((a.asname or a.name).split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def _private_attributes(package: Path) -> set[str]:
    """The ``_names`` flowreduce gives its objects: methods and attributes set on ``self``."""
    import ast

    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_attributes_read(source: str, private: set[str]) -> list[str]:
    """Attributes ``x._name`` a test reads whose name is one of flowreduce's private ones."""
    import ast

    return sorted({node.attr for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Attribute) and node.attr in private})


def test_no_test_reaches_a_private_name():
    """Tests use flowreduce as its packages export it: a private name (a
    module's, or an attribute or method of its objects) is free to change
    without a test noticing."""
    tests = Path(__file__).parent
    reached = {str(p.relative_to(tests)): names for p in sorted(tests.rglob("*.py"))
               if (names := _private_names_reached(p.read_text()))}
    assert not reached, f"tests reach private names: {reached}"
    private = _private_attributes(tests.parent / "flowreduce")
    read = {str(p.relative_to(tests)): names for p in sorted(tests.rglob("*.py"))
            if (names := _private_attributes_read(p.read_text(), private))}
    assert not read, f"tests read private attributes of flowreduce's objects: {read}"
    assert _private_attributes_read("trainer._last[0]", private) == ["_last"]
    assert _private_names_reached("from flowreduce.tracing.capture import _since") == [
        "flowreduce.tracing.capture._since"]
    assert _private_names_reached("import flowreduce.schedule.call as c\nc._locate(1)") == ["c._locate"]


@pytest.mark.parametrize("name,module", [("allreduce", "call"), ("describe", "call"), ("topology", "hosts"),
                                         ("rank_groups", "placement")])
def test_the_top_level_functions_are_the_real_ones(name, module):
    """``flowreduce.allreduce``, ``describe``, ``topology`` and ``rank_groups``
    show the signature and docstring of flowreduce.schedule's functions
    (``help()``), yet ``import flowreduce`` alone still imports no distributed."""
    code = ("import inspect, json, sys; import flowreduce; light = 'distributed' not in sys.modules; "
            f"f = flowreduce.{name}; import flowreduce.schedule.{module} as c; real = c.{name}; "
            "print(json.dumps([light, str(inspect.signature(f)) == str(inspect.signature(real)), "
            "list(inspect.signature(f).parameters), f.__doc__ == real.__doc__, f.__doc__ or '']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_this_checkout(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import json

    light, same_signature, parameters, same_doc, doc = json.loads(out.stdout)
    assert light, "import flowreduce imported distributed"
    assert same_signature and same_doc, (parameters, doc[:200])
    if name == "allreduce":
        assert parameters[:3] == ["client", "inputs", "op"] and "options" in parameters
        assert "Parameters\n    ----------" in doc and "from the result futures" in doc
    elif name == "describe":
        assert parameters == ["futures"] and "CallRecord" in doc
    else:
        assert parameters[:2] == ["client", "workers" if name == "topology" else "inputs"] and "node" in doc
