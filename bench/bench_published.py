"""Published large-scale runs against the search's cost model, and the search on their hardware.

Each published configuration (torchtitan's LLaMA-3.1 benchmarks on H100s, end of 2024:
pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md) is planned by hand as its
authors ran it, on the meta device (HF LlamaConfig sizes, bf16 compute with fp32 master weights),
and ``ap.predict(plan, "h100")`` gives its tokens/s per GPU and memory per rank: the published
figures sit beside them. Then ``ap.plan(auto=ap.Auto(device="h100", memory_budget=...))`` searches
the same mesh: its choice, predicted throughput and search time (a fresh process each, peak RSS).

The published runs used H100s capped at 500 W with 96 GB of HBM2e (2.4 TB/s); the ``h100``
profile is measured on a 700 W H100 80GB HBM3 (bench/gpu_calibration.py), and ``h100-500w`` is
derived from that measurement for their hardware (search/profiles.py: power-cap and bandwidth
ratios, no constant fitted to the published figures); both predictions are given. Their runs also used
torch.compile, Float8 and activation checkpointing where the table says so; the rows name what
the prediction models and what it does not.

Example:
    $ PYTHONPATH=. python -m bench.run --only published
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import row

GIB = 2**30

# name: (model, mesh shape, mesh names, local batch, seq, checkpointing, published tok/s/GPU, GiB, what it ran)
PUBLISHED = {
    "8B FSDP 8": ("8b", (8,), ("dp",), 2, 8192, "selective", 5762, 82.4, "FSDP (Table 1)"),
    "8B FSDP 128": ("8b", (16, 8), ("rep", "dp"), 2, 8192, "selective", 5605, 67.0, "FSDP (Table 3)"),
    "70B FSDP 32 x TP 8": ("70b", (32, 8), ("dp", "tp"), 16, 8192, "full", 829, 71.9, "compile, Float8 (Table 4)"),
    "405B FSDP 8 x PP 8 x TP 8": (
        "405b",
        (8, 8, 8),
        ("dp", "pp", "tp"),
        32,
        8192,
        "full",
        100,
        82.5,
        "compile, Float8, async TP, 1F1B (Table 5)",
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
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# torchtitan's attention: F.scaled_dot_product_attention(q, k, v, is_causal=True), no mask tensor.
# HF's own "sdpa" builds a (B, 1, S, S) boolean mask when traced (it cannot see that no padding
# comes); under a name HF has no mask function for, it builds none and SDPA runs causal, GQA in
# the kernel (enable_gqa) instead of copied K/V heads.
AttentionInterface.register("causal_sdpa", sdpa_attention_forward)
size, shape, names, local, seq, mode, search = json.loads(sys.argv[1])
hidden, inter, layers, heads, kv = {"8b": (4096, 14336, 32, 32, 8), "70b": (8192, 28672, 80, 64, 8),
                                    "405b": (16384, 53248, 126, 128, 8)}[size]
cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=128256, max_position_embeddings=seq, use_cache=False,
                  tie_word_embeddings=False, attn_implementation="causal_sdpa")


class LossOnly(torch.nn.Module):
    # The step's program returns the loss alone: torchtitan's loop keeps the loss and frees the
    # logits (del pred; under a pipeline the last stage feeds them to the loss), where HF's model
    # also returns them, gathered over a vocabulary split.
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


with torch.device("meta"):
    model = LossOnly(LlamaForCausalLM(cfg).to(torch.bfloat16))  # traced in bf16: activations as the runs kept them
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
                         shard_size=(shape[0] * shape[1]) if "rep" in names else None, reduce_dtype=torch.float32,
                         reshard_after_forward="pp" not in names)
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True) if "tp" in names else {}
    pp = dict(zip(names, shape)).get("pp")  # torchtitan's default micro-batch count: the pp degree
    pipe = ap.Pipeline("pp", microbatches=pp, schedule="1f1b") if pp else None
    # torchtitan's selective policy (selective_ac_option = "op") keeps every second matmul's output
    ac = ap.ActivationCheckpoint(mode, save_every=2 if mode == "selective" else 1)
    plan = ap.plan(model, mesh, kwargs=kw, annotations=ann, data_parallel=dp, dynamic=False, pipeline=pipe,
                   activation_checkpoint=ac)
    chosen = "hand"
else:
    plan = ap.plan(model, mesh, kwargs=kw, dynamic=False, auto=ap.Auto(device="h100", memory_budget=search * 2**30))
    chosen = plan.built["auto"]["chosen"]
seconds = time.perf_counter() - t0
p = ap.predict(plan, "h100")
print(json.dumps({"time_s": p["time_s"], "time_500w_s": ap.predict(plan, "h100-500w")["time_s"], "memory": p["memory"], "tokens": local * dp_size * seq, "ranks": mesh.size,
                  "chosen": chosen, "seconds": seconds,
                  "search_s": plan.built.get("auto", {}).get("search_s"),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def predicted(size, shape, names, local, seq, mode, search=None) -> dict:
    """ap.predict of the hand plan (search=None) or of the search's plan under a budget (GiB)."""
    arg = json.dumps([size, list(shape), list(names), local, seq, mode, search])
    out = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, check=False)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": last[:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool) -> list[dict]:
    rows = []
    for name, (size, shape, names, local, seq, mode, tps, gib, what) in PUBLISHED.items():
        if quick and size != "8b":
            continue
        what = f"{what}, {mode} checkpointing"
        hand = predicted(size, shape, names, local, seq, mode)
        if "error" in hand:
            rows.append(row("published", name, "predicted tok/s/GPU", "-", f"{tps:,}", hand["error"]))
            continue
        mine = hand["tokens"] / hand["time_s"] / hand["ranks"]
        theirs = hand["tokens"] / hand["time_500w_s"] / hand["ranks"]  # their hardware (profiles.py)
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
            found = predicted(size, shape, names, local, seq, mode, search=budget)
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
    return rows


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv):
        print(r)
