"""Every notebook in notebooks/ runs top to bottom (nbclient + ipykernel, pinned)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import nbclient  # noqa: E402  (pinned in requirements-test.txt: a missing one is a failure, not a skip)
import nbformat  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/docs/ -> ..)
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def run_notebook(path: Path, timeout: int = 300):
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    return nb


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts += [str(v) for v in out.get("data", {}).values()]
    return "\n".join(parts)


# make test runs the quickstart (the first thing a newcomer opens) and the llama notebook (the plan at
# model size); the gpt, pipeline and zero notebooks (each a kernel of its own, ~45 s together on a quiet
# machine, 215 s loaded) run in `make fuzz`, their stories tested piece by piece in tests/simulated.
IN_MAKE_TEST = {"quickstart", "llama"}
RUNS = [p if p.stem in IN_MAKE_TEST else pytest.param(p, marks=pytest.mark.slow) for p in NOTEBOOKS]


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = run_notebook(path)
    text = outputs_text(nb)
    assert "Traceback" not in text
    if path.stem == "quickstart":
        assert "'max_rel'" in text and "autopar plan for Sequential on Mesh(dp=2, tp=2)" in text
    if path.stem == "llama":  # HF LLaMA, Megatron preset, sequence parallel off/on, measured = planned
        assert "SP: measured bytes == planned bytes on every axis: True; same collectives: True" in text
        assert "no SP: measured bytes == planned bytes on every axis: True; same collectives: True" in text
        # the 8B-shaped model on meta: 32 layers folded into one line, a parameter drawn on the mesh
        assert "layers.0-31 x 32, identical plan" in text
        tree, flat = map(int, re.search(r"(\d+) lines, against (\d+) in the flat table", text).groups())
        assert tree <= 60 and flat > 2000
        assert "(R, S(0)) on Mesh(dp=8, tp=8)" in text and "<svg" in text
        assert "tp=4, batch=32, memory per rank" in text  # the what-if's second plan
        assert "<- chosen" in text and "the runner-up: " in text  # the search's options, the runner-up explained
        assert "(asked for with ap.Auto(option=...); the search itself chooses" in text
    if path.stem == "zero":
        assert "ZeRO-1 vs plain DP: losses and parameters identical" in text
        assert "ZeRO-2 vs plain DP: losses and parameters identical" in text
        assert "ZeRO-1 optimizer state: 1/4 of plain DP's" in text
    if path.stem == "pipeline":
        assert text.count("equal to serial") >= 3
        assert "GPipe holds m = 4 micro-batches per rank [4, 4]; 1F1B at most p - r [2, 1]" in text
    if path.stem == "gpt":
        assert "plans agree: same layouts and collectives" in text
        assert any("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_outputs(path):
    """A notebook tells its story with real output: run it and save it before committing."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), f"{path.name}: run it top to bottom, then save"
    assert sum(bool(c.get("outputs")) for c in code) >= len(code) * 2 // 3
