"""The test suite's own layout: test modules in folders per concern, and every launched script exists.

Read from the source with ``ast`` (and, for paths named in prose, a regular expression), so it runs in the fast lane
without importing a test module or starting a process:

- every test module sits in one of the concern folders (``CONCERNS``), never directly in ``tests/``, and no two share
  a basename (pytest's default import mode imports each under its basename);
- every script a test module launches, through ``worker_results`` or ``run_ranks``, exists; a worker under
  ``workers/`` is launched through ``worker_results`` only, and is named after the test module that launches it
  (``workers/<module>_worker.py`` or ``workers/<module>_<variant>_worker.py`` for ``test_<module>.py``; one that
  several modules launch is named after one of them, and its docstring names the others); every ``*_worker.py`` is
  launched by some test module, and the other scripts there are helpers no test launches;
- every path to a test module or a worker that a file under ``tests/`` names (docstrings and comments included)
  exists;
- every worker ends through ``helpers.leave_without_finalizing`` (or ``run_scenarios``, which calls it).
"""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WORKERS = TESTS / "workers"
#: the folders test modules live in, one per concern (the package's layers, the Lightning adapter, the docs)
CONCERNS = ("record", "agree", "publish", "recover", "lightning", "docs")
LAUNCHERS = ("worker_results", "run_ranks")

TEST_MODULES = sorted(TESTS.rglob("test_*.py"))
SOURCES = sorted(path for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)


def _rel(path: Path) -> str:
    return path.relative_to(TESTS).as_posix()


def test_every_test_module_sits_in_a_concern_folder():
    misplaced = [_rel(path) for path in TEST_MODULES
                 if len(path.relative_to(TESTS).parts) != 2 or path.relative_to(TESTS).parts[0] not in CONCERNS]
    assert not misplaced, f"test modules outside tests/{{{','.join(CONCERNS)}}}/: {misplaced}"
    for concern in CONCERNS:
        assert any(path.parent.name == concern for path in TEST_MODULES), f"tests/{concern}/ holds no test module"


def test_test_module_basenames_are_unique():
    seen: dict[str, list[str]] = {}
    for path in TEST_MODULES:
        seen.setdefault(path.name, []).append(_rel(path))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_test_module_in_the_workers_folder():
    assert not list(WORKERS.glob("test_*.py"))


