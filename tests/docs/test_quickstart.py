"""The quick start's code runs as written (``docs/quickstart.md``).

Every ``python`` block of the page runs, in order, in one namespace, in an empty temporary directory. A ``text`` block
that follows a ``python`` block with nothing but "prints" between them is what that block prints: it must appear in
the block's standard output, compared with runs of whitespace collapsed (the page wraps long lines). The page has no
block that is not run. One small CPU fit in one process; nothing is launched.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "docs" / "quickstart.md"

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
OUTPUT_LEAD = {"", "prints", "prints:"}


def fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, code, prose before it)`` for every fenced block of a Markdown page, in order."""
    blocks, end = [], 0
    for match in FENCE.finditer(text):
        blocks.append((match.group(1).strip(), match.group(2), text[end : match.start()]))
        end = match.end()
    return blocks


def collapse(text: str) -> str:
    return " ".join(text.split())


def test_the_quick_start_runs_and_prints_what_it_says(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = fenced_blocks(QUICKSTART.read_text())
    namespace: dict[str, object] = {"__name__": "quickstart"}
    ran = compared = 0
    for index, (language, code, _) in enumerate(blocks):
        if language != "python":
            continue
        capsys.readouterr()
        exec(compile(code, f"{QUICKSTART.name}, python block {ran + 1}", "exec"), namespace)
        ran += 1
        printed = capsys.readouterr().out
        if index + 1 < len(blocks):
            next_language, expected, between = blocks[index + 1]
            if next_language == "text" and between.strip() in OUTPUT_LEAD:
                assert collapse(expected) in collapse(printed), f"python block {ran} printed:\n{printed}"
                compared += 1
    assert ran >= 2 and compared >= 1, "the quick start lost its runnable example or its printed output"
