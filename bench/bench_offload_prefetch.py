"""Offload prefetch (``ActivationCheckpoint(offload=True)``): the recompute of block k starts block
k - 1's copies back to the device (parallel/activation_checkpoint/offload.py ``Ahead``). On CUDA
they overlap block k's backward on a side stream; on a CPU there is nothing to overlap (a copy is
a memcpy on the thread that runs backward), so the CPU copies at need by default. This bench forces the prefetching path
on the CPU (``offload.PREFETCH``) and measures what it does there: step time (alternating with
the default, median of per-step ratios) and peak bytes (LiveBytes), on 4 gloo ranks (dp=2 x
tp=2, Megatron), rank 0, the GPT and the residual MLP stack of bench_activation_checkpoint.py.

Example:
    $ python -m bench.run --only offload_prefetch
"""

from __future__ import annotations

import functools

import autopar as ap
from autopar.parallel.activation_checkpoint import offload
from bench.bench_activation_checkpoint import MODELS, _step, measure_step
from bench.common import alternate, median_ratio, ms, pool, row

NAME = "offload_prefetch"
KINDS = ("gpt", "mlp")


def _with_prefetch(on: bool, fn):
    before = offload.PREFETCH
    offload.PREFETCH = before | {"cpu"} if on else before - {"cpu"}
    try:
        return fn()
    finally:
        offload.PREFETCH = before


def job(kind, quick, mode, iters, warmup) -> dict:
    """One rank: seconds per step at need and prefetched (alternating), and each one's peak."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, batch, ann, loss_of = MODELS[kind](quick)
    module = ap.parallelize(model, ap.Mesh((2, 2), ("dp", "tp")), args=batch, annotations=ann, data_parallel="dp",
                            activation_checkpoint=ap.ActivationCheckpoint(mode, offload=True))  # fmt: skip
    a, k = module.autopar_plan.local_inputs(rank, *batch)
    step = functools.partial(_step, module, a, k, loss_of)
    times = alternate(
        {"at need": functools.partial(_with_prefetch, False, step), "prefetched": functools.partial(_with_prefetch, True, step)},
        iters, warmup, barrier=dist.barrier,
    )  # fmt: skip
    peaks = {
        name: _with_prefetch(on, lambda: measure_step(lambda: loss_of(module(*a, **k))))["peak"]
        for name, on in (("at need", False), ("prefetched", True))
    }
    return {"times": times, "peaks": peaks}


def run(quick: bool) -> list[dict]:
    iters, warmup = (3, 1) if quick else (12, 2)
    rows = []
    for kind in KINDS:
        for mode in ("full", "selective"):
            r = pool(4).run("bench.bench_offload_prefetch:job", kind, quick, mode, iters, warmup)[0]
            t, p = r["times"], r["peaks"]
            c = f"{kind} 4 blocks, dp2 x tp2, {mode}+offload, CPU"
            ratio = median_ratio(t["prefetched"], t["at need"])
            rows += [
                row(NAME, c, "step ms at need / prefetched", f"{ms(t['at need']):.1f} / {ms(t['prefetched']):.1f}",
                    "", f"prefetched {ratio:.2f}x (alternating, median of ratios)"),
                row(NAME, c, "peak MB at need / prefetched", f"{p['at need'] / 1e6:.3f} / {p['prefetched'] / 1e6:.3f}",
                    "", f"{p['prefetched'] / p['at need']:.3f}x"),
            ]  # fmt: skip
    return rows


if __name__ == "__main__":
    from bench.common import main

    main(run)
