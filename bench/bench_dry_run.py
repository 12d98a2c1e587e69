"""Dry runs at full size: a LLaMA-3.1-8B-shaped rank program on fake tensors in a fake world of 8
ranks (plan.dry_run), its measured peak memory, collectives and FLOPs against the plan's formulas
(plan.memory_per_rank, ap.predict, plan.collectives(), plan.cost()), and the seconds and RSS it took.

The model is built on the meta device in bf16, planned as torchtitan ran it (FSDP, gradients reduced
in fp32, their selective checkpointing: every second matmul kept), local batch 2 x 8192, and run in
a subprocess (the fake process group is the process's one; RSS is its own). The 70B and 405B
rows are the hand plans of docs/auto.md; the "search's choice" rows plan each published mesh with
``ap.Auto(device="h100", memory_budget=80 GiB)`` (fp32 masters under the bf16 policy, as
bench_published searches) and dry-run the rank that holds the most.

Example:
    $ python -m bench.run --only dry_run
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import row

SCRIPT = r"""
import json, resource, sys, time
from collections import Counter
import torch
import autopar as ap
from transformers import LlamaForCausalLM
from bench.llama_shapes import LossOnly, llama_config

case = json.loads(sys.argv[1])
chosen = "hand"
if isinstance(case, dict):  # the search's choice on a published mesh, searched as bench_published searches it
    hidden, inter, layers, heads, kv, vocab = case["size"]
    local, seq, shape, names = case["local"], case["seq"], case["shape"], case["names"]
    with torch.device("meta"):  # fp32 masters under torchtitan's policy: bf16 compute, fp32 reduction
        model = LossOnly(LlamaForCausalLM(llama_config(hidden, inter, layers, heads, kv, vocab, seq)))
    data = 1
    for a, size in zip(names, shape):
        data *= size if a in ("rep", "dp") else 1
    ids = torch.zeros(local * data, seq, dtype=torch.long, device="meta")
    kw = {"input_ids": ids, "labels": ids}
    policy = ap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = ap.plan(model, ap.Mesh(tuple(shape), tuple(names)), kwargs=kw, dynamic=False, mixed_precision=policy,
                   auto=ap.Auto(device="h100", memory_budget=case["budget_gib"] * 2**30))
    chosen = plan.built["auto"]["chosen"]
    rank = plan.peak_memory_rank(2)  # the rank that holds the most (ap.Auto(verify=True) runs it)
else:
    hidden, inter, layers, heads, kv, vocab, local, seq, n, mode, tp, *more = case
    pp, rank = (more + [1, 0])[:2] if more else (1, 0)  # pipeline positions; the rank to run
    cfg = llama_config(hidden, inter, layers, heads, kv, vocab, seq)  # torchtitan's causal SDPA, no mask

    with torch.device("meta"):
        model = LossOnly(LlamaForCausalLM(cfg).to(torch.bfloat16))
    ids = torch.zeros(local * n, seq, dtype=torch.long, device="meta")
    ac = None if mode == "none" else ap.ActivationCheckpoint(mode, save_every=2 if mode == "selective" else 1)
    kw = {"input_ids": ids, "labels": ids}
    axes = [("dp", n)] + ([("pp", pp)] if pp > 1 else []) + ([("tp", tp)] if tp > 1 else [])
    mesh = ap.Mesh(tuple(s for _, s in axes), tuple(a for a, _ in axes))
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True) if tp > 1 else {}  # torchtitan's tp + sp
    # torchtitan under pp: 1F1B with pp micro-batches, blocks not resharded after forward
    pipe = ap.Pipeline("pp", microbatches=pp, schedule="1f1b") if pp > 1 else None
    dp = ap.DataParallel("dp", zero=3, reduce_dtype=torch.float32, reshard_after_forward=pp == 1)
    plan = ap.plan(model, mesh, kwargs=kw, dynamic=False, annotations=ann, data_parallel=dp, activation_checkpoint=ac,
                   pipeline=pipe)
