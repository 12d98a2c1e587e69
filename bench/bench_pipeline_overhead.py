"""Pipeline step overhead: autopar's 1F1B runner against a hand-written two-process 1F1B
pipeline of the same model (2 gloo processes, one stage each).

The model is bench/bench_pipeline.py's balanced residual MLP (its blocks split in two equal
stages, a mean-square loss on the last); the hand-written pipeline is what a careful user
writes with torch.distributed alone: each rank keeps its half of the blocks, posts every
receive of the step at its start (``irecv``, shapes known), sends with ``isend``, runs the 1F1B
order (rank 0: one warm-up forward, then one forward and one backward in turn; rank 1: a
forward then its backward), each micro-batch's loss weighted 1/m. Both are timed alternately
(bench.common.alternate, a barrier before each step); the identical pair (the hand-written
pipeline against a second copy of itself) shows the run's noise. autopar's step also returns
the mean loss on every rank (one scalar all-reduce a step), which the hand-written one skips:
the ``sync_loss=False`` row skips it too (the loss stays on the last stage, as the hand-written
pipeline's).

Example:
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.bench_pipeline_overhead
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.bench_pipeline_overhead --profile   # cProfile, both ranks
"""

from __future__ import annotations

import copy
import os

from bench.common import alternate, main, median_ratio, ms, pool, row

# (width, hidden, blocks per stage, rows per micro-batch, micro-batches): small actions, where
# the runner's per-micro-batch Python weighs most against the math
SIZES = {"quick": (32, 64, 1, 4, 4), "small": (128, 512, 2, 8, 8)}
ITERS = {"quick": (5, 1), "small": (60, 5)}


class HandPipeline:
    """One rank's stage of a hand-written 1F1B pipeline over two ranks (see the module docstring)."""

    def __init__(self, blocks, rank: int, m: int):
        import torch.nn as nn

        self.stage, self.rank, self.m = nn.ModuleList(blocks), rank, m

    def parameters(self):
        return self.stage.parameters()

    def _fwd(self, x):
        for b in self.stage:
            x = b(x)
        return x

    def step(self, xs, ys):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        m, width = self.m, xs[0].shape
        if self.rank == 0:
            grads = [torch.empty(width) for _ in range(m)]
            recvs = [dist.irecv(grads[i], src=1, tag=2 * i + 1) for i in range(m)]
            outs, sends, nxt = [], [], 0
            order = ["F"] + ["F", "B"] * (m - 1) + ["B"]  # 1F1B, first stage of two
            done = 0
            for kind in order:
                if kind == "F":
                    y = self._fwd(xs[nxt])
                    sends.append(dist.isend(y.detach(), dst=1, tag=2 * nxt))
                    outs.append(y)
                    nxt += 1
                else:
                    recvs[done].wait()
                    outs[done].backward(grads[done])
                    outs[done] = None
                    done += 1
            for s in sends:
                s.wait()
            return None
        acts = [torch.empty(width) for _ in range(m)]
        recvs = [dist.irecv(acts[i], src=0, tag=2 * i) for i in range(m)]
        sends, total = [], 0.0
        for i in range(m):  # last stage: each forward's backward right after it
            recvs[i].wait()
            a = acts[i].requires_grad_(True)
            loss = F.mse_loss(self._fwd(a), ys[i]) / m
            loss.backward()
            total += loss.detach()
            sends.append(dist.isend(a.grad, dst=0, tag=2 * i + 1))
        for s in sends:
            s.wait()
        return total


def _setup(size: str):
    import torch
    import torch.distributed as dist

    from bench.bench_pipeline import _model, _plan

    width, hidden, per_stage, rows, m = SIZES[size]
    plan, x, y = _plan("1f1b", 1, 2, width, hidden, rows, m)
    # One input for both, asking no gradient: bench_pipeline.py's x asks one (to balance its
    # stages), which gave autopar's first stage an input-gradient matmul per micro-batch that the
    # hand-written one (fed x.detach()) skipped: 192 matmuls a step on rank 0 against 184.
    x = x.detach()
    plan.stage_layout.options  # noqa: B018 - the plan is split (its stages built) before timing
    rank = dist.get_rank()
    runner = plan.pipeline_runner(rank)
    # the same blocks as the plan's model, split in two equal stages as its layout splits them
    model = _model(width, hidden, len(plan.model.blocks))
    half = len(model.blocks) // 2
    mine = list(model.blocks)[:half] if rank == 0 else list(model.blocks)[half:]
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    hand = [HandPipeline(copy.deepcopy(mine), rank, m) for _ in range(2)]
    torch.manual_seed(0)
    return runner, hand, (x, y), (xs, ys), per_stage


