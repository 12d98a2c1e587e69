"""Context parallel: peak memory per rank for cp = 1, 2, 4 at one fixed long sequence, and the step
time of ring, all-gather and Ulysses attention, on gloo processes.

An HF LLaMA (4 layers, SDPA attention, GQA 4 query / 2 kv heads, RoPE) with batch 1 and one long
sequence (quick: 256 tokens, d 64; full: 2048 tokens, d 128), trained context-parallel over a gloo
pool of cp processes (cp = 1 is the model alone on one process). Per rank, ``measure_step``
(bench_activation_checkpoint.py) records the bytes held after the forward and the peak bytes alive
over forward + backward (gradients allocated by a warm-up step): on the CPU from
runtime/live_bytes.LiveBytes; beside them the cost model's (``plan.memory_per_rank``). The step times
alternate ring and all-gather modules step by step (bench/common.alternate), rank 0 reports.
``state`` (simulated): the parameter, gradient and AdamW-state bytes a rank holds after a step with
context parallel folded into zero=3's shard group (``DataParallel(shard_axes=...)``) and without.

``long_rows`` (``python -m bench.bench_context_parallel --long [tokens]``, 8192 by default): per
method at cp = 2 and 4, the attention's bytes per rank and step, the peak per rank and the step time.

Example:
    $ python -m bench.run --only context_parallel
"""

from __future__ import annotations

import functools

import torch

import autopar as ap
from bench.bench_activation_checkpoint import measure_step
from bench.common import alternate, median_ratio, ms, pool, row

NAME = "context_parallel"
METHODS = ("allgather", "ring", "ulysses")


def llama(quick, seq=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d, s = (64, 256) if quick else (128, 2048)
    s = seq or s
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=s, attn_implementation="sdpa", use_cache=False,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _module(model, kw, cp: int, method, load_balance: bool = True):
    cp_opt = ap.ContextParallel("cp", method=method, load_balance=load_balance) if cp > 1 else None
    return ap.parallelize(model, ap.Mesh((cp,), ("cp",)), kwargs=kw, context_parallel=cp_opt)


def long_job(seq: int, method: str) -> dict:
    """One rank of cp = world at one long sequence (the quick model, d 64, 4 layers: 1 x ``seq``
    tokens) by ``method``: the attention's bytes per rank and step (the plan's, and the whole
    step's planned and ran: ap.comm_stats), the peak bytes alive over the first step (LiveBytes;
    the gradients it allocates are ~1 MB) beside the model's, and the seconds of a second, plain
    step (one step per method and job: at 8192 tokens a step takes minutes on the shared 2 cores)."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    model, kw = llama(True, seq)
    module = _module(model, kw, dist.get_world_size(), method)
    plan = module.autopar_plan
    _, local = plan.local_inputs(rank, **kw)
    with ap.comm_stats() as stats:
        measured = measure_step(lambda: module(**local).loss)
    dist.barrier()
    t0 = time.perf_counter()
    _step(module, local)
    dist.barrier()
    attention = [c for c in plan.collectives() if c.node in set(plan.built["context_parallel"])]
    return (
        measured
        | predicted(plan, rank)
        | {
            "planned_bytes": sum(c.bytes for c in attention),
            "step_planned": sum(c.bytes for c in plan.collectives()),
            "step_ran": sum(r.bytes for r in stats.records),
            "step_s": time.perf_counter() - t0,
        }
    )


def long_rows(seq: int = 8192, cps=(2, 4), methods=METHODS):
    """Rows per cp and method at 1 x ``seq`` tokens (rank 0): attention bytes per rank and step,
    peak MB per rank (measured, predicted) and step time; yielded as each job ends."""
    for cp in cps:
        for method in methods:
            r = pool(cp).run("bench.bench_context_parallel:long_job", seq, method)[0]
            c = f"llama d 64, 4 layers, 1 x {seq} tokens, cp={cp} {method} (load balanced)"
            yield from (
                row(NAME, c, "attention MB/rank/step", _mb(r["planned_bytes"]), "",
                    f"the plan's; whole step: planned {_mb(r['step_planned'])}, ran {_mb(r['step_ran'])}"),
                row(NAME, c, "peak MB/rank", _mb(r["peak"]), "", f"predicted {_mb(r['model_peak'])} "
                    f"({r['model_peak'] / r['peak'] - 1:+.1%})"),
                row(NAME, c, "step ms", round(1e3 * r["step_s"], 1), "", "one step, rank 0"),
            )  # fmt: skip


def memory_job(quick, method, steps=2) -> dict:
    """One rank: the model context-parallel over this pool; the last step's held and peak bytes
    (measure_step) beside the model's (``memory_per_rank``: ``activations`` against the bytes
    held after the forward; + ``workspace`` + ``backward`` + ``recompute`` against the peak)."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(), dist.get_rank()
    model, kw = llama(quick)
    module = _module(model, kw, cp, method)
    _, local = module.autopar_plan.local_inputs(rank, **kw)
    out = [measure_step(lambda: module(**local).loss) for _ in range(steps)]
    return out[-1] | predicted(module.autopar_plan, rank)


def predicted(plan, rank: int) -> dict:
    """The cost model's held and peak bytes of ``rank`` (plan.memory_per_rank)."""
    mem = plan.memory_per_rank(rank)
    peak = sum(mem.get(k, 0) for k in ("activations", "recompute", "workspace", "backward", "outputs"))
    return {
        "model_held": mem["activations"],
        "model_peak": peak,
        "model_workspace": mem.get("workspace", 0),
        "model_backward": mem.get("backward", 0),
    }


