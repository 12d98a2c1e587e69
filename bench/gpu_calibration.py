"""Calibration measurements on one CUDA GPU: the rates and memory the h100 profile is derived from.

Run on a machine with a GPU (plain PyTorch, autopar is not imported, so any recent torch works):

    python -m bench.gpu_calibration --out calib.json

It measures, on the card it finds:

- bf16 matrix products at the shapes of LLaMA-3.1 8B/70B layers (forward and the two backward
  products), as achieved TFLOP/s: the matmul rate a step really gets, not the datasheet's;
- causal flash attention (SDPA) forward + backward at sequence 8192, head dim 128, GQA, in TFLOP/s
  counting only the unmasked half;
- a device-to-device copy (bytes read + written per second): the rate of elementwise ops and norms;
- one LLaMA-3.1-8B decoder layer (RMSNorm, RoPE, GQA causal SDPA, SwiGLU) at local batch 2 x 8192
  in bf16: step time and the activation bytes it keeps for backward, with no checkpointing, full
  checkpointing and selective checkpointing (matmul and attention outputs saved); and the logits +
  cross-entropy peak of a 128,256 vocabulary over those 16,384 tokens.

Each timing is the median of repeated runs timed with CUDA events after a warm-up. The results go
to bench/RESULTS.md (GPU section) and docs/auto.md, which say which constant comes from which row.
"""

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def timed(fn, warmup=3, repeat=10):
    """Median milliseconds of fn() over `repeat` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (max(times) - min(times))


def product_times(m, k, n):
    """Milliseconds of x @ w (m x k by k x n) and of its two backward products, on random bf16 data."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    fwd, _ = timed(lambda: a @ w)
    bwd, _ = timed(lambda: (g @ w.t(), a.t() @ g))
    return fwd, bwd


def matmul_rows(tokens):
    """(name, m, k, n) of a layer's forward products; backward runs two products of the same size."""
    shapes = {
        "8B qkv": (tokens, 4096, 4096 + 2 * 1024),
        "8B o": (tokens, 4096, 4096),
        "8B gate_up": (tokens, 4096, 2 * 14336),
        "8B down": (tokens, 14336, 4096),
        "70B gate_up tp8": (tokens, 8192, 2 * 28672 // 8),
        "70B down tp8": (tokens, 28672 // 8, 8192),
        "8B lm_head": (tokens, 4096, 128256),
        "square 8192": (8192, 8192, 8192),
    }
    rows = []
    for name, (m, k, n) in shapes.items():
        fwd, bwd = product_times(m, k, n)
        flops = 2 * m * k * n
        rows.append(
            {"name": name, "m": m, "k": k, "n": n, "fwd_tflops": flops / fwd / 1e9, "bwd_tflops": 2 * flops / bwd / 1e9}
        )
    return rows


def attention_row(batch, seq, heads=32, kv_heads=8, dim=128):
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out = fwd()
    grad = torch.randn_like(out)
    fwd_ms, _ = timed(fwd)
    step_ms, _ = timed(lambda: torch.autograd.grad(fwd(), (q, k, v), grad))
    flops = 4 * batch * heads * seq * seq * dim / 2  # QK^T and PV, causal half
    return {
        "batch": batch,
        "seq": seq,
        "fwd_tflops": flops / fwd_ms / 1e9,
        "fwd_bwd_tflops": 3.5 * flops / step_ms / 1e9,
    }


def copy_row(n_bytes=4 * 2**30):
    src = torch.randn(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = timed(lambda: dst.copy_(src))
    return {"bytes": n_bytes, "tb_per_s": 2 * n_bytes / ms / 1e9}


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(torch.nn.Module):
    """A LLaMA-3.1 decoder layer as HF writes it (no fused kernels beyond SDPA)."""

    def __init__(self, hidden=4096, heads=32, kv_heads=8, ffn=14336):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.input_norm, self.post_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v = torch.nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate = torch.nn.Linear(hidden, ffn, bias=False)
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.input_norm(x)
        q = self.q(h).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


SAVED_BY_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def selective_context():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def layer_rows(batch, seq, layers=2):
    """Step time and kept activation bytes of `layers` decoder layers under three policies."""
    torch.manual_seed(0)
    stack = torch.nn.ModuleList(DecoderLayer() for _ in range(layers)).cuda().to(torch.bfloat16)
    pos = torch.arange(seq, device="cuda", dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128))
    angles = torch.outer(pos, inv)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    x0 = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run(policy):
        x = x0
        for layer in stack:
            if policy == "none":
                x = layer(x, cos, sin)
            elif policy == "full":
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False, context_fn=selective_context)
        return x

    rows = []
    for policy in ("none", "full", "selective"):
        run(policy).sum().backward()  # warm-up, allocator settled
        stack.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = run(policy)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        forward_peak = torch.cuda.max_memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        out.sum().backward()
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated() - before
        del out
        ms, spread = timed(lambda: run(policy).sum().backward(), warmup=1, repeat=5)
        tokens = batch * seq
        rows.append(
            {
                "policy": policy,
                "layers": layers,
                "tokens": tokens,
                "kept_bytes_per_layer": kept / layers,
                "kept_bytes_per_token_per_layer": kept / layers / tokens,
                "forward_peak_bytes": forward_peak,
                "backward_peak_bytes": backward_peak,
                "step_ms_per_layer": ms / layers,
                "spread_ms": spread,
            }
        )
    param_bytes = sum(p.numel() * p.element_size() for p in stack.parameters())
    flops = 6 * (param_bytes // 2) * batch * seq + 3 * 4 * batch * 32 * seq * seq * 128 / 2 * layers
    for row in rows:
        row["model_tflops"] = flops / (row["step_ms_per_layer"] * layers) / 1e9
    return rows


def loss_row(tokens, vocab=128256, hidden=4096):
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True) / math.sqrt(hidden)
    w = w.detach().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = F.cross_entropy((h @ w.t()).float(), labels)
    kept = torch.cuda.memory_allocated() - before
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - before
    return {
        "tokens": tokens,
        "vocab": vocab,
        "kept_bytes": kept,
        "peak_bytes": peak,
        "logit_bf16_bytes": tokens * vocab * 2,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_calibration.json")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "memory_bytes": props.total_memory, "torch": torch.__version__}
    print(result, flush=True)
    result["matmul"] = matmul_rows(args.batch * args.seq)
    for row in result["matmul"]:
        print(f"matmul {row['name']:18s} fwd {row['fwd_tflops']:6.0f} bwd {row['bwd_tflops']:6.0f} TFLOP/s", flush=True)
    result["attention"] = attention_row(args.batch, args.seq)
    print("attention", result["attention"], flush=True)
    result["copy"] = copy_row()
    print("copy", result["copy"], flush=True)
    torch.cuda.empty_cache()
    result["layers"] = layer_rows(args.batch, args.seq)
    for row in result["layers"]:
        print(
            f"layer {row['policy']:9s} kept {row['kept_bytes_per_layer'] / 2**30:6.2f} GiB/layer "
            f"({row['kept_bytes_per_token_per_layer']:7.0f} B/token) fwd peak {row['forward_peak_bytes'] / 2**30:6.2f} "
            f"bwd peak {row['backward_peak_bytes'] / 2**30:6.2f} GiB  {row['step_ms_per_layer']:7.2f} ms/layer "
            f"{row['model_tflops']:5.0f} TFLOP/s",
            flush=True,
        )
    torch.cuda.empty_cache()
    result["loss"] = loss_row(args.batch * args.seq)
    print("loss", result["loss"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
