"""`make survey`: plan every architecture of the installed transformers, check it, write SURVEY.md.

For each architecture with a causal-LM, seq2seq-LM, masked-LM or image-classification head
(bench/survey_models.py builds it tiny): the Megatron preset on axis tp where it finds a pair,
plain data parallel otherwise, on meshes (2,) and (2, 2); ``plan.check`` against serial
(forward and every gradient); which ops fell back to gathered-and-replicated; the fraction
of the parameters one rank holds. Each model runs in a worker process under a time limit.

Example:
    $ python -m bench.survey -j 2 --limit 120            # writes bench/SURVEY.md
    $ python -m bench.survey --only LlamaForCausalLM     # one model, result printed
    $ python -m bench.survey -j 1 --head causal-lm --precision bf16 --out bench/SURVEY_BF16.md

``--precision bf16``: after the fp32 plan and check, the same model planned under FSDP2's recipe
(bf16 compute over fp32 masters) and held against the serial model under it
(bench/survey_precision.py says the plans, the reference and the tolerance).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
MESHES = ((2,), (2, 2))


def _mesh(shape, preset: bool):
    import autopar as ap

    if shape == (2,):
        return ap.Mesh(shape, ("tp",) if preset else ("dp",))
    return ap.Mesh(shape, ("dp", "tp"))


def _fallbacks(plan) -> list[str]:
    return sorted({str(n.target) for n in plan.graph.nodes if getattr(n.meta.get("autopar"), "fallback", False)})


def _param_fraction(plan) -> float:
    total = sum(p.numel() for p in plan.model.parameters())
    local = sum(p.numel() for p in plan.module(0).parameters())
    return local / max(total, 1)


def _cause(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    head = msg[0] if msg else ""
    return f"{type(e).__name__}: {head}"[:240]


def run_one(name: str, precision: str | None = None) -> dict:
    """Build, plan and check one architecture; every failure recorded with its cause. With
    ``precision="bf16"``, an architecture equal to serial in fp32 is planned again under the bf16
    policy and checked against the serial policy (``bf16_*`` fields)."""
    import autopar as ap
    from bench.survey_models import architectures, build

    arch = next(a for a in architectures() if a.name == name)
    row = {
        "name": name,
        "model_type": arch.model_type,
        "head": arch.head,
        "built": False,
        "planned": False,
        "equal": False,
        "fallback": [],
        "params_per_rank": None,
        "plan": "",
        "cause": "",
        "seconds": 0.0,
    }
    t0 = time.time()
    try:
        model, kwargs = build(arch)
        row["built"] = True
    except BaseException as e:  # noqa: BLE001 - a survey records every failure
        row["cause"] = "build: " + _cause(e)
        return row
    stage = "preset"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                preset = ap.presets.megatron(model, "tp", kwargs=kwargs)
            except ap.AnnotationError:
                preset = None
            row["plan"] = "megatron" if preset is not None else "data parallel"
            fallback, fractions = set(), []
            for shape in MESHES:
                stage = f"plan {shape}"
                mesh = _mesh(shape, preset is not None)
                dp = "dp" if "dp" in mesh.axis_names else None
                plan = ap.plan(
                    model, mesh, kwargs=kwargs, annotations=dict(preset or {}), data_parallel=dp, dynamic=False
                )
                fallback |= set(_fallbacks(plan))
                fractions.append(_param_fraction(plan))
                row["planned"] = shape == MESHES[-1]
                stage = f"check {shape}"
                plan.check(**kwargs, rtol=1e-3, atol=1e-4)
            row["equal"] = True
            row["fallback"] = sorted(fallback)
            row["params_per_rank"] = round(fractions[0], 3)
            if precision == "bf16":
                stage = "bf16"
                _bf16(row, model, kwargs, preset)
    except BaseException as e:  # noqa: BLE001
        row["cause"] = f"{stage}: " + _cause(e)
        row["trace"] = traceback.format_exc(limit=-3)[-1200:]
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _bf16(row: dict, model, kwargs: dict, preset) -> None:
    """The bf16 policy's plans of ``model`` checked against the serial policy (``bf16_*`` fields)."""
    import autopar as ap
    from bench.survey_precision import policy_check, policy_plans, training_model

    row.update(bf16_planned=False, bf16_equal=False, bf16_fallback=[], bf16_cause="", bf16_max_rel=None)
    stage, worst, fallback = "plan", 0.0, set()
    try:
        trained, kwargs = training_model(model, kwargs)
        if trained is not model and preset is not None:  # the wrapper's module paths
            preset = ap.presets.megatron(trained, "tp", kwargs=kwargs)
        model = trained
        for shape, plan in policy_plans(model, kwargs, preset):
            fallback |= set(_fallbacks(plan))
            row["bf16_planned"] = shape == MESHES[-1]
            stage = f"check {shape}"
            worst = max(worst, policy_check(plan, model, kwargs))
        row["bf16_equal"] = True
        row["bf16_max_rel"] = round(worst, 5)
    except BaseException as e:  # noqa: BLE001 - a survey records every failure
        if isinstance(e, TimeoutError):
            raise
        row["bf16_cause"] = f"{stage}: " + _cause(e)
        row["bf16_trace"] = traceback.format_exc(limit=-3)[-1200:]
    row["bf16_fallback"] = sorted(fallback)


