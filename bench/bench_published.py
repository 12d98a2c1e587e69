"""Published large-scale runs against the search's cost model, and the search on their hardware.

Each published configuration (torchtitan's LLaMA-3.1 benchmarks on H100s, end of 2024:
pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md) is planned by hand as its
authors ran it, on the meta device (HF LlamaConfig sizes; the fp32 HF model under the precision policy
``ap.MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``: bf16 compute over fp32 master weights),
and ``ap.predict(plan, "h100")`` gives its tokens/s per GPU and memory per rank: the published
figures sit beside them. Then ``ap.plan(auto=ap.Auto(device="h100", memory_budget=...))`` searches
the same mesh: its choice, predicted throughput and search time (a fresh process each, peak RSS).
Each run is predicted as it ran (``ap.Auto(compiled=, float8=)``: the last field of PUBLISHED);
the 8B's compiled and compiled + Float8 rows of their Table 1 are anchors whose speed-up over the
eager row is held against the published speed-up (their figures are never inputs to the model).

The published runs used H100s capped at 500 W with 96 GB of HBM2e (2.4 TB/s); the ``h100``
profile is measured on a 700 W H100 80GB HBM3 (bench/gpu_calibration.py), and ``h100-500w`` is
derived from that measurement for their hardware (search/profiles.py: power-cap and bandwidth
ratios, no constant fitted to the published figures); both predictions are given. Their runs also used
torch.compile, Float8 and activation checkpointing where the table says so: compile and Float8 are
modelled (cost/fusion.py, parallel/float8/cost.py), async TP is not.

``PUBLISHED_EAGER``: torchtitan's runs without compile or Float8 (docs/performance.md at the
commits that added them: 64 A100s, and the 405B on 128 H100s), each predicted under its own
profile (``a100``, ``h100-500w``) beside ``h100``; no search. ``--eager`` runs them alone.

Example:
    $ PYTHONPATH=. python -m bench.run --only published
    $ PYTHONPATH=. python -m bench.bench_published --eager
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import row

GIB = 2**30

# name: (model, mesh shape, mesh names, local batch, seq, checkpointing, published tok/s/GPU, GiB, what it ran,
#        how it ran: what of it the cost model takes (ap.Auto(compiled=, float8=)); async TP is not modelled)
# torchtitan compiles each TransformerBlock on its own (apply_compile): "blocks", the head and loss eager
EAGER, COMPILED, FLOAT8 = {}, {"compiled": "blocks"}, {"compiled": "blocks", "float8": True}
PUBLISHED = {
    "8B FSDP 8": ("8b", (8,), ("dp",), 2, 8192, "selective", 5762, 82.4, "FSDP (Table 1)", EAGER),
    "8B FSDP 8, compile": ("8b", (8,), ("dp",), 2, 8192, "selective", 6667, 77.0, "FSDP + compile (Table 1)", COMPILED),
    "8B FSDP 8, compile + Float8": (
        "8b",
        (8,),
        ("dp",),
        2,
        8192,
        "selective",
        8532,
        76.8,
        "FSDP + compile + Float8 (Table 1)",
        FLOAT8,
    ),
    "8B FSDP 128": ("8b", (16, 8), ("rep", "dp"), 2, 8192, "selective", 5605, 67.0, "FSDP (Table 3)", EAGER),
    "70B FSDP 32 x TP 8": (
        "70b",
        (32, 8),
        ("dp", "tp"),
        16,
        8192,
        "full",
        829,
        71.9,
        "compile, Float8 (Table 4)",
        FLOAT8,
    ),
    "405B FSDP 8 x PP 8 x TP 8": (
        "405b",
        (8, 8, 8),
        ("dp", "pp", "tp"),
        32,
        8192,
        "full",
        100,
        82.5,
        "compile, Float8, async TP (not modelled), 1F1B (Table 5)",
        FLOAT8,
    ),
}

# Eager runs (no torch.compile, no Float8): torchtitan's docs/performance.md, each row read at the
# commit that added it, its configuration from train_configs/*.toml and the parallelisms' code at
# that commit. WPS there is tokens/s per GPU (train.py: a rank's tokens over model_parallel_size);
# MFU counts 6 x all parameters + 12 x layers x heads x head_dim x seq FLOPs per token, which
# checks the sizes and sequence length: each published MFU is its WPS at these within 0.07 points
# (tests/unit/test_bench.py).
# Common to all: FSDP2 with bf16 parameters and fp32 gradient reduction
# (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)), every block resharded after
# forward but the last, causal F.scaled_dot_product_attention; selective "op" keeps every second
# mm's output (and SDPA's), as in the Dec-2024 runs.
TT_A100 = "pytorch/torchtitan 1ea476e9f24b docs/performance.md (2024-04-24; train_configs/llama3_*.toml there)"
TT_A100_L2 = "pytorch/torchtitan 395a526276ee docs/performance.md (2024-04-18; train_configs/llama_13b.toml, llama_70b.toml there)"
TT_405B = (
    "pytorch/torchtitan 3faaa1a0dee6 docs/performance.md (2024-08-23; train_configs/llama3_405b.toml at 9515a140b^)"
)
LLAMA2_13B = (5120, 13824, 40, 40, 40, 32000)  # torchtitan "13B": dim 5120, 40 layers, 40 heads, ffn 13824
LLAMA2_70B = (8192, 28672, 80, 64, 8, 32000)  # "70B": ffn 1.3 x 8/3 x 8192 rounded up to 4096s
# name: (model, mesh shape, mesh names, local batch, seq, checkpointing, profile, published
#        tok/s/GPU, published MFU %, source, what it ran)
PUBLISHED_EAGER = {
    # 64 A100 80GB (the A100's kind is not stated beyond 80GB; the multinode script at that commit
    # is "optimized for AWS with EFA"). FSDP over all 64 ranks: (8, 8) with ZeRO-3 sharded over both
    # axes, as the 8B FSDP 128 row above. The 70B tomls' tensor_parallel_degree 8 and batch_size
    # (Llama 3: 8, Llama 2: 16) were overridden: the tables say FSDP2 1D at local batch 1 (Llama 3)
    # and 2 (Llama 2).
    "Llama 3 8B FSDP 64, A100": (
        "8b",
        (8, 8),
        ("rep", "dp"),
        1,
        8192,
        "selective",
        "a100",
        2973,
        58.2,
        TT_A100,
        "FSDP, selective op AC, fused_rmsnorm (Triton)",
    ),
    "Llama 3 70B FSDP 64, A100": (
        "70b",
        (8, 8),
        ("rep", "dp"),
        1,
        8192,
        "full",
        "a100",
        331,
        51.7,
        TT_A100,
        "FSDP, full AC",
    ),
    "Llama 2 13B FSDP 64, A100, no AC": (
        LLAMA2_13B,
        (8, 8),
        ("rep", "dp"),
        2,
        4096,
        "none",
        "a100",
        2162,
        61.1,
        TT_A100_L2,
        "FSDP, no AC, fused_rmsnorm",
    ),
    "Llama 2 13B FSDP 64, A100": (
        LLAMA2_13B,
        (8, 8),
        ("rep", "dp"),
        2,
        4096,
        "selective",
        "a100",
        1904,
        53.8,
        TT_A100_L2,
        "FSDP, selective op AC, fused_rmsnorm",
    ),
    "Llama 2 70B FSDP 64, A100": (
        LLAMA2_70B,
        (8, 8),
        ("rep", "dp"),
        2,
        4096,
        "full",
        "a100",
        353,
        50.5,
        TT_A100_L2,
        "FSDP, full AC",
    ),
    # 128 H100 "(94GB)", "HBM2e based lower TDP SXM H100", peak "between SXM and NVL" (their
    # footnote, as the Dec-2024 table's): the fleet h100-500w is derived for. FSDP 16 x TP 8
    # (Megatron tp + sp, loss parallel), local batch 2, full AC, "Optimizations: None". The toml
    # at the doc's commit turns compile, Float8 and async TP on (their other two rows, 177 and
    # 185 WPS); the None row is read as the toml before that commit (compile = false, Float8
    # off): the doc does not say whether it compiled. The same commit replaced a first figure, 118 WPS at 37.1% MFU (NVL's
    # peak), by 109 at 29.0% (SXM's) when they "updated the peak FLOPs for H100".
    "Llama 3.1 405B FSDP 16 x TP 8, H100 94GB": (
        "405b",
        (16, 8),
        ("dp", "tp"),
        2,
        8192,
        "full",
        "h100-500w",
        109,
        29.0,
        TT_405B,
        "FSDP + TP (sp), full AC, no compile, no Float8",
    ),
}

SIZES = {  # LLaMA-3.1 (hidden, intermediate, layers, heads, kv heads)
    "8b": (4096, 14336, 32, 32, 8),
    "70b": (8192, 28672, 80, 64, 8),
    "405b": (16384, 53248, 126, 128, 8),
}

SCRIPT = r"""
import json, resource, sys, time
import torch
import autopar as ap
from transformers import LlamaForCausalLM
from bench.llama_shapes import LossOnly, llama_config

