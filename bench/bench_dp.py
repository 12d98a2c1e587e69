"""Data-parallel step time on 2 gloo processes: autopar vs torch DDP, and fused vs per-parameter.

A GPT-style model (autopar.models.gpt) trains with SGD; every rank gets its slice of the
same global batch. Contenders, built in the same processes and timed side by side:

- ``ddp``: torch.nn.parallel.DistributedDataParallel at its defaults: 25 MB buckets, the first
  1 MB, which is the layout of ap.DataParallel's defaults (the row's note shows both layouts,
  read from DDP's logging data and autopar's GradSync after the first step);
- ``autopar``: ap.parallelize(..., data_parallel=ap.DataParallel("dp")), its defaults;
- ``ddp_copy``: a second, identical DDP module: the ddp_copy / ddp row is the run's noise;
- the small size only: ``per_param`` (bucket_max_params=1: one all-reduce per parameter);
  ``ddp_one_bucket`` (DDP with ``bucket_cap_mb=25`` passed: an explicit cap turns DDP's small
  first bucket off, so the whole 3.7 MB model is one bucket reduced after backward: the peer
  of this bench's rows before 2026-11-29); ``local_loss`` (the same autopar plan of the model
  called without targets, the loss the rank's own mean outside it, as DDP's: the global
  mean's one all-reduce of two numbers in forward is all that differs from ``autopar``).

Sizes: ``small`` (the 4x128 GPT the bench has always had; "full" is its old name) and ``30m``
(d 512, 8 layers, sequence 128, vocabulary 8192: 29.4M parameters); ``BENCH_SIZES`` (or
``python -m bench.run --sizes``) picks them, default both.

Timing protocol (bench/common.py): every iteration runs each contender once (forward,
backward, optimizer step, zero_grad), in a shuffled order seeded alike on every rank, both
ranks starting together (barrier outside the timed region); the figure is the median over
iterations of the per-iteration ratio, after warm-up. Rank 0's times are reported.

Example:
    $ PYTHONPATH=. python bench/bench_dp.py          # both sizes
    $ BENCH_SIZES=small PYTHONPATH=. python bench/bench_dp.py
"""

from __future__ import annotations

import os

from bench.common import alternate, main, median_ratio, ms, pool, row, train_step

SIZES = {  # name -> (layers, embd, heads, vocab, seq, batch per rank)
    "quick": (2, 64, 4, 256, 32, 4),
    "small": (4, 128, 8, 1024, 64, 8),
    "30m": (8, 512, 8, 8192, 128, 2),
}
ITERS = {"quick": (20, 3), "small": (30, 5), "30m": (15, 3)}  # (pairs, warm-up) per size
BUCKET_MB = 25.0


def _model(size: str, seed: int = 0):
    import torch
    from autopar.models.gpt import GPT, GPTConfig

    layers, embd, heads, vocab, seq, _ = SIZES[size]
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=embd))


def _batch(size: str, world: int):
    import torch

    _, _, _, vocab, seq, b = SIZES[size]
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, vocab, (b * world, seq), generator=g),
        torch.randint(0, vocab, (b * world, seq), generator=g),
    )


def autopar_module(size: str, targets: bool = True, **options):
    """The bench's autopar contender on this rank of the job: (rank module, its local args and
    kwargs, the global batch). ``targets=False``: the model returns its logits (no loss inside)."""
    import torch.distributed as dist
    import autopar as ap

    rank, world = dist.get_rank(), dist.get_world_size()
    idx, tg = _batch(size, world)
    args = (idx, tg) if targets else (idx,)
    dp = ap.DataParallel("dp", **options)
    module = ap.parallelize(_model(size), ap.Mesh((world,), ("dp",)), args=args, data_parallel=dp)
    return (module, *module.autopar_plan.local_inputs(rank, *args), (idx, tg))