def _r(collectives):  # (kind, axis, bytes rounded): the ones that differ are printed
    return [(k, a, round(b)) for k, a, b in collectives]


t0, c0, rss0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run = plan.dry_run(rank=rank, device="cuda", steps=2).runs[rank]
print(json.dumps({
    "seconds": time.perf_counter() - t0, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "cpu_s": time.process_time() - c0, "planned_rss_mib": rss0 / 1024,  # CPU: the machine is shared
    "peak": run.peak_bytes, "peak_by_kind": run.peak_by_kind, "predicted": run.predicted_bytes,
    "predicted_by_kind": run.predicted_by_kind, "predict": ap.predict(plan, "h100")["memory"],
    "phases": run.predicted_phases, "parts_sum": run.predicted_sum,
    "flops": run.flops, "predicted_flops": run.predicted_flops,
    "attention_flops": sum(v for k, v in run.flops_by_op.items() if "attention" in k),
    "rank": rank, "equal": run.collectives_match, "chosen": chosen,
    "differ": [sorted((Counter(_r(run.collectives)) - Counter(_r(run.predicted_collectives))).elements())[:8],
               sorted((Counter(_r(run.predicted_collectives)) - Counter(_r(run.collectives))).elements())[:8]],
    "collectives": sorted(Counter(f"{k} {a}" for k, a, _ in run.collectives).items()),
    "predicted_collectives": sorted(Counter(f"{k} {a}" for k, a, _ in run.predicted_collectives).items()),
    "bytes": sum(b for *_, b in run.collectives), "predicted_bytes": sum(b for *_, b in run.predicted_collectives),
}))
"""

# docs/auto.md's 405B on FSDP 8 x PP 8 x TP 8 (1F1B, full AC), one row per rank dry-run: its shape,
# local batch 32 in 8 micro-batches, then (pp, rank)
_405B = (16384, 53248, 126, 128, 8, 128256, 32, 8192, 8, "full", 8, 8)

CASES = {  # name: (hidden, intermediate, layers, heads, kv heads, vocab, local batch, seq, dp ranks, checkpointing, tp)
    "LLaMA-3.1-8B, FSDP 8, selective AC": (4096, 14336, 32, 32, 8, 128256, 2, 8192, 8, "selective", 1),
    "LLaMA-3.1-8B, FSDP 8, no AC": (4096, 14336, 32, 32, 8, 128256, 2, 8192, 8, "none", 1),
    "LLaMA-3.1-8B, FSDP 128, selective AC": (4096, 14336, 32, 32, 8, 128256, 2, 8192, 128, "selective", 1),
    "LLaMA-3.1-70B, FSDP 32 x TP 8, full AC": (8192, 28672, 80, 64, 8, 128256, 2, 8192, 32, "full", 8),
    # docs/auto.md's 405B: local batch 32 per dp rank in 8 micro-batches; rank 0 (stage 0: the
    # embedding and the first blocks) and the last stage's rank 56 (the head and the loss)
    "LLaMA-3.1-405B, FSDP 8 x PP 8 x TP 8, 1F1B, full AC, stage 0": (*_405B, 0),
    "LLaMA-3.1-405B, FSDP 8 x PP 8 x TP 8, 1F1B, full AC, last stage": (*_405B, 56),
}
# the search's own choice on each published configuration (docs/auto.md's search column), searched
# as bench_published does (fp32 masters under MixedPrecision(bf16, reduce fp32), ap.Auto(device=
# "h100", memory_budget=80 GiB), eager: the published runs' compile and Float8 left out), its
# fullest rank dry-run
_SIZES = {"8b": (4096, 14336, 32, 32, 8, 128256), "70b": (8192, 28672, 80, 64, 8, 128256),
          "405b": (16384, 53248, 126, 128, 8, 128256)}  # fmt: skip
SEARCHED = {
    "search's choice, 8B on 8 (80 GiB)": dict(size=_SIZES["8b"], local=2, seq=8192, shape=[8], names=["dp"]),
    "search's choice, 8B on 16 x 8 (80 GiB)": dict(
        size=_SIZES["8b"], local=2, seq=8192, shape=[16, 8], names=["rep", "dp"]
    ),
    "search's choice, 70B on 32 x 8 (80 GiB)": dict(
        size=_SIZES["70b"], local=16, seq=8192, shape=[32, 8], names=["dp", "tp"]
    ),
    "search's choice, 405B on 8 x 8 x 8 (80 GiB)": dict(
        size=_SIZES["405b"], local=32, seq=8192, shape=[8, 8, 8], names=["dp", "pp", "tp"]
    ),
}
for _case in SEARCHED.values():
    _case["budget_gib"] = 80
CASES.update(SEARCHED)
QUICK = {
    "LLaMA-shaped 2 x 64, FSDP 4, selective AC": (64, 128, 2, 4, 2, 256, 2, 32, 4, "selective", 1),
    "LLaMA-shaped 4 x 64, FSDP 2 x PP 2 x TP 2, 1F1B, full AC, last stage": (
        64,
        128,
        4,
        4,
        2,
        256,
        4,
        32,
        2,
        "full",
        2,
        2,
        2,
    ),
}


def dry_run(case: tuple) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(case)], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError((out.stderr.strip().splitlines() or ["?"])[-1][:300])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool, only: str | None = None) -> list[dict]:
    rows = []
    for name, case in (QUICK if quick else CASES).items():
        if only is not None and only not in name:
            continue
        got = dry_run(case)
        gib = 2**30
        kinds = ", ".join(f"{k} {v / gib:.2f}" for k, v in sorted(got["peak_by_kind"].items()))
        rows += [
            row(
                "dry_run",
                name,
                "peak GiB, measured / plan.memory_per_rank",
                f"{got['peak'] / gib:.2f} / {got['predicted'] / gib:.2f} ({got['peak'] / got['predicted']:.3f}x)",
                "within 5%",
                (f"rank {got['rank']} of {got['chosen']}; " if got["chosen"] != "hand" else "")
                + kinds
                + f"; parts' sum {got['parts_sum'] / gib:.2f}; predicted by phase "
                + ", ".join(f"{k} {v / gib:.2f}" for k, v in got["phases"].items()),
            ),
            row(
                "dry_run",
                name,
                "FLOPs per step, measured / plan.cost()",
                f"{got['flops']:.4g} / {got['predicted_flops']:.4g} ({got['flops'] / got['predicted_flops']:.3f}x)",
                "within 2%",
                f"attention (causal at half, backward 2.5x: dryrun/flops.py) {got['attention_flops']:.4g}",
            ),
            row(
                "dry_run",
                name,
                "collectives per step, measured / plan.collectives()",
                f"{dict(got['collectives'])} / {dict(got['predicted_collectives'])}",
                "equal",
                f"{'equal' if got['equal'] else 'NOT equal: measured only, predicted only ' + str(got['differ'])}"
                " in kind, axis and bytes; "
                f"bytes {got['bytes']:.4g} / {got['predicted_bytes']:.4g}",
            ),
            row(
                "dry_run",
                name,
                "seconds (2 steps), RSS MiB",
                f"{got['seconds']:.0f} s ({got['cpu_s']:.0f} s of CPU), {got['rss_mib']:.0f}",
                "<= 120 s, 4 GiB",
                f"RSS after planning, before the dry run: {got['planned_rss_mib']:.0f} MiB",
            ),
        ]
    return rows


if __name__ == "__main__":  # python -m bench.bench_dry_run [--quick] [a part of a case's name]
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    for r in run("--quick" in sys.argv, names[0] if names else None):
        print(r)
