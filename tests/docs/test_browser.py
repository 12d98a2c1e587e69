"""The plan's HTML view in a real browser: Playwright drives Debian's headless ``chromium``
(skipped without either: ``apt-get install chromium``; playwright is pinned in
requirements-test.txt and uses that browser, nothing downloaded). It loads the page, reads the
rows a person sees on the first screen, clicks the folded block open and reads its rows, and
saves a screenshot.

``python -m tests.docs.test_browser NOTEBOOK.ipynb OUT.png`` screenshots a notebook's outputs
(the page nbconvert would make: HTML outputs as they are, text as <pre>).
"""

from __future__ import annotations

import html
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - pinned in requirements-test.txt
    sync_playwright = None

# Run in the page: the rows on the first screen, the tree's alignment, the fold and its children.
SEEN = """() => {
  const shown = (e) => e.checkVisibility();  // false inside a closed <details>
  const rows = [...document.querySelectorAll(".autopar-plan .g:not(.head)")];
  const name = (r) => r.querySelector("span");
  const textLeft = (e) => {  // where the name's text starts: after its indentation
    const range = document.createRange();
    range.selectNodeContents(e);
    return range.getBoundingClientRect().left;
  };
  const fold = document.querySelector("summary.fold");
  const inside = [...fold.parentElement.querySelectorAll(":scope > details > summary, :scope > div.g")];
  return {
    first_screen: rows.filter((r) => shown(r) && r.getBoundingClientRect().bottom <= window.innerHeight)
      .map((r) => name(r).textContent.trim()),
    align: getComputedStyle(name(rows[0])).textAlign,
    fold_left: textLeft(name(fold)),
    inside: inside.filter(shown).map((r) => [name(r).textContent.trim(), textLeft(name(r))]),
    shown: rows.filter(shown).length,
  };
}"""


@contextmanager
def browser_page(width: int = 1400, height: int = 900):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def notebook_page(path: Path) -> str:
    """A notebook's outputs as one static page, as nbconvert lays them out (no kernel)."""
    import nbformat

    parts = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "markdown":
            parts.append(f"<h4>{html.escape(cell.source.splitlines()[0])}</h4>")
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/html" in data:
                parts.append(data["text/html"])
            elif "image/png" in data:
                parts.append(f'<img src="data:image/png;base64,{data["image/png"]}">')
            else:
                parts.append(f"<pre>{html.escape(out.get('text', data.get('text/plain', '')))}</pre>")
    return "<html><body>" + "\n".join(parts) + "</body></html>"


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
@pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (requirements-test.txt)")
def test_folded_tree_in_chromium(tmp_path):
    from tests.harness.models import shared_gpt_plan

    page_file = tmp_path / "plan.html"
    page_file.write_text("<html><body>" + shared_gpt_plan("dp2xtp2")._repr_html_() + "</body></html>")
    with browser_page() as page:
        page.goto(page_file.as_uri())
        before = page.evaluate(SEEN)
        first = before["first_screen"]
        # the whole structure on the first screen, blocks folded, no op without a collective
        assert first[:4] == ["wte", "wpe", "drop", "blocks.0-1 x 2 identical plan"], first
        assert {"ln_f", "lm_head", "(top)", "(grad sync)"} <= set(first) and len(first) <= 12
        assert before["align"] == "left" and before["inside"] == []  # the fold closed
        page.click("summary.fold")  # a person's click opens the folded block
        after = page.evaluate(SEEN)
        names = dict((n, left) for n, left in after["inside"])
        # its children, indented under it (and its own residual adds, behind one more click)
        assert set(names) == {"ln_1", "attn", "ln_2", "mlp", "2 ops without collectives"}, names
        assert all(left > after["fold_left"] for left in names.values())
        assert after["shown"] - before["shown"] == 5
        shot = tmp_path / "plan.png"
        page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


# Run in the notebook's page: the 8B plan's folded layers, and the search view's runner-up.
NOTEBOOK_SEEN = """() => {
  const fold = [...document.querySelectorAll("summary.fold")].find((s) => s.textContent.includes("layers.0-31"));
  const kids = [...fold.parentElement.querySelectorAll(":scope > details > summary, :scope > div.g")];
  const runner = [...document.querySelectorAll(".autopar-search details")].find(
    (d) => d.querySelector("summary").textContent.startsWith("the runner-up"));
  return {
    fold: fold.textContent.trim().replace(/\\s+/g, " "),
    open: fold.parentElement.open,
    children: kids.filter((r) => r.checkVisibility()).map((r) => r.querySelector("span").textContent.trim()),
    runner_open: runner.open,
    runner_text: runner.querySelector("pre").checkVisibility() ? runner.querySelector("pre").textContent : "",
  };
}"""


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
@pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (requirements-test.txt)")
def test_llama_notebook_in_chromium(tmp_path):
    """The llama notebook as a static page (its committed outputs, no kernel): the 8B shape's 32
    layers are one closed fold that a click opens onto its modules, and the search view's
    runner-up explain opens on a click too. The screenshots are the docs' (see docs/explore.md)."""
    page_file = tmp_path / "llama.html"
    page_file.write_text(notebook_page(Path(__file__).resolve().parents[2] / "notebooks" / "llama.ipynb"))
    with browser_page(height=1200) as page:
        page.goto(page_file.as_uri())
        before = page.evaluate(NOTEBOOK_SEEN)
        assert before["fold"].startswith("layers.0-31 x 32 identical plan") and not before["open"], before
        assert before["children"] == [] and not before["runner_open"] and before["runner_text"] == ""
        page.locator("summary.fold", has_text="layers.0-31").first.click()
        page.locator(".autopar-search summary", has_text="the runner-up").first.click()
        after = page.evaluate(NOTEBOOK_SEEN)
        assert {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"} <= set(after["children"]), after
        assert (
            after["runner_text"].startswith("automatic plan: ")
            and "asked for with ap.Auto(option=" in after["runner_text"]
        )
        shot = tmp_path / "search.png"
        page.locator(".autopar-search").first.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


if __name__ == "__main__":
    nb, png = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
    page_file = png.with_suffix(".html")
    page_file.write_text(notebook_page(nb))
    with browser_page(height=2400) as page:
        page.goto(page_file.as_uri())
        page.screenshot(path=str(png))
    print(png)