def _worker(names: list[str], out: Path, limit: int, precision: str | None = None) -> None:
    """Run ``names`` one after another, one JSON line each; SIGALRM ends a model over the limit."""

    def alarm(*_):
        raise TimeoutError(f"over the {limit} s limit")

    signal.signal(signal.SIGALRM, alarm)
    with out.open("a") as f:
        for name in names:
            f.write(json.dumps({"start": name}) + "\n")
            f.flush()
            signal.alarm(limit)
            try:
                row = run_one(name, precision)
            except TimeoutError as e:
                row = {"name": name, "built": True, "cause": f"timeout: {e}"}
            signal.alarm(0)
            f.write(json.dumps(row) + "\n")
            f.flush()


def _read(path: Path) -> tuple[dict, str | None]:
    rows, started = {}, None
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "start" in rec:
                started = rec["start"]
            else:
                rows[rec["name"]] = rec
                started = None
    return rows, started


def run_all(names: list[str], jobs: int, limit: int, workdir: Path, precision: str | None = None) -> dict:
    """Workers over ``jobs`` processes; a worker stuck past the limit is killed and restarted."""
    workdir.mkdir(parents=True, exist_ok=True)
    chunks = [names[i::jobs] for i in range(jobs)]
    procs = {
        i: (chunk, _spawn(chunk, workdir / f"w{i}.jsonl", limit, precision)) for i, chunk in enumerate(chunks) if chunk
    }
    rows: dict = {}
    while procs:
        time.sleep(2)
        for i, (chunk, proc) in list(procs.items()):
            got, started = _read(workdir / f"w{i}.jsonl")
            rows.update(got)
            left = [n for n in chunk if n not in got]
            if proc.poll() is not None or (started and _stuck(workdir, i, limit)):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if started and started in left:
                    rows[started] = {"name": started, "built": True, "cause": "timeout: killed after the limit"}
                    _append(workdir / f"w{i}.jsonl", rows[started])
                    left.remove(started)
                procs.pop(i)
                if left:
                    procs[i] = (chunk, _spawn(left, workdir / f"w{i}.jsonl", limit, precision))
    return rows


def _stuck(workdir: Path, i: int, limit: int) -> bool:
    """No line written for longer than the limit allows: the alarm did not fire (C code)."""
    return time.time() - (workdir / f"w{i}.jsonl").stat().st_mtime > limit + 60


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _spawn(names, out: Path, limit: int, precision: str | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    return subprocess.Popen(
        [sys.executable, "-m", "bench.survey", "--worker", str(out), "--limit", str(limit)]
        + (["--precision", precision] if precision else [])
        + names,
        cwd=HERE.parent,
        env=env,
        stdout=subprocess.DEVNULL,
    )


def main(argv=None) -> None:
    from bench.survey_models import HEADS

    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("names", nargs="*")
    ap_.add_argument("--only", help="run one architecture in this process and print its row")
    ap_.add_argument("--worker", help=argparse.SUPPRESS)
    ap_.add_argument("-j", "--jobs", type=int, default=2)
    ap_.add_argument("--limit", type=int, default=180, help="seconds per model")
    ap_.add_argument("--out", help="default: bench/SURVEY.md, bench/SURVEY_BF16.md with --precision bf16")
    ap_.add_argument("--report", help="write SURVEY.md from the worker files in this folder (a partial run)")
    ap_.add_argument("--head", choices=sorted(HEADS), help="survey the architectures with this head only")
    ap_.add_argument("--precision", choices=["bf16"], help="also plan under the bf16 policy (survey_precision.py)")
    args = ap_.parse_args(argv)
    args.out = args.out or str(HERE / ("SURVEY.md" if args.precision is None else "SURVEY_BF16.md"))
    if args.only:
        print(json.dumps(run_one(args.only, args.precision), indent=1))
        return
    if args.worker:
        _worker(args.names, Path(args.worker), args.limit, args.precision)
        return
    from bench.survey_models import architectures
    from bench.survey_report import write

    if args.report:
        rows = {}
        for p in sorted(Path(args.report).glob("w*.jsonl")):
            rows.update(_read(p)[0])
        total = len([a for a in architectures() if args.head in (None, a.head)])
        Path(args.out).write_text(write(list(rows.values()), 0.0, args, total=total))
        return
    names = args.names or [a.name for a in architectures() if args.head in (None, a.head)]
    t0 = time.time()
    workdir = HERE / (".survey" if args.precision is None else f".survey-{args.precision}")
    for p in workdir.glob("w*.jsonl"):
        p.unlink()
    rows = run_all(names, args.jobs, args.limit, workdir, args.precision)
    text = write([rows[n] for n in names if n in rows], time.time() - t0, args)
    Path(args.out).write_text(text)
    print(text.split("\n\n")[1] if "\n\n" in text else text)


if __name__ == "__main__":
    main()
