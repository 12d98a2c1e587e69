"""A pipeline rank's activation memory: the model (``plan.memory_per_rank(rank)["activations"]``,
parallel/pipeline/stage_memory.py) against what each of 4 gloo ranks holds.

A GPT (4 blocks per chunk, dropout 0.1, hidden 128, sequence 64) on 4 pipeline ranks, micro-batches
of 2 rows, with 1F1B, GPipe and ZB-H1 (4 micro-batches) and the interleaved 1F1B, ZBV and DualPipeV
(2 chunks per rank: 8 blocks, 8 stages; 8 micro-batches, so that the steady parts run), each with and without
``Pipeline(checkpoint=True)``. Per rank, the most bytes alive between two of its actions among
those the step made (runtime/live_bytes.LiveBytes, read as the runner starts each action, after
a warm-up step: its micro-batches in flight, its sends not yet known received, its prefetched
receives), and the model's figure for that rank.

Example:
    $ python -m bench.run --only pipeline_memory
"""

from __future__ import annotations

import torch

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig
from bench.common import pool, row

CASES = [  # (schedule, chunks, checkpoint, micro-batches): interleaved at m = 2 pp (its steady part runs)
    ("1f1b", 1, False, 4),
    ("1f1b", 1, True, 4),
    ("gpipe", 1, False, 4),
    ("gpipe", 1, True, 4),
    ("interleaved", 2, False, 8),
    ("interleaved", 2, True, 8),
    # zero-bubble: a micro-batch held to its W (and from B to W the gradients W starts from); the
    # V-shaped ones on 2 chunks per rank as interleaved (DualPipeV needs m >= 2 pp)
    ("zb-h1", 1, False, 4),
    ("zb-h1", 1, True, 4),
    ("zbv", 2, False, 8),
    ("zbv", 2, True, 8),
    ("dualpipev", 2, False, 8),
    ("dualpipev", 2, True, 8),
]


def job(schedule, chunks, checkpoint, m, quick) -> dict:
    """One rank of a 4-rank gloo job: the most bytes held between its actions, and the model's."""
    import torch.distributed as dist

    from tests.harness.pipeline_memory import held_between_actions

    rank = dist.get_rank()
    d, s = (32, 16) if quick else (128, 64)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=s, n_layer=4 * chunks, n_head=4, n_embd=d, dropout=0.1))
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 256, (2 * m, s), generator=g) for _ in range(2))  # 2 rows a micro-batch
    pipe = ap.Pipeline("pp", microbatches=m, schedule=schedule, chunks=chunks, checkpoint=checkpoint)
    plan = ap.plan(model.train(), ap.Mesh((4,), ("pp",)), args=batch, pipeline=pipe)
    held = held_between_actions(plan.pipeline_runner(rank), batch)
    return {"held": max(held), "model": plan.memory_per_rank(rank)["activations"]}


NAME = "pipeline_memory"


def run(quick: bool) -> list[dict]:
    rows = []
    for schedule, chunks, checkpoint, m in CASES:
        got = pool(4).run("bench.bench_pipeline_memory:job", schedule, chunks, checkpoint, m, quick)
        c = f"gpt {4 * chunks} blocks, pp4, {schedule}{' x2 chunks' if chunks > 1 else ''}, m={m}, " + (
            "checkpoint=True" if checkpoint else "no checkpointing"
        )
        for rank, r in enumerate(got):
            held = f"{r['held'] / 1e3:.1f} / {r['model'] / 1e3:.1f}"
            off = f"{100 * (r['model'] / r['held'] - 1):+.1f}%"
            rows.append(row(NAME, c, f"rank {rank} held KB (measured / model)", held, "within 15%", off))
    return rows


if __name__ == "__main__":
    from bench.common import main

    main(run)
