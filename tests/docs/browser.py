"""Drive Debian's headless ``chromium`` through Playwright in a child process that a hard timeout
can kill, so that a browser that hangs (seen in CI: a launch under load failed, the next test's
browser never answered, and the run sat there until CI's 90 minutes ran out) fails one test in
minutes instead of holding the whole run. pytest-timeout cannot help there: its alarm fires
once, and the ``finally`` that closes the browser hangs again after it.

A job is a JSON object: the page to open, a script to evaluate before and after the clicks, the
clicks (a CSS selector and the text the element holds), and where to save a screenshot (of the
page, or of the first element a selector finds). The child prints what the script returned::

    seen = drive({"page": "plan.html", "seen": "() => document.title", "clicks": [["summary.fold", ""]],
                  "shot": "plan.png"})
    seen["before"], seen["after"]

``python -m tests.docs.browser NOTEBOOK.ipynb OUT.png`` screenshots a notebook's outputs (the page
nbconvert would make: HTML outputs as they are, text as <pre>).
"""

from __future__ import annotations

import html
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# A cold chromium start on a loaded 2-core machine takes seconds; a whole job minutes at the very worst.
JOB_SECONDS = 240
REPO = Path(__file__).resolve().parents[2]


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


def drive(job: dict, seconds: int = JOB_SECONDS) -> dict:
    """Run ``job`` in a child process; its ``{"before": ..., "after": ...}``, or AssertionError
    saying what went wrong (the child's error, or that chromium did not answer in ``seconds``)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.docs.browser", "--job", json.dumps(job)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: a timeout kills chromium and Playwright's driver with it
    )
    try:
        out, err = child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise AssertionError(f"chromium did not finish {job['page']} in {seconds} s (killed)") from None
    if child.returncode != 0:
        raise AssertionError(f"the browser job on {job['page']} failed:\n{err[-4000:]}")
    return json.loads(out.splitlines()[-1])


def _run_job(job: dict) -> dict:
    from playwright.sync_api import sync_playwright

    timeout_ms = 1000 * (JOB_SECONDS - 30)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"], timeout=timeout_ms
        )
        try:
            page = browser.new_page(viewport={"width": job.get("width", 1400), "height": job.get("height", 900)})
            page.set_default_timeout(timeout_ms)
            page.goto(Path(job["page"]).resolve().as_uri())
            seen = {"before": page.evaluate(job["seen"]) if job.get("seen") else None}
            for selector, text in job.get("clicks", []):
                page.locator(selector, has_text=text or None).first.click()
            seen["after"] = page.evaluate(job["seen"]) if job.get("seen") else None
            if job.get("shot"):
                target = page.locator(job["shot_of"]).first if job.get("shot_of") else page
                target.screenshot(path=job["shot"])
        finally:
            browser.close()
    return seen


if __name__ == "__main__":
    if sys.argv[1] == "--job":
        print(json.dumps(_run_job(json.loads(sys.argv[2]))))
    else:
        nb, png = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
        page_file = png.with_suffix(".html")
        page_file.write_text(notebook_page(nb))
        print(json.dumps(_run_job({"page": str(page_file), "height": 2400, "shot": str(png)})))
