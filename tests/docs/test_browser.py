"""The plan's HTML view in a real browser: Debian's headless ``chromium`` loads the page, a
script in it opens the folded block and measures what a person sees (skipped without chromium).

The script writes its findings into the page; ``--dump-dom`` hands the page back after it ran.
``python -m tests.docs.test_browser NOTEBOOK.ipynb OUT.png`` screenshots a notebook's outputs
(the page nbconvert would make: HTML outputs as they are, text as <pre>).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,900"]

# Runs in the page: the first screen's rows, the tree's indentation, then the fold opened.
PROBE = """<script>
window.addEventListener("load", () => {
  const shown = (e) => e.checkVisibility();  // false inside a closed <details>
  const rows = [...document.querySelectorAll(".autopar-plan .g:not(.head)")];
  const first = rows.filter((r) => shown(r) && r.getBoundingClientRect().bottom <= window.innerHeight);
  const name = (r) => r.querySelector("span");
  const textLeft = (e) => {  // where the name's text starts: after its indentation
    const range = document.createRange();
    range.selectNodeContents(e);
    return range.getBoundingClientRect().left;
  };
  const fold = document.querySelector("summary.fold");
  const before = rows.filter(shown).length;
  fold.parentElement.open = true;
  const inside = [...fold.parentElement.querySelectorAll(":scope > details > summary, :scope > div.g")];
  const out = {
    first_screen: first.map((r) => name(r).textContent.trim()),
    align: getComputedStyle(name(rows[0])).textAlign,
    fold_left: textLeft(name(fold)),
    inside: inside.map((r) => [name(r).textContent.trim(), textLeft(name(r))]),
    opened: rows.filter(shown).length - before,
  };
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium(page: Path, *args: str) -> str:
    cmd = [CHROMIUM, *FLAGS, "--virtual-time-budget=3000", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout


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
def test_folded_tree_in_chromium(tmp_path):
    from tests.harness.models import shared_gpt_plan

    page = tmp_path / "plan.html"
    page.write_text("<html><body>" + shared_gpt_plan("dp2xtp2")._repr_html_() + PROBE + "</body></html>")
    dom = chromium(page, "--dump-dom")
    found = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)))
    first = found["first_screen"]
    # the whole structure on the first screen, blocks folded, no op without a collective
    assert first[:4] == ["wte", "wpe", "drop", "blocks.0-1 x 2 identical plan"], first
    assert {"ln_f", "lm_head", "(top)", "(grad sync)"} <= set(first) and len(first) <= 12
    assert found["align"] == "left"
    names = dict((n, left) for n, left in found["inside"])
    # the fold's children, one click open, indented under it (and its own residual adds, behind one more)
    assert set(names) == {"ln_1", "attn", "ln_2", "mlp", "2 ops without collectives"}, names
    assert all(left > found["fold_left"] for left in names.values())
    assert found["opened"] == 5
    shot = tmp_path / "plan.png"
    chromium(page, f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000


if __name__ == "__main__":
    nb, png = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
    page = png.with_suffix(".html")
    page.write_text(notebook_page(nb))
    chromium(page, f"--screenshot={png}", "--window-size=1400,2400")
    print(png)
