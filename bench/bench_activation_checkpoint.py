"""Activation checkpointing: peak memory per rank and step time with none / full / selective, and
the activation-memory model (cost/activation_memory.py) against what the allocator holds.

A GPT (4 blocks) and an HF LLaMA (4 layers) on dp=2 x tp=2, all four ranks simulated in this
process (the same program gloo ranks run; the simulator's collectives allocate what gloo's do).
Per rank, ``measure_step`` records:

- ``held``: bytes alive right after the forward among the tensors the step made: what autograd
  keeps for backward plus the outputs (the model's ``activations``);
- ``peak``: the most bytes alive at once over forward + backward (gradients preallocated by a
  warm-up step, so that what is counted is activations, recompute and backward temporaries).

On the CPU both come from autopar/runtime/live_bytes.LiveBytes (a dispatch mode seeing every
storage an op makes, alive until it dies: torch keeps no allocator statistics on the CPU); on
CUDA from torch.cuda.memory_allocated / max_memory_allocated. The model's prediction is
``memory_per_rank``'s ``activations`` (and ``+ recompute`` for the peak).

Example:
    $ python -m bench.run --only activation_checkpoint
"""

from __future__ import annotations

import time

import torch

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig
from autopar.runtime.live_bytes import LiveBytes
from bench.common import row

POLICIES = {"none": None, "full": ap.ActivationCheckpoint("full"), "selective": ap.ActivationCheckpoint("selective")}
MEGATRON = {
    "blocks.*.attn.qkv": ap.colwise("tp"),
    "blocks.*.attn.proj": ap.rowwise("tp"),
    "blocks.*.mlp.fc": ap.colwise("tp"),
    "blocks.*.mlp.proj": ap.rowwise("tp"),
}


def gpt(quick):
    torch.manual_seed(0)
    d, s = (64, 32) if quick else (256, 128)
    model = GPT(GPTConfig(vocab_size=256, block_size=s, n_layer=4, n_head=4, n_embd=d, dropout=0.1)).train()
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 256, (8, s), generator=g) for _ in range(2))
    return model, batch, MEGATRON, lambda out: out[1]


def llama(quick):
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.presets import megatron

    torch.manual_seed(0)
    d, s = (64, 32) if quick else (256, 128)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=s, attn_implementation="sdpa", use_cache=False,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (8, s), generator=torch.Generator().manual_seed(1))
    return model, (ids, ids), megatron(model, "tp"), lambda out: out["loss"] if isinstance(out, dict) else out[0]


def measure_step(forward, cuda: bool = False) -> dict:
    """held (bytes after ``forward()``, which returns the loss), peak (over forward + backward)
    and seconds of one step; on CUDA from the allocator's counters, on the CPU from LiveBytes."""
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = forward()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        return {"held": held, "peak": torch.cuda.max_memory_allocated() - base, "s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    with LiveBytes() as mem:
        loss = forward()
        held = mem.live
        loss.backward()
    return {"held": held, "peak": mem.peak, "s": time.perf_counter() - t0}


def _kwargs_call(kind):
    if kind == "llama":
        return lambda m, ids, labels: m(input_ids=ids, labels=labels)
    return lambda m, idx, tg: m(idx, tg)


def case(kind, quick, policy, steps=3) -> dict:
    model, batch, ann, loss_of = (gpt if kind == "gpt" else llama)(quick)
    call = _kwargs_call(kind)
    kw = (
        {"kwargs": {"input_ids": batch[0], "labels": batch[1]}, "args": ()}
        if kind == "llama"
        else {"args": batch, "kwargs": {}}
    )
    plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), annotations=ann, data_parallel="dp",
                   activation_checkpoint=POLICIES[policy], **kw)  # fmt: skip

    def step(module, *a, **k):
        out = []
        for _ in range(steps):  # the first allocates the gradients: later steps accumulate into them
            out.append(measure_step(lambda: loss_of(call(module, *a, *k.values())), torch.cuda.is_available()))
        return out[-1] | {"s": min(o["s"] for o in out[1:])}

    got = plan.simulate(step, *kw["args"], **kw["kwargs"])[0]
    mem = plan.memory_per_rank(0)
    model_held = mem["activations"]
    model_peak = mem["activations"] + mem.get("recompute", 0)
    return got | {"model_held": model_held, "model_peak": model_peak}


def run(quick: bool) -> list[dict]:
    rows = []
    for kind in ("gpt", "llama"):
        results = {p: case(kind, quick, p) for p in POLICIES}
        none = results["none"]
        for policy, r in results.items():
            c = f"{kind} 4 blocks, dp2 x tp2, {policy}"
            rows += [
                row("activation_checkpoint", c, "peak MB/rank", round(r["peak"] / 1e6, 3)),
                row(
                    "activation_checkpoint",
                    c,
                    "peak vs none",
                    round(r["peak"] / none["peak"], 3),
                    "full <= 0.55" if policy == "full" else "",
                ),  # fmt: skip
                row("activation_checkpoint", c, "step ms", round(r["s"] * 1e3, 1)),
                row(
                    "activation_checkpoint",
                    c,
                    "held MB (measured / model)",
                    f"{r['held'] / 1e6:.3f} / {r['model_held'] / 1e6:.3f}",
                    "within 15%",
                    f"{100 * (r['model_held'] / r['held'] - 1):+.1f}%",
                ),  # fmt: skip
            ]
    return rows


if __name__ == "__main__":
    from bench.common import main

    main(run)
