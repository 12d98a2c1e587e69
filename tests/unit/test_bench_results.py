"""bench/run.py keeps the RESULTS.md sections after its marker when a full run rewrites the table."""

from __future__ import annotations

from bench.run import KEPT, results_md


def test_sections_after_the_marker_survive_a_full_run():
    data = {"started": "now", "machine": "here", "rows": []}
    old = results_md(data) + f"\n{KEPT}\n\n## Step overhead\nprofiles\n"
    new = results_md(dict(data, started="later"), old)
    assert "run later on here" in new and new.endswith(f"{KEPT}\n\n## Step overhead\nprofiles\n")
    assert KEPT not in results_md(data, "no marker")
