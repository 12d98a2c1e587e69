"""Data-parallel step time on 2 gloo processes: autopar vs torch DDP, and fused vs per-parameter.

A GPT-style model (autopar.models.gpt) trains with SGD; every rank gets its slice of the
same global batch. Contenders, built in the same processes and timed side by side:

- ``ddp``: torch.nn.parallel.DistributedDataParallel, bucket_cap_mb = the bucket size;
- ``autopar``: ap.parallelize(..., data_parallel=ap.DataParallel("dp", bucket_mb=same));
- ``per_param``: the same plan with bucket_max_params=1 (one all-reduce per parameter).

Timing protocol (bench/common.py): every iteration runs each contender once (forward,
backward, optimizer step, zero_grad), in a shuffled order seeded alike on every rank, both
ranks starting together (barrier outside the timed region); the figure is the median over
iterations of the per-iteration ratio, after warm-up. Rank 0's times are reported.

Example:
    $ PYTHONPATH=. python bench/bench_dp.py          # full size
"""

from __future__ import annotations


from bench.common import alternate, main, median_ratio, ms, pool, row, train_step

SIZES = {  # name -> (layers, embd, heads, vocab, seq, batch per rank)
    "quick": (2, 64, 4, 256, 32, 4),
    "full": (4, 128, 8, 1024, 64, 8),
}
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


def _contenders(size: str):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import autopar as ap

    rank, world = dist.get_rank(), dist.get_world_size()
    idx, tg = _batch(size, world)
    local = (idx.chunk(world)[rank], tg.chunk(world)[rank])
    ddp = DDP(_model(size), bucket_cap_mb=BUCKET_MB)
    dp = ap.DataParallel("dp", bucket_mb=BUCKET_MB)
    module = ap.parallelize(_model(size), ap.Mesh((world,), ("dp",)), args=(idx, tg), data_parallel=dp)
    plan = module.autopar_plan
    per_param = plan.with_data_parallel(ap.DataParallel("dp", bucket_mb=BUCKET_MB, bucket_max_params=1))
    a_args, a_kw = plan.local_inputs(rank, idx, tg)
    return {
        "ddp": train_step(ddp, local)[0],
        "autopar": train_step(module, a_args, a_kw)[0],
        "per_param": train_step(per_param.build_module(rank), a_args, a_kw)[0],
    }, len(plan.grad_buckets())


def dp_job(size: str, iters: int, warmup: int) -> dict:
    """Runs on every rank: build the contenders, check they agree on the loss, time them."""
    import torch

    torch.set_num_threads(1)
    steps, n_buckets = _contenders(size)
    losses = {}
    for n, s in steps.items():  # one step each: same model, same data, so the same global loss
        loss = s().detach().clone()
        if n == "ddp":  # DDP's loss is this rank's slice's mean; autopar's is the global mean
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        losses[n] = loss.item()
    times = alternate(steps, iters, warmup, barrier=torch.distributed.barrier)
    return {"times": times, "losses": losses, "buckets": n_buckets}


def _row(case, metric, value, target="", note=""):
    return row("dp", case, metric, value, target, note)


def run(quick: bool) -> list[dict]:
    size = "quick" if quick else "full"
    iters, warmup = (20, 3) if quick else (30, 5)
    res = pool(2).run("bench.bench_dp:dp_job", size, iters, warmup)[0]
    t = res["times"]
    layers, embd, *_ = SIZES[size]
    case = f"GPT {layers}x{embd}, 2 gloo ranks, bucket {BUCKET_MB:g} MB"
    med = {n: ms(v) for n, v in t.items()}
    agree = max(res["losses"].values()) - min(res["losses"].values())
    note = (
        f"median step ms: ddp {med['ddp']:.1f}, autopar {med['autopar']:.1f}, per-param "
        f"{med['per_param']:.1f}; {res['buckets']} bucket(s); first-step losses agree to {agree:.1e}"
    )
    return [
        _row(case, "autopar / DDP step time", round(median_ratio(t["autopar"], t["ddp"]), 3), "<= 1.05", note),
        _row(
            case,
            "per-parameter / fused step time",
            round(median_ratio(t["per_param"], t["autopar"]), 3),
            "",
            f"one all-reduce per parameter; n={iters}",
        ),
    ]


if __name__ == "__main__":
    main(run)
