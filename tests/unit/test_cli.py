"""The autopar command: plan and check from PACKAGE.MODULE:FACTORY."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import autopar as ap
from autopar.cli import main

GPT_TP = [
    "--annotate",
    "blocks.*.attn.qkv=colwise:tp",
    "--annotate",
    "blocks.*.attn.proj=rowwise:tp",
    "--annotate",
    "blocks.*.mlp.fc=colwise:tp",
    "--annotate",
    "blocks.*.mlp.proj=rowwise:tp",
]


def test_plan_gpt_prints_table_summary_cost_and_saves(capsys, tmp_path):
    out_file = tmp_path / "gpt.json"
    rc = main(
        [
            "plan",
            "autopar.models.examples:gpt",
            "--mesh",
            "dp=2,tp=2",
            *GPT_TP,
            "--cost",
            "--sizes",
            "H=32",
            "--explain",
            "blocks.0.mlp.fc",
            "--save",
            str(out_file),
            "--collectives-only",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("autopar plan for GPT on Mesh(dp=2, tp=2) (4 ranks)")
    # batch 8, sequence 16, H 32, float32, dp 2: 8 all-reduces of 8 KiB on tp per step and rank
    assert "communication on tp: 8 collectives, 64.0 KiB per step and rank" in out
    row = next(line for line in out.splitlines() if " linear_default_2 " in line)
    assert "blocks.0.mlp.fc" in row and "(S(0), S(2))" in row and "all_reduce(tp, bwd)" in row
    assert " gelu " not in out  # --collectives-only: ops without collectives are left out
    table = out.split("\nmodule blocks.0.mlp.fc")[0]
    assert sum(" all_reduce(" in line for line in table.splitlines()) == 10  # the loss: one on dp
    assert "comm on tp: 64*B*H*S*(tp - 1)/(dp*tp)  = 65536 B" in out
    assert "module blocks.0.mlp.fc" in out
    from autopar.models.examples import gpt

    loaded = ap.load_plan(out_file, gpt()[0])
    assert loaded.mesh.axis_names == ("dp", "tp")


def test_check_mlp(capsys):
    rc = main(
        [
            "check",
            "autopar.models.examples:mlp",
            "--mesh",
            "tp=2",
            "--annotate",
            "fc1=colwise:tp",
            "--annotate",
            "fc2=rowwise:tp",
            "--summary-only",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "check passed: 1 outputs and 4 gradients match the serial model" in out


def test_errors_are_one_clear_line(capsys):
    rc = main(["plan", "autopar.models.examples:mlp", "--mesh", "tp=2", "--annotate", "fc9=colwise:tp"])
    assert rc == 1 and "AnnotationError: Annotation pattern 'fc9' matches no module path" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="write axis=size pairs"):
        main(["plan", "autopar.models.examples:mlp", "--mesh", "tp:2"])
    with pytest.raises(SystemExit, match="unknown annotation 'diagonal:tp'"):
        main(["plan", "autopar.models.examples:mlp", "--mesh", "tp=2", "--annotate", "fc1=diagonal:tp"])


def test_python_dash_m():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "autopar", "plan", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0 and "--annotate PATTERN=KIND[:ARG]" in done.stdout


FACTORY = """import torch

def tiny():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)), (torch.randn(4, 4),)
"""


def _console_script(tmp_path):
    """The installed ``autopar`` script, else one written as pip writes it (run from its own
    folder, so sys.path[0] is that folder and not the current directory)."""
    installed = os.path.join(os.path.dirname(sys.executable), "autopar")
    if os.path.exists(installed):
        return [sys.executable, installed]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "autopar").write_text("import sys\nfrom autopar.cli import main\nsys.exit(main())\n")
    return [sys.executable, str(bin_dir / "autopar")]


@pytest.mark.parametrize("how", ["script", "dash_m"])
def test_factory_in_the_current_directory(tmp_path, how):
    """``autopar plan my_models:tiny`` from the folder holding my_models.py, by the console script
    as by ``python -m autopar`` (the script could not import it)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_models.py").write_text(FACTORY)
    cmd = _console_script(tmp_path) if how == "script" else [sys.executable, "-m", "autopar"]
    root = os.path.dirname(os.path.dirname(ap.__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    done = subprocess.run(
        [*cmd, "plan", "my_models:tiny", "--mesh", "dp=2", "--summary-only"],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "autopar plan for Sequential on Mesh(dp=2)" in done.stdout
