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
    "leaves": ("_distributed", "errors"),
    "record": ("record", "record.sources", "record.deepspeed_sources", "record.source_selection", "record.finiteness",
               "record.window", "record.skips", "record.state_sources", "record.state_check", "record.squares",
               "record.step_values"),
    "agree": ("agree", "agree.report", "agree.agreement", "agree.guard", "agree.top_k_vote", "agree.spikes"),
    "publish": ("publish", "publish.ledger", "publish.transaction", "publish.seal", "publish.staging",
                "publish.background", "publish.remote", "publish.storage", "publish.writers", "publish.durability"),
    "recover": ("recover", "recover.policy", "recover.rewind"),
    "core": ("core", "core.publisher"),  # the Trainer-free publisher: agreement and publication together
    # "": the package itself; "callback": the import path of earlier releases
    "lightning": ("", "callback", "lightning", "lightning.callback", "lightning.fit", "lightning.packages",
                  "lightning.validation", "lightning.held_metrics", "pytorch_lightning"),
}
#: Each layer's folder: a module of a layer lives in its folder (the leaves and the public modules at the top).
FOLDERS = {"record": "record", "agree": "agree", "publish": "publish", "recover": "recover", "core": "core"}
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
    assert f"{PACKAGE}.agree.agreement" in MODULES and f"{PACKAGE}.lightning.callback" in MODULES
    assert f"{PACKAGE}.agree.report" in GRAPH[f"{PACKAGE}.agree.agreement"]  # the parser sees imports at all


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


@pytest.mark.parametrize("layer", sorted(FOLDERS))
def test_a_layer_is_a_folder(layer):
    """The file list shows the architecture: every module of a layer sits in that layer's folder, and the folder holds
    nothing of another layer."""
    for member in LAYERS[layer]:
        assert member.split(".")[0] == FOLDERS[layer], f"{member} ({layer}) is not under {FOLDERS[layer]}/"
    in_folder = {name for name in MODULES if name.startswith(f"{PACKAGE}.{FOLDERS[layer]}")}
    assert {_layer_of(name) for name in in_folder} == {layer}


#: The longest function body the package allows (its signature and docstring aside), and the callback module's size.
MAX_BODY_LINES = 40
MAX_CALLBACK_LINES = 350


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                 str):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0  # type: ignore[operator]


def test_no_function_body_is_longer_than_40_lines():
    long = sorted(
        f"{module}.{node.name}: {_body_lines(node)} lines"
        for module, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_BODY_LINES
    )
    assert not long, long


def test_the_callback_module_holds_only_what_faces_lightning():
    lines = len(MODULES[f"{PACKAGE}.lightning.callback"].read_text().splitlines())
    assert lines <= MAX_CALLBACK_LINES, f"callback.py has {lines} lines"
