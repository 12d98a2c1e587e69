"""Every ```python block of README.md and docs/**/*.md runs, so that no example rots (issue 49).

A page's blocks run in order in one namespace, in this process, in a scratch directory (a block may write
plan.json or a checkpoint). Two markers, HTML comments that the site does not show, on the line just above a
block or anywhere in the page:

    <!-- test: skip REASON -->     the next ```python block is not run here (REASON is required, e.g. "needs
                                   torchrun" or "CUDA only"); say so in the page's text too.
    <!-- test: setup               hidden code run at that point of the page, before the blocks after it:
    import torch, autopar as ap    the model and inputs that a fragment assumes. Its lines end with -->.
    -->

Example: `pytest tests/docs/test_doc_blocks.py -k getting_started`.
"""

from __future__ import annotations

import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/docs/ -> ..)
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)

SKIP = re.compile(r"^\s*<!--\s*test:\s*skip\b(.*?)-->\s*$")  # indented too: a block in a list item
SETUP = re.compile(r"^\s*<!--\s*test:\s*setup\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*(\S*)")


@dataclass
class Block:
    line: int  # 1-based line of the block's first code line in the page
    code: str
    kind: str  # "python" (a shown block), "setup" (hidden code), "skip" (shown, not run)
    reason: str = ""


def parse(path: Path) -> list[Block]:
    """The page's python blocks and setup comments in page order; raises ValueError on a malformed marker."""
    lines = path.read_text().split("\n")
    blocks, skip_reason, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if SETUP.match(line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            if end is None:
                raise ValueError(f"{path.name}:{i + 1}: '<!-- test: setup' without a closing '-->' line")
            blocks.append(Block(i + 2, textwrap.dedent("\n".join(lines[i + 1 : end])), "setup"))
            i = end + 1
            continue
        m = SKIP.match(line)
        if m:
            if not m.group(1).strip():
                raise ValueError(f"{path.name}:{i + 1}: '<!-- test: skip -->' needs a reason after 'skip'")
            skip_reason = m.group(1).strip()
            i += 1
            continue
        m = FENCE.match(line)
        if m:
            indent, fence, lang = m.groups()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence))
            if lang == "python":
                code = textwrap.dedent("\n".join(lines[i + 1 : end]))
                kind = "skip" if skip_reason is not None else "python"
                blocks.append(Block(i + 2, code, kind, skip_reason or ""))
            elif skip_reason is not None:
                raise ValueError(f"{path.name}:{i + 1}: a skip marker stands above a {lang or 'plain'} block")
            skip_reason = None
            i = end + 1
            continue
        if line.strip() and skip_reason is not None:
            raise ValueError(f"{path.name}:{i + 1}: a skip marker must stand just above its ```python block")
        i += 1
    return blocks


def _runs(path):
    return any(b.kind == "python" for b in parse(path))


RUN_PAGES = [p for p in PAGES if _runs(p)]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", RUN_PAGES, ids=[_name(p) for p in RUN_PAGES])
def test_page_blocks_run(path, tmp_path, monkeypatch):
    """The page's blocks, in order, in one namespace: each as the reader would paste it."""
    import matplotlib

    matplotlib.use("Agg")  # plots in a block are drawn, never shown
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # `from examples...` as from the repository root
    namespace = {"__name__": "__doc_block__"}
    for block in parse(path):
        if block.kind == "skip":
            continue
        # Padding keeps the page's line numbers in tracebacks: "README.md", line 42.
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        try:
            exec(code, namespace)
        except Exception:
            pytest.fail(f"{_name(path)}: the {block.kind} block at line {block.line} failed:\n{traceback.format_exc()}")


def test_markers_are_well_formed():
    """Every skip marker has a reason and stands above a python block; every setup comment is closed."""
    for path in PAGES:
        parse(path)  # raises ValueError naming the page and line


def test_every_public_name_is_in_the_reference():
    """docs/reference/api.md lists `::: autopar.NAME` for every name of autopar.__all__ (mkdocstrings renders it)."""
    import autopar

    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    listed = set(re.findall(r"^::: autopar\.(?:api\.)?(\w+)", text, re.M))
    missing = sorted(set(autopar.__all__) - listed)
    assert not missing, f"add `::: autopar.NAME` for {missing} to docs/reference/api.md"


def test_skipped_blocks_still_compile():
    """A block that cannot run here (torchrun, CUDA) is at least valid Python."""
    for path in PAGES:
        for block in parse(path):
            if block.kind == "skip":
                try:
                    compile(block.code, str(path), "exec")
                except SyntaxError as e:
                    pytest.fail(f"{_name(path)}:{block.line}: skipped block is not valid Python: {e}")


def test_parse_finds_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "<!-- test: setup\nx = 1\n-->\n\n```python\ny = x + 1\n```\n\n"
        "<!-- test: skip needs torchrun -->\n```python\ndist.init_process_group()\n```\n"
    )
    kinds = [(b.kind, b.line, b.reason) for b in parse(page)]
    assert kinds == [("setup", 2, ""), ("python", 6, ""), ("skip", 11, "needs torchrun")]
    page.write_text("<!-- test: skip -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        parse(page)
