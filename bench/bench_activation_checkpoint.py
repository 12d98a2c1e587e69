"""Activation checkpointing: peak memory per rank and step time with none / full / selective, and
the activation-memory model (cost/activation_memory.py) against what the allocator holds.

A GPT (4 blocks, eager attention, dropout), an HF LLaMA (4 layers, SDPA attention) and a stack
of 4 residual MLP blocks (no attention, dropout) on dp=2 x tp=2 (Megatron layouts), four gloo
processes; rank 0 reports. Per rank, ``measure_step`` records:

- ``held``: bytes alive right after the forward among the tensors the step made: what autograd
  keeps for backward plus the outputs (the model's ``activations``);
- ``peak``: the most bytes alive at once over forward + backward (gradients preallocated by a
  warm-up step, so that what is counted is activations, recompute and backward temporaries);
- ``host``: under ``offload=True``, the bytes of the host copies alive after the forward
  (parallel/activation_checkpoint/offload.py; on the CPU a separate storage all the same), held
  against the model's ``offloaded``; ``held`` and ``peak`` leave them out.

On the CPU both come from autopar/runtime/live_bytes.LiveBytes (a dispatch mode seeing every
storage an op makes, alive until it dies: torch keeps no allocator statistics on the CPU); on
CUDA from torch.cuda.memory_allocated / max_memory_allocated. The model's prediction is
``memory_per_rank``'s ``activations`` (and ``+ recompute + backward`` for the peak).

Example:
    $ python -m bench.run --only activation_checkpoint
    $ AUTOPAR_BENCH_DEVICE=cuda python -m bench.run --only activation_checkpoint   # on a GPU (not run yet)
"""

from __future__ import annotations

import copy
import functools
import os
import time

import torch

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig
from autopar.runtime.live_bytes import LiveBytes
from autopar.runtime.live_bytes import host_storages
from bench.common import alternate, median_ratio, ms, pool, row

POLICIES = {
    "none": None,
    "full": ap.ActivationCheckpoint("full"),
    "selective": ap.ActivationCheckpoint("selective"),
    "full+offload": ap.ActivationCheckpoint("full", offload=True),
    "selective+offload": ap.ActivationCheckpoint("selective", offload=True),
}
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


class MLPBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class MLPStack(torch.nn.Module):
    """A third shape of model: residual MLP blocks, no attention, a mean-square loss."""

    def __init__(self, d, n=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(MLPBlock(d) for _ in range(n))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return x, (x - y).pow(2).mean()


def mlp(quick):
    torch.manual_seed(0)
    d, s = (64, 32) if quick else (256, 128)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, s, d, generator=g), torch.randn(8, s, d, generator=g))
    ann = {"blocks.*.fc1": ap.colwise("tp"), "blocks.*.fc2": ap.rowwise("tp")}
    return MLPStack(d).train(), batch, ann, lambda out: out[1]