def _evaluate(node: ast.expr, assignments: dict[str, list[ast.expr]], where: str) -> list[str]:
    """The values a launch's script argument can take: a string, ``TESTS``, a name assigned in the module, and
    ``os.path.join`` / ``os.path.dirname`` of those. Anything else fails: a launched script must be checkable."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        if node.id == "TESTS":
            return [str(TESTS)]
        if node.id in assignments:
            return [value for expr in assignments[node.id] for value in _evaluate(expr, assignments, where)]
    if isinstance(node, ast.Call) and not node.keywords:
        func = ast.unparse(node.func)
        if func in ("os.path.join", "os.path.dirname"):
            parts = [_evaluate(arg, assignments, where) for arg in node.args]
            if func == "os.path.dirname" and len(parts) == 1:
                return [os.path.dirname(value) for value in parts[0]]
            if func == "os.path.join" and all(len(values) == 1 for values in parts):
                return [os.path.join(*(values[0] for values in parts))]
    pytest.fail(f"{where}: cannot tell which script `{ast.unparse(node)}` launches; name it with a string, or with "
                "os.path.join of TESTS and strings")


@functools.cache
def launches() -> list[tuple[Path, str, int, str]]:
    """(test module, launcher, line, script path as given) for every launch in every test module."""
    found = []
    for path in TEST_MODULES:
        tree = ast.parse(path.read_text(), filename=str(path))
        assignments: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assignments.setdefault(target.id, []).append(node.value)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LAUNCHERS:
                where = f"{_rel(path)}:{node.lineno}"
                assert node.args, f"{where}: {node.func.id}() without a script"
                for script in _evaluate(node.args[0], assignments, where):
                    found.append((path, node.func.id, node.lineno, script))
    return found


def test_the_check_sees_the_launches():
    assert {launcher for _, launcher, _, _ in launches()} == set(LAUNCHERS)
    assert any(script.startswith("workers/") for _, _, _, script in launches())
    assert any(script.startswith(str(ROOT / "examples")) for _, _, _, script in launches())


def test_every_launched_script_exists():
    missing = [f"{_rel(path)}:{line}: {script}" for path, _, line, script in launches()
               if not (TESTS / script).is_file()]  # an absolute script path stays absolute
    assert not missing, f"launches of scripts that do not exist: {missing}"


def test_workers_are_launched_through_worker_results_and_named_after_their_test_module():
    wrong, users = [], {}
    for path, launcher, line, script in launches():
        if (TESTS / script).resolve().parent != WORKERS:
            continue
        if launcher != "worker_results":
            wrong.append(f"{_rel(path)}:{line}: {script} launched by {launcher}, not worker_results")
        users.setdefault(Path(script).stem, set()).add(path)
    for name, modules in users.items():
        named_after = [path for path in modules if _serves(name, path.stem.removeprefix("test_"))]
        if not named_after:
            wrong.append(f"workers/{name}.py is named after none of {sorted(_rel(p) for p in modules)}")
        worker = WORKERS / f"{name}.py"
        docstring = (ast.get_docstring(ast.parse(worker.read_text())) or "") if worker.is_file() else ""
        for other in modules - set(named_after[:1]):
            if other.name not in docstring:
                wrong.append(f"workers/{name}.py: its docstring does not say that {_rel(other)} launches it too")
    assert not wrong, wrong


def _serves(worker: str, module: str) -> bool:
    """``<module>_worker`` or ``<module>_<variant>_worker``."""
    return worker == f"{module}_worker" or (worker.startswith(f"{module}_") and worker.endswith("_worker"))


#: what a worker rank ends through once its results are written (``run_scenarios`` calls the other): gloo's objects are
#: not left to the interpreter's exit, where destroying them has aborted ranks with ``terminate called without an
#: active exception`` after every result was written (``helpers.leave_without_finalizing``)
WORKER_ENDINGS = ("leave_without_finalizing", "run_scenarios")


def test_every_worker_ends_without_leaving_gloo_to_the_interpreter():
    def calls(path: Path) -> set[str]:
        return {node.func.id for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}

    workers = sorted(WORKERS.glob("*_worker.py"))
    assert workers
    unended = [path.name for path in workers if not calls(path) & set(WORKER_ENDINGS)]
    assert not unended, f"workers that leave gloo to the interpreter's exit: {unended}"


def test_every_worker_is_launched_and_the_other_scripts_there_are_not():
    launched = {(TESTS / script).resolve() for _, _, _, script in launches()}
    workers = {path.resolve() for path in WORKERS.glob("*_worker.py")}
    assert not sorted(workers - launched), "workers no test module launches"
    helpers = {path.resolve() for path in WORKERS.glob("*.py")} - workers
    assert not sorted(helpers & launched), "helpers launched as workers: name a worker <module>_worker.py"


#: a path to a test module or a worker as the tests' prose names it: ``tests/...py``, ``workers/...py``, or a test
#: module's bare basename (``test_ddp.py``, ``test_ddp.py::test_name``)
NAMED_PATH = re.compile(r"(?<![\w/.-])((?:tests/)?(?:[\w]+/)*(?:workers/\w+|test_\w+)\.py)\b")


def test_every_test_module_or_worker_named_in_the_tests_exists():
    basenames = {path.name for path in TEST_MODULES}
    stale = []
    for source in SOURCES:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for named in NAMED_PATH.findall(line):
                relative = named.removeprefix("tests/")
                exists = (TESTS / relative).is_file() if "/" in relative else relative in basenames
                if not exists:
                    stale.append(f"{_rel(source)}:{number}: {named}")
    assert not stale, f"paths to test modules or workers that do not exist: {stale}"
