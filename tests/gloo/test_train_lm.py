"""examples/train_lm.py as users start it (python -m torch.distributed.run, gloo), a tiny
model for a handful of steps: the files it writes, a resume on the same mesh logging the
uninterrupted run's losses, a resume on another mesh (a pipeline), the transformers reload, and
the refusals of bad input. Plus the pieces in-process: the model equals LlamaForCausalLM, the
loader's rows are the plan's."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import autopar as ap

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)

import lm_data  # noqa: E402
import lm_model  # noqa: E402
import train_lm  # noqa: E402

TINY = "--hidden 32 --layers 2 --heads 4 --kv-heads 2 --seq 32 --batch 4 --corpus-mb 0.3"
QUICK = "--eval-every 2 --eval-batches 1 --ckpt-every 2 --sample-tokens 8"


def launch(nproc: int, args: str, timeout: int = 180) -> str:
    """torchrun (its module form) on the example; its stdout. On a timeout the whole process group
    goes (the workers too), and the test fails with what they printed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [os.path.join(EXAMPLES, "train_lm.py"), *args.split(), "--timeout", "60"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    for noise in ("requires_grad=True to a scalar", "all_gather_into_tensor` is deprecated"):  # issue 40
        assert noise not in err, err[-3000:]
    return out


def rows(out_dir: str, kind: str = "train", run: int | None = None) -> dict:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        got = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r for r in got if r["kind"] == kind and (run is None or r["run"] == run)}


def back_to_step(src: str, dst: str, step: int) -> None:
    """``dst``: ``src`` as it was when step ``step``'s checkpoint was the last one written."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("hf", "sample.txt"))
    for name in os.listdir(os.path.join(dst, "ckpt")):
        if name.startswith("step_") and int(name[5:]) > step:
            shutil.rmtree(os.path.join(dst, "ckpt", name))
    with open(os.path.join(dst, "ckpt", "latest"), "w") as f:
        f.write(f"step_{step:06d}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 4-step tp=2 run shared by the export and both resumes (three torchrun launches in one test
    ran past pytest's 300 s on a loaded machine): its directory and stdout."""
    a = str(tmp_path_factory.mktemp("train_lm") / "a")
    return a, launch(2, f"--mesh tp=2 --steps 4 {TINY} {QUICK} --out {a}")


def test_train_and_export(trained):
    a, done = trained
    train = rows(a)
    assert sorted(train) == [1, 2, 3, 4] and sorted(rows(a, "val")) == [2, 4]
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm"} <= set(train[1])
    for name in ("loss.png", "sample.txt", "run.json", "hf/config.json", "hf/tokenizer.json", "ckpt/step_000002"):
        assert os.path.exists(os.path.join(a, name)), name
    assert "transformers' LlamaForCausalLM reloads it" in done
    # transformers reads the saved directory: its loss on a validation batch is the trained model's
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(os.path.join(a, "hf"))
    tok = AutoTokenizer.from_pretrained(os.path.join(a, "hf"))
    ids = tok("import os\n", return_tensors="pt").input_ids
    assert hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).shape[1] == ids.shape[1] + 4
    theirs, ours = re.search(r"reloads it: loss ([\d.]+) .*trained module: ([\d.]+)", done).groups()
    assert float(theirs) == pytest.approx(float(ours), abs=2e-5)


def test_resume_on_the_same_mesh(trained, tmp_path):
    """Interrupted after step 2, resumed on the same mesh: the same losses as the uninterrupted run."""
    a, _ = trained
    train = rows(a)
    b = str(tmp_path / "b")
    back_to_step(a, b, 2)
    launch(2, f"--mesh tp=2 --steps 4 {QUICK} --out {b} --resume")
    resumed = rows(b, run=1)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step]["loss"] == pytest.approx(train[step]["loss"], rel=1e-6, abs=1e-6)
        assert resumed[step]["lr"] == pytest.approx(train[step]["lr"], rel=1e-12)


# 41 s on a quiet machine (a torchrun launch); a DCP checkpoint resharded into another plan (a pipeline
# too) is in CI by tests/gloo/test_checkpoint.py::test_dcp_reshards_into_other_plans
@pytest.mark.slow
def test_resume_on_another_mesh(trained, tmp_path):
    """... and on another mesh: a two-stage pipeline (the checkpoint resharded by DCP)."""
    a, _ = trained
    train = rows(a)
    c = str(tmp_path / "c")
    back_to_step(a, c, 2)
    launch(2, f"--mesh pp=2 --microbatches 2 --steps 4 {QUICK} --out {c} --resume")
    other = rows(c, run=1)
    for step in (3, 4):
        assert other[step]["loss"] == pytest.approx(train[step]["loss"], rel=1e-4)
    assert os.path.exists(os.path.join(c, "hf", "config.json"))