args = json.loads(sys.argv[1])
size, shape, names, local, seq, mode, search = args[:7]
profiles = args[7] if len(args) > 7 else []  # eager rows: each profile's prediction, parts too
ran = args[8] if len(args) > 8 else {}  # how it ran: ap.Auto's compiled= / float8= (eager without)
# a size by name (LLaMA-3.1, its 128,256-token vocabulary) or (hidden, intermediate, layers, heads, kv, vocab)
hidden, inter, layers, heads, kv, vocab = {"8b": (4096, 14336, 32, 32, 8, 128256), "70b": (8192, 28672, 80, 64, 8, 128256),
                                           "405b": (16384, 53248, 126, 128, 8, 128256)}[size] if isinstance(size, str) else size
# torchtitan's attention, causal SDPA with no mask tensor (bench/llama_shapes.py says why)
cfg = llama_config(hidden, inter, layers, heads, kv, vocab, seq)

with torch.device("meta"):
    model = LossOnly(LlamaForCausalLM(cfg))  # fp32, as HF builds it: the policy computes in bf16 over fp32 masters
# FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), as torchtitan ran it:
# the plan is traced in bf16 (activations as the runs kept them), parameters, gradients and Adam
# state stay fp32 (16 B per parameter), blocks gathered in bf16, gradients reduced in fp32
policy = ap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
mesh = ap.Mesh(tuple(shape), tuple(names))
dp_size = 1
for n, s in zip(names, shape):
    if n in ("rep", "dp"):
        dp_size *= s