def ddp_module(size: str, **options):
    """DDP of the bench's model: its defaults (25 MB buckets, the first 1 MB) unless ``options``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(_model(size), **options)


def _local_loss_step(size: str):
    """autopar's plan of the model without targets, the loss the rank's own mean outside it."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    module, args, kwargs, (_, tg) = autopar_module(size, targets=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    target = tg.chunk(world)[rank].reshape(-1)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step():
        logits = module(*args, **kwargs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def contenders(size: str, only=None):
    """{name: step} of the contenders (those in ``only``, default all) and the bucket layouts
    {name: callable giving bucket bytes after the first step} of autopar's and DDP's."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    idx, tg = _batch(size, world)
    local = (idx.chunk(world)[rank], tg.chunk(world)[rank])
    made: dict = {}

    def make_autopar():
        module, args, kwargs, _ = autopar_module(size)
        made["autopar"] = module.autopar_grad_sync
        return train_step(module, args, kwargs)[0]

    def make_ddp(name, **options):
        made[name] = ddp_module(size, **options)
        return train_step(made[name], local)[0]

    def make_per_param():
        module, args, kwargs, _ = autopar_module(size, bucket_max_params=1)
        return train_step(module, args, kwargs)[0]

    builders = {
        "autopar": make_autopar,
        "ddp": lambda: make_ddp("ddp"),
        "ddp_copy": lambda: make_ddp("ddp_copy"),
    }
    if size != "30m":
        builders["per_param"] = make_per_param
        builders["ddp_one_bucket"] = lambda: make_ddp("ddp_one_bucket", bucket_cap_mb=BUCKET_MB)
        builders["local_loss"] = lambda: _local_loss_step(size)
    steps = {n: b() for n, b in builders.items() if only is None or n in only}
    return steps, lambda: _layouts(made)


def _layouts(made: dict) -> dict:
    """Bucket bytes in launch order: autopar's GradSync, and DDP's rebuilt buckets."""
    out = {}
    for name, thing in made.items():
        if name == "autopar":
            out[name] = [b.nbytes for b in thing.buckets]
        else:
            sizes = thing._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
            out[name] = [int(x) for x in str(sizes).split(",") if x.strip()]
    return out


def dp_job(size: str, iters: int, warmup: int) -> dict:
    """Runs on every rank: build the contenders, check they agree on the loss, time them."""
    import torch

    torch.set_num_threads(1)
    steps, layouts = contenders(size)
    losses = {}
    for n, s in steps.items():  # one step each: same model, same data, so the same global loss
        loss = s().detach().clone()
        if n.startswith("ddp") or n == "local_loss":  # the rank's own mean; autopar's is the global mean
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        losses[n] = loss.item()
    times = alternate(steps, iters, warmup, barrier=torch.distributed.barrier)
    return {"times": times, "losses": losses, "buckets": layouts()}


def _row(case, metric, value, target="", note=""):
    return row("dp", case, metric, value, target, note)


def sizes(quick: bool) -> list[str]:
    if quick:
        return ["quick"]
    names = os.environ.get("BENCH_SIZES", "small,30m").split(",")
    return [{"full": "small"}.get(n, n) for n in names if {"full": "small"}.get(n, n) in SIZES]


def run(quick: bool) -> list[dict]:
    rows = []
    for size in sizes(quick):
        iters, warmup = ITERS[size]
        iters = int(os.environ.get("BENCH_ITERS", iters))
        res = pool(2).run("bench.bench_dp:dp_job", size, iters, warmup)[0]
        rows += _rows(size, res, iters)
    return rows


def _rows(size: str, res: dict, iters: int) -> list[dict]:
    t, buckets = res["times"], res["buckets"]
    layers, embd, *_ = SIZES[size]
    case = f"GPT {layers}x{embd}, 2 gloo ranks, defaults (25 MB buckets, first 1 MB)"
    med = {n: ms(v) for n, v in t.items()}
    agree = max(res["losses"].values()) - min(res["losses"].values())
    same = "same" if buckets["autopar"] == buckets["ddp"] else f"DDP's {buckets['ddp']}"
    note = (
        f"median step ms: ddp {med['ddp']:.1f}, autopar {med['autopar']:.1f}; bucket bytes autopar "
        f"{buckets['autopar']} ({same}); first-step losses agree to {agree:.1e}; n={iters}"
    )
    rows = [
        _row(case, "ddp / ddp (noise)", round(median_ratio(t["ddp_copy"], t["ddp"]), 3), "1.00 +- 0.02", "identical"),
        _row(case, "autopar / DDP step time", round(median_ratio(t["autopar"], t["ddp"]), 3), "<= 1.02", note),
    ]
    extra = {
        "per_param": ("per-parameter / fused step time", "autopar", "one all-reduce per parameter"),
        "ddp_one_bucket": (
            "autopar / DDP(bucket_cap_mb=25) step time",
            "autopar",
            "the peer of the rows before 2026-11-29: an explicit cap turns DDP's 1 MB first bucket off, "
            f"one bucket of {buckets.get('ddp_one_bucket')} bytes reduced after backward",
        ),
        "local_loss": (
            "autopar loss outside (rank's own mean) / autopar step time",
            "autopar",
            "what the global mean's all-reduce of two numbers in forward costs",
        ),
    }
    for name, (metric, base, why) in extra.items():
        if name in t:
            a, b = (t[base], t[name]) if name == "ddp_one_bucket" else (t[name], t[base])
            rows.append(_row(case, metric, round(median_ratio(a, b), 3), "", f"{why}; ms {med[name]:.1f}; n={iters}"))
    return rows


if __name__ == "__main__":
    main(run)