def _step(fn, params):
    def step():
        out = fn()
        for p in params:
            p.grad = None
        return out

    return step


def overhead_job(size: str, iters: int, warmup: int) -> dict:
    """Runs on both ranks: build autopar's runner and two hand-written pipelines, check the loss
    agrees, time the three steps alternately."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    runner, hand, (x, y), (xs, ys), _ = _setup(size)
    loss_autopar = float(runner.step((x,), y))
    for p in runner.parameters():
        p.grad = None
    loss_hand = hand[0].step(xs, ys)
    for p in hand[0].parameters():
        p.grad = None
    steps = {
        "autopar": _step(lambda: runner.step((x,), y), list(runner.parameters())),
        "autopar_local": _step(lambda: runner.step((x,), y, sync_loss=False), list(runner.parameters())),
        "hand": _step(lambda: hand[0].step(xs, ys), list(hand[0].parameters())),
        "hand_copy": _step(lambda: hand[1].step(xs, ys), list(hand[1].parameters())),
    }
    times = alternate(steps, iters, warmup, barrier=dist.barrier)
    return {"times": times, "loss": (loss_autopar, None if loss_hand is None else float(loss_hand))}


def profile_job(size: str, steps: int, top: int) -> dict:
    """Runs on both ranks: cProfile of ``steps`` steps of each pipeline (after a warm-up), call
    counts per step and the top entries by own time."""
    import cProfile
    import io
    import pstats

    import torch

    torch.set_num_threads(1)
    runner, hand, (x, y), (xs, ys), _ = _setup(size)
    steps_of = {
        "autopar": _step(lambda: runner.step((x,), y), list(runner.parameters())),
        "autopar_local": _step(lambda: runner.step((x,), y, sync_loss=False), list(runner.parameters())),
        "hand": _step(lambda: hand[0].step(xs, ys), list(hand[0].parameters())),
    }
    out = {}
    for name, step in steps_of.items():
        for _ in range(3):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).strip_dirs()
        calls = sum(v[1] for v in stats.stats.values())
        text.write(f"function calls per step: {calls / steps:.0f}\n")
        stats.sort_stats("tottime").print_stats(top)
        out[name] = text.getvalue()
    return out


def run(quick: bool) -> list[dict]:
    sizes = ["quick"] if quick else [s for s in os.environ.get("BENCH_SIZES", "small").split(",") if s in SIZES]
    rows = []
    for size in sizes:
        iters, warmup = ITERS[size]
        iters = int(os.environ.get("BENCH_ITERS", iters))
        res = pool(2).run("bench.bench_pipeline_overhead:overhead_job", size, iters, warmup)
        t = res[0]["times"]
        la, lh = res[1]["loss"]  # the last stage's rank holds the hand-written loss
        width, hidden, per_stage, rows_mb, m = SIZES[size]
        case = f"1f1b p=2 m={m}, {2 * per_stage} blocks {width}x{hidden}, {rows_mb} rows per micro-batch, 2 gloo ranks"
        agree = abs(la - lh) <= 1e-5 * max(1.0, abs(lh))
        rows += [
            row(
                "pipeline_step",
                case,
                "hand / hand (noise)",
                round(median_ratio(t["hand_copy"], t["hand"]), 3),
                "1.00 +- 0.05",
            ),
            row(
                "pipeline_step",
                case,
                "autopar / hand-written step time",
                round(median_ratio(t["autopar"], t["hand"]), 3),
                "<= 1.02",
                f"median step ms (rank 0): autopar {ms(t['autopar']):.2f}, hand {ms(t['hand']):.2f}; "
                f"losses {'agree' if agree else 'DIFFER'} ({la:.6g} / {lh:.6g}); n={iters}",
            ),
            row(
                "pipeline_step",
                case,
                "autopar (sync_loss=False) / hand-written step time",
                round(median_ratio(t["autopar_local"], t["hand"]), 3),
                "<= 1.02",
                f"median step ms (rank 0): autopar {ms(t['autopar_local']):.2f}, hand {ms(t['hand']):.2f}; "
                "no loss all-reduce (the hand-written pipeline has none)",
            ),
        ]
    return rows


if __name__ == "__main__":
    import sys

    if "--profile" in sys.argv:
        from bench.common import close_pools

        try:
            res = pool(2).run("bench.bench_pipeline_overhead:profile_job", "small", 20, 30)
        finally:
            close_pools()
        for rank, r in enumerate(res):
            for name, text in r.items():
                print(f"==== rank {rank} {name}")
                print(text)
    else:
        main(run)
