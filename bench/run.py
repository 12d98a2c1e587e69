"""Run every benchmark (bench/bench_*.py), print one markdown table, write bench/results.json.

Each module exposes ``run(quick: bool) -> list[dict]`` with rows of keys benchmark, case,
metric, value, target, note. ``--quick`` runs the tiny sizes (what the tests run);
``--only tp,compile`` picks modules by name; ``--sizes small,30m`` the model sizes of the
step benchmarks (dp, tp, overhead: ``BENCH_SIZES``).

Example:
    $ make bench                         # = python -m bench.run
    $ python -m bench.run --only compile
    $ python -m bench.run --only dp,tp,overhead --sizes small,30m   # the step-overhead targets
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # so that the gloo workers can import bench.*


def modules(only: list[str] | None = None) -> list[str]:
    names = sorted(p.stem for p in HERE.glob("bench_*.py"))
    return [n for n in names if not only or n.removeprefix("bench_") in only]


def run_all(quick: bool, only: list[str] | None = None) -> list[dict]:
    """Every benchmark's rows; a benchmark that raises gives one row saying so (the rest still run)."""
    rows = []
    for name in modules(only):
        t0 = time.perf_counter()
        try:
            rows += importlib.import_module(f"bench.{name}").run(quick)
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            rows.append(
                {
                    "benchmark": name,
                    "case": "-",
                    "metric": "FAILED",
                    "value": None,
                    "target": "",
                    "note": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}",
                }
            )
        print(f"[bench] {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| benchmark | case | metric | value | target | note |\n|---|---|---|---|---|---|"
    lines = [
        f"| {r['benchmark']} | {r['case']} | {r['metric']} | {'-' if r['value'] is None else r['value']} "
        f"| {r['target'] or ''} | {r['note'] or ''} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


KEPT = "<!-- kept across runs: sections below are not regenerated -->"


def results_md(data: dict, old: str = "") -> str:
    """bench/RESULTS.md: the table of a full run, the machine it ran on, and the command; the
    sections of ``old`` after the KEPT marker (recorded profiles, focused runs) stay."""
    kept = old[old.index(KEPT) :] if KEPT in old else ""
    return (
        f"# autopar benchmark results\n\nCommand: `make bench` (= `OMP_NUM_THREADS=1 python -m bench.run`), "
        f"run {data['started']} on {data['machine']}.\n\n{RESULTS_NOTES}\n\n{markdown(data['rows'])}\n"
        + (f"\n{kept}" if kept else "")
    )


RESULTS_NOTES = """\
How to read it:

- **tp_step**: training step (forward, loss, backward) on 2 gloo processes. Ratios are medians of
  per-iteration ratios, the contenders alternating in a shuffled order (the same on both ranks);
  below 1 means autopar is faster. The sanity row times two identical hand-written Megatron
  modules against each other: its distance from 1.00 is this run's noise. The hand-written
  reference's gradients are checked against serial in the same job. "small" is hidden 128
  (framework overhead decides), "large" hidden 512 / MLP 2048 (matmuls decide). The DTensor
  targets assume DTensor costs 2.2x (small) and 1.17x (large) the floor; where DTensor itself
  is cheaper than that on the day, the same autopar step reads a higher ratio.
- **compile**: GPT-style models on the meta device, mesh (2, 4) = (dp, tp). torch.export is timed
  apart from autopar's own work (propagation with its choice cache, emitting all 8 ranks'
  GraphModules). Export runs on the first two blocks only, the others are copied (autopar/trace/repeat_blocks.py;
  the row "every block exported" is the same plan with `repeat_blocks=False`); the 8 ranks share one
  generated program (autopar/codegen/program.py). The 48-layer row is the median of 3 runs. With dynamic
  batch/sequence dims (the default) export is slower than with `ap.plan(..., dynamic=False)`, the
  last compile row.
- **pipeline**: idle fraction per rank against the schedule's bubble. "replayed": each action's
  measured CPU time put back on the schedule (simulated ranks); "real gloo": wall clock of 2 real
  processes, per step from the runners' timelines, median over steps.
- **memory**: one rank's module run alone with shape-only collectives under a tensor-allocation
  counter: parameter bytes, and the peak bytes a step allocates (activations kept for backward,
  gradients, temporaries). Embeddings, norms and logits stay replicated under the Megatron
  annotations, hence ratios above 1 to serial/tp.
- **checkpoint**: a LLaMA-like model on the meta device, planned on (dp=2, tp=2), filled by
  `ap.load_pretrained` from a sharded HF directory on 4 gloo processes: the peak resident memory
  the load adds per rank (kernel VmHWM, reset before), against the rank's pieces plus the largest
  tensor. DCP save/load times (max over ranks) and bytes on disk against `dcp.save` of the serial
  model's `state_dict()` in one process.
- **experts**: a
  Mixtral-shaped model (2 layers, hidden 128, 8 experts top-2, expert ffn 256, 4 x 64 tokens per
  rank) data parallel on 4 gloo processes, its experts three ways: `expert_parallel("dp")` (all-to-all
  dispatch, 1/4 of the experts per rank), the expert weights split on dp without the dispatch
  (`ap.place(Shard(0))`: the grouped matmuls split op by op, tokens gathered over dp around them),
  and plain dp with every expert on every rank. Step time (SGD, alternating, medians) and bytes per
  step and rank from `Plan.collectives()` (the dispatch's rows at their uniform-routing expectation).
- **uneven**: what a size that does not divide by its axis costs on 4 gloo processes: a GPT
  (Megatron + vocab-parallel on tp=4) with an odd vocabulary against the same vocabulary rounded
  up to a multiple of 4 (Megatron's padding), and a ragged data-parallel batch (two rows short:
  pieces 8, 8, 7, 7, means weighted by rows) against an even one; both pairs hold the same largest
  piece per rank, so ~1 is the expectation.
- Wall-clock figures depend on the machine's load (it is shared); ratios much less so."""


def machine() -> str:
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (tp, compile, memory, ...)")
    ap.add_argument("--sizes", default="", help="model sizes of dp, tp, overhead (small, large, 30m)")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args(argv)
    if args.sizes:
        os.environ["BENCH_SIZES"] = args.sizes
    from bench.common import close_pools

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        rows = run_all(args.quick, [s for s in args.only.split(",") if s] or None)
    finally:
        close_pools()
    print(f"\nautopar benchmarks ({started}; {machine()})\n")
    print(markdown(rows))
    data = {"started": started, "machine": machine(), "quick": args.quick, "rows": rows}
    Path(args.out).write_text(json.dumps(data, indent=1))
    if not args.quick and not args.only:  # a full run refreshes the published figures
        path = HERE / "RESULTS.md"
        path.write_text(results_md(data, path.read_text() if path.exists() else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
