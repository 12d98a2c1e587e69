"""Data-parallel step time on 2 gloo processes: autopar vs torch DDP, and fused vs per-parameter.

A GPT-style model (autopar.models.gpt) trains with SGD; every rank gets its slice of the
same global batch. Contenders, built in the same processes and timed side by side:

- ``ddp``: torch.nn.parallel.DistributedDataParallel, bucket_cap_mb = the bucket size;
- ``autopar``: ap.parallelize(..., data_parallel=ap.DataParallel("dp", bucket_mb=same));
- ``per_param``: the same plan with bucket_max_params=1 (one all-reduce per parameter; the
  small size only);
- ``ddp_copy``: a second, identical DDP module: the ddp_copy / ddp row is the run's noise.

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


def autopar_module(size: str):
    """The bench's autopar contender on this rank of the job: (rank module, its local args and
    kwargs, the global batch)."""
    import torch.distributed as dist
    import autopar as ap

    rank, world = dist.get_rank(), dist.get_world_size()
    idx, tg = _batch(size, world)
    dp = ap.DataParallel("dp", bucket_mb=BUCKET_MB)
    module = ap.parallelize(_model(size), ap.Mesh((world,), ("dp",)), args=(idx, tg), data_parallel=dp)
    return (module, *module.autopar_plan.local_inputs(rank, idx, tg), (idx, tg))


def contenders(size: str, only=None):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import autopar as ap

    rank, world = dist.get_rank(), dist.get_world_size()
    module, a_args, a_kw, (idx, tg) = autopar_module(size)
    local = (idx.chunk(world)[rank], tg.chunk(world)[rank])
    plan = module.autopar_plan
    steps = {"autopar": train_step(module, a_args, a_kw)[0]}
    for name in ("ddp", "ddp_copy"):
        steps[name] = train_step(DDP(_model(size), bucket_cap_mb=BUCKET_MB), local)[0]
    if size != "30m":
        per_param = plan.with_data_parallel(ap.DataParallel("dp", bucket_mb=BUCKET_MB, bucket_max_params=1))
        steps["per_param"] = train_step(per_param.build_module(rank), a_args, a_kw)[0]
    if only is not None:
        steps = {n: s for n, s in steps.items() if n in only}
    return steps, len(plan.grad_buckets())


def dp_job(size: str, iters: int, warmup: int) -> dict:
    """Runs on every rank: build the contenders, check they agree on the loss, time them."""
    import torch

    torch.set_num_threads(1)
    steps, n_buckets = contenders(size)
    losses = {}
    for n, s in steps.items():  # one step each: same model, same data, so the same global loss
        loss = s().detach().clone()
        if n.startswith("ddp"):  # DDP's loss is this rank's slice's mean; autopar's is the global mean
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        losses[n] = loss.item()
    times = alternate(steps, iters, warmup, barrier=torch.distributed.barrier)
    return {"times": times, "losses": losses, "buckets": n_buckets}


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
    t = res["times"]
    layers, embd, *_ = SIZES[size]
    case = f"GPT {layers}x{embd}, 2 gloo ranks, bucket {BUCKET_MB:g} MB"
    med = {n: ms(v) for n, v in t.items()}
    agree = max(res["losses"].values()) - min(res["losses"].values())
    note = (
        f"median step ms: ddp {med['ddp']:.1f}, autopar {med['autopar']:.1f}"
        + (f", per-param {med['per_param']:.1f}" if "per_param" in med else "")
        + f"; {res['buckets']} bucket(s); first-step losses agree to {agree:.1e}; n={iters}"
    )
    rows = [
        _row(case, "ddp / ddp (noise)", round(median_ratio(t["ddp_copy"], t["ddp"]), 3), "1.00 +- 0.02", "identical"),
        _row(case, "autopar / DDP step time", round(median_ratio(t["autopar"], t["ddp"]), 3), "<= 1.02", note),
    ]
    if "per_param" in t:
        rows.append(
            _row(
                case,
                "per-parameter / fused step time",
                round(median_ratio(t["per_param"], t["autopar"]), 3),
                "",
                f"one all-reduce per parameter; n={iters}",
            )
        )
    return rows


if __name__ == "__main__":
    main(run)
