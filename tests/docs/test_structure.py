"""The package's import structure: no import cycles, and layers whose imports run downwards only.

Read from the source with ``ast``, so every import counts: top-level ones, those under ``if TYPE_CHECKING:`` and
those inside functions (a cycle dodged by a local import is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "lightning_ckguard"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE  # tests/docs/ -> the repository root

#: The layers, bottom up, each module in exactly one. The leaves are shared by all; recording reads device-side
#: sources; the agreement turns them into one verdict; publication writes, evicts and links (never reading recording
#: code); recovery restores; the Trainer-free publisher joins agreement and publication; the Lightning adapters sit on
#: top.
LAYERS: dict[str, tuple[str, ...]] = {
    "leaves": ("_distributed", "errors", "policy"),
    "record": ("sources", "deepspeed_sources", "source_selection", "finiteness", "window", "skips", "state_sources",
               "state_check"),
    "agree": ("report", "agreement", "guard"),
    "publish": ("ledger", "publication", "seal", "staging", "background", "top_k_vote", "remote"),
    "recover": ("rewind",),
    "core": ("publisher",),  # the Trainer-free publisher: agreement and publication together
    "lightning": ("", "callback", "pytorch_lightning", "held_metrics", "_validation"),  # "": the package itself
}
#: What each layer may import: its own layer and the ones below it that it needs; never one above.
MAY_IMPORT: dict[str, set[str]] = {
    "leaves": {"leaves"},
    "record": {"leaves", "record"},
    "agree": {"leaves", "record", "agree"},
    "publish": {"leaves", "publish"},
    "recover": {"leaves", "agree", "publish", "recover"},
    "core": {"leaves", "agree", "publish", "recover", "core"},
    "lightning": set(LAYERS),
}


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


def _layer_of(module: str) -> str | None:
    short = module.removeprefix(PACKAGE).removeprefix(".")
    return next((layer for layer, members in LAYERS.items() if short in members), None)


def test_every_module_has_one_layer():
    unplaced = sorted(module for module in MODULES if _layer_of(module) is None)
    assert not unplaced, f"place these modules in a layer of LAYERS: {unplaced}"
    placed = [member for members in LAYERS.values() for member in members]
    assert len(placed) == len(set(placed)), "a module is in two layers"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downwards_only(module):
    layer = _layer_of(module)
    assert layer is not None
    upward = sorted(
        f"{dependency.removeprefix(f'{PACKAGE}.')} ({_layer_of(dependency)})"
        for dependency in GRAPH[module]
        if _layer_of(dependency) not in MAY_IMPORT[layer]
    )
    assert not upward, f"{module} ({layer}) imports from a layer it may not: {upward}"
