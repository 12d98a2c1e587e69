"""The activation-memory model against the CUDA allocator, on one GPU.

For an HF LLaMA (SDPA attention: on CUDA the flash kernel, which keeps no s x s matrix) and the
repo's GPT (eager attention), planned on a one-rank mesh with no checkpointing, full and
selective checkpointing, the rank module runs forward and backward on CUDA in bf16; the bytes
the allocator holds after the forward (what autograd keeps, plus the outputs) and the peak over
the step are held against ``plan.memory_per_rank(0)``'s ``activations`` (and ``+ recompute``).

    PYTHONPATH=. python bench/gpu_activation_memory.py --out gpu_activation_memory.json

Prints one line per model and policy; the figures go to bench/RESULTS.md (GPU section).
"""

from __future__ import annotations

import argparse
import json

import torch

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig

POLICIES = {"none": None, "full": "full", "selective": "selective"}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=2048,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32000, (4, 2048))
    return model, {"input_ids": ids, "labels": ids}


def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, block_size=1024, n_layer=4, n_head=8, n_embd=1024, dropout=0.0))
    idx = torch.randint(0, 8192, (4, 1024))
    return model, {"idx": idx, "targets": idx}


def measure(build, policy) -> dict:
    model, kw = build()
    model = model.to(device="cuda", dtype=torch.bfloat16)  # traced on CUDA: its constants are made there
    inputs = {k: v.cuda() for k, v in kw.items()}
    extra = {"activation_checkpoint": ap.ActivationCheckpoint(policy)} if policy else {}
    plan = ap.plan(model, ap.Mesh((1,), ("dp",)), kwargs=inputs, dynamic=False, **extra)
    predicted = plan.memory_per_rank(0)
    module = plan.module(0)

    def step():
        out = module(**inputs)
        loss = out["loss"] if isinstance(out, dict) else (out.loss if hasattr(out, "loss") else out[1])
        return loss

    step().backward()  # warm-up: gradients allocated, kernels chosen
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {
        "held": held,
        "peak": peak,
        "predicted_activations": float(predicted["activations"]),
        "predicted_recompute": float(predicted.get("recompute", 0)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_activation_memory.json")
    args = parser.parse_args()
    rows = []
    for name, build in (("hf llama 4x1024, 4x2048 tokens", llama), ("gpt 4x1024, 4x1024 tokens", gpt)):
        for policy in POLICIES.values():
            try:
                r = measure(build, policy)
            except Exception as e:  # noqa: BLE001 - reported, the other rows still run
                print(f"{name} {policy}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            r.update(model=name, policy=policy or "none", device=torch.cuda.get_device_name(0))
            rows.append(r)
            print(
                f"{name:32s} {policy or 'none':9s} held {r['held'] / 2**20:8.1f} MiB, model "
                f"{r['predicted_activations'] / 2**20:8.1f} MiB ({r['predicted_activations'] / max(r['held'], 1):.3f}x); "
                f"peak {r['peak'] / 2**20:8.1f} MiB",
                flush=True,
            )
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
