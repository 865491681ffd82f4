"""The package's import structure: no import cycles, and publication code that never imports recording code.

Read from the source with ``ast``, so every import counts: top-level ones, those under ``if TYPE_CHECKING:`` and
those inside functions (a cycle dodged by a local import is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "lightning_ckguard"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

PUBLICATION = ("background", "ledger", "publication", "remote", "seal", "staging", "top_k_vote")
RECORDING = ("sources", "deepspeed_sources", "source_selection", "finiteness", "window", "skips")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names, relative imports included."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            # ``from lightning_ckguard import window`` imports the module ``window``, not a name of the package
            found.update(
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names
            )
    # an import of ``a.b.c`` names ``a.b.c``; keep the deepest of the package's modules each one names
    return {_deepest_module(name) for name in found if name == PACKAGE or name.startswith(f"{PACKAGE}.")} - {module}


def _deepest_module(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


GRAPH = {module: imports_of(module) for module in MODULES}


def _path_between(start: str, goal: str) -> list[str] | None:
    """A chain of imports from ``start`` to ``goal`` (depth first), or None."""
    stack, seen = [[start]], set()
    while stack:
        path = stack.pop()
        for nxt in sorted(GRAPH[path[-1]]):
            if nxt == goal:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*path, nxt])
    return None


def test_the_package_is_found():
    assert f"{PACKAGE}.agreement" in MODULES and f"{PACKAGE}.callback" in MODULES
    assert f"{PACKAGE}.report" in GRAPH[f"{PACKAGE}.agreement"]  # the parser sees imports at all


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_cycle_runs_through(module):
    cycle = _path_between(module, module)
    assert cycle is None, "import cycle: " + " -> ".join(name.removeprefix(f"{PACKAGE}.") for name in cycle)


@pytest.mark.parametrize("module", PUBLICATION)
def test_publication_code_imports_no_recording_code(module):
    name = f"{PACKAGE}.{module}"
    assert name in MODULES
    recording = sorted(m.removeprefix(f"{PACKAGE}.") for m in GRAPH[name] if m.removeprefix(f"{PACKAGE}.") in RECORDING)
    assert not recording, f"{module} imports recording code: {recording}"
