"""The documentation site's sources hold together without building it (``docs/``; CI builds it with ``-W``).

- every public name (``lightning_ckguard.__all__``, and the ``pytorch_lightning`` callback) has an entry in the API
  reference, by the public path it is imported from, and that path imports;
- every relative link of ``README.md`` and of the pages in ``docs/`` points at a file that exists, and a ``#anchor``
  into a Markdown page at one of its headings;
- every script under ``tests/``, ``examples/`` or ``benchmarks/`` that those pages name exists at exactly that path
  (a test module moved into another folder must be renamed in the pages too);
- ``README.md`` stays short, keeps the two commands as its first code block (``.ci/run`` reads the ``-m pytest``
  line), and ``docs/development.md`` repeats that block as it is.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import lightning_ckguard

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts)

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
AUTODOC = re.compile(r"^\.\. auto(?:class|exception|function):: (\S+)", re.MULTILINE)
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.MULTILINE)
SCRIPT = re.compile(r"\b(tests|examples|benchmarks)/([\w/]*?)(\w+\.py)\b")


def _resolve(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading, which myst-parser's ``myst_heading_anchors`` reproduces."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(heading) for heading in HEADING.findall(_without_code_blocks(page.read_text()))}


def _relative_links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(_without_code_blocks(page.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def test_every_public_name_has_a_reference_entry_by_its_public_path():
    documented = AUTODOC.findall((DOCS / "api.md").read_text())
    expected = {f"lightning_ckguard.{name}" for name in lightning_ckguard.__all__}
    expected.add("lightning_ckguard.pytorch_lightning.FiniteGradCheckpoint")
    assert not expected - set(documented), f"no API reference entry: {sorted(expected - set(documented))}"
    for path in documented:
        assert path.startswith("lightning_ckguard."), path
        _resolve(path)  # the path a user imports from exists


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_links_into_the_docs():
    targets = {target.partition("#")[0] for target in _relative_links(README)}
    into_docs = {target for target in targets if target.startswith("docs/")}
    assert {"docs/quickstart.md", "docs/api.md"} <= into_docs
    assert len(into_docs) >= 10, sorted(into_docs)


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda path: str(path.relative_to(ROOT)))
def test_scripts_the_pages_name_exist(page):
    missing = sorted(
        f"{top}/{folder}{name}"
        for top, folder, name in SCRIPT.findall(page.read_text())
        if not (ROOT / top / folder / name).exists()
    )
    assert not missing, f"{page.relative_to(ROOT)} names scripts that do not exist: {missing}"


def test_the_readme_is_short_and_keeps_its_two_commands_first():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    language, first_block = FENCE.search(text).groups()
    commands = first_block.strip().splitlines()
    assert language.strip() == "bash" and len(commands) == 2
    assert "examples/ddp_nan_demo.py" in commands[0]
    assert "-m pytest" in commands[1]  # the line .ci/run runs
    assert FENCE.search((DOCS / "development.md").read_text()).group(2) == first_block
