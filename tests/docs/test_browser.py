"""The plan's HTML view in a real browser: Playwright drives Debian's headless ``chromium``
(skipped where that system package is missing: ``apt-get install chromium``, which `make test`
does as root; playwright is pinned in requirements-test.txt, so a missing one fails, and it uses
that browser, nothing downloaded). It loads the page, reads the
rows a person sees on the first screen, clicks the folded block open and reads its rows, and
saves a screenshot. The browser runs in a child process with a hard timeout (tests/docs/browser.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.browser import CHROMIUM, drive, notebook_page

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)"
)

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


@needs_chromium
def test_folded_tree_in_chromium(tmp_path):
    from tests.harness.models import shared_gpt_plan

    page_file = tmp_path / "plan.html"
    page_file.write_text("<html><body>" + shared_gpt_plan("dp2xtp2")._repr_html_() + "</body></html>")
    shot = tmp_path / "plan.png"
    # a person's click opens the folded block
    seen = drive({"page": str(page_file), "seen": SEEN, "clicks": [["summary.fold", ""]], "shot": str(shot)})
    before, after = seen["before"], seen["after"]
    first = before["first_screen"]
    # the whole structure on the first screen, blocks folded, no op without a collective
    assert first[:4] == ["wte", "wpe", "drop", "blocks.0-1 x 2 identical plan"], first
    assert {"ln_f", "lm_head", "(top)", "(grad sync)"} <= set(first) and len(first) <= 12
    assert before["align"] == "left" and before["inside"] == []  # the fold closed
    names = dict((n, left) for n, left in after["inside"])
    # its children, indented under it (and its own residual adds, behind one more click)
    assert set(names) == {"ln_1", "attn", "ln_2", "mlp", "2 ops without collectives"}, names
    assert all(left > after["fold_left"] for left in names.values())
    assert after["shown"] - before["shown"] == 5
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


@needs_chromium
def test_llama_notebook_in_chromium(tmp_path):
    """The llama notebook as a static page (its committed outputs, no kernel): the 8B shape's 32
    layers are one closed fold that a click opens onto its modules, and the search view's
    runner-up explain opens on a click too. The screenshots are the docs' (see docs/explore.md)."""
    page_file = tmp_path / "llama.html"
    page_file.write_text(notebook_page(Path(__file__).resolve().parents[2] / "notebooks" / "llama.ipynb"))
    shot = tmp_path / "search.png"
    clicks = [["summary.fold", "layers.0-31"], [".autopar-search summary", "the runner-up"]]
    job = {"page": str(page_file), "height": 1200, "seen": NOTEBOOK_SEEN, "clicks": clicks}
    seen = drive(job | {"shot": str(shot), "shot_of": ".autopar-search"})
    before, after = seen["before"], seen["after"]
    assert before["fold"].startswith("layers.0-31 x 32 identical plan") and not before["open"], before
    assert before["children"] == [] and not before["runner_open"] and before["runner_text"] == ""
    assert {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"} <= set(after["children"]), after
    assert (
        after["runner_text"].startswith("automatic plan: ") and "asked for with ap.Auto(option=" in after["runner_text"]
    )
    assert shot.stat().st_size > 10_000