MODELS = {"gpt": gpt, "llama": llama, "mlp": mlp}


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
        host = sum(s.nbytes() for s in host_storages())
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return {"held": held, "peak": peak, "host": host, "s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    with LiveBytes() as mem:
        loss = forward()  # the loss kept, the model's other outputs dropped (a training loop)
        mem.refresh()  # what died after the last op (those outputs) counted out
        held, host = mem.live, mem.host
        loss.backward()
    return {"held": held, "peak": mem.peak, "host": host, "s": time.perf_counter() - t0}


def ac_job(kind, quick, policy, steps=3) -> dict:
    """One rank of a gloo job: the model parallelized with ``policy``, ``steps`` steps measured
    (the first allocates the gradients, later ones accumulate into them); the last step's
    bytes, the fastest step's time, and the model's prediction for this rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, batch, ann, loss_of = MODELS[kind](quick)
    device = os.environ.get("AUTOPAR_BENCH_DEVICE", "cpu")  # "cuda": measured by the CUDA allocator
    model, batch = model.to(device), tuple(t.to(device) for t in batch)
    args, kwargs = ((), {"input_ids": batch[0], "labels": batch[1]}) if kind == "llama" else (batch, {})
    module = ap.parallelize(model, ap.Mesh((2, 2), ("dp", "tp")), args=args, kwargs=kwargs, annotations=ann,
                            data_parallel="dp", activation_checkpoint=POLICIES[policy])  # fmt: skip
    plan = module.autopar_plan
    a, k = plan.local_inputs(rank, *args, **kwargs)
    on_gpu = next(module.parameters()).is_cuda
    out = [measure_step(lambda: loss_of(module(*a, **k)), on_gpu) for _ in range(steps)]
    mem = plan.memory_per_rank(rank)
    return out[-1] | {
        "model_held": mem["activations"],
        "model_peak": mem["activations"] + mem.get("recompute", 0) + mem.get("backward", 0),
        "model_host": mem.get("offloaded", 0),
    }


def time_job(kind, quick, iters, warmup) -> dict:
    """One rank of a gloo job: the three policies' steps (forward + backward) alternating in a
    shuffled order, no byte counter (bench/common.alternate); seconds per step per policy."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, batch, ann, loss_of = MODELS[kind](quick)
    args, kwargs = ((), {"input_ids": batch[0], "labels": batch[1]}) if kind == "llama" else (batch, {})
    steps = {}
    for policy, ac in POLICIES.items():
        module = ap.parallelize(copy.deepcopy(model), ap.Mesh((2, 2), ("dp", "tp")), args=args, kwargs=kwargs,
                                annotations=ann, data_parallel="dp", activation_checkpoint=ac)  # fmt: skip
        a, k = module.autopar_plan.local_inputs(rank, *args, **kwargs)
        steps[policy] = functools.partial(_step, module, a, k, loss_of)
    return alternate(steps, iters, warmup, barrier=dist.barrier)


def _step(module, a, k, loss_of):
    loss_of(module(*a, **k)).backward()


def case(kind, quick, policy) -> dict:
    """Rank 0's figures of a 4-rank gloo run (bench/common.pool)."""
    return pool(4).run("bench.bench_activation_checkpoint:ac_job", kind, quick, policy)[0]


def step_times(kind, quick) -> dict:
    """Rank 0's seconds per step of each policy, alternating (median ratios to none's)."""
    iters, warmup = (3, 1) if quick else (12, 2)
    return pool(4).run("bench.bench_activation_checkpoint:time_job", kind, quick, iters, warmup)[0]


NAME = "activation_checkpoint"
TARGETS = {
    "none": "",
    "full": "<= 0.55",
    "selective": "between full and none",
    "full+offload": "below full",
    "selective+offload": "below selective",
}
PEAK_NOTE = " (the model's peak: activations + recompute + the loss's backward)"


def _off(model, measured) -> str:
    return f"{100 * (model / measured - 1):+.1f}%"


def run(quick: bool) -> list[dict]:
    rows = []
    for kind in MODELS:
        results = {p: case(kind, quick, p) for p in POLICIES}
        times = step_times(kind, quick)
        none = results["none"]
        for policy, r in results.items():
            c = f"{kind} 4 blocks, dp2 x tp2, {policy}"
            held = f"{r['held'] / 1e6:.3f} / {r['model_held'] / 1e6:.3f}"
            peak = f"{r['peak'] / 1e6:.3f} / {r['model_peak'] / 1e6:.3f}"
            rows += [
                row(NAME, c, "peak MB/rank", round(r["peak"] / 1e6, 3)),
                row(NAME, c, "peak vs none", round(r["peak"] / none["peak"], 3), TARGETS[policy]),
                row(
                    NAME,
                    c,
                    "step ms",
                    round(ms(times[policy]), 1),
                    "",
                    f"{median_ratio(times[policy], times['none']):.2f}x none's (alternating, median of ratios)",
                ),  # fmt: skip
                row(NAME, c, "held MB (measured / model)", held, "within 15%", _off(r["model_held"], r["held"])),
                row(NAME, c, "peak MB (measured / model)", peak, "", _off(r["model_peak"], r["peak"]) + PEAK_NOTE),
            ]
            if r["model_host"] or r["host"]:
                host = f"{r['host'] / 1e6:.3f} / {r['model_host'] / 1e6:.3f}"
                rows.append(row(NAME, c, "host MB (measured / model)", host, "", _off(r["model_host"], r["host"])))
    return rows


if __name__ == "__main__":
    from bench.common import main

    main(run)