@pytest.mark.slow  # 22 s; cp on real processes is in CI by tests/gloo/test_context_parallel.py
def test_context_parallel_trains_as_tensor_parallel(tmp_path):
    """--mesh cp=2 (every sequence split, ring attention, load balanced) trains the same steps as
    tp=2 on the same batches: equal losses."""
    cp, tp = str(tmp_path / "cp"), str(tmp_path / "tp")
    launch(2, f"--mesh cp=2 --steps 2 {TINY} --eval-every 2 --eval-batches 1 --sample-tokens 4 --out {cp}")
    launch(2, f"--mesh tp=2 --steps 2 {TINY} --eval-every 2 --eval-batches 1 --sample-tokens 4 --out {tp}")
    for step in (1, 2):
        assert rows(cp)[step]["loss"] == pytest.approx(rows(tp)[step]["loss"], rel=1e-4)
    assert rows(cp, "val")[2]["val_loss"] == pytest.approx(rows(tp, "val")[2]["val_loss"], rel=1e-4)


def check(argv: str, world: int = 2) -> str:
    with pytest.raises(train_lm.Usage) as e:
        train_lm.check_input(train_lm.parse_args(argv.split()), world)
    return str(e.value)


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "exists" in check(f"--out {out} --mesh tp=2") and "--resume" in check(f"--out {out} --mesh tp=2")
    assert "nothing to resume" in check(f"--out {out} --mesh tp=2 --resume")
    assert "nothing to resume" in check(f"--out {tmp_path / 'none'} --mesh tp=2 --resume")
    assert "4 ranks but 2 processes" in check(f"--out {tmp_path / 'x'} --mesh dp=2,tp=2")
    assert "must divide into 2 x 2 chunks" in check(f"--out {tmp_path / 'x'} --mesh cp=2 --seq 30")
    assert "not with pp" in check(f"--out {tmp_path / 'x'} --mesh cp=2 --auto")
    assert "dp axis" in check(f"--out {tmp_path / 'x'} --mesh tp=2 --zero 1")
    assert "must divide --kv-heads" in check(f"--out {tmp_path / 'x'} --mesh tp=2 --kv-heads 1 --heads 4")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and sorted(os.listdir(out)) == ["metrics.jsonl"]
    assert not (tmp_path / "x").exists() and not (tmp_path / "none").exists()
    # the command line itself: one message, exit status 2
    cmd = [sys.executable, os.path.join(EXAMPLES, "train_lm.py"), "--out", str(out)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd())
    )
    assert done.returncode == 2 and done.stderr.count("train_lm.py: error:") == 1, done.stderr


def test_a_resumed_run_keeps_its_settings(tmp_path):
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "latest").write_text("step_000002")
    (out / "run.json").write_text(json.dumps({"run": {**train_lm.RUN_DEFAULTS, "hidden": 32}}))
    assert "started with 32" in check(f"--out {out} --mesh tp=2 --resume --hidden 64")
    args = train_lm.parse_args(f"--out {out} --mesh tp=2 --resume --steps 9".split())
    assert train_lm.check_input(args, 2)[0]["hidden"] == 32


def test_model_is_llama_for_causal_lm():
    from transformers import LlamaForCausalLM

    cfg = lm_model.llama_config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, seq=16)
    torch.manual_seed(0)
    ours = lm_model.LlamaLM(cfg)
    theirs = LlamaForCausalLM(cfg)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(ours(idx), theirs(input_ids=idx).logits, rtol=1e-5, atol=1e-5)


def test_loader_gives_each_rank_the_plans_rows():
    cfg = lm_model.llama_config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, seq=8)
    ids = torch.arange(1000, dtype=torch.int32) % 64
    example = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
    plan = ap.plan(lm_model.LlamaLM(cfg), ap.Mesh((2, 2), ("tp", "dp")), args=example, data_parallel="dp")
    whole = lm_data.TokenLoader(ids, 4, 8)
    x, y = whole.next()
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(x[1, 0:1], y[0, -1:])
    for rank in plan.mesh.ranks():
        dp_rank, dp_size = train_lm.dp_position(plan, rank, pipeline=False)
        loader = lm_data.TokenLoader(ids, 4, 8, dp_rank, dp_size)
        (lx, ly), _ = plan.local_inputs(rank, x, y)
        got = loader.next()
        assert torch.equal(got[0], lx) and torch.equal(got[1], ly)
        assert loader.state_dict() == whole.state_dict()  # the position is global: any dp size resumes it