ids = torch.zeros(local * dp_size, seq, dtype=torch.long, device="meta")
kw = {"input_ids": ids, "labels": ids}
t0 = time.perf_counter()
if search is None:
    # torchtitan's FSDP: gradients reduced in fp32; under a pipeline the blocks stay gathered
    # through the step (apply_fsdp: reshard_after_forward=False when pp is on)
    dp = ap.DataParallel("dp", zero=3, replicate_axis="rep" if "rep" in names else None,
                         shard_size=(shape[0] * shape[1]) if "rep" in names else None,
                         reshard_after_forward="pp" not in names)
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True) if "tp" in names else {}
    pp = dict(zip(names, shape)).get("pp")  # torchtitan's default micro-batch count: the pp degree
    pipe = ap.Pipeline("pp", microbatches=pp, schedule="1f1b") if pp else None
    # torchtitan's selective policy (selective_ac_option = "op") keeps every second matmul's output
    ac = None if mode == "none" else ap.ActivationCheckpoint(mode, save_every=2 if mode == "selective" else 1)
    plan = ap.plan(model, mesh, kwargs=kw, annotations=ann, data_parallel=dp, dynamic=False, pipeline=pipe,
                   activation_checkpoint=ac, mixed_precision=policy)
    chosen = "hand"
else:
    plan = ap.plan(model, mesh, kwargs=kw, dynamic=False, mixed_precision=policy,
                   auto=ap.Auto(device="h100", memory_budget=search * 2**30, **ran))
    chosen = plan.built["auto"]["chosen"]
seconds = time.perf_counter() - t0
p = ap.predict(plan, ap.Auto(device="h100", **ran))  # as it ran: eager, compiled, Float8
print(json.dumps({"time_s": p["time_s"], "time_500w_s": ap.predict(plan, ap.Auto(device="h100-500w", **ran))["time_s"], "memory": p["memory"], "tokens": local * dp_size * seq, "ranks": mesh.size,
                  "chosen": chosen, "seconds": seconds,
                  "search_s": plan.built.get("auto", {}).get("search_s"),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "by_profile": {d: {k: v for k, v in ap.predict(plan, d).items() if k.endswith("_s")} for d in profiles}}))