def time_job(quick, iters, warmup) -> dict:
    """One rank of cp = world: ring and all-gather steps alternating; seconds per step each."""
    import torch.distributed as dist

    model, kw = llama(quick)
    steps = {}
    for method in METHODS:
        module = _module(model, kw, dist.get_world_size(), method)
        _, local = module.autopar_plan.local_inputs(dist.get_rank(), **kw)
        steps[method] = functools.partial(_step, module, local)
    return alternate(steps, iters, warmup, barrier=dist.barrier)


def _step(module, local):
    module(**local).loss.backward()


def memory(quick) -> dict:
    """(cp, method) -> rank 0's measured and predicted bytes (memory_job), cp = 1 (one process), 2 and 4."""
    out = {}
    for cp in (1, 2, 4):
        for method in METHODS if cp > 1 else METHODS[:1]:
            out[(cp, method)] = pool(cp).run("bench.bench_context_parallel:memory_job", quick, method)[0]
    return out


STATE_PLANS = {  # name -> (mesh shape, axes, DataParallel): without and with cp folded into the shard group
    "cp=4": ((4,), ("cp",), None),
    "cp=4, zero=3 over cp": ((4,), ("cp",), ap.DataParallel(zero=3, shard_axes=("cp",))),
    "dp=2 x cp=2, zero=3 over dp": ((2, 2), ("dp", "cp"), ap.DataParallel("dp", zero=3)),
    "dp=2 x cp=2, zero=3 over dp x cp": ((2, 2), ("dp", "cp"), ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp"))),
}


def state(quick) -> dict:
    """Plan name -> rank 0's measured (parameters, gradients, AdamW state after one step, in the
    simulator) and predicted (``plan.memory_per_rank``) bytes of state, the worst rank's measured."""
    from autopar.runtime.simulator import run_ranks

    model, kw = llama(quick)
    batch = {"input_ids": kw["input_ids"].repeat(2, 1), "labels": kw["labels"].repeat(2, 1)}  # dp=2 splits it
    out = {}
    for name, (shape, axes, dp) in STATE_PLANS.items():
        cp = ap.ContextParallel("cp", method="ring", load_balance=True)
        plan = ap.plan(model, ap.Mesh(shape, axes), kwargs=batch, data_parallel=dp, context_parallel=cp)
        got = run_ranks(plan.mesh.size, functools.partial(_state_step, plan, batch))
        mem = plan.memory_per_rank(0, state_slots=2)
        out[name] = {"measured": got[0], "worst": max(got), "predicted": sum(mem[k] for k in _STATE)}
    return out


_STATE = ("params", "grads", "optimizer_state")


def _state_step(plan, batch, rank) -> int:
    module = plan.build_module(rank)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    _, local = plan.local_inputs(rank, **batch)
    module(**local).loss.backward()
    opt.step()
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if v.dim()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _mb(x) -> float:
    return round(x / 1e6, 3)


def run(quick: bool) -> list[dict]:
    got = memory(quick)
    one = got[(1, "allgather")]["peak"]
    seq = 256 if quick else 2048
    rows = []
    for (cp, method), r in got.items():
        c = f"llama 4 layers, 1 x {seq} tokens, cp={cp}" + (f" {method} (load balanced)" if cp > 1 else "")
        rows += [
            row(NAME, c, "held MB/rank", _mb(r["held"]), "", f"predicted {_mb(r['model_held'])} "
                f"({r['model_held'] / r['held'] - 1:+.1%})"),
            row(NAME, c, "peak MB/rank", _mb(r["peak"]), "", f"predicted {_mb(r['model_peak'])} "
                f"({r['model_peak'] / r['peak'] - 1:+.1%}; workspace {_mb(r['model_workspace'])})"),
        ]  # fmt: skip
        if cp > 1:
            rows.append(row(NAME, c, "peak vs cp=1", round(r["peak"] / one, 3), f"~1/{cp} of the activations"))
    for name, r in state(quick).items():
        rows.append(
            row(NAME, f"llama 4 layers, {name}", "state MB/rank", _mb(r["measured"]), "",
                f"params + grads + AdamW state after a step, rank 0 (worst {_mb(r['worst'])}); predicted "
                f"{_mb(r['predicted'])}"),
        )  # fmt: skip
    iters, warmup = (3, 1) if quick else (10, 2)
    times = pool(4).run("bench.bench_context_parallel:time_job", quick, iters, warmup)[0]
    for method in METHODS:
        rows.append(
            row(
                NAME,
                f"llama 4 layers, 1 x {seq} tokens, cp=4 {method}",
                "step ms",
                round(ms(times[method]), 1),
                "",
                f"{median_ratio(times[method], times['allgather']):.2f}x all-gather's (alternating, median of ratios)",
            )
        )
    return rows


if __name__ == "__main__":
    import sys

    from bench.common import close_pools, main

    if "--long" in sys.argv:  # python -m bench.bench_context_parallel --long [seq]
        try:
            args = [a for a in sys.argv[1:] if a.isdigit()]
            for r in long_rows(int(args[0]) if args else 8192):
                print(r, flush=True)
        finally:
            close_pools()
    else:
        main(run)