"""


def predicted(size, shape, names, local, seq, mode, search=None, profiles=(), ran=None) -> dict:
    """ap.predict of the hand plan (search=None) or of the search's plan under a budget (GiB),
    as it ran (``ran``: ap.Auto's compiled= and float8=); ``profiles``: also each named profile's
    time and its parts (``by_profile``)."""
    arg = json.dumps([size, list(shape), list(names), local, seq, mode, search, list(profiles), ran or {}])
    out = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, check=False)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": last[:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool) -> list[dict]:
    rows, eager = [], {}  # eager: (size, shape) -> (predicted h100, h100-500w, published) tok/s/GPU
    for name, (size, shape, names, local, seq, mode, tps, gib, what, ran) in PUBLISHED.items():
        if quick and size != "8b":
            continue
        what = f"{what}, {mode} checkpointing"
        hand = predicted(size, shape, names, local, seq, mode, ran=ran)
        if "error" in hand:
            rows.append(row("published", name, "predicted tok/s/GPU", "-", f"{tps:,}", hand["error"]))
            continue
        mine = hand["tokens"] / hand["time_s"] / hand["ranks"]
        theirs = hand["tokens"] / hand["time_500w_s"] / hand["ranks"]  # their hardware (profiles.py)
        if not ran:
            eager[size, shape] = (mine, theirs, tps)
        elif (size, shape) in eager:  # the speed-up over the same run eager, against theirs
            e_mine, e_theirs, e_tps = eager[size, shape]
            rows.append(
                row(
                    "published",
                    name,
                    "predicted / published speed-up over eager",
                    round((theirs / e_theirs) / (tps / e_tps), 3),
                    "0.9-1.1",
                    f"predicted {theirs / e_theirs:.3f}x (h100-500w; h100 {mine / e_mine:.3f}x), "
                    f"published {tps / e_tps:.3f}x",
                )
            )
        rows += [
            row(
                "published",
                name,
                "predicted (h100-500w) / published tok/s/GPU",
                round(theirs / tps, 3),
                "0.8-1.2",
                f"predicted {theirs:,.0f} on their 500 W HBM2e H100s (derived profile), published {tps:,}",
            ),
            row(
                "published",
                name,
                "predicted / published tok/s/GPU",
                round(mine / tps, 3),
                "0.8-1.2",
                f"predicted {mine:,.0f}, published {tps:,} ({what})",
            ),
            row(
                "published",
                name,
                "predicted / published GiB per rank",
                round(hand["memory"] / GIB / gib, 3),
                "0.85-1.15",
                f"predicted {hand['memory'] / GIB:.1f}, published {gib}; plan + predict {hand['seconds']:.1f} s",
            ),
        ]
        for budget in (80, 95):
            found = predicted(size, shape, names, local, seq, mode, search=budget, ran=ran)
            if "error" in found:
                rows.append(row("published", f"{name}, search {budget} GB", "chose", "-", "fits", found["error"]))
                continue
            speed = found["tokens"] / found["time_s"] / found["ranks"]
            rows.append(
                row(
                    "published",
                    f"{name}, search {budget} GiB",
                    "predicted tok/s/GPU",
                    round(speed),
                    f">= hand's {mine:,.0f}",
                    f"chose {found['chosen']}; {found['memory'] / GIB:.1f} GiB; search {found['search_s']:.2f} s, "
                    f"trace + search {found['seconds']:.1f} s, RSS {found['rss_mib']:.0f} MiB",
                )
            )
    return rows + run_eager(quick)


CAPACITY_GIB = {"a100": 80, "h100-500w": 94}  # the cards the eager runs fit on, as their docs name them


def eager_args(name: str) -> tuple:
    """The arguments ``predicted`` takes for an eager row: its hand plan as they ran it, and the
    row's profile with ``h100`` (measured) beside it."""
    size, shape, names, local, seq, mode, profile = PUBLISHED_EAGER[name][:7]
    return size, shape, names, local, seq, mode, None, tuple(dict.fromkeys((profile, "h100")))


def run_eager(quick: bool) -> list[dict]:
    """The eager runs (PUBLISHED_EAGER): predicted tok/s/GPU under the row's profile beside the
    published figure, the prediction's parts, and the predicted memory against the card's."""
    rows = []
    for name, (size, _, _, local, seq, mode, profile, tps, mfu, source, what) in PUBLISHED_EAGER.items():
        if quick and size != "8b":
            continue
        hand = predicted(*eager_args(name))
        if "error" in hand:
            rows.append(row("published eager", name, "predicted tok/s/GPU", "-", f"{tps:,}", hand["error"]))
            continue
        speed = {d: hand["tokens"] / p["time_s"] / hand["ranks"] for d, p in hand["by_profile"].items()}
        p = hand["by_profile"][profile]
        parts = ", ".join(f"{k[:-2]} {p[k]:.3f}" for k in ("compute_s", "comm_s", "sync_s", "optimizer_s"))
        rows += [
            row(
                "published eager",
                name,
                f"predicted ({profile}) / published tok/s/GPU",
                round(speed[profile] / tps, 3),
                "0.8-1.2",
                f"predicted {speed[profile]:,.0f}, published {tps:,} (MFU {mfu}%); {what}, "
                f"local batch {local} x {seq}; step {p['time_s']:.3f} s ({parts}); {source}",
            ),
            row(
                "published eager",
                name,
                "predicted (h100) / published tok/s/GPU",
                round(speed["h100"] / tps, 3),
                "-",
                f"predicted {speed['h100']:,.0f} on the measured 700 W H100, published {tps:,}",
            ),
            row(
                "published eager",
                name,
                "predicted GiB per rank",
                round(hand["memory"] / GIB, 1),
                f"<= {CAPACITY_GIB[profile]} (it ran)",
                f"not published; plan + predict {hand['seconds']:.1f} s",
            ),
        ]
    return rows


if __name__ == "__main__":
    # --eager: the eager rows alone (a minute or two; the full run also searches 512 ranks)
    rows = run_eager("--quick" in sys.argv) if "--eager" in sys.argv else run(quick="--quick" in sys.argv)
    for r in rows:
        print(r)
